//! The engine: sessions, turns and the durable session log.
//!
//! The engine consumes operations (create a session, run a turn with a prompt,
//! cancel it through a token) and emits [`EventMsg`]s. It knows nothing of ACP or
//! JSON-RPC: the agent's profiles project its events onto the wire.
//!
//! - [`session`]: sessions and the turn loop.
//! - [`tool_call`]: the tool call entity and its state machine.
//! - [`permission`]: the permission policy and the approver seam.
//! - [`log`]: the per-session JSON-lines log actor.

pub mod error;
pub mod log;
pub mod permission;
pub mod session;
pub mod tool_call;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use error::EngineError;
pub use permission::{Approver, Decision, NoApprover, PermissionAnswer, PermissionPolicy};
use pier_model::{ModelProvider, ToolSpec, Usage};
use pier_tools::{PlanEntry, Toolbox, Workspace};
pub use session::{Session, TurnContext, TurnPermit};
pub use tool_call::{ToolCallRecord, ToolCallStatus};

use crate::log::{LogRecord, SessionLog};

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
    /// A new tool call, in `pending`.
    ToolCall(ToolCallRecord),
    /// A tool call's new state.
    ToolCallUpdate(ToolCallRecord),
    /// The whole plan, replacing the previous one.
    Plan(Vec<PlanEntry>),
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
                "You are pier, a careful software engineering agent. The session's working directory is {}; \
                 your tools read, search and change files and run commands there. Look before you change \
                 anything, keep changes small, and answer the user directly and concisely.",
                cwd.display()
            )),
        }
    }
}

/// Everything sessions share: set up once per engine.
pub(crate) struct Services {
    pub config: EngineConfig,
    pub model: Arc<dyn ModelProvider>,
    pub toolbox: Arc<Toolbox>,
    pub policy: PermissionPolicy,
}

impl Services {
    fn tool_specs(&self) -> Vec<ToolSpec> {
        self.toolbox
            .tools()
            .iter()
            .map(|t| ToolSpec {
                name: t.name().to_owned(),
                description: t.description().to_owned(),
                parameters: t.parameters(),
            })
            .collect()
    }
}

/// Creates sessions over one model provider, one toolbox and one permission policy.
pub struct Engine {
    services: Arc<Services>,
}

impl Engine {
    pub fn new(
        config: EngineConfig,
        model: Arc<dyn ModelProvider>,
        toolbox: Arc<Toolbox>,
        policy: PermissionPolicy,
    ) -> Engine {
        Engine { services: Arc::new(Services { config, model, toolbox, policy }) }
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
        let workspace = Workspace::new(&cwd).map_err(|e| EngineError::Workspace(format!("{}: {e}", cwd.display())))?;
        log.append(0, &LogRecord::SessionStarted { session_id: id.clone(), cwd: cwd.clone() });
        log.flush().await?;
        Ok(Arc::new(Session::new(id, cwd, workspace, log, self.services.clone())))
    }
}
