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

    /// Whether a session with this id has a log.
    pub fn exists(&self, id: &str) -> bool {
        valid_id(id) && self.log_path(id).is_file()
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

    pub async fn read_meta(&self, id: &str) -> Option<SessionMeta> {
        let bytes = tokio::fs::read(self.meta_path(id)).await.ok()?;
        serde_json::from_slice(&bytes).ok()
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
    let bytes = tokio::fs::read(path).await.map_err(|e| EngineError::Log(format!("{}: {e}", path.display())))?;
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
}
