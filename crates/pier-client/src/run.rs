//! One run of the client: start the agent, handshake, open or continue a
//! session, send one prompt, follow the turn to its stop reason, tear down.
//!
//! Cancellation (Ctrl-C, SIGTERM, `--timeout`, `--max-time`) is the handshake of
//! seed 000: send `session/cancel`, answer every permission request `cancelled`
//! from then on (R088), keep taking updates, and wait for the `cancelled` stop
//! reason up to the grace period; an agent that does not confirm is killed. A
//! second interrupt kills at once. Before the turn runs (the handshake, the
//! session's setup) there is nothing to cancel: an interrupt, `--timeout` or
//! `--max-time` kills the agent's group at once. Whatever the ending, teardown kills
//! every terminal and the agent's whole process group.
//!
//! State by lifetime: [`RunOptions`] is the agent spec (what to start and how to
//! serve it), [`LiveAgent`] the connection state (the process, the connection, the
//! capabilities it announced), and `Turn` the state of one turn (its session, the
//! answer kept so far and its `Phase`). Each setup request waits in one place
//! (`LiveAgent::setup_raw`), the turn in one loop over a closed `Wake` enum, and a
//! cancel starts in one place (`Turn::cancel`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agent_client_protocol_schema::ProtocolVersion;
use agent_client_protocol_schema::v1::{
    ClientCapabilities, ContentBlock, ElicitationCapabilities, ElicitationFormCapabilities, FileSystemCapabilities,
    Implementation, InitializeRequest, InitializeResponse, LoadSessionRequest, NewSessionRequest, NewSessionResponse,
    ResumeSessionRequest, SessionNotification, SessionUpdate, StopReason,
};
use pier_acp::{Connection, ConnectionConfig, RequestError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::handler::{ClientHandler, ClientState, EventReceiver, event_channel};
use crate::policy::ClientPolicy;
use crate::process::AgentProcess;
use crate::registry::AgentCommand;
use crate::sandbox::Sandbox;
use crate::turn::*;
use crate::{ClientError, ClientEvent};

/// How to run. Its `Debug` leaves out what can hold a secret (`redacted.rs`).
#[derive(Clone)]
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
    /// How `terminal/*` commands are confined (`--sandbox off`: no Landlock; they still
    /// end with their turn).
    pub confinement: pier_tools::Confinement,
    /// The jail the agent process runs in (`None`: unconfined, only its process group ends with it).
    pub jail: Option<crate::process::JailSetup>,
    /// Told each turn's session id as soon as the agent gives it, before the prompt is
    /// sent (a parent showing its subagent's session, say).
    pub session_ids: Option<mpsc::UnboundedSender<String>>,
    /// `_meta` sent with `session/new` and `session/prompt` (the host's `pier.dev/task`).
    pub meta: Option<agent_client_protocol_schema::v1::Meta>,
    /// MCP servers for the agent's session (a task's `mcp_servers`); an agent that cannot take
    /// one (an HTTP server without `mcpCapabilities.http`) fails the run, saying so.
    pub mcp_servers: Vec<agent_client_protocol_schema::v1::McpServer>,
    /// MCP servers the host offers besides (its own endpoint): passed to an agent that takes
    /// them (an HTTP one needs `mcpCapabilities.http`), left out for one that does not, said
    /// in the log; never a reason to fail.
    pub host_mcp_servers: Vec<agent_client_protocol_schema::v1::McpServer>,
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
    /// A new session that must be continuable later (`pier prompt -s`): refused before
    /// it is opened when the agent offers neither `session/resume` nor `session/load`.
    NewContinuable,
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
    TimedOut { confirmed: bool, limit: TimeLimit },
    /// Ctrl-C or SIGTERM.
    Interrupted { confirmed: bool },
    /// `--non-interactive fail` met a permission request that asks.
    PermissionRequired,
    /// Something failed; see `error`.
    Failed,
}

/// Which time limit ended a run, and how long it was: what a person is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeLimit {
    /// The agent sent nothing for this long during the turn (`--timeout`, a task's `timeout`).
    Idle(Duration),
    /// The turn ran this long in all (`--max-time`, a task's `max_time`).
    Total(Duration),
    /// The agent did not start or open its session within this long.
    Setup(Duration),
}

impl TimeLimit {
    pub fn duration(self) -> Duration {
        match self {
            TimeLimit::Idle(d) | TimeLimit::Total(d) | TimeLimit::Setup(d) => d,
        }
    }
}

impl std::fmt::Display for TimeLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = |d: Duration| {
            let s = d.as_secs_f64();
            if s.fract() == 0.0 { format!("{s:.0}s") } else { format!("{s:.1}s") }
        };
        match *self {
            TimeLimit::Idle(d) => write!(f, "timed out after {} without any update from the agent", secs(d)),
            TimeLimit::Total(d) => write!(f, "timed out: the turn reached its time limit of {}", secs(d)),
            TimeLimit::Setup(d) => {
                write!(f, "timed out: the agent did not start and open its session within {}", secs(d))
            }
        }
    }
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
    /// The limit of its jail the agent broke, when that ended the run.
    pub breach: Option<pier_jail::Breach>,
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
            breach: None,
        }
    }
}

/// The most text of one assistant message a run keeps for its outcome. The updates
/// themselves (and so `--format json`) carry every chunk; only the kept copy is bounded.
pub const MAX_TEXT: usize = 1 << 20;

/// The tail of one assistant message, at most [`MAX_TEXT`] once rendered, and how
/// many bytes were cut from its start.
#[derive(Debug, Default, Clone)]
pub(crate) struct Kept {
    pub(crate) text: String,
    pub(crate) cut: usize,
}

impl Kept {
    pub(crate) fn push(&mut self, s: &str) {
        self.text.push_str(s);
        // Trim in batches: each byte is moved at most once more.
        if self.text.len() > 2 * MAX_TEXT {
            self.trim();
        }
    }

    pub(crate) fn trim(&mut self) {
        if self.text.len() <= MAX_TEXT {
            return;
        }
        let mut at = self.text.len() - MAX_TEXT;
        while !self.text.is_char_boundary(at) {
            at += 1;
        }
        self.text.drain(..at);
        self.cut += at;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.text.is_empty() && self.cut == 0
    }

    pub(crate) fn render(&self) -> String {
        let mut kept = self.clone();
        kept.trim();
        if kept.cut == 0 {
            return kept.text;
        }
        format!(
            "[pier: the first {} bytes of this message were cut; the session's updates carry all of it]\n{}",
            kept.cut, kept.text
        )
    }
}

/// Builds the final assistant message from updates: a tool call starts a new message.
#[derive(Default)]
pub(crate) struct Transcript {
    pub(crate) current: Kept,
    pub(crate) last: Kept,
    pub(crate) usage: Option<Value>,
}

impl Transcript {
    /// Takes one `session/update`.
    pub(crate) fn see(&mut self, n: &SessionNotification) {
        match &n.update {
            SessionUpdate::ToolCall(_) if !self.current.is_empty() => {
                self.last = std::mem::take(&mut self.current);
            }
            SessionUpdate::UsageUpdate(_) => self.usage = serde_json::to_value(&n.update).ok(),
            update => {
                if let Some(text) = crate::handler::message_text(update) {
                    self.current.push(text);
                }
            }
        }
    }

    pub(crate) fn text(&self) -> String {
        if self.current.is_empty() { self.last.render() } else { self.current.render() }
    }
}

/// How long `session/close` may take before the agent is deemed unfit for reuse.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How many events may wait between a turn and whoever consumes its `events`.
pub const EVENT_QUEUE: usize = 1024;

/// Ctrl-C and SIGTERM (or the host's stop), once each.
pub type Interrupts = mpsc::UnboundedReceiver<()>;

/// Runs one prompt on a fresh agent process, then tears it down. `events` receives
/// everything that happens; `interrupts` yields once per Ctrl-C or SIGTERM, and one
/// ends the run at any phase: during the handshake it kills the agent's group, during
/// the turn it starts the cancel handshake.
pub async fn run(
    opts: RunOptions,
    target: SessionTarget,
    prompt: Vec<ContentBlock>,
    events: mpsc::Sender<ClientEvent>,
    mut interrupts: Interrupts,
) -> RunOutcome {
    let started = Instant::now();
    let mut outcome = match LiveAgent::start_interruptible(&opts, &events, &mut interrupts).await {
        Ok(mut agent) => {
            let outcome = agent.turn(&opts, target, prompt, &events, &mut interrupts).await;
            agent.shutdown(&events).await;
            outcome
        }
        Err(stopped) => stopped.into_outcome(None),
    };
    outcome.duration = started.elapsed();
    outcome
}

/// Why a run stopped before an answer: how it ended and what to say.
pub(crate) struct Stopped {
    pub(crate) ending: Ending,
    pub(crate) error: ClientError,
}

impl Stopped {
    pub(crate) fn failed(error: ClientError) -> Stopped {
        Stopped { ending: Ending::Failed, error }
    }

    pub(crate) fn into_outcome(self, base: Option<RunOutcome>) -> RunOutcome {
        let mut outcome = base.unwrap_or_else(|| RunOutcome::failed(None));
        outcome.ending = self.ending;
        outcome.error = Some(self.error);
        outcome
    }
}

/// The latest instant a setup request (handshake, session) may be answered by, and
/// the limit that sets it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    pub(crate) at: Instant,
    pub(crate) limit: TimeLimit,
}

pub(crate) fn setup_deadline(opts: &RunOptions, from: Instant) -> Deadline {
    let limit = match opts.max_time {
        Some(max) if max < opts.setup_timeout => TimeLimit::Total(max),
        _ => TimeLimit::Setup(opts.setup_timeout),
    };
    Deadline { at: from + limit.duration(), limit }
}

/// An agent process that has answered `initialize`: the connection's state, which
/// lives as long as the process. It serves one turn at a time, each in a session of
/// its own, and can serve another as long as every turn so far ended cleanly
/// ([`LiveAgent::reusable`]): a task host keeps such agents warm instead of paying a
/// process start per task.
pub struct LiveAgent {
    pub(crate) process: AgentProcess,
    pub(crate) conn: Connection,
    pub(crate) state: Arc<ClientState>,
    pub(crate) inner_rx: EventReceiver,
    pub(crate) init: Value,
    pub(crate) info: Option<Implementation>,
    pub(crate) load_session: bool,
    pub(crate) resume_session: bool,
    /// False once a turn ended in anything but an answer: a cancel, a kill, an error.
    pub(crate) clean: bool,
}

impl LiveAgent {
    /// The count of questions asked for this agent outside its client (see
    /// [`crate::handler::AskingCount`]).
    pub fn asking(&self) -> crate::handler::AskingCount {
        crate::handler::AskingCount(self.state.clone())
    }

    /// Spawns the agent and runs the handshake. On failure the agent is already torn down.
    pub async fn start(opts: &RunOptions, events: &mpsc::Sender<ClientEvent>) -> Result<LiveAgent, ClientError> {
        // Nobody interrupts: a receiver whose sender is gone never yields.
        let (_, mut none) = mpsc::unbounded_channel();
        LiveAgent::start_interruptible(opts, events, &mut none).await.map_err(|s| s.error)
    }

    /// [`LiveAgent::start`] that an interrupt ends at any point of the handshake (the agent's
    /// group is killed at once); the error is the outcome of a run that got no further.
    pub async fn start_or_stop(
        opts: &RunOptions,
        events: &mpsc::Sender<ClientEvent>,
        interrupts: &mut Interrupts,
    ) -> Result<LiveAgent, RunOutcome> {
        LiveAgent::start_interruptible(opts, events, interrupts).await.map_err(|stopped| {
            let mut outcome = RunOutcome::failed(Some(stopped.error));
            outcome.ending = stopped.ending;
            outcome
        })
    }

    /// [`LiveAgent::start`], ended by an interrupt: the agent's group is killed at once.
    pub(crate) async fn start_interruptible(
        opts: &RunOptions,
        events: &mpsc::Sender<ClientEvent>,
        interrupts: &mut Interrupts,
    ) -> Result<LiveAgent, Stopped> {
        let deadline = setup_deadline(opts, Instant::now());
        let sandbox = Sandbox::new(&opts.cwd, &opts.allow_dirs)
            .map(|s| s.with_confinement(opts.confinement.clone()).with_jail(opts.jail.clone()))
            .and_then(|s| match &opts.writable {
                Some(w) => s.with_writable(w),
                None => Ok(s),
            })
            .map_err(|e| Stopped::failed(ClientError::usage(format!("cannot use the directories to serve: {e}"))))?;
        let (inner_tx, inner_rx) = event_channel();
        // Echoed to a terminal, stderr is already shown; otherwise it is an event, recorded.
        let stderr_events = (!opts.echo_stderr).then(|| inner_tx.clone());
        let (process, pipes) =
            AgentProcess::spawn(&opts.agent, &opts.cwd, opts.echo_stderr, opts.jail.as_ref(), stderr_events)
                .await
                .map_err(Stopped::failed)?;
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
        match agent.handshake(opts, deadline, interrupts).await {
            Ok(()) => Ok(agent),
            Err(e) => {
                agent.shutdown(events).await;
                Err(e)
            }
        }
    }

    pub(crate) async fn handshake(
        &mut self,
        opts: &RunOptions,
        deadline: Deadline,
        interrupts: &mut Interrupts,
    ) -> Result<(), Stopped> {
        // Form questions are answered by the host's person, at the terminal, or declined at
        // once when nobody is there; an asker that answers none (a subagent's parent) does not
        // advertise them.
        let mut caps = ClientCapabilities::new()
            .fs(FileSystemCapabilities::new().read_text_file(opts.fs).write_text_file(opts.fs))
            .terminal(opts.terminal);
        if opts.asker.as_ref().is_none_or(|a| a.answers_questions()) {
            caps = caps.elicitation(ElicitationCapabilities::new().form(ElicitationFormCapabilities::new()));
        }
        let init = InitializeRequest::new(ProtocolVersion::V1)
            .client_capabilities(caps)
            .client_info(Implementation::new("pier", env!("CARGO_PKG_VERSION")));
        let init: Value = self.setup("initialize", &init, deadline, interrupts).await?;
        let init_response: InitializeResponse = serde_json::from_value(init.clone()).map_err(|e| {
            Stopped::failed(protocol_fault(&mut self.process, format!("its initialize response is malformed: {e}")))
        })?;
        if init_response.protocol_version != ProtocolVersion::V1 {
            return Err(Stopped::failed(protocol_fault(
                &mut self.process,
                format!(
                    "it speaks ACP protocol version {}, and pier speaks only version 1 (R028)",
                    init_response.protocol_version
                ),
            )));
        }
        self.info = init_response.agent_info.clone();
        self.load_session = init_response.agent_capabilities.load_session;
        self.resume_session = init_response.agent_capabilities.session_capabilities.resume.is_some();
        self.init = init;
        Ok(())
    }

    /// The agent's `initialize` answer, as it gave it.
    pub fn init(&self) -> &Value {
        &self.init
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
        interrupts: &mut Interrupts,
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
        let outcome = match self.open_session(opts, target, setup_deadline(opts, started), interrupts).await {
            Ok(session_id) => {
                if let Some(tx) = &opts.session_ids {
                    let _ = tx.send(session_id.clone());
                }
                self.prompt(opts, session_id, prompt, events, interrupts, started, outcome).await
            }
            Err(stopped) => stopped.into_outcome(Some(outcome)),
        };
        self.end_turn(outcome, events, started).await
    }

    /// Sends another prompt in a session this agent has open (a task host's follow-up
    /// message). Unlike [`LiveAgent::turn`] it does not need every earlier turn to have
    /// ended cleanly: a turn cancelled to make room for this prompt (its cancel confirmed)
    /// leaves the session able to go on. The process and connection must be alive.
    pub async fn continue_turn(
        &mut self,
        opts: &RunOptions,
        session_id: String,
        prompt: Vec<ContentBlock>,
        events: &mpsc::Sender<ClientEvent>,
        interrupts: &mut Interrupts,
    ) -> RunOutcome {
        let started = Instant::now();
        let mut outcome = RunOutcome::failed(None);
        outcome.agent_info = self.info.clone();
        if self.conn.is_closing() || self.process.try_exit().is_some() {
            outcome.error = Some(agent_error(&mut self.process, "it is gone, so its session cannot go on".into()));
            return outcome;
        }
        self.state.begin_turn(opts.asker.clone());
        let outcome = self.prompt(opts, session_id, prompt, events, interrupts, started, outcome).await;
        self.end_turn(outcome, events, started).await
    }

    /// One prompt in an open session, followed to its answer (or its stop).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn prompt(
        &mut self,
        opts: &RunOptions,
        session_id: String,
        prompt: Vec<ContentBlock>,
        events: &mpsc::Sender<ClientEvent>,
        interrupts: &mut Interrupts,
        started: Instant,
        mut outcome: RunOutcome,
    ) -> RunOutcome {
        outcome.session_id = Some(session_id.clone());
        self.state.serve_session(&session_id);
        let prompt = fit_prompt(prompt, &self.init);
        let mut turn = Turn::new(opts, session_id, started);
        let answer = turn.drive(self, prompt, events, interrupts).await;
        outcome.text = turn.transcript.text();
        outcome.usage = turn.transcript.usage.clone();
        match answer {
            Ok(response) => {
                if let Some(usage) = response.usage {
                    outcome.usage = Some(usage);
                }
                outcome.stop_reason = Some(response.stop_reason);
                outcome.ending = turn.phase.ending(response.stop_reason == StopReason::Cancelled);
                outcome
            }
            Err(stopped) => stopped.into_outcome(Some(outcome)),
        }
    }

    /// What every turn ends with: a turn that did not end in an answer makes the agent unfit
    /// for another task; the turn's terminals are killed and its last events passed on.
    pub(crate) async fn end_turn(
        &mut self,
        mut outcome: RunOutcome,
        events: &mpsc::Sender<ClientEvent>,
        started: Instant,
    ) -> RunOutcome {
        if outcome.ending != Ending::Answered || outcome.error.is_some() {
            self.clean = false;
        }
        // The jail stopped the agent at a limit: that, not the broken pipe it left, is the ending.
        if let Some(breach) = self.process.breach() {
            self.clean = false;
            outcome.ending = Ending::Failed;
            outcome.error =
                Some(ClientError::Agent { agent: self.process.name.clone(), message: breach.message.clone() });
            outcome.breach = Some(breach);
        }
        self.state.terminals.kill_all();
        self.process.flush_stderr().await;
        while let Ok(event) = self.inner_rx.try_recv() {
            let _ = events.send(event).await;
        }
        outcome.duration = started.elapsed();
        outcome
    }

    /// Ends a session the caller will not continue, with `session/close` when the agent
    /// offers it, so that an agent serving many turns (a host's warm agent) does not keep
    /// every session it ever opened. An agent that does not answer in time is not reused.
    pub async fn close_session(&mut self, session_id: &str) {
        let offered = self.init["agentCapabilities"]["sessionCapabilities"].get("close").is_some();
        if !offered || !self.reusable() {
            return;
        }
        let request = json!({ "sessionId": session_id });
        let closing = self.conn.request::<_, Value>("session/close", &request);
        if !matches!(tokio::time::timeout(CLOSE_TIMEOUT, closing).await, Ok(Ok(_))) {
            tracing::warn!(session = session_id, "the agent did not close its session; it is not reused");
            self.clean = false;
        }
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

    /// The session the turn runs in: a new one (authenticating first if the agent
    /// asks for it), or an earlier one resumed or loaded.
    pub(crate) async fn open_session(
        &mut self,
        opts: &RunOptions,
        target: SessionTarget,
        deadline: Deadline,
        interrupts: &mut Interrupts,
    ) -> Result<String, Stopped> {
        let session_id = match target {
            SessionTarget::NewContinuable if !self.resume_session && !self.load_session => {
                return Err(Stopped::failed(self.cannot_continue()));
            }
            SessionTarget::New | SessionTarget::NewContinuable => {
                let http = self.init["agentCapabilities"]["mcpCapabilities"]["http"] == true;
                if let Some(server) = opts.mcp_servers.iter().find_map(|s| match s {
                    agent_client_protocol_schema::v1::McpServer::Http(h) if !http => Some(h.name.clone()),
                    _ => None,
                }) {
                    return Err(Stopped::failed(agent_error(
                        &mut self.process,
                        format!("it does not take HTTP MCP servers (no mcpCapabilities.http), and `{server}` is one"),
                    )));
                }
                let mut servers = opts.mcp_servers.clone();
                for s in &opts.host_mcp_servers {
                    match s {
                        agent_client_protocol_schema::v1::McpServer::Http(h) if !http => {
                            tracing::info!(server = %h.name, "the agent takes no HTTP MCP servers: the host's is left out");
                        }
                        other => servers.push(other.clone()),
                    }
                }
                let mut request = NewSessionRequest::new(opts.cwd.clone()).meta(opts.meta.clone()).mcp_servers(servers);
                // The directories besides cwd this run may use, told to an agent that confines
                // itself to its session's roots; sent only when it advertises
                // `sessionCapabilities.additionalDirectories` (ACP v1, session/new). The
                // client-side sandbox bounds its fs/* and terminal/* calls either way.
                let offers_roots =
                    self.init["agentCapabilities"]["sessionCapabilities"].get("additionalDirectories").is_some();
                if offers_roots && !opts.allow_dirs.is_empty() {
                    request = request.additional_directories(opts.allow_dirs.clone());
                }
                let first = self.setup_raw::<NewSessionResponse>("session/new", &request, deadline, interrupts).await?;
                let response = match first {
                    Err(RequestError::Remote(e)) if i32::from(e.code) == -32000 => {
                        self.authenticate(&opts.agent, deadline, interrupts).await?;
                        self.setup::<NewSessionResponse>("session/new", &request, deadline, interrupts).await?
                    }
                    other => self.settle("session/new", other).await?,
                };
                response.session_id.0.to_string()
            }
            SessionTarget::Continue { session_id } => {
                if self.resume_session {
                    let request = ResumeSessionRequest::new(session_id.clone(), opts.cwd.clone());
                    self.setup::<Value>("session/resume", &request, deadline, interrupts).await?;
                } else if self.load_session {
                    self.state.replaying.store(true, Ordering::SeqCst);
                    let request = LoadSessionRequest::new(session_id.clone(), opts.cwd.clone());
                    let loaded = self.setup::<Value>("session/load", &request, deadline, interrupts).await;
                    self.state.replaying.store(false, Ordering::SeqCst);
                    loaded?;
                } else {
                    return Err(Stopped::failed(self.cannot_continue()));
                }
                session_id
            }
        };
        Ok(session_id)
    }

    pub(crate) fn cannot_continue(&self) -> ClientError {
        ClientError::Agent {
            agent: self.process.name.clone(),
            message: "it cannot continue sessions (it offers neither session/resume nor session/load), \
                      so a named session of it could never go on; use `pier exec` for a one-off prompt"
                .into(),
        }
    }

    /// Authenticates with the first env-var method whose variables are all set in the agent's
    /// environment: its command's own, and pier's less what the command withholds (a host's
    /// agent has its model gateway's placeholders, not pier's keys).
    pub(crate) async fn authenticate(
        &mut self,
        agent: &crate::AgentCommand,
        deadline: Deadline,
        interrupts: &mut Interrupts,
    ) -> Result<(), Stopped> {
        let has = |var: &str| {
            agent.env.iter().any(|(k, _)| k == var)
                || (std::env::var_os(var).is_some() && !agent.env_remove.iter().any(|r| r == var))
        };
        let methods = self.init["authMethods"].as_array().cloned().unwrap_or_default();
        let usable = methods.iter().find(|m| {
            let vars: Vec<&str> =
                match (m.get("vars").and_then(Value::as_array), m.get("varName").and_then(Value::as_str)) {
                    (Some(vars), _) => {
                        vars.iter().filter_map(|v| v.get("name").and_then(Value::as_str).or(v.as_str())).collect()
                    }
                    (None, Some(name)) => vec![name],
                    _ => Vec::new(),
                };
            m["type"] == "env_var" && !vars.is_empty() && vars.iter().all(|v| has(v))
        });
        let Some(method) = usable else {
            let names: Vec<String> = methods
                .iter()
                .map(|m| format!("{} ({})", m["id"].as_str().unwrap_or("?"), m["name"].as_str().unwrap_or("")))
                .collect();
            return Err(Stopped::failed(ClientError::Agent {
                agent: self.process.name.clone(),
                message: format!(
                    "it requires authentication and none of its methods can be used unattended; its methods: {}",
                    if names.is_empty() { "none".to_owned() } else { names.join(", ") }
                ),
            }));
        };
        let params = json!({ "methodId": method["id"].clone() });
        self.setup::<Value>("authenticate", &params, deadline, interrupts).await?;
        Ok(())
    }

    /// One setup request, answered or failed.
    pub(crate) async fn setup<T: DeserializeOwned>(
        &mut self,
        what: &str,
        params: &impl Serialize,
        deadline: Deadline,
        interrupts: &mut Interrupts,
    ) -> Result<T, Stopped> {
        let answer = self.setup_raw(what, params, deadline, interrupts).await?;
        self.settle(what, answer).await
    }

    /// The one place a setup request (handshake, authentication, session) waits: for
    /// its answer, bounded by `deadline` (`--timeout`, `--max-time`), a protocol breach
    /// or an interrupt. A timeout or an interrupt kills the agent's group at once.
    pub(crate) async fn setup_raw<T: DeserializeOwned>(
        &mut self,
        what: &str,
        params: &impl Serialize,
        deadline: Deadline,
        interrupts: &mut Interrupts,
    ) -> Result<Result<T, RequestError>, Stopped> {
        enum Wake<T> {
            Answered(Result<T, RequestError>),
            TimedOut,
            Broken,
            Interrupted,
        }
        let wake = tokio::select! {
            answer = self.conn.request::<_, T>(what, params) => Wake::Answered(answer),
            _ = tokio::time::sleep_until(deadline.at.into()) => Wake::TimedOut,
            _ = self.state.protocol_broken.cancelled() => Wake::Broken,
            Some(()) = interrupts.recv() => Wake::Interrupted,
        };
        match wake {
            Wake::Answered(answer) => Ok(answer),
            Wake::Broken => Err(Stopped::failed(protocol_error(&mut self.process, &self.state))),
            Wake::TimedOut => {
                self.process.kill().await;
                let limit = deadline.limit;
                let error = agent_error(&mut self.process, format!("{limit}: it did not answer {what}; it was killed"));
                Err(Stopped { ending: Ending::TimedOut { confirmed: false, limit }, error })
            }
            Wake::Interrupted => {
                self.process.kill().await;
                let error = agent_error(&mut self.process, format!("interrupted during {what}; the agent was killed"));
                Err(Stopped { ending: Ending::Interrupted { confirmed: false }, error })
            }
        }
    }

    /// A request's answer, or the agent failure it means.
    pub(crate) async fn settle<T>(&mut self, what: &str, r: Result<T, RequestError>) -> Result<T, Stopped> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => {
                if matches!(e, RequestError::Closed) {
                    // The agent went away: let it finish exiting so the error can say how.
                    self.process.settle_exit(Duration::from_secs(1)).await;
                }
                Err(Stopped::failed(request_error(&mut self.process, what, e)))
            }
        }
    }
}
