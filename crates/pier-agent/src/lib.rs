//! The ACP agent: answers a client over a [`pier_acp::Connection`] by driving
//! [`pier_engine`] sessions, and projects engine events through a [`Profile`].
//!
//! State ownership: [`AcpAgent`] owns the table of live sessions. Each entry
//! holds the engine session and the cancel token of its running turn, if any;
//! the token is set by the prompt's handler before the handler yields, so a
//! `session/cancel` that follows a prompt on the wire always finds it.

pub mod permission;
pub mod profile;
pub mod prompt;
pub mod wire;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use agent_client_protocol_schema::v1::{
    ClientNotification, ClientRequest, Error, Implementation, InitializeRequest, InitializeResponse, NewSessionRequest,
    NewSessionResponse, PromptRequest, PromptResponse, SessionNotification, StopReason,
};
use agent_client_protocol_schema::{MethodDispatchError, ProtocolVersion};
use futures::future::BoxFuture;
use pier_acp::error::{decode_params, internal, invalid_params};
use pier_acp::{Connection, Handler, RequestCx};
use pier_engine::{Engine, EngineError, EventMsg, Session, TurnContext};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use profile::Profile;

/// An ACP agent over the engine.
pub struct AcpAgent {
    engine: Engine,
    profile: Profile,
    initialized: AtomicBool,
    sessions: Mutex<HashMap<String, Arc<SessionEntry>>>,
}

struct SessionEntry {
    session: Arc<Session>,
    /// The running turn's sequence number and cancel token. Set and cleared by
    /// the prompt handler; the number makes sure a turn clears only its own token.
    turn: Mutex<Option<(u64, CancellationToken)>>,
    turns: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn to_value<T: Serialize>(v: &T) -> Result<Value, Error> {
    serde_json::to_value(v).map_err(|e| internal(format!("could not encode the response: {e}")))
}

impl AcpAgent {
    pub fn new(engine: Engine, profile: Profile) -> Arc<AcpAgent> {
        Arc::new(AcpAgent {
            engine,
            profile,
            initialized: AtomicBool::new(false),
            sessions: Mutex::new(HashMap::new()),
        })
    }

    /// Closes every session and flushes its log. Call after the connection closed.
    pub async fn shutdown(&self) {
        let entries: Vec<Arc<SessionEntry>> = lock(&self.sessions).drain().map(|(_, e)| e).collect();
        for entry in entries {
            if let Some((_, token)) = lock(&entry.turn).take() {
                token.cancel();
            }
            if let Err(e) = entry.session.close().await {
                tracing::error!(session = %entry.session.id, error = %e, "closing a session failed");
            }
        }
    }

    fn initialize(&self, req: InitializeRequest) -> Result<Value, Error> {
        // R026/R027: we speak version 1 only; we answer 1 to 1 and to any other request.
        tracing::info!(requested = req.protocol_version.as_u16(), "initialize");
        self.initialized.store(true, Ordering::SeqCst);
        let response = InitializeResponse::new(ProtocolVersion::V1)
            .agent_capabilities(self.profile.capabilities())
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

    async fn new_session(self: Arc<Self>, cancel: CancellationToken, req: NewSessionRequest) -> Result<Value, Error> {
        self.require_initialized()?;
        if !req.cwd.is_absolute() {
            return Err(invalid_params(format!("cwd must be an absolute path, got `{}`", req.cwd.display())));
        }
        if !req.mcp_servers.is_empty() {
            return Err(invalid_params(format!(
                "the {} profile takes no MCP servers; send `mcpServers: []`",
                self.profile.name()
            )));
        }
        if !req.additional_directories.is_empty() {
            return Err(invalid_params(format!(
                "the {} profile takes no additionalDirectories; the session is confined to cwd",
                self.profile.name()
            )));
        }
        match tokio::fs::metadata(&req.cwd).await {
            Ok(m) if m.is_dir() => {}
            _ => return Err(invalid_params(format!("cwd `{}` is not an existing directory", req.cwd.display()))),
        }
        let session = self.engine.create_session(req.cwd).await.map_err(|e| engine_error(&e))?;
        if cancel.is_cancelled() {
            // Lost the race with close: dispose of the handle nobody will ever see.
            let _ = session.close().await;
            return Err(Error::request_cancelled());
        }
        let id = session.id.clone();
        tracing::info!(session = %id, cwd = %session.cwd.display(), "session created");
        lock(&self.sessions)
            .insert(id.clone(), Arc::new(SessionEntry { session, turn: Mutex::new(None), turns: AtomicU64::new(0) }));
        to_value(&NewSessionResponse::new(id))
    }

    /// The synchronous half of `session/prompt`: validation and reserving the
    /// session happen in wire order, before any later message is read.
    fn start_prompt(self: &Arc<Self>, cx: RequestCx, req: PromptRequest) -> BoxFuture<'static, Result<Value, Error>> {
        let prepared = (|| -> Result<_, Error> {
            self.require_initialized()?;
            let id = req.session_id.0.to_string();
            let entry = lock(&self.sessions).get(&id).cloned().ok_or_else(|| {
                Error::session_not_found(req.session_id.clone())
                    .data(json!({ "sessionId": id, "reason": "no such session on this connection; create one with session/new" }))
            })?;
            let text = prompt::prompt_text(&req.prompt)?;
            let permit = entry.session.begin_turn().map_err(|e| engine_error(&e))?;
            let token = cx.cancel.child_token();
            let seq = entry.turns.fetch_add(1, Ordering::SeqCst);
            *lock(&entry.turn) = Some((seq, token.clone()));
            Ok((entry, text, permit, token, seq))
        })();
        let agent = self.clone();
        Box::pin(async move {
            let (entry, text, permit, token, seq) = prepared?;
            let result = agent.run_turn(&cx.conn, &entry, text, permit, token).await;
            let mut current = lock(&entry.turn);
            if current.as_ref().is_some_and(|(s, _)| *s == seq) {
                *current = None;
            }
            drop(current);
            result
        })
    }

    async fn run_turn(
        &self,
        conn: &Connection,
        entry: &SessionEntry,
        text: String,
        permit: pier_engine::TurnPermit,
        token: CancellationToken,
    ) -> Result<Value, Error> {
        let session_id = entry.session.id.clone();
        let (tx, mut rx) = mpsc::channel::<EventMsg>(64);
        let profile = self.profile;
        let forward = async {
            while let Some(event) = rx.recv().await {
                if let Some(update) = profile.project(&event) {
                    let note = SessionNotification::new(session_id.clone(), update);
                    if conn.notify("session/update", &note).await.is_err() {
                        tracing::debug!("connection closed while sending an update");
                    }
                }
            }
        };
        // The turn ends, drops its sender, and `forward` drains: every update is
        // written before the response (R092).
        let approver = Arc::new(permission::ClientApprover { conn: conn.clone(), session_id: session_id.clone() });
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
                    None => tracing::debug!(session = %n.session_id, "session/cancel with no running turn"),
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
        EngineError::Log(_) => {
            Error::new(-32603, e.to_string()).data(json!({ "kind": "session_log", "reason": e.to_string() }))
        }
    }
}

/// The -32602 error for params that did not match the method's type, with the serde path.
fn invalid_payload(method: &str, params: &Value) -> Error {
    let path_error = match method {
        "initialize" => decode_params::<InitializeRequest>(method, params).err(),
        "session/new" => decode_params::<NewSessionRequest>(method, params).err(),
        "session/prompt" => decode_params::<PromptRequest>(method, params).err(),
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
            ClientRequest::NewSessionRequest(r) => Box::pin(agent.new_session(cx.cancel.clone(), r)),
            ClientRequest::PromptRequest(r) => agent.start_prompt(cx, r),
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
