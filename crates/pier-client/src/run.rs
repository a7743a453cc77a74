//! One run of the client: start the agent, handshake, open or continue a
//! session, send one prompt, follow the turn to its stop reason, tear down.
//!
//! Cancellation (Ctrl-C, SIGTERM, `--timeout`, `--max-time`) is the handshake of
//! seed 000: send `session/cancel`, answer every permission request `cancelled`
//! from then on (R088), keep taking updates, and wait for the `cancelled` stop
//! reason up to the grace period; an agent that does not confirm is killed. A
//! second interrupt kills at once. Whatever the ending, teardown kills every
//! terminal and the agent's whole process group.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agent_client_protocol_schema::ProtocolVersion;
use agent_client_protocol_schema::v1::{
    ClientCapabilities, ContentBlock, FileSystemCapabilities, Implementation, InitializeRequest, InitializeResponse,
    LoadSessionRequest, NewSessionRequest, NewSessionResponse, PromptRequest, PromptResponse, ResumeSessionRequest,
    SessionNotification, SessionUpdate, StopReason,
};
use pier_acp::{Connection, ConnectionConfig, RequestError};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::handler::{ClientHandler, ClientState, EventReceiver, event_channel, message_text};
use crate::policy::ClientPolicy;
use crate::process::AgentProcess;
use crate::registry::AgentCommand;
use crate::sandbox::Sandbox;
use crate::{ClientError, ClientEvent};

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub agent: AgentCommand,
    pub cwd: PathBuf,
    pub allow_dirs: Vec<PathBuf>,
    pub fs: bool,
    pub terminal: bool,
    pub policy: ClientPolicy,
    pub interactive: bool,
    pub echo_stderr: bool,
    /// Longest silence from the agent during the turn.
    pub idle_timeout: Option<Duration>,
    /// Longest turn.
    pub max_time: Option<Duration>,
    /// How long a cancel may take to be confirmed.
    pub cancel_grace: Duration,
    /// Longest wait for `initialize` and session setup.
    pub setup_timeout: Duration,
    /// Answers *ask* permission decisions instead of the terminal.
    pub asker: Option<Arc<dyn crate::handler::Asker>>,
    /// When set, the only directories the agent may write (fs writes and edit permissions).
    pub writable: Option<Vec<PathBuf>>,
}

impl std::fmt::Debug for dyn crate::handler::Asker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Asker")
    }
}

/// Which session the prompt goes to.
#[derive(Debug, Clone)]
pub enum SessionTarget {
    New,
    /// An existing session, continued with `session/resume` or `session/load`.
    Continue {
        session_id: String,
    },
}

/// How the turn ended, beyond its stop reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The agent answered the prompt.
    Answered,
    /// `--timeout` or `--max-time` fired; `confirmed` says whether the agent confirmed the cancel.
    TimedOut { confirmed: bool },
    /// Ctrl-C or SIGTERM.
    Interrupted { confirmed: bool },
    /// `--non-interactive fail` met a permission request that asks.
    PermissionRequired,
    /// Something failed; see `error`.
    Failed,
}

/// Everything a renderer needs at the end.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub ending: Ending,
    pub stop_reason: Option<StopReason>,
    /// The last assistant message.
    pub text: String,
    pub usage: Option<Value>,
    pub agent_info: Option<Implementation>,
    pub session_id: Option<String>,
    pub load_session: bool,
    pub resume_session: bool,
    pub error: Option<ClientError>,
    pub duration: Duration,
}

impl RunOutcome {
    /// A run that got nowhere (yet): no agent, no session, no stop reason.
    pub fn failed(error: Option<ClientError>) -> RunOutcome {
        RunOutcome {
            ending: Ending::Failed,
            stop_reason: None,
            text: String::new(),
            usage: None,
            agent_info: None,
            session_id: None,
            load_session: false,
            resume_session: false,
            error,
            duration: Duration::ZERO,
        }
    }
}

/// Builds the final assistant message from updates: a tool call starts a new message.
#[derive(Default)]
struct Transcript {
    current: String,
    last: String,
    usage: Option<Value>,
}

impl Transcript {
    fn see(&mut self, params: &Value) {
        let Ok(note) = serde_json::from_value::<SessionNotification>(params.clone()) else { return };
        match &note.update {
            SessionUpdate::ToolCall(_) => {
                if !self.current.is_empty() {
                    self.last = std::mem::take(&mut self.current);
                }
            }
            SessionUpdate::UsageUpdate(_) => self.usage = Some(params["update"].clone()),
            update => {
                if let Some(text) = message_text(update) {
                    self.current.push_str(text);
                }
            }
        }
    }

    fn text(&self) -> String {
        if self.current.is_empty() { self.last.clone() } else { self.current.clone() }
    }
}

/// How many events may wait between a turn and whoever consumes its `events`.
pub const EVENT_QUEUE: usize = 1024;

/// Runs one prompt on a fresh agent process, then tears it down. `events` receives
/// everything that happens; `interrupts` yields once per Ctrl-C or SIGTERM.
pub async fn run(
    opts: RunOptions,
    target: SessionTarget,
    prompt: Vec<ContentBlock>,
    events: mpsc::Sender<ClientEvent>,
    mut interrupts: mpsc::UnboundedReceiver<()>,
) -> RunOutcome {
    let started = Instant::now();
    let mut outcome = match LiveAgent::start(&opts, &events).await {
        Ok(mut agent) => {
            let outcome = agent.turn(&opts, target, prompt, &events, &mut interrupts).await;
            agent.shutdown(&events).await;
            outcome
        }
        Err(error) => RunOutcome::failed(Some(error)),
    };
    outcome.duration = started.elapsed();
    outcome
}

/// An agent process that has answered `initialize`. It serves one turn at a time,
/// each in a session of its own, and can serve another as long as every turn so far
/// ended cleanly ([`LiveAgent::reusable`]): a task host keeps such agents warm
/// instead of paying a process start per task.
pub struct LiveAgent {
    process: AgentProcess,
    conn: Connection,
    state: Arc<ClientState>,
    inner_rx: EventReceiver,
    init: Value,
    info: Option<Implementation>,
    load_session: bool,
    resume_session: bool,
    /// False once a turn ended in anything but an answer: a cancel, a kill, an error.
    clean: bool,
}

impl LiveAgent {
    /// Spawns the agent and runs the handshake. On failure the agent is already torn down.
    pub async fn start(opts: &RunOptions, events: &mpsc::Sender<ClientEvent>) -> Result<LiveAgent, ClientError> {
        let sandbox = Sandbox::new(&opts.cwd, &opts.allow_dirs)
            .and_then(|s| match &opts.writable {
                Some(w) => s.with_writable(w),
                None => Ok(s),
            })
            .map_err(|e| ClientError::usage(format!("cannot use the directories to serve: {e}")))?;
        let (process, pipes) = AgentProcess::spawn(&opts.agent, &opts.cwd, opts.echo_stderr)?;
        // The handler reports to `inner`; a turn forwards to its `events` and learns from it.
        let (inner_tx, inner_rx) = event_channel();
        let state = Arc::new(ClientState::new(
            sandbox,
            opts.cwd.clone(),
            opts.fs,
            opts.terminal,
            opts.policy.clone(),
            opts.interactive,
            inner_tx,
        ));
        state.begin_turn(opts.asker.clone());
        let conn = Connection::spawn(
            pipes.stdout,
            pipes.stdin,
            Arc::new(ClientHandler(state.clone())),
            ConnectionConfig::default(),
        );
        let mut agent = LiveAgent {
            process,
            conn,
            state,
            inner_rx,
            init: Value::Null,
            info: None,
            load_session: false,
            resume_session: false,
            clean: true,
        };
        match agent.handshake(opts).await {
            Ok(()) => Ok(agent),
            Err(e) => {
                agent.shutdown(events).await;
                Err(e)
            }
        }
    }

    async fn handshake(&mut self, opts: &RunOptions) -> Result<(), ClientError> {
        let (agent, conn, state) = (&mut self.process, &self.conn, &self.state);
        let caps = ClientCapabilities::new()
            .fs(FileSystemCapabilities::new().read_text_file(opts.fs).write_text_file(opts.fs))
            .terminal(opts.terminal);
        let init = InitializeRequest::new(ProtocolVersion::V1)
            .client_capabilities(caps)
            .client_info(Implementation::new("pier", env!("CARGO_PKG_VERSION")));
        let init: Value = setup(agent, opts, state, "initialize", conn.request("initialize", &init)).await?;
        let init_response: InitializeResponse = serde_json::from_value(init.clone())
            .map_err(|e| agent_error(agent, format!("its initialize response is malformed: {e}")))?;
        if init_response.protocol_version != ProtocolVersion::V1 {
            return Err(agent_error(
                agent,
                format!(
                    "it speaks ACP protocol version {}, and pier speaks only version 1 (R028)",
                    init_response.protocol_version
                ),
            ));
        }
        self.info = init_response.agent_info.clone();
        self.load_session = init_response.agent_capabilities.load_session;
        self.resume_session = init_response.agent_capabilities.session_capabilities.resume.is_some();
        self.init = init;
        Ok(())
    }

    /// Whether the agent can take another turn: every turn so far was answered
    /// without a cancel, and the process and its connection are alive.
    pub fn reusable(&mut self) -> bool {
        self.clean && !self.conn.is_closing() && self.process.try_exit().is_none()
    }

    /// Opens or continues a session and runs one prompt in it. Teardown of what the
    /// turn started (terminals) happens here; the agent itself stays up.
    pub async fn turn(
        &mut self,
        opts: &RunOptions,
        target: SessionTarget,
        prompt: Vec<ContentBlock>,
        events: &mpsc::Sender<ClientEvent>,
        interrupts: &mut mpsc::UnboundedReceiver<()>,
    ) -> RunOutcome {
        let started = Instant::now();
        let mut outcome = RunOutcome::failed(None);
        outcome.agent_info = self.info.clone();
        outcome.load_session = self.load_session;
        outcome.resume_session = self.resume_session;
        if !self.reusable() {
            outcome.error = Some(agent_error(&mut self.process, "it cannot take another turn".into()));
            return outcome;
        }
        self.state.begin_turn(opts.asker.clone());
        let result = drive(
            opts,
            target,
            prompt,
            &self.conn,
            &self.state,
            &mut self.process,
            &self.init,
            &mut self.inner_rx,
            events,
            interrupts,
            &mut outcome,
        )
        .await;
        if let Err(e) = result {
            // A cancel that ended in a kill has set its own ending already.
            outcome.error = Some(e);
        }
        if outcome.ending != Ending::Answered || outcome.error.is_some() {
            self.clean = false;
        }
        self.state.terminals.kill_all();
        while let Ok(event) = self.inner_rx.try_recv() {
            let _ = events.send(event).await;
        }
        outcome.duration = started.elapsed();
        outcome
    }

    /// Closes the connection and ends the agent's whole process group.
    pub async fn shutdown(mut self, events: &mpsc::Sender<ClientEvent>) {
        self.state.terminals.kill_all();
        self.conn.close().await;
        self.process.shutdown(Duration::from_secs(2)).await;
        while let Ok(event) = self.inner_rx.try_recv() {
            let _ = events.send(event).await;
        }
    }
}

/// An agent failure with the last lines of its stderr.
fn agent_error(agent: &mut AgentProcess, message: String) -> ClientError {
    let mut message = message;
    if let Some(status) = agent.try_exit() {
        message.push_str(&format!(" (the agent exited: {status})"));
    }
    let tail = agent.stderr_tail();
    if !tail.is_empty() {
        let last: Vec<String> = tail.iter().rev().take(10).rev().cloned().collect();
        message.push_str(&format!("\nlast lines of its stderr:\n  {}", last.join("\n  ")));
    }
    ClientError::Agent { agent: agent.name.clone(), message }
}

fn request_error(agent: &mut AgentProcess, what: &str, e: RequestError) -> ClientError {
    let message = match e {
        RequestError::Closed => format!("it closed the connection during {what}"),
        RequestError::Remote(err) => {
            let data = err.data.map(|d| format!(" ({d})")).unwrap_or_default();
            format!("{what} failed: {} {}{data}", i32::from(err.code), err.message)
        }
        other => format!("{what} failed: {other}"),
    };
    agent_error(agent, message)
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    opts: &RunOptions,
    target: SessionTarget,
    prompt: Vec<ContentBlock>,
    conn: &Connection,
    state: &Arc<ClientState>,
    agent: &mut AgentProcess,
    init: &Value,
    inner_rx: &mut EventReceiver,
    events: &mpsc::Sender<ClientEvent>,
    interrupts: &mut mpsc::UnboundedReceiver<()>,
    outcome: &mut RunOutcome,
) -> Result<(), ClientError> {
    // Session.
    let session_id = match target {
        SessionTarget::New => {
            let request = NewSessionRequest::new(opts.cwd.clone());
            let first = guard(
                agent,
                opts,
                state,
                "session/new",
                conn.request::<_, NewSessionResponse>("session/new", &request),
            )
            .await?;
            let response = match first {
                Err(RequestError::Remote(e)) if i32::from(e.code) == -32000 => {
                    authenticate(agent, opts, state, conn, init).await?;
                    setup(
                        agent,
                        opts,
                        state,
                        "session/new",
                        conn.request::<_, NewSessionResponse>("session/new", &request),
                    )
                    .await?
                }
                other => settle(agent, "session/new", other).await?,
            };
            response.session_id.0.to_string()
        }
        SessionTarget::Continue { session_id } => {
            if outcome.resume_session {
                let request = ResumeSessionRequest::new(session_id.clone(), opts.cwd.clone());
                setup(agent, opts, state, "session/resume", conn.request::<_, Value>("session/resume", &request))
                    .await?;
            } else if outcome.load_session {
                state.replaying.store(true, Ordering::SeqCst);
                let request = LoadSessionRequest::new(session_id.clone(), opts.cwd.clone());
                let loaded =
                    setup(agent, opts, state, "session/load", conn.request::<_, Value>("session/load", &request)).await;
                state.replaying.store(false, Ordering::SeqCst);
                loaded?;
            } else {
                return Err(ClientError::Agent {
                    agent: agent.name.clone(),
                    message: "it cannot continue sessions (it offers neither session/resume nor session/load); \
                              start a new session instead"
                        .into(),
                });
            }
            session_id
        }
    };
    outcome.session_id = Some(session_id.clone());

    // The turn.
    let request = PromptRequest::new(session_id.clone(), prompt);
    let prompt_fut = conn.request::<_, Value>("session/prompt", &request);
    tokio::pin!(prompt_fut);
    let started = Instant::now();
    let mut last_activity = Instant::now();
    let mut cancel: Option<(Instant, Ending)> = None;
    let mut transcript = Transcript::default();
    let far = Duration::from_secs(365 * 24 * 3600);
    let response = loop {
        let idle_deadline = opts.idle_timeout.map_or(started + far, |t| last_activity + t);
        let max_deadline = opts.max_time.map_or(started + far, |t| started + t);
        let grace_deadline = cancel.map_or(started + far, |(at, _)| at + opts.cancel_grace);
        tokio::select! {
            response = &mut prompt_fut => break response,
            Some(event) = inner_rx.recv() => {
                last_activity = Instant::now();
                if !of_session(&event, &session_id) {
                    continue;
                }
                match &event {
                    ClientEvent::Update(params) => transcript.see(params),
                    ClientEvent::ProtocolError(_) => {
                        let _ = events.send(event.clone()).await;
                        outcome.text = transcript.text();
                        return Err(protocol_error(agent, state));
                    }
                    _ => {}
                }
                // A bounded queue: while its consumer is behind, this waits, the handler's
                // backlog grows, and the connection stops reading (see `event_channel`).
                let _ = events.send(event).await;
            }
            _ = tokio::time::sleep_until(idle_deadline.into()), if cancel.is_none() => {
                start_cancel(conn, state, &session_id).await;
                cancel = Some((Instant::now(), Ending::TimedOut { confirmed: true }));
            }
            _ = tokio::time::sleep_until(max_deadline.into()), if cancel.is_none() => {
                start_cancel(conn, state, &session_id).await;
                cancel = Some((Instant::now(), Ending::TimedOut { confirmed: true }));
            }
            _ = state.permission_failed.cancelled(), if cancel.is_none() => {
                start_cancel(conn, state, &session_id).await;
                cancel = Some((Instant::now(), Ending::PermissionRequired));
            }
            Some(()) = interrupts.recv() => {
                if cancel.is_some() {
                    agent.kill().await;
                    outcome.ending = Ending::Interrupted { confirmed: false };
                    outcome.text = transcript.text();
                    return Err(agent_error(agent, "interrupted twice; the agent was killed".into()));
                }
                start_cancel(conn, state, &session_id).await;
                cancel = Some((Instant::now(), Ending::Interrupted { confirmed: true }));
            }
            _ = tokio::time::sleep_until(grace_deadline.into()), if cancel.is_some() => {
                agent.kill().await;
                let ending = match cancel.map(|c| c.1) {
                    Some(Ending::TimedOut { .. }) => Ending::TimedOut { confirmed: false },
                    Some(Ending::PermissionRequired) => Ending::PermissionRequired,
                    _ => Ending::Interrupted { confirmed: false },
                };
                outcome.ending = ending;
                outcome.text = transcript.text();
                return Err(agent_error(
                    agent,
                    format!("it did not confirm the cancel within {:?}; it was killed", opts.cancel_grace),
                ));
            }
        }
    };
    // Updates that raced the response are still part of the turn.
    while let Ok(event) = inner_rx.try_recv() {
        if !of_session(&event, &session_id) {
            continue;
        }
        if let ClientEvent::Update(params) = &event {
            transcript.see(params);
        }
        let _ = events.send(event).await;
    }
    outcome.text = transcript.text();
    outcome.usage = transcript.usage.clone();
    let response = settle(agent, "session/prompt", response).await?;
    if let Some(usage) = response.get("usage") {
        outcome.usage = Some(usage.clone());
    }
    let prompt_response: PromptResponse = serde_json::from_value(response)
        .map_err(|e| agent_error(agent, format!("its session/prompt response is malformed: {e}")))?;
    outcome.stop_reason = Some(prompt_response.stop_reason);
    outcome.ending = match cancel {
        None => Ending::Answered,
        Some((_, Ending::TimedOut { .. })) => {
            Ending::TimedOut { confirmed: prompt_response.stop_reason == StopReason::Cancelled }
        }
        Some((_, Ending::PermissionRequired)) => Ending::PermissionRequired,
        Some(_) => Ending::Interrupted { confirmed: prompt_response.stop_reason == StopReason::Cancelled },
    };
    Ok(())
}

/// Whether an event belongs to this turn's session. An agent that serves several
/// turns may still send an update for an earlier session; it is not this turn's.
fn of_session(event: &ClientEvent, session_id: &str) -> bool {
    match event {
        ClientEvent::Update(params) => {
            let of = params["sessionId"].as_str() == Some(session_id);
            if !of {
                tracing::debug!(session = ?params["sessionId"], "ignored an update for another session");
            }
            of
        }
        _ => true,
    }
}

async fn start_cancel(conn: &Connection, state: &ClientState, session_id: &str) {
    state.cancelling.cancel();
    if let Err(e) = conn.notify("session/cancel", &json!({ "sessionId": session_id })).await {
        tracing::warn!(error = %e, "could not send session/cancel");
    }
}

async fn settle<T>(agent: &mut AgentProcess, what: &str, r: Result<T, RequestError>) -> Result<T, ClientError> {
    match r {
        Ok(v) => Ok(v),
        Err(e) => {
            if matches!(e, RequestError::Closed) {
                // The agent went away: let it finish exiting so the error can say how.
                agent.settle_exit(Duration::from_secs(1)).await;
            }
            Err(request_error(agent, what, e))
        }
    }
}

async fn setup<T>(
    agent: &mut AgentProcess,
    opts: &RunOptions,
    state: &ClientState,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, RequestError>>,
) -> Result<T, ClientError> {
    let r = guard(agent, opts, state, what, fut).await?;
    settle(agent, what, r).await
}

/// Bounds a setup request by the setup timeout and a protocol breach.
async fn guard<T>(
    agent: &mut AgentProcess,
    opts: &RunOptions,
    state: &ClientState,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, RequestError>>,
) -> Result<Result<T, RequestError>, ClientError> {
    tokio::select! {
        r = tokio::time::timeout(opts.setup_timeout, fut) => match r {
            Ok(r) => Ok(r),
            Err(_) => Err(agent_error(agent, format!("it did not answer {what} within {:?}", opts.setup_timeout))),
        },
        _ = state.protocol_broken.cancelled() => Err(protocol_error(agent, state)),
    }
}

fn protocol_error(agent: &mut AgentProcess, state: &ClientState) -> ClientError {
    let what =
        state.protocol_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone().unwrap_or_default();
    agent_error(agent, format!("it wrote something that is not a JSON-RPC message to stdout: {what}"))
}

/// Authenticates with the first env-var method whose variables are all set.
async fn authenticate(
    agent: &mut AgentProcess,
    opts: &RunOptions,
    state: &ClientState,
    conn: &Connection,
    init: &Value,
) -> Result<(), ClientError> {
    let methods = init["authMethods"].as_array().cloned().unwrap_or_default();
    let usable = methods.iter().find(|m| {
        let vars: Vec<&str> = match (m.get("vars").and_then(Value::as_array), m.get("varName").and_then(Value::as_str))
        {
            (Some(vars), _) => {
                vars.iter().filter_map(|v| v.get("name").and_then(Value::as_str).or(v.as_str())).collect()
            }
            (None, Some(name)) => vec![name],
            _ => Vec::new(),
        };
        m["type"] == "env_var" && !vars.is_empty() && vars.iter().all(|v| std::env::var_os(v).is_some())
    });
    let Some(method) = usable else {
        let names: Vec<String> = methods
            .iter()
            .map(|m| format!("{} ({})", m["id"].as_str().unwrap_or("?"), m["name"].as_str().unwrap_or("")))
            .collect();
        return Err(ClientError::Agent {
            agent: agent.name.clone(),
            message: format!(
                "it requires authentication and none of its methods can be used unattended; its methods: {}",
                if names.is_empty() { "none".to_owned() } else { names.join(", ") }
            ),
        });
    };
    let id = method["id"].clone();
    setup(agent, opts, state, "authenticate", conn.request::<_, Value>("authenticate", &json!({ "methodId": id })))
        .await?;
    Ok(())
}
