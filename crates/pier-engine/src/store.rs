//! Sessions at rest: where a session's log and its summary live under
//! `$PIER_HOME/sessions/`, reading a log back, listing and deleting.
//!
//! The log (`<id>.jsonl`) is the record; the summary (`<id>.meta.json`: cwd,
//! title, last update) exists so that listing reads one small file per session
//! instead of every log. It is rewritten atomically at the session's start and
//! at every turn end, so it is never ahead of the log it describes.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::log::LogRecord;

/// The summary of a stored session, as `session/list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionMeta {
    pub session_id: String,
    pub cwd: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// RFC 3339, UTC.
    pub updated_at: String,
}

/// Where sessions are kept.
#[derive(Debug, Clone)]
pub struct SessionStore {
    dir: PathBuf,
}

/// Whether `id` can name a stored session: ids become file names, so anything
/// but the characters pier's own ids use is refused before it nears the filesystem.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Opens a session file with `options`, refusing a symlink in its place (`O_NOFOLLOW`): a
/// session's files are pier's own, and a link planted there must not make pier read or
/// append to whatever it points at.
pub(crate) async fn open_own(path: &Path, options: &mut tokio::fs::OpenOptions) -> std::io::Result<tokio::fs::File> {
    options.custom_flags(libc::O_NOFOLLOW).open(path).await
}

/// The whole of a session file, opened as [`open_own`] does.
async fn read_own(path: &Path) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut file = open_own(path, tokio::fs::OpenOptions::new().read(true)).await?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).await?;
    Ok(bytes)
}

pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

impl SessionStore {
    pub fn new(home: &Path) -> SessionStore {
        SessionStore { dir: home.join("sessions") }
    }

    pub fn log_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.jsonl"))
    }

    fn meta_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.meta.json"))
    }

    /// Whether a session with this id has a log (a file of its own, not a link).
    pub fn exists(&self, id: &str) -> bool {
        valid_id(id) && std::fs::symlink_metadata(self.log_path(id)).is_ok_and(|m| m.is_file())
    }

    /// Writes the summary atomically (temporary file, then rename).
    pub async fn write_meta(&self, meta: &SessionMeta) -> Result<(), EngineError> {
        let path = self.meta_path(&meta.session_id);
        let bytes = serde_json::to_vec(meta).map_err(|e| EngineError::Log(e.to_string()))?;
        let tmp = self.dir.join(format!(".{}.meta.{}.tmp", meta.session_id, uuid::Uuid::new_v4().simple()));
        let result = async {
            tokio::fs::create_dir_all(&self.dir).await?;
            tokio::fs::write(&tmp, &bytes).await?;
            tokio::fs::rename(&tmp, &path).await
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result.map_err(|e| EngineError::Log(format!("{}: {e}", path.display())))
    }

    /// The summary of session `id`. The id is the file's name: a summary that names another
    /// session (planted, or copied by hand) is not this one's, and is passed over.
    pub async fn read_meta(&self, id: &str) -> Option<SessionMeta> {
        let path = self.meta_path(id);
        let bytes = read_own(&path).await.ok()?;
        let meta: SessionMeta = serde_json::from_slice(&bytes).ok()?;
        if meta.session_id != id {
            tracing::warn!(file = %path.display(), named = %meta.session_id, "a session summary names another session; skipped");
            return None;
        }
        Some(meta)
    }

    /// Every stored session's summary, newest first (ties by id), optionally only those in `cwd`.
    pub async fn list(&self, cwd: Option<&Path>) -> Result<Vec<SessionMeta>, EngineError> {
        let mut entries = match tokio::fs::read_dir(&self.dir).await {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(EngineError::Log(format!("{}: {e}", self.dir.display()))),
        };
        let mut out = Vec::new();
        while let Some(entry) = entries.next_entry().await.map_err(|e| EngineError::Log(e.to_string()))? {
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".meta.json")) else { continue };
            if !valid_id(id) {
                continue;
            }
            let Some(meta) = self.read_meta(id).await else { continue };
            if cwd.is_none_or(|c| meta.cwd == c) {
                out.push(meta);
            }
        }
        out.sort_by(|a, b| b.updated_at.cmp(&a.updated_at).then_with(|| a.session_id.cmp(&b.session_id)));
        Ok(out)
    }

    /// Removes a session's log and summary. Returns whether there was anything to remove.
    pub async fn delete(&self, id: &str) -> Result<bool, EngineError> {
        if !valid_id(id) {
            return Ok(false);
        }
        let mut found = false;
        for path in [self.log_path(id), self.meta_path(id)] {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => found = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(EngineError::Log(format!("{}: {e}", path.display()))),
            }
        }
        Ok(found)
    }
}

#[derive(Deserialize)]
struct Line {
    #[serde(default)]
    turn: u64,
    #[serde(flatten)]
    record: LogRecord,
}

/// Reads a session log back: every record in order, with its turn. Lines this
/// version does not know, and a torn last line left by a crash, are skipped.
pub async fn read_log(path: &Path) -> Result<Vec<(u64, LogRecord)>, EngineError> {
    let bytes = read_own(path).await.map_err(|e| EngineError::Log(format!("{}: {e}", path.display())))?;
    Ok(bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| match serde_json::from_slice::<Line>(l) {
            Ok(line) => Some((line.turn, line.record)),
            Err(e) => {
                tracing::debug!(error = %e, "skipped a session log line");
                None
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_could_leave_the_directory_are_invalid() {
        for bad in ["", "../x", "a/b", ".", "a b", "x\0", &"a".repeat(65)] {
            assert!(!valid_id(bad), "{bad:?}");
        }
        assert!(valid_id("0b7e5c9a-2f4e-4b8e-9a51-0c3f1d2e3f4a"));
    }

    fn meta(id: &str) -> SessionMeta {
        SessionMeta { session_id: id.into(), cwd: "/w".into(), title: None, updated_at: now_rfc3339() }
    }

    #[tokio::test]
    async fn a_summary_naming_another_session_is_not_listed() {
        let home = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = SessionStore::new(home.path());
        store.write_meta(&meta("s1")).await.unwrap_or_else(|e| panic!("{e}"));
        let planted = serde_json::to_vec(&meta("../../etc/passwd")).unwrap_or_default();
        std::fs::write(home.path().join("sessions/planted.meta.json"), planted).unwrap_or_else(|e| panic!("{e}"));
        let listed: Vec<String> =
            store.list(None).await.unwrap_or_else(|e| panic!("{e}")).into_iter().map(|m| m.session_id).collect();
        assert_eq!(listed, ["s1"]);
        assert_eq!(store.read_meta("planted").await, None);
    }

    #[tokio::test]
    async fn a_session_file_that_is_a_link_is_neither_read_nor_appended_to() {
        let home = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = SessionStore::new(home.path());
        let victim = home.path().join("victim.txt");
        std::fs::write(&victim, "{\"turn\":0,\"type\":\"note\"}\n").unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(home.path().join("sessions")).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(&victim, store.log_path("s2")).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(&victim, store.meta_path("s2")).unwrap_or_else(|e| panic!("{e}"));
        assert!(!store.exists("s2"), "a link is not a session's log");
        assert!(read_log(&store.log_path("s2")).await.is_err(), "not followed on load");
        assert_eq!(store.read_meta("s2").await, None);
        assert!(crate::log::SessionLog::create(&store.log_path("s2")).await.is_err(), "not followed on append");
        let kept = std::fs::read_to_string(&victim).unwrap_or_default();
        assert_eq!(kept, "{\"turn\":0,\"type\":\"note\"}\n", "the file it points at is untouched");
    }
}
