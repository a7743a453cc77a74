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
//! - [`store`]: sessions at rest: reading logs back, listing, deleting.

pub mod error;
pub mod log;
pub mod permission;
pub mod session;
pub mod store;
pub mod tool_call;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use error::EngineError;
pub use permission::{Approver, Decision, Grants, Mode, NoApprover, PermissionAnswer, PermissionPolicy, Verdict};
use pier_model::{ModelProvider, Usage};
use pier_tools::{PlanEntry, Tool, Toolbox, Workspace};
pub use session::{Session, TurnContext, TurnPermit, UserPrompt};
pub use store::{SessionMeta, SessionStore};
pub use tool_call::{ToolCallRecord, ToolCallStatus};

use crate::log::{LogRecord, SessionLog};
use crate::session::SessionState;

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
    /// A tool call's whole state, to be shown again in full: a permission question about
    /// an action of its tool showed that action on the call (its title, kind, content).
    ToolCallRestated(ToolCallRecord),
    /// The whole plan, replacing the previous one.
    Plan(Vec<PlanEntry>),
    /// The session got its title (from its first prompt).
    Title(String),
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
    /// When set, the only directories any session's writes may land in (tools and commands).
    pub writable: Option<Vec<PathBuf>>,
}

impl EngineConfig {
    pub fn new(home: PathBuf) -> Self {
        Self { home, max_turn_requests: 64, system_prompt: None, writable: None }
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
    pub store: SessionStore,
}

/// How a session is set up: where it works and what it may use beyond the engine's own.
pub struct SessionOptions {
    /// The session directory; relative paths start here.
    pub cwd: PathBuf,
    /// More directories tools may touch (ACP `additionalDirectories`).
    pub roots: Vec<PathBuf>,
    /// Tools of this session only (its MCP servers'), offered after the built-in ones; one of
    /// a built-in's name stands in for it (`run_command` through the client's terminal).
    pub tools: Vec<Arc<dyn Tool>>,
    /// The permission mode a new session starts in; a reopened one keeps its own.
    pub mode: Mode,
    /// A paragraph the system prompt gets for this session only (the task a host runs it for).
    pub note: Option<String>,
}

impl SessionOptions {
    pub fn new(cwd: PathBuf) -> SessionOptions {
        SessionOptions { cwd, roots: Vec::new(), tools: Vec::new(), mode: Mode::default(), note: None }
    }
}

/// A session opened again from its log, and the records a replay shows.
pub struct Reopened {
    pub session: Arc<Session>,
    pub records: Vec<(u64, LogRecord)>,
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
        let store = SessionStore::new(&config.home);
        Engine { services: Arc::new(Services { config, model, toolbox, policy, store }) }
    }

    /// Whether the engine's toolbox has a tool of this name.
    pub fn has_tool(&self, name: &str) -> bool {
        self.services.toolbox.get(name).is_some()
    }

    /// Where this engine keeps sessions.
    pub fn store(&self) -> &SessionStore {
        &self.services.store
    }

    /// Creates a fresh session rooted at `cwd`, with its log under `$PIER_HOME/sessions/`.
    pub async fn create_session(&self, cwd: PathBuf) -> Result<Arc<Session>, EngineError> {
        self.create(SessionOptions::new(cwd)).await
    }

    /// Creates a fresh session, with its log under `$PIER_HOME/sessions/`.
    pub async fn create(&self, options: SessionOptions) -> Result<Arc<Session>, EngineError> {
        let id = uuid::Uuid::new_v4().to_string();
        let log = SessionLog::create(&self.services.store.log_path(&id)).await?;
        self.start(id, options, log).await
    }

    /// Creates a session that logs to `log`; for tests.
    pub async fn create_session_with_log(&self, cwd: PathBuf, log: SessionLog) -> Result<Arc<Session>, EngineError> {
        self.start(uuid::Uuid::new_v4().to_string(), SessionOptions::new(cwd), log).await
    }

    async fn start(&self, id: String, options: SessionOptions, log: SessionLog) -> Result<Arc<Session>, EngineError> {
        let workspace = workspace(&options, self.services.config.writable.as_deref())?;
        log.append(0, &LogRecord::SessionStarted { session_id: id.clone(), cwd: options.cwd.clone() });
        log.flush().await?;
        let session = Session::new(id, options, workspace, log, SessionState::default(), self.services.clone());
        session.write_meta().await?;
        Ok(Arc::new(session))
    }

    /// Opens a stored session again, in this process or a later one: its conversation,
    /// plan, mode and remembered permission answers come back from its log. The roots
    /// are the ones given now, never the stored ones (R058).
    pub async fn open(&self, id: &str, options: SessionOptions) -> Result<Reopened, EngineError> {
        let store = &self.services.store;
        if !store.exists(id) {
            return Err(EngineError::UnknownSession(id.to_owned()));
        }
        let workspace = workspace(&options, self.services.config.writable.as_deref())?;
        let records = store::read_log(&store.log_path(id)).await?;
        let mut state = SessionState::default();
        let mut mode = options.mode;
        for (turn, record) in &records {
            state.turns = state.turns.max(*turn);
            match record {
                LogRecord::History { messages } => state.history.extend(messages.iter().cloned()),
                LogRecord::Grant { key, allow } => {
                    state
                        .grants
                        .get_mut()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .remember(key.clone(), *allow);
                }
                LogRecord::Plan { entries } => state.plan = entries.clone(),
                LogRecord::Setting { id, value } if id == "mode" => mode = value.parse().unwrap_or(mode),
                _ => {}
            }
        }
        let title = store.read_meta(id).await.and_then(|m| m.title);
        let log = SessionLog::create(&store.log_path(id)).await?;
        log.append(state.turns, &LogRecord::SessionOpened { cwd: options.cwd.clone(), roots: options.roots.clone() });
        log.flush().await?;
        let session = Session::new(
            id.to_owned(),
            SessionOptions { mode, ..options },
            workspace,
            log,
            state,
            self.services.clone(),
        );
        session.restore_title(title);
        session.write_meta().await?;
        Ok(Reopened { session: Arc::new(session), records })
    }
}

fn workspace(options: &SessionOptions, writable: Option<&[PathBuf]>) -> Result<Workspace, EngineError> {
    let ws = Workspace::with_roots(&options.cwd, &options.roots)
        .map_err(|e| EngineError::Workspace(format!("{}: {e}", options.cwd.display())))?;
    match writable {
        Some(dirs) => ws.with_writable(dirs).map_err(|e| EngineError::Workspace(format!("a writable directory: {e}"))),
        None => Ok(ws),
    }
}
