//! One turn of a run, once its session is open: the prompt out, updates taken until its
//! answer, and the cancel handshake of seed 000 when it is interrupted or times out. The
//! turn waits in one loop over a closed [`Wake`] enum; a cancel starts in one place
//! ([`Turn::cancel`]).

use std::time::{Duration, Instant};

use agent_client_protocol_schema::v1::{
    ContentBlock, EmbeddedResource, EmbeddedResourceResource, PromptRequest, PromptResponse, StopReason, TextContent,
};
use pier_acp::RequestError;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::handler::ClientState;
use crate::process::AgentProcess;
use crate::{ClientError, ClientEvent};

use crate::run::*;

/// Where a turn is, once its session is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The prompt is out; updates are taken until its answer.
    Prompting,
    /// `session/cancel` went out at `since`: every permission request is answered
    /// `cancelled` (R088) and the agent has the grace period to confirm.
    Cancelling { since: Instant, cause: Cause },
}

/// Why a turn is being cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// `--timeout` or `--max-time`.
    Timeout(TimeLimit),
    /// Ctrl-C, SIGTERM or the host's stop.
    Interrupt,
    /// `--non-interactive fail` met an *ask*.
    Permission,
}

impl Phase {
    /// How the turn ended, given whether the agent confirmed a cancel.
    pub(crate) fn ending(self, confirmed: bool) -> Ending {
        match self {
            Phase::Prompting => Ending::Answered,
            Phase::Cancelling { cause: Cause::Timeout(limit), .. } => Ending::TimedOut { confirmed, limit },
            Phase::Cancelling { cause: Cause::Interrupt, .. } => Ending::Interrupted { confirmed },
            Phase::Cancelling { cause: Cause::Permission, .. } => Ending::PermissionRequired,
        }
    }
}

/// The agent's answer to the prompt.
pub(crate) struct Answer {
    pub(crate) stop_reason: StopReason,
    pub(crate) usage: Option<Value>,
}

/// What woke the turn's loop.
pub(crate) enum Wake {
    Answered(Result<Value, RequestError>),
    Event(ClientEvent),
    Asking,
    TerminalOutput,
    TimedOut,
    PermissionRequired,
    Interrupted,
    GraceOver,
}

/// The state of one turn: its session, what it kept of the answer, and its phase.
pub(crate) struct Turn<'a> {
    pub(crate) opts: &'a RunOptions,
    pub(crate) session_id: String,
    pub(crate) started: Instant,
    pub(crate) last_activity: Instant,
    pub(crate) transcript: Transcript,
    pub(crate) phase: Phase,
}

impl<'a> Turn<'a> {
    pub(crate) fn new(opts: &'a RunOptions, session_id: String, started: Instant) -> Turn<'a> {
        Turn {
            opts,
            session_id,
            started,
            last_activity: Instant::now(),
            transcript: Transcript::default(),
            phase: Phase::Prompting,
        }
    }

    /// The first of `--timeout` (since the last update) and `--max-time` (since the turn began).
    /// While a person is being asked, only `--max-time` runs: waiting for a person is not
    /// idleness.
    pub(crate) fn timeout_at(&self, asking: bool) -> Instant {
        let far = self.started + Duration::from_secs(365 * 24 * 3600);
        let idle = match self.opts.idle_timeout {
            Some(t) if !asking => self.last_activity + t,
            _ => far,
        };
        let max = self.opts.max_time.map_or(far, |t| self.started + t);
        idle.min(max)
    }

    /// Which limit `timeout_at` found reached.
    pub(crate) fn limit_reached(&self, asking: bool) -> TimeLimit {
        match (self.opts.max_time, self.opts.idle_timeout) {
            (Some(max), _) if Instant::now() >= self.started + max => TimeLimit::Total(max),
            (_, Some(idle)) if !asking => TimeLimit::Idle(idle),
            (max, _) => TimeLimit::Total(max.unwrap_or_default()),
        }
    }

    pub(crate) fn grace_over_at(&self) -> Instant {
        match self.phase {
            Phase::Cancelling { since, .. } => since + self.opts.cancel_grace,
            Phase::Prompting => self.started + Duration::from_secs(365 * 24 * 3600),
        }
    }

    /// Sends the prompt and follows the turn to its answer, or to the kill that ends a
    /// cancel the agent did not confirm.
    pub(crate) async fn drive(
        &mut self,
        agent: &mut LiveAgent,
        prompt: Vec<ContentBlock>,
        events: &mpsc::Sender<ClientEvent>,
        interrupts: &mut Interrupts,
    ) -> Result<Answer, Stopped> {
        let request = PromptRequest::new(self.session_id.clone(), prompt).meta(self.opts.meta.clone());
        let conn = agent.conn.clone();
        let prompt_fut = conn.request::<_, Value>("session/prompt", &request);
        tokio::pin!(prompt_fut);
        let mut asking = agent.state.asking.subscribe();
        let mut terminal_output = agent.state.terminals.activity.subscribe();
        loop {
            let prompting = self.phase == Phase::Prompting;
            let asked = *asking.borrow_and_update() > 0;
            let wake = tokio::select! {
                answer = &mut prompt_fut => Wake::Answered(answer),
                Some(event) = agent.inner_rx.recv() => Wake::Event(event),
                Ok(()) = asking.changed() => Wake::Asking,
                Ok(()) = terminal_output.changed() => Wake::TerminalOutput,
                _ = tokio::time::sleep_until(self.timeout_at(asked).into()), if prompting => Wake::TimedOut,
                _ = agent.state.permission_failed.cancelled(), if prompting => Wake::PermissionRequired,
                Some(()) = interrupts.recv() => Wake::Interrupted,
                _ = tokio::time::sleep_until(self.grace_over_at().into()), if !prompting => Wake::GraceOver,
            };
            match wake {
                Wake::Answered(answer) => {
                    // Updates that raced the answer are still part of the turn, and so is what
                    // the agent wrote to stderr before it.
                    agent.process.flush_stderr().await;
                    while let Ok(event) = agent.inner_rx.try_recv() {
                        self.take(agent, event, events).await?;
                    }
                    // A permission `--non-interactive fail` refused may have ended the turn
                    // before its own wake-up was taken (`select!` picks among ready branches
                    // at random): the turn still ends as refused, not as answered. Nothing is
                    // left to cancel.
                    if prompting && agent.state.permission_failed.is_cancelled() {
                        self.phase = Phase::Cancelling { since: Instant::now(), cause: Cause::Permission };
                    }
                    let answer = agent.settle("session/prompt", answer).await?;
                    let usage = answer.get("usage").cloned();
                    let response: PromptResponse = serde_json::from_value(answer).map_err(|e| {
                        let message = format!("its session/prompt response is malformed: {e}");
                        Stopped::failed(protocol_fault(&mut agent.process, message))
                    })?;
                    return Ok(Answer { stop_reason: response.stop_reason, usage });
                }
                Wake::Event(event) => {
                    self.last_activity = Instant::now();
                    self.take(agent, event, events).await?;
                }
                // A question opened or closed: the idle timer starts afresh either way. A
                // command printing in one of the agent's terminals is the agent at work.
                Wake::Asking | Wake::TerminalOutput => self.last_activity = Instant::now(),
                Wake::TimedOut => {
                    let limit = self.limit_reached(asked);
                    self.cancel(agent, Cause::Timeout(limit)).await
                }
                Wake::PermissionRequired => self.cancel(agent, Cause::Permission).await,
                Wake::Interrupted if prompting => self.cancel(agent, Cause::Interrupt).await,
                Wake::Interrupted => {
                    agent.process.kill().await;
                    let error = agent_error(&mut agent.process, "interrupted twice; the agent was killed".into());
                    return Err(Stopped { ending: Ending::Interrupted { confirmed: false }, error });
                }
                Wake::GraceOver => {
                    agent.process.kill().await;
                    let error = agent_error(
                        &mut agent.process,
                        format!("it did not confirm the cancel within {:?}; it was killed", self.opts.cancel_grace),
                    );
                    return Err(Stopped { ending: self.phase.ending(false), error });
                }
            }
        }
    }

    /// Passes one event of this turn's session on. A bounded queue: while its consumer
    /// is behind, this waits, the handler's backlog grows, and the connection stops
    /// reading (see `event_channel`).
    pub(crate) async fn take(
        &mut self,
        agent: &mut LiveAgent,
        event: ClientEvent,
        events: &mpsc::Sender<ClientEvent>,
    ) -> Result<(), Stopped> {
        if !of_session(&event, &self.session_id) {
            return Ok(());
        }
        match &event {
            ClientEvent::Update(params) => self.transcript.see(params),
            ClientEvent::ProtocolError(_) => {
                let _ = events.send(event).await;
                return Err(Stopped::failed(protocol_error(&mut agent.process, &agent.state)));
            }
            _ => {}
        }
        let _ = events.send(event).await;
        Ok(())
    }

    /// The one place a turn starts cancelling: from here on every permission request
    /// is answered `cancelled` (R088), and the agent is told with `session/cancel`.
    pub(crate) async fn cancel(&mut self, agent: &LiveAgent, cause: Cause) {
        self.phase = Phase::Cancelling { since: Instant::now(), cause };
        agent.state.cancelling().cancel();
        if let Err(e) = agent.conn.notify("session/cancel", &json!({ "sessionId": self.session_id })).await {
            tracing::warn!(error = %e, "could not send session/cancel");
        }
    }
}

/// The prompt as this agent may take it: an embedded resource goes as a text block
/// (its path, then its text) to an agent that does not advertise
/// `promptCapabilities.embeddedContext`, which a client must not send it otherwise.
pub(crate) fn fit_prompt(prompt: Vec<ContentBlock>, init: &Value) -> Vec<ContentBlock> {
    if init["agentCapabilities"]["promptCapabilities"]["embeddedContext"] == Value::Bool(true) {
        return prompt;
    }
    prompt
        .into_iter()
        .map(|block| match block {
            ContentBlock::Resource(r) => match r.resource {
                EmbeddedResourceResource::TextResourceContents(t) => {
                    let path = t.uri.strip_prefix("file://").unwrap_or(&t.uri).to_owned();
                    ContentBlock::Text(TextContent::new(format!("{path}:\n{}", t.text)))
                }
                other => ContentBlock::Resource(EmbeddedResource::new(other)),
            },
            other => other,
        })
        .collect()
}

/// An agent failure with the last lines of its stderr.
pub(crate) fn agent_error(agent: &mut AgentProcess, message: String) -> ClientError {
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

/// The same failure as [`agent_error`], classed as a broken protocol (not retried).
pub(crate) fn protocol_fault(agent: &mut AgentProcess, message: String) -> ClientError {
    match agent_error(agent, message) {
        ClientError::Agent { agent, message } => ClientError::Protocol { agent, message },
        other => other,
    }
}

/// JSON-RPC codes that say the request itself was wrong: pier sends well-formed requests
/// of methods the agent advertised, so from an agent they mean it broke the protocol.
pub(crate) const PROTOCOL_CODES: [i32; 4] = [-32700, -32600, -32601, -32602];

pub(crate) fn request_error(agent: &mut AgentProcess, what: &str, e: RequestError) -> ClientError {
    let (message, protocol) = match e {
        RequestError::Closed => (format!("it closed the connection during {what}"), false),
        RequestError::Remote(err) => {
            let code = i32::from(err.code);
            let data = err.data.map(|d| format!(" ({d})")).unwrap_or_default();
            (format!("{what} failed: {code} {}{data}", err.message), PROTOCOL_CODES.contains(&code))
        }
        other => (format!("{what} failed: {other}"), false),
    };
    if protocol { protocol_fault(agent, message) } else { agent_error(agent, message) }
}

/// Whether an event belongs to this turn's session. An agent that serves several
/// turns may still send an update for an earlier session; it is not this turn's.
pub(crate) fn of_session(event: &ClientEvent, session_id: &str) -> bool {
    match event {
        ClientEvent::Update(n) => {
            let of = n.session_id.0.as_ref() == session_id;
            if !of {
                tracing::debug!(session = %n.session_id.0, "ignored an update for another session");
            }
            of
        }
        _ => true,
    }
}

pub(crate) fn protocol_error(agent: &mut AgentProcess, state: &ClientState) -> ClientError {
    let what =
        state.protocol_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone().unwrap_or_default();
    protocol_fault(agent, format!("it wrote something that is not a JSON-RPC message to stdout: {what}"))
}
