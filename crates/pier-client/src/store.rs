//! Named sessions (`pier prompt -s NAME`) that survive a restart.
//!
//! A record is scoped to (agent, cwd) and stored as one JSON file under
//! `$PIER_HOME/client-sessions/`, written atomically (temporary file, fsync,
//! rename), so a crash leaves either the old record or the new one.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One named session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub name: String,
    /// The agent as given (`pier`, `codex`, a command line).
    pub agent: String,
    pub cwd: PathBuf,
    pub session_id: String,
    pub created_at_ms: u128,
    pub updated_at_ms: u128,
    pub turns: u64,
    #[serde(default)]
    pub last_stop_reason: Option<String>,
}

/// The store of named sessions.
pub struct SessionStore {
    dir: PathBuf,
}

impl SessionStore {
    pub fn new(pier_home: &Path) -> SessionStore {
        SessionStore { dir: pier_home.join("client-sessions") }
    }

    /// The file of (agent, cwd, name): readable, and unique per scope.
    fn path(&self, agent: &str, cwd: &Path, name: &str) -> PathBuf {
        let scope = format!("{agent}\u{0}{}", cwd.display());
        let hash = fnv1a(scope.as_bytes());
        let safe: String =
            name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
        self.dir.join(format!("{safe}-{hash:016x}.json"))
    }

    pub fn get(&self, agent: &str, cwd: &Path, name: &str) -> std::io::Result<Option<SessionRecord>> {
        match std::fs::read(self.path(agent, cwd, name)) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub fn put(&self, record: &SessionRecord) -> std::io::Result<()> {
        use std::io::Write;
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(&record.agent, &record.cwd, &record.name);
        let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
        let bytes = serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?;
        let result = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(&self.dir)?.sync_all()
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Every record, sorted by name.
    pub fn list(&self) -> std::io::Result<Vec<SessionRecord>> {
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e),
        };
        for entry in entries.flatten() {
            if entry.path().extension().is_some_and(|e| e == "json")
                && let Ok(bytes) = std::fs::read(entry.path())
                && let Ok(r) = serde_json::from_slice::<SessionRecord>(&bytes)
            {
                out.push(r);
            }
        }
        out.sort_by(|a, b| (&a.name, &a.agent, &a.cwd).cmp(&(&b.name, &b.agent, &b.cwd)));
        Ok(out)
    }

    /// Removes a record; true if there was one.
    pub fn remove(&self, agent: &str, cwd: &Path, name: &str) -> std::io::Result<bool> {
        match std::fs::remove_file(self.path(agent, cwd, name)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_are_scoped() -> std::io::Result<()> {
        let home = tempfile::tempdir()?;
        let store = SessionStore::new(home.path());
        let rec = SessionRecord {
            name: "fix bug".into(),
            agent: "pier".into(),
            cwd: "/repo".into(),
            session_id: "s1".into(),
            created_at_ms: 1,
            updated_at_ms: 2,
            turns: 1,
            last_stop_reason: Some("end_turn".into()),
        };
        store.put(&rec)?;
        assert_eq!(store.get("pier", Path::new("/repo"), "fix bug")?, Some(rec.clone()));
        assert_eq!(store.get("pier", Path::new("/other"), "fix bug")?, None);
        assert_eq!(store.get("codex", Path::new("/repo"), "fix bug")?, None);
        assert_eq!(store.list()?, vec![rec]);
        assert!(store.remove("pier", Path::new("/repo"), "fix bug")?);
        assert!(!store.remove("pier", Path::new("/repo"), "fix bug")?);
        assert!(store.list()?.is_empty());
        Ok(())
    }
}
