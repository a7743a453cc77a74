//! The engine: sessions, turns and the durable session log.
//!
//! The engine consumes operations (create a session, run a turn with a prompt,
//! cancel it through a token) and emits [`EventMsg`]s. It knows nothing of ACP or
//! JSON-RPC: the agent's profiles project its events onto the wire.
//!
//! - [`session`]: sessions and the turn loop.
//! - [`log`]: the per-session JSON-lines log actor.
//! - [`tools`]: the seam where tools plug in.

pub mod error;
pub mod log;
pub mod session;
pub mod tools;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use error::EngineError;
use pier_model::{ModelProvider, Usage};
pub use session::{Session, TurnPermit};
pub use tools::{NoTools, ToolHost, ToolOutcome};

use crate::log::{LogRecord, SessionLog};
use crate::session::SessionServices;

/// Why a turn ended; the five stop reasons of seed 000.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model finished its answer.
    EndTurn,
    /// The model stopped on its output token limit.
    MaxTokens,
    /// The turn would have exceeded its model request budget.
    MaxTurnRequests,
    /// The model refused; the prompt and all after it leave the history.
    Refusal,
    /// The caller cancelled.
    Cancelled,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::MaxTurnRequests => "max_turn_requests",
            StopReason::Refusal => "refusal",
            StopReason::Cancelled => "cancelled",
        }
    }
}

/// What happened in a turn, as it happens.
#[derive(Debug, Clone, PartialEq)]
pub enum EventMsg {
    /// A piece of assistant text, not yet committed.
    TextDelta(String),
    /// A piece of the model's reasoning.
    ReasoningDelta(String),
    /// A finished assistant message: its whole text.
    MessageCommitted(String),
    /// Token usage of one model request.
    Usage(Usage),
}

/// Settings of the engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Root of pier's data (`$PIER_HOME`); session logs go to `sessions/` under it.
    pub home: PathBuf,
    /// Model requests allowed in one turn.
    pub max_turn_requests: u32,
    /// The system prompt; `None` sends the default one, `Some("")` sends none.
    pub system_prompt: Option<String>,
}

impl EngineConfig {
    pub fn new(home: PathBuf) -> Self {
        Self { home, max_turn_requests: 64, system_prompt: None }
    }

    fn system_prompt(&self, cwd: &Path) -> Option<String> {
        match &self.system_prompt {
            Some(s) if s.is_empty() => None,
            Some(s) => Some(s.clone()),
            None => Some(format!(
                "You are pier, a careful software engineering agent. Answer the user's request directly and \
                 concisely. The session's working directory is {}.",
                cwd.display()
            )),
        }
    }
}

/// Creates sessions over one model provider and one tool host.
pub struct Engine {
    services: Arc<SessionServices>,
}

impl Engine {
    pub fn new(config: EngineConfig, model: Arc<dyn ModelProvider>, tools: Arc<dyn ToolHost>) -> Engine {
        Engine { services: Arc::new(SessionServices { config, model, tools }) }
    }

    /// Creates a fresh session rooted at `cwd`, with its log under `$PIER_HOME/sessions/`.
    pub async fn create_session(&self, cwd: PathBuf) -> Result<Arc<Session>, EngineError> {
        let id = uuid::Uuid::new_v4().to_string();
        let path = self.services.config.home.join("sessions").join(format!("{id}.jsonl"));
        let log = SessionLog::create(&path).await?;
        self.start(id, cwd, log).await
    }

    /// Creates a session that logs to `log`; for tests.
    pub async fn create_session_with_log(&self, cwd: PathBuf, log: SessionLog) -> Result<Arc<Session>, EngineError> {
        self.start(uuid::Uuid::new_v4().to_string(), cwd, log).await
    }

    async fn start(&self, id: String, cwd: PathBuf, log: SessionLog) -> Result<Arc<Session>, EngineError> {
        log.append(0, &LogRecord::SessionStarted { session_id: id.clone(), cwd: cwd.clone() });
        log.flush().await?;
        Ok(Arc::new(Session::new(id, cwd, log, self.services.clone())))
    }
}
