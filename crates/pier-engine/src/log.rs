//! The durable session log: one JSON-lines file per session, owned by an actor.
//!
//! [`SessionLog`] is a cheap handle over a channel; the actor task owns the file.
//! Appends are queued without waiting and written to the file as soon as the queue
//! is drained (so `tail -f` follows a turn live); [`SessionLog::flush`] waits until every
//! earlier append is written and synced, and reports the first write error since
//! the last flush, so a failed write is never dropped silently: the turn that
//! flushes it fails. The log is the source later profiles replay from; read it
//! with `jq`.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, oneshot};

use crate::error::EngineError;

/// One record of the log. Every line is `{"at_ms":…,"turn":…,"type":…,…}`.
///
/// A session reopens from these records ([`crate::Engine::open`]): `history` rebuilds
/// the conversation, `grant` the remembered permission answers, `setting` the mode
/// and the model; the rest is what a replay shows.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LogRecord {
    SessionStarted {
        session_id: String,
        cwd: PathBuf,
    },
    /// The session was opened again (`load` or `resume`), possibly in another process.
    SessionOpened {
        cwd: PathBuf,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        roots: Vec<PathBuf>,
    },
    Prompt {
        text: String,
    },
    ModelRequest {
        n: u32,
        provider: String,
    },
    ModelResponse {
        n: u32,
        finish: String,
        usage: Option<pier_model::Usage>,
    },
    Reasoning {
        text: String,
    },
    Message {
        text: String,
    },
    Refusal {
        text: String,
    },
    /// A tool call's full state, written at every transition.
    ToolCall {
        call: Box<crate::tool_call::ToolCallRecord>,
    },
    Permission {
        call_id: String,
        answer: String,
    },
    Plan {
        entries: Vec<pier_tools::PlanEntry>,
    },
    /// The session's title, from its first prompt.
    Title {
        title: String,
    },
    /// Model request `n` failed before any answer came and is sent again: try `attempt`, after
    /// `delay_ms`.
    Retry {
        n: u32,
        attempt: u32,
        delay_ms: u64,
        error: String,
    },
    TurnEnded {
        stop_reason: String,
    },
    /// The messages a turn added to the conversation, written when it ends and keeps them.
    History {
        messages: Vec<pier_model::ChatMessage>,
    },
    /// An *always* permission answer, by scope key.
    Grant {
        key: String,
        allow: bool,
    },
    /// A session setting changed (`mode`, `model`).
    Setting {
        id: String,
        value: String,
    },
    TurnFailed {
        error: String,
    },
    SessionClosed,
}

#[derive(Serialize)]
struct Line<'a> {
    at_ms: u128,
    turn: u64,
    #[serde(flatten)]
    record: &'a LogRecord,
}

enum LogCmd {
    Append(Vec<u8>),
    Flush(oneshot::Sender<Result<(), String>>),
}

/// A handle to a session's log actor. Cloning shares the same file.
#[derive(Clone)]
pub struct SessionLog {
    tx: mpsc::UnboundedSender<LogCmd>,
    path: PathBuf,
}

enum Sink {
    /// The log file, open only while there is something to write: an idle session holds
    /// no descriptor, so a process may keep any number of sessions.
    File {
        path: PathBuf,
        open: Option<BufWriter<tokio::fs::File>>,
    },
    Other(BufWriter<Box<dyn AsyncWrite + Unpin + Send>>),
}

impl Sink {
    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::File { path, open } => {
                if open.is_none() {
                    *open = Some(BufWriter::new(open_append(path).await?));
                }
                match open {
                    Some(w) => w.write_all(bytes).await,
                    None => Ok(()),
                }
            }
            Sink::Other(w) => w.write_all(bytes).await,
        }
    }

    /// Hands buffered bytes to the OS.
    async fn push(&mut self) -> std::io::Result<()> {
        match self {
            Sink::File { open: Some(w), .. } => w.flush().await,
            Sink::File { open: None, .. } => Ok(()),
            Sink::Other(w) => w.flush().await,
        }
    }

    /// Makes everything written durable, then closes the file until the next write.
    async fn sync(&mut self) -> std::io::Result<()> {
        match self {
            Sink::File { open, .. } => {
                if let Some(mut w) = open.take() {
                    w.flush().await?;
                    w.get_ref().sync_data().await?;
                }
                Ok(())
            }
            Sink::Other(w) => w.flush().await,
        }
    }
}

async fn open_append(path: &Path) -> std::io::Result<tokio::fs::File> {
    crate::store::open_own(path, tokio::fs::OpenOptions::new().create(true).append(true)).await
}

impl SessionLog {
    /// Creates (or appends to) the log at `path`, creating its directory.
    pub async fn create(path: &Path) -> Result<SessionLog, EngineError> {
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(|e| EngineError::Log(format!("{}: {e}", dir.display())))?;
        }
        // Opened once here so that a path that cannot be written fails now, not at the first turn.
        open_append(path).await.map_err(|e| EngineError::Log(format!("{}: {e}", path.display())))?;
        Ok(Self::spawn(Sink::File { path: path.to_owned(), open: None }, path.to_owned()))
    }

    /// A log over any writer; for tests that need a failing disk.
    pub fn from_writer(writer: Box<dyn AsyncWrite + Unpin + Send>, path: PathBuf) -> SessionLog {
        Self::spawn(Sink::Other(BufWriter::new(writer)), path)
    }

    fn spawn(sink: Sink, path: PathBuf) -> SessionLog {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(sink, rx));
        SessionLog { tx, path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues a record; errors surface at the next [`SessionLog::flush`].
    pub fn append(&self, turn: u64, record: &LogRecord) {
        let at_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        match serde_json::to_vec(&Line { at_ms, turn, record }) {
            Ok(mut bytes) => {
                bytes.push(b'\n');
                let _ = self.tx.send(LogCmd::Append(bytes));
            }
            Err(e) => tracing::error!(error = %e, "could not encode a session log record"),
        }
    }

    /// Waits until everything appended so far is on disk.
    pub async fn flush(&self) -> Result<(), EngineError> {
        let (ack, done) = oneshot::channel();
        self.tx.send(LogCmd::Flush(ack)).map_err(|_| EngineError::Log("the session log has stopped".into()))?;
        match done.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(EngineError::Log(format!("{}: {e}", self.path.display()))),
            Err(_) => Err(EngineError::Log("the session log has stopped".into())),
        }
    }
}

async fn run(mut sink: Sink, mut rx: mpsc::UnboundedReceiver<LogCmd>) {
    let mut failed: Option<String> = None;
    while let Some(cmd) = rx.recv().await {
        match cmd {
            LogCmd::Append(bytes) => {
                if failed.is_none() {
                    let mut result = sink.write_all(&bytes).await;
                    if result.is_ok() && rx.is_empty() {
                        // Hand what is queued to the OS so the log can be tailed live;
                        // the fsync waits for the turn's end.
                        result = sink.push().await;
                    }
                    if let Err(e) = result {
                        tracing::error!(error = %e, "writing the session log failed");
                        failed = Some(e.to_string());
                    }
                }
            }
            LogCmd::Flush(ack) => {
                let result = match failed.take() {
                    Some(e) => Err(e),
                    None => sink.sync().await.map_err(|e| e.to_string()),
                };
                let _ = ack.send(result);
            }
        }
    }
    // Every handle is gone: write out what is left.
    if let Err(e) = sink.sync().await {
        tracing::error!(error = %e, "flushing the session log at close failed");
    }
}
