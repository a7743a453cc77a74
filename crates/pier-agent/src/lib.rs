//! The ACP agent: answers a client over a [`pier_acp::Connection`] by driving
//! [`pier_engine`] sessions, and projects engine events through a [`Profile`].
//!
//! State ownership: [`AcpAgent`] owns the table of live sessions. Each entry
//! holds the engine session and the cancel token of its running turn, if any;
//! the token is set by the prompt's handler before the handler yields, so a
//! `session/cancel` that follows a prompt on the wire always finds it.

pub mod ask;
pub mod mcp;
pub mod permission;
pub mod profile;
pub mod prompt;
mod sessions;
mod settings;
pub mod terminal;
pub mod wire;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use agent_client_protocol_schema::v1::{
    ClientNotification, ClientRequest, CloseSessionRequest, DeleteSessionRequest, Error, Implementation,
    InitializeRequest, InitializeResponse, ListSessionsRequest, LoadSessionRequest, NewSessionRequest, PromptRequest,
    PromptResponse, ResumeSessionRequest, SessionNotification, SessionUpdate, SetSessionConfigOptionRequest,
    SetSessionModeRequest, StopReason,
};
use agent_client_protocol_schema::{MethodDispatchError, ProtocolVersion};
use futures::future::BoxFuture;
use pier_acp::error::{decode_params, internal, invalid_params};
use pier_acp::{Connection, Handler, RequestCx};
use pier_engine::{Engine, EngineError, EventMsg, Mode, Session, TurnContext};
use pier_model::ModelProvider;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use profile::Profile;

/// A model a session may be switched to (`pier.toml`'s named providers).
#[derive(Clone)]
pub struct NamedModel {
    pub name: String,
    pub provider: Arc<dyn ModelProvider>,
    /// Whether it takes images.
    pub vision: bool,
}

/// Cancels a subagent's turn by its session id; false when no such child runs.
pub type CancelSubagent = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// How the agent is set up, beyond its engine.
#[derive(Clone)]
pub struct AgentOptions {
    pub profile: Profile,
    /// The mode new sessions start in (editor profile).
    pub mode: Mode,
    /// The models a session may choose from; a `model` config option is offered when there are several.
    pub models: Vec<NamedModel>,
    /// The name of the engine's own model in `models`, if it is one of them.
    pub default_model: Option<String>,
    /// Whether the engine's own model takes images.
    pub vision: bool,
    /// How long MCP servers get to start and list their tools.
    pub mcp_timeout: std::time::Duration,
    /// The `pier` binary, whose `subagent-guard` leads each stdio MCP server's process tree
    /// (ends it with the session and with the agent); `None` runs servers bare.
    pub mcp_guard: Option<std::path::PathBuf>,
    /// Cancels a subagent's running turn by its session id (`session/cancel` of a child
    /// session an editor was shown); false when no such child runs.
    pub cancel_subagent: Option<CancelSubagent>,
    /// The `pier` binary that guards a command run in the client's terminal (`pier
    /// command-guard`): with it, an editor-profile session whose client advertised
    /// `terminal` runs `run_command` there; without it, commands always run here.
    pub terminal_guard: Option<std::path::PathBuf>,
    /// Tell the model which task a host runs a session for (its metadata, from
    /// `_meta["pier.dev/task"]` of `session/new`), in the system prompt.
    pub task_context: bool,
}

impl AgentOptions {
    pub fn new(profile: Profile) -> AgentOptions {
        AgentOptions {
            profile,
            mode: Mode::default(),
            models: Vec::new(),
            default_model: None,
            vision: false,
            terminal_guard: None,
            mcp_timeout: std::time::Duration::from_secs(30),
            mcp_guard: None,
            cancel_subagent: None,
            task_context: true,
        }
    }
}

/// An ACP agent over the engine.
pub struct AcpAgent {
    engine: Engine,
    profile: Profile,
    options: AgentOptions,
    initialized: AtomicBool,
    /// The client advertised `subagents` in `initialize`.
    client_subagents: AtomicBool,
    /// The client advertised form elicitation: sessions are offered `ask_user`.
    client_elicitation: AtomicBool,
    /// The client advertised `terminal`: editor sessions run commands in its terminals.
    client_terminal: AtomicBool,
    sessions: Mutex<HashMap<String, Arc<SessionEntry>>>,
}

struct SessionEntry {
    session: Arc<Session>,
    /// The running turn's sequence number and cancel token. Set and cleared by
    /// the prompt handler; the number makes sure a turn clears only its own token.
    turn: Mutex<Option<(u64, CancellationToken)>>,
    turns: AtomicU64,
    /// Held by a running turn for its whole length: `session/close` waits on it.
    running: Arc<tokio::sync::Mutex<()>>,
    /// The chosen model's name, when a session picked one of `AgentOptions::models`.
    model: Mutex<Option<String>>,
    /// The session's MCP servers; stopped when the session closes.
    mcp: Mutex<Option<mcp::Servers>>,
}

impl SessionEntry {
    fn new(session: Arc<Session>, mcp: Option<mcp::Servers>) -> SessionEntry {
        SessionEntry {
            session,
            turn: Mutex::new(None),
            turns: AtomicU64::new(0),
            running: Arc::new(tokio::sync::Mutex::new(())),
            model: Mutex::new(None),
            mcp: Mutex::new(mcp),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn to_value<T: Serialize>(v: &T) -> Result<Value, Error> {
    serde_json::to_value(v).map_err(|e| internal(format!("could not encode the response: {e}")))
}

impl AcpAgent {
    pub fn new(engine: Engine, profile: Profile) -> Arc<AcpAgent> {
        Self::with_options(engine, AgentOptions::new(profile))
    }

    pub fn with_options(engine: Engine, options: AgentOptions) -> Arc<AcpAgent> {
        Arc::new(AcpAgent {
            engine,
            profile: options.profile,
            options,
            initialized: AtomicBool::new(false),
            client_subagents: AtomicBool::new(false),
            client_elicitation: AtomicBool::new(false),
            client_terminal: AtomicBool::new(false),
            sessions: Mutex::new(HashMap::new()),
        })
    }

    /// Closes every session, flushes its log and stops its MCP servers. Call after the connection closed.
    pub async fn shutdown(&self) {
        let entries: Vec<Arc<SessionEntry>> = lock(&self.sessions).drain().map(|(_, e)| e).collect();
        for entry in entries {
            self.dispose(&entry).await;
        }
    }

    /// Cancels a session's turn, waits (bounded) for it to end, stops its MCP servers and
    /// closes its log. The entry must already be out of the table.
    async fn dispose(&self, entry: &SessionEntry) {
        if let Some((_, token)) = lock(&entry.turn).take() {
            token.cancel();
        }
        if tokio::time::timeout(std::time::Duration::from_secs(10), entry.running.lock()).await.is_err() {
            tracing::error!(session = %entry.session.id, "the cancelled turn did not end within 10 s");
        }
        let servers = lock(&entry.mcp).take();
        if let Some(servers) = servers {
            servers.shutdown().await;
        }
        if let Err(e) = entry.session.close().await {
            tracing::error!(session = %entry.session.id, error = %e, "closing a session failed");
        }
    }

    fn entry(&self, id: &str) -> Result<Arc<SessionEntry>, Error> {
        lock(&self.sessions).get(id).cloned().ok_or_else(|| unknown_session(id))
    }

    fn initialize(&self, req: InitializeRequest) -> Result<Value, Error> {
        // R026/R027: we speak version 1 only; we answer 1 to 1 and to any other request.
        tracing::info!(requested = req.protocol_version.as_u16(), "initialize");
        self.initialized.store(true, Ordering::SeqCst);
        self.client_subagents.store(req.client_capabilities.subagents.is_some(), Ordering::SeqCst);
        let form = req.client_capabilities.elicitation.as_ref().is_some_and(|e| e.supports_form());
        self.client_elicitation.store(form, Ordering::SeqCst);
        self.client_terminal.store(req.client_capabilities.terminal, Ordering::SeqCst);
        let response = InitializeResponse::new(ProtocolVersion::V1)
            .agent_capabilities(self.profile.capabilities(self.options.vision))
            .auth_methods(Vec::new())
            .agent_info(Implementation::new("pier", env!("CARGO_PKG_VERSION")).title("pier".to_owned()));
        to_value(&response)
    }

    fn require_initialized(&self) -> Result<(), Error> {
        if self.initialized.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Error::invalid_request()
                .data(json!({ "reason": "the connection is not initialized; send `initialize` first" })))
        }
    }

    /// The synchronous half of `session/prompt`: validation and reserving the
    /// session happen in wire order, before any later message is read.
    fn start_prompt(self: &Arc<Self>, cx: RequestCx, req: PromptRequest) -> BoxFuture<'static, Result<Value, Error>> {
        let prepared = (|| -> Result<_, Error> {
            self.require_initialized()?;
            let id = req.session_id.0.to_string();
            let entry = self.entry(&id)?;
            let text = match self.profile {
                Profile::Automation => prompt::prompt_text(&req.prompt)?.into(),
                Profile::Editor => {
                    let accepts = prompt::Accepts { embedded_context: true, image: self.session_vision(&entry) };
                    prompt::user_prompt(&req.prompt, accepts)?
                }
            };
            let running = entry.running.clone().try_lock_owned().map_err(|_| engine_error(&EngineError::Busy))?;
            let permit = entry.session.begin_turn().map_err(|e| engine_error(&e))?;
            let token = cx.cancel.child_token();
            let seq = entry.turns.fetch_add(1, Ordering::SeqCst);
            *lock(&entry.turn) = Some((seq, token.clone()));
            Ok((entry, text, permit, token, seq, running))
        })();
        let agent = self.clone();
        Box::pin(async move {
            let (entry, text, permit, token, seq, running) = prepared?;
            let result = agent.run_turn(&cx.conn, &entry, text, permit, token).await;
            let mut current = lock(&entry.turn);
            if current.as_ref().is_some_and(|(s, _)| *s == seq) {
                *current = None;
            }
            drop(current);
            drop(running);
            result
        })
    }

    /// Whether the model of this session takes images.
    fn session_vision(&self, entry: &SessionEntry) -> bool {
        match lock(&entry.model).as_deref() {
            Some(name) => self.options.models.iter().any(|m| m.name == name && m.vision),
            None => self.options.vision,
        }
    }

    /// Sends one `session/update`; a closed connection is only logged (the turn ends anyway).
    async fn send_update(conn: &Connection, session_id: &str, update: SessionUpdate) {
        let note = SessionNotification::new(session_id.to_owned(), update);
        if conn.notify("session/update", &note).await.is_err() {
            tracing::debug!("connection closed while sending an update");
        }
    }

    async fn run_turn(
        &self,
        conn: &Connection,
        entry: &SessionEntry,
        text: pier_engine::UserPrompt,
        permit: pier_engine::TurnPermit,
        token: CancellationToken,
    ) -> Result<Value, Error> {
        let session_id = entry.session.id.clone();
        let (tx, mut rx) = mpsc::channel::<EventMsg>(64);
        let (asks_tx, mut asks) = mpsc::channel::<permission::Ask>(1);
        let subagents = self.client_subagents.load(Ordering::SeqCst);
        let mut projector = self.profile.projector(entry.session.model().context_window(), subagents);
        let forward = async {
            let mut asking = true;
            loop {
                // Events first: a permission request leaves after the updates emitted before it.
                tokio::select! {
                    biased;
                    event = rx.recv() => match event {
                        Some(event) => {
                            for update in projector.project(&event) {
                                Self::send_update(conn, &session_id, update).await;
                            }
                        }
                        None => break,
                    },
                    ask = asks.recv(), if asking => match ask {
                        Some(ask) => {
                            let sent = conn.send_request("session/request_permission", &ask.request).await;
                            let _ = ask.sent.send(sent);
                        }
                        None => asking = false,
                    },
                }
            }
        };
        // The turn ends, drops its sender, and `forward` drains: every update is
        // written before the response (R092).
        let approver = Arc::new(permission::ClientApprover {
            asks: asks_tx,
            session_id: session_id.clone(),
            always: self.profile == Profile::Editor,
        });
        let cx = TurnContext { cancel: token, events: tx, approver };
        let (result, ()) = tokio::join!(permit.run(text, cx), forward);
        match result {
            Ok(stop) => to_value(&PromptResponse::new(stop_reason(stop))),
            Err(e) => Err(engine_error(&e)),
        }
    }

    fn cancel(&self, params: Value) {
        match ClientNotification::from_method_and_params("session/cancel", &params) {
            Ok(ClientNotification::CancelNotification(n)) => {
                let entry = lock(&self.sessions).get(n.session_id.0.as_ref()).cloned();
                match entry.and_then(|e| lock(&e.turn).as_ref().map(|(_, t)| t.clone())) {
                    Some(token) => {
                        tracing::info!(session = %n.session_id, "cancelling the running turn");
                        token.cancel();
                    }
                    None => {
                        let child = self.options.cancel_subagent.as_ref().is_some_and(|c| c(n.session_id.0.as_ref()));
                        if child {
                            tracing::info!(session = %n.session_id, "cancelling a subagent's turn");
                        } else {
                            tracing::debug!(session = %n.session_id, "session/cancel with no running turn");
                        }
                    }
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "ignored a malformed session/cancel"),
        }
    }
}

fn stop_reason(stop: pier_engine::StopReason) -> StopReason {
    match stop {
        pier_engine::StopReason::EndTurn => StopReason::EndTurn,
        pier_engine::StopReason::MaxTokens => StopReason::MaxTokens,
        pier_engine::StopReason::MaxTurnRequests => StopReason::MaxTurnRequests,
        pier_engine::StopReason::Refusal => StopReason::Refusal,
        pier_engine::StopReason::Cancelled => StopReason::Cancelled,
    }
}

fn engine_error(e: &EngineError) -> Error {
    match e {
        EngineError::Busy => Error::invalid_request().data(json!({ "reason": e.to_string() })),
        EngineError::Model(m) => {
            let kind = match m {
                pier_model::ModelError::NotConfigured(_) => "model_not_configured",
                pier_model::ModelError::Http { .. } => "provider_http_error",
                pier_model::ModelError::Connect { .. } => "provider_unreachable",
                pier_model::ModelError::IdleTimeout(_) => "provider_timeout",
                pier_model::ModelError::StreamCut(_) => "provider_stream_cut",
                _ => "provider_error",
            };
            let mut data = json!({ "kind": kind, "reason": m.to_string() });
            if let pier_model::ModelError::Http { status, .. } = m {
                data["status"] = json!(status);
            }
            Error::new(-32603, m.to_string()).data(data)
        }
        EngineError::Workspace(_) => invalid_params(e.to_string()),
        EngineError::UnknownSession(id) => unknown_session(id),
        EngineError::Log(_) => {
            Error::new(-32603, e.to_string()).data(json!({ "kind": "session_log", "reason": e.to_string() }))
        }
    }
}

/// -32002 for a session this agent does not have.
fn unknown_session(id: &str) -> Error {
    Error::session_not_found(id.to_owned()).data(json!({
        "sessionId": id,
        "reason": "no such session; create one with session/new, or find stored ones with session/list",
    }))
}

/// The -32602 error for params that did not match the method's type, with the serde path.
fn invalid_payload(method: &str, params: &Value) -> Error {
    let path_error = match method {
        "initialize" => decode_params::<InitializeRequest>(method, params).err(),
        "session/new" => decode_params::<NewSessionRequest>(method, params).err(),
        "session/prompt" => decode_params::<PromptRequest>(method, params).err(),
        "session/load" => decode_params::<LoadSessionRequest>(method, params).err(),
        "session/resume" => decode_params::<ResumeSessionRequest>(method, params).err(),
        "session/list" => decode_params::<ListSessionsRequest>(method, params).err(),
        "session/close" => decode_params::<CloseSessionRequest>(method, params).err(),
        "session/delete" => decode_params::<DeleteSessionRequest>(method, params).err(),
        "session/set_mode" => decode_params::<SetSessionModeRequest>(method, params).err(),
        "session/set_config_option" => decode_params::<SetSessionConfigOptionRequest>(method, params).err(),
        _ => None,
    };
    path_error.unwrap_or_else(|| invalid_params(format!("the params of `{method}` do not match its schema")))
}

fn method_not_found(method: &str, why: &str) -> Error {
    Error::method_not_found().data(json!({ "method": method, "reason": why }))
}

/// Serves the agent on a connection; `Arc<AcpAgent>` is the [`Handler`].
pub struct AgentHandler(pub Arc<AcpAgent>);

impl Handler for AgentHandler {
    fn request(&self, cx: RequestCx, method: String, params: Value) -> BoxFuture<'static, Result<Value, Error>> {
        let agent = self.0.clone();
        if !agent.profile.offers(&method) {
            let why = if method.starts_with('_') {
                "pier offers no extension methods".to_owned()
            } else if ClientRequest::supports_method(&method) {
                format!("the {} profile does not offer this method", agent.profile.name())
            } else {
                "unknown method".to_owned()
            };
            let error = method_not_found(&method, &why);
            return Box::pin(async move { Err(error) });
        }
        let request = match ClientRequest::from_method_and_params(&method, &params) {
            Ok(r) => r,
            Err(MethodDispatchError::UnknownMethod { .. }) => {
                let error = method_not_found(&method, "unknown method");
                return Box::pin(async move { Err(error) });
            }
            Err(_) => {
                let error = invalid_payload(&method, &params);
                return Box::pin(async move { Err(error) });
            }
        };
        match request {
            ClientRequest::InitializeRequest(r) => {
                let result = agent.initialize(r);
                Box::pin(async move { result })
            }
            ClientRequest::NewSessionRequest(r) => Box::pin(agent.new_session(cx, r)),
            ClientRequest::PromptRequest(r) => agent.start_prompt(cx, r),
            ClientRequest::LoadSessionRequest(r) => Box::pin(agent.load_session(cx, r)),
            ClientRequest::ResumeSessionRequest(r) => Box::pin(agent.resume_session(cx, r)),
            ClientRequest::ListSessionsRequest(r) => Box::pin(agent.list_sessions(r)),
            ClientRequest::CloseSessionRequest(r) => Box::pin(agent.close_session(r)),
            ClientRequest::DeleteSessionRequest(r) => Box::pin(agent.delete_session(r)),
            ClientRequest::SetSessionModeRequest(r) => Box::pin(agent.set_mode(cx, r)),
            ClientRequest::SetSessionConfigOptionRequest(r) => Box::pin(agent.set_config_option(cx, r)),
            _ => {
                let error = method_not_found(&method, "not offered");
                Box::pin(async move { Err(error) })
            }
        }
    }

    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        if method == "session/cancel" {
            self.0.cancel(params);
        } else {
            tracing::debug!(method, "ignored a notification");
        }
    }
}
