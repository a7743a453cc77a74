//! The client side of the connection: session updates, permission requests and
//! the `fs/*` and `terminal/*` methods the agent calls.

use std::collections::HashMap;
use std::io::{BufRead, IsTerminal};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use agent_client_protocol_schema::v1::{
    AgentRequest, Content, ContentBlock, CreateElicitationRequest, Error, RequestPermissionOutcome,
    RequestPermissionRequest, RequestPermissionResponse, SelectedPermissionOutcome, SessionNotification, SessionUpdate,
    TextContent, ToolCallContent, ToolCallStatus,
};
use futures::future::BoxFuture;
use pier_acp::error::internal;
use pier_acp::{Connection, Handler, RequestCx};
use pier_tools::ToolKind;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::elicit::{ElicitAnswer, form_schema};
use crate::policy::{Choice, ClientPolicy, NonInteractive, Rule, choose, kind_of};
use crate::sandbox::Sandbox;
use crate::terminal::Terminals;
use crate::{ClientEvent, fs};

/// A person's answer to a permission request, through the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AskAnswer {
    /// This offered option.
    Option(String),
    /// This offered option, chosen by the asker itself without a person, for the reason given
    /// (the host allowing a tool of its own MCP endpoint).
    Decided { option: String, why: String },
    /// Nobody answered (the turn is ending): reject.
    Nobody,
    /// The question was withdrawn because the task was cancelled or its attempt ended:
    /// answered `cancelled` (R088), the turn is about to be cancelled.
    Withdrawn,
}

/// Who answers the permission requests that a policy leaves to a person, when
/// that person is not at this terminal (the task host, for example).
pub trait Asker: Send + Sync + 'static {
    fn ask(&self, request: &RequestPermissionRequest) -> BoxFuture<'static, AskAnswer>;
    /// A question from the agent for the person (`elicitation/create`, form mode). Without
    /// a way to reach one, it is declined.
    fn elicit(&self, _request: &CreateElicitationRequest) -> BoxFuture<'static, ElicitAnswer> {
        Box::pin(async { ElicitAnswer::Decline })
    }
    /// Whether [`Asker::elicit`] reaches a person: only then does the client advertise form
    /// questions, so that an agent never asks what would only be declined (a subagent's
    /// parent answers its permission requests, never its questions).
    fn answers_questions(&self) -> bool {
        false
    }
}

/// What the client serves, shared by the handler and the driver.
pub struct ClientState {
    pub sandbox: Sandbox,
    pub cwd: PathBuf,
    pub fs: bool,
    pub terminal: bool,
    pub policy: ClientPolicy,
    /// Whether a person can be asked on the terminal.
    pub interactive: bool,
    pub events: EventSender,
    /// Fires once the turn is being cancelled: every permission request is then
    /// answered `cancelled` (R088).
    cancelling: Mutex<CancellationToken>,
    /// Fires when `--non-interactive fail` met an *ask*.
    pub permission_failed: CancellationToken,
    /// Fires when the agent wrote something that is not JSON-RPC; the description is kept.
    pub protocol_broken: CancellationToken,
    pub protocol_error: Mutex<Option<String>>,
    pub terminals: Terminals,
    /// While a `session/load` replays history, updates are not shown.
    pub replaying: AtomicBool,
    /// Tool kinds by tool call id, from updates, for permission requests that omit the kind.
    kinds: Mutex<HashMap<String, ToolKind>>,
    /// Tool calls of this turn whose permission request was granted and that have not
    /// ended yet, with their kinds: while one runs, a client method of its kind is the
    /// work that was granted (an agent edits through `fs/write_text_file` after asking).
    granted: Mutex<HashMap<String, ToolKind>>,
    /// Answers *ask* when set, instead of the terminal or the non-interactive rule.
    /// Per turn: an agent that serves several turns answers each turn's asker.
    asker: Mutex<Option<Arc<dyn Asker>>>,
    /// The session whose turn this client serves (set as its prompt is sent): a permission
    /// request for another session, or outside a turn, is refused, never answered by this
    /// turn's policy or person (S3-19).
    session: Mutex<Option<String>>,
    /// How many questions wait for a person right now (the host's asker or the terminal).
    /// Waiting for a person is not idleness: the turn's idle timer stops while this is
    /// above zero and starts afresh when it drops to zero.
    pub asking: tokio::sync::watch::Sender<usize>,
}

/// Counts the questions to a person asked for an agent outside its client (the host's MCP
/// `ask_person`): while one is open the turn's idle timer stops, as for the client's own.
#[derive(Clone)]
pub struct AskingCount(pub(crate) Arc<ClientState>);

impl AskingCount {
    /// One question open until the guard is dropped.
    pub fn start(&self) -> AskingGuard {
        self.0.asking.send_modify(|n| *n += 1);
        AskingGuard(self.0.clone())
    }
}

/// One open question of an [`AskingCount`].
pub struct AskingGuard(Arc<ClientState>);

impl Drop for AskingGuard {
    fn drop(&mut self) {
        self.0.asking.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Counts one question to a person for as long as it lives (see [`ClientState::asking`]).
struct Asking<'a>(&'a tokio::sync::watch::Sender<usize>);

impl<'a> Asking<'a> {
    fn start(count: &'a tokio::sync::watch::Sender<usize>) -> Asking<'a> {
        count.send_modify(|n| *n += 1);
        Asking(count)
    }
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The handler's events on their way to the turn, counted: an agent can write
/// updates faster than they are rendered or recorded, and with more than `HIGH`
/// waiting the connection stops reading (`Handler::backpressure`) until the turn is
/// down to `LOW`, so a flood costs the agent a blocked pipe instead of costing pier
/// unbounded memory. Sending counts up and receiving counts down, so no consumer
/// has to remember to.
pub fn event_channel() -> (EventSender, EventReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let backlog = Arc::new(Backlog::default());
    (EventSender { tx, backlog: backlog.clone() }, EventReceiver { rx, backlog })
}

#[derive(Clone)]
pub struct EventSender {
    tx: mpsc::UnboundedSender<ClientEvent>,
    backlog: Arc<Backlog>,
}

pub struct EventReceiver {
    rx: mpsc::UnboundedReceiver<ClientEvent>,
    backlog: Arc<Backlog>,
}

#[derive(Default)]
struct Backlog {
    queued: AtomicUsize,
    drained: tokio::sync::Notify,
}

const HIGH: usize = 1024;
const LOW: usize = 256;

impl EventSender {
    fn send(&self, event: ClientEvent) {
        self.backlog.queued.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(event).is_err() {
            // Nobody will take it.
            self.backlog.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Sends `event` unless more than `HIGH` events wait (the agent's stderr, which has no
    /// pipe to block: a flood of it is dropped, counted, rather than queued without bound).
    pub(crate) fn send_unless_backlogged(&self, event: ClientEvent) -> bool {
        if self.backlog.queued.load(Ordering::SeqCst) > HIGH {
            return false;
        }
        self.send(event);
        true
    }

    /// `Some` while more than `HIGH` events wait: resolves once no more than `LOW` do.
    fn backpressure(&self) -> Option<BoxFuture<'static, ()>> {
        if self.backlog.queued.load(Ordering::SeqCst) <= HIGH {
            return None;
        }
        let backlog = self.backlog.clone();
        Some(Box::pin(async move {
            loop {
                let notified = backlog.drained.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if backlog.queued.load(Ordering::SeqCst) <= LOW {
                    return;
                }
                notified.await;
            }
        }))
    }
}

impl EventReceiver {
    pub async fn recv(&mut self) -> Option<ClientEvent> {
        let event = self.rx.recv().await;
        self.took(event.is_some());
        event
    }

    pub fn try_recv(&mut self) -> Result<ClientEvent, mpsc::error::TryRecvError> {
        let event = self.rx.try_recv();
        self.took(event.is_ok());
        event
    }

    fn took(&self, one: bool) {
        if one && self.backlog.queued.fetch_sub(1, Ordering::SeqCst) == LOW + 1 {
            self.backlog.drained.notify_waiters();
        }
    }
}

impl ClientState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        sandbox: Sandbox,
        cwd: PathBuf,
        fs: bool,
        terminal: bool,
        policy: ClientPolicy,
        interactive: bool,
        events: EventSender,
    ) -> ClientState {
        ClientState {
            sandbox,
            cwd,
            fs,
            terminal,
            policy,
            interactive,
            events,
            cancelling: Mutex::new(CancellationToken::new()),
            permission_failed: CancellationToken::new(),
            protocol_broken: CancellationToken::new(),
            protocol_error: Mutex::new(None),
            terminals: Terminals::default(),
            replaying: AtomicBool::new(false),
            kinds: Mutex::new(HashMap::new()),
            granted: Mutex::new(HashMap::new()),
            asker: Mutex::new(None),
            session: Mutex::new(None),
            asking: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Readies the state for the next turn of the same agent: its asker, and no
    /// memory of the last turn's tool calls.
    pub fn begin_turn(&self, asker: Option<Arc<dyn Asker>>) {
        *self.asker.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = asker;
        // A turn after a cancelled one (a host's follow-up prompt) is not being cancelled.
        let mut cancelling = lock(&self.cancelling);
        if cancelling.is_cancelled() {
            *cancelling = CancellationToken::new();
        }
        drop(cancelling);
        self.kinds.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        lock(&self.granted).clear();
        *lock(&self.session) = None;
    }

    /// `notification` with each terminal a tool call embeds followed by what it has printed so
    /// far (this client runs the terminals): the text view, the host's transcript and the
    /// dashboard show a terminal's output from any agent, not a bare terminal id.
    pub fn with_terminal_output(&self, mut notification: SessionNotification) -> SessionNotification {
        let content = match &mut notification.update {
            SessionUpdate::ToolCall(call) => Some(&mut call.content),
            SessionUpdate::ToolCallUpdate(update) => update.fields.content.as_mut(),
            _ => None,
        };
        let Some(content) = content else { return notification };
        if !content.iter().any(|c| matches!(c, ToolCallContent::Terminal(_))) {
            return notification;
        }
        let mut shown = Vec::with_capacity(content.len() + 1);
        for item in content.drain(..) {
            let output = match &item {
                ToolCallContent::Terminal(t) => self.terminals.shown(&t.terminal_id.0),
                _ => None,
            };
            shown.push(item);
            if let Some(output) = output {
                let mut text = output.output;
                if output.truncated {
                    text.insert_str(0, "[the start was cut]\n");
                }
                if let Some(exit) = output.exit_status {
                    match (exit.exit_code, exit.signal) {
                        (Some(code), _) => text.push_str(&format!("\n[exit code {code}]")),
                        (None, Some(signal)) => text.push_str(&format!("\n[killed by {signal}]")),
                        (None, None) => {}
                    }
                }
                shown.push(ToolCallContent::Content(Content::new(ContentBlock::Text(TextContent::new(text)))));
            }
        }
        *content = shown;
        notification
    }

    /// The turn being served is session `id`'s.
    pub fn serve_session(&self, id: &str) {
        *lock(&self.session) = Some(id.to_owned());
    }

    /// Fires once the current turn is being cancelled: every permission request is then
    /// answered `cancelled` (R088).
    pub fn cancelling(&self) -> CancellationToken {
        lock(&self.cancelling).clone()
    }

    fn emit(&self, event: ClientEvent) {
        self.events.send(event);
    }

    fn remember_kind(&self, update: &SessionUpdate) {
        let (id, kind, status) = match update {
            SessionUpdate::ToolCall(c) => (&c.tool_call_id, Some(c.kind), Some(c.status)),
            SessionUpdate::ToolCallUpdate(u) => (&u.tool_call_id, u.fields.kind, u.fields.status),
            _ => return,
        };
        let id = id.0.to_string();
        if matches!(status, Some(ToolCallStatus::Completed | ToolCallStatus::Failed)) {
            lock(&self.granted).remove(&id);
        }
        if let Some(kind) = kind {
            lock(&self.kinds).insert(id, kind_of(Some(&kind)));
        }
    }

    /// Answers a permission request. Whatever decided it, one rule has the last word:
    /// once the turn is being cancelled, the answer is `cancelled` (R088).
    /// `gone` fires when the agent withdraws the request (`$/cancel_request`) or the
    /// connection closes: nobody is left to answer, so nobody is kept waiting for a person.
    async fn permission(
        self: Arc<Self>,
        req: RequestPermissionRequest,
        gone: CancellationToken,
    ) -> Result<Value, Error> {
        let id = req.tool_call.tool_call_id.0.to_string();
        let serving = lock(&self.session).clone();
        if serving.as_deref() != Some(&*req.session_id.0) {
            tracing::warn!(session = %req.session_id.0, serving = ?serving, tool_call = %id, "refused a permission request for a session whose turn this client does not serve");
            return Err(pier_acp::error::invalid_params(match serving {
                Some(s) => {
                    format!("session `{}` is not the session whose turn this client serves (`{s}`)", req.session_id.0)
                }
                None => format!("no turn of session `{}` is being served", req.session_id.0),
            }));
        }
        let kind = match &req.tool_call.fields.kind {
            Some(k) => kind_of(Some(k)),
            None => lock(&self.kinds).get(&id).copied().unwrap_or(ToolKind::Other),
        };
        let (mut choice, rule, mut reason) = if self.cancelling().is_cancelled() {
            (Choice::Cancelled, Value::Null, String::new())
        } else {
            self.decide(&req, kind, &gone).await
        };
        if self.cancelling().is_cancelled() {
            (choice, reason) = (Choice::Cancelled, "the turn is being cancelled (R088)".to_owned());
        }
        let outcome = match &choice {
            Choice::Select { option_id, .. } => {
                RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(option_id.clone()))
            }
            Choice::Cancelled => RequestPermissionOutcome::Cancelled,
        };
        let response = RequestPermissionResponse::new(outcome);
        let value = serde_json::to_value(&response).map_err(|e| internal(e.to_string()))?;
        let response: RequestPermissionResponse = response;
        self.note_grant(&id, kind, &choice);
        tracing::info!(tool_call = %id, ?choice, %reason, "permission decided");
        self.emit(ClientEvent::Permission { request: Box::new(req), outcome: response.outcome, rule, reason });
        Ok(value)
    }

    /// Answers a question from the agent: through the host's asker (a person answers with
    /// `pier answer`), declined at once when nobody can be asked, `cancel` once the turn is
    /// being cancelled or the request is gone.
    async fn elicitation(
        self: Arc<Self>,
        req: CreateElicitationRequest,
        gone: CancellationToken,
    ) -> Result<Value, Error> {
        let cancelling = self.cancelling();
        let asker = lock(&self.asker).clone();
        let (answer, reason) = if cancelling.is_cancelled() {
            (ElicitAnswer::Cancel, "the turn is being cancelled (R088)")
        } else if form_schema(&req).is_none() {
            (ElicitAnswer::Decline, "pier answers form questions only")
        } else if let Some(asker) = asker {
            let _asking = Asking::start(&self.asking);
            tokio::select! {
                answer = asker.elicit(&req) => (answer, "answered through the host"),
                _ = cancelling.cancelled() => (ElicitAnswer::Cancel, "the turn is being cancelled (R088)"),
                _ = gone.cancelled() => (ElicitAnswer::Cancel, "the agent withdrew the question"),
            }
        } else if self.interactive {
            let _asking = Asking::start(&self.asking);
            let request = req.clone();
            let asked = tokio::task::spawn_blocking(move || crate::elicit::ask_on_terminal(&request));
            tokio::select! {
                answer = asked => match answer.ok().flatten() {
                    Some(answer) => (answer, "answered at the terminal"),
                    None => (ElicitAnswer::Decline, "nobody answered at the terminal, so it was declined"),
                },
                _ = cancelling.cancelled() => (ElicitAnswer::Cancel, "the turn is being cancelled (R088)"),
                _ = gone.cancelled() => (ElicitAnswer::Cancel, "the agent withdrew the question"),
            }
        } else {
            (ElicitAnswer::Decline, "nobody can answer here (unattended), so it was declined")
        };
        let response = answer.response();
        let value = serde_json::to_value(&response).map_err(|e| internal(e.to_string()))?;
        tracing::info!(message = %req.message, %reason, "question answered");
        self.emit(ClientEvent::Elicitation { request: Box::new(req), response: value.clone(), reason: reason.into() });
        Ok(value)
    }

    /// The choice for a permission request by the policy, the host's asker or the
    /// person at the terminal, with the rule applied (as JSON) and the reason.
    async fn decide(
        &self,
        req: &RequestPermissionRequest,
        kind: ToolKind,
        gone: &CancellationToken,
    ) -> (Choice, Value, String) {
        let cancelling = self.cancelling();
        let id = req.tool_call.tool_call_id.0.to_string();
        let title = req.tool_call.fields.title.clone().unwrap_or_else(|| id.clone());
        let rule_json = |r: Rule| serde_json::to_value(r).unwrap_or(Value::Null);
        // Host-side trust: an edit of a path outside the writable paths is never granted,
        // whatever the agent claims about it.
        let outside: Vec<String> = req
            .tool_call
            .fields
            .locations
            .iter()
            .flatten()
            .filter(|l| !self.sandbox.may_write(&l.path))
            .map(|l| l.path.display().to_string())
            .collect();
        let writes = matches!(kind, ToolKind::Edit | ToolKind::Delete | ToolKind::Move);
        if writes && !outside.is_empty() {
            let (c, why) = choose(Rule::Deny, &req.options);
            return (
                c,
                rule_json(Rule::Deny),
                format!("{} is outside the paths this task may write{why}", outside.join(", ")),
            );
        }
        let mut rule = self.policy.rule(kind);
        let mut reason = format!("policy for {} tools: {rule:?}", kind.as_str());
        let asker = lock(&self.asker).clone();
        if rule == Rule::Ask
            && let Some(asker) = asker
        {
            let _asking = Asking::start(&self.asking);
            let answer = tokio::select! {
                answer = asker.ask(req) => answer,
                _ = cancelling.cancelled() => AskAnswer::Nobody,
                _ = gone.cancelled() => AskAnswer::Withdrawn,
            };
            let mut why = "answered by a person through the host".to_owned();
            let choice = match answer {
                AskAnswer::Decided { option, why: decided } => {
                    why = decided;
                    req.options
                        .iter()
                        .find(|o| o.option_id.0.as_ref() == option)
                        .map(|o| Choice::Select { option_id: option.clone(), kind: o.kind })
                }
                AskAnswer::Option(id) => req
                    .options
                    .iter()
                    .find(|o| o.option_id.0.as_ref() == id)
                    .map(|o| Choice::Select { option_id: id.clone(), kind: o.kind }),
                AskAnswer::Nobody => None,
                AskAnswer::Withdrawn => {
                    let why = "the question was withdrawn: the task was cancelled, its attempt ended, or the agent \
                               gave up the request";
                    return (Choice::Cancelled, json!("ask"), why.to_owned());
                }
            };
            return match choice {
                Some(c) => (c, json!("ask"), why),
                None => {
                    let (c, why) = choose(Rule::Deny, &req.options);
                    (c, json!("ask"), format!("nobody answered the question; rejected {why}"))
                }
            };
        }
        if rule == Rule::Ask {
            if self.interactive {
                let _asking = Asking::start(&self.asking);
                let asked = tokio::select! {
                    answer = ask_on_terminal(title, kind) => answer,
                    _ = cancelling.cancelled() => None,
                    _ = gone.cancelled() => None,
                };
                match asked {
                    Some(true) => (rule, reason) = (Rule::Allow, "allowed at the terminal".to_owned()),
                    Some(false) => (rule, reason) = (Rule::Deny, "rejected at the terminal".to_owned()),
                    None => {}
                }
            } else {
                rule = Rule::Deny;
                reason = match self.policy.non_interactive {
                    NonInteractive::Deny => {
                        format!("{} tools ask and nobody can be asked: --non-interactive deny", kind.as_str())
                    }
                    NonInteractive::Fail => {
                        self.permission_failed.cancel();
                        format!("{} tools ask and nobody can be asked: --non-interactive fail", kind.as_str())
                    }
                };
            }
        }
        if self.permission_failed.is_cancelled() {
            // The run is about to cancel the turn: grant nothing, deterministically.
            return (Choice::Cancelled, rule_json(rule), reason);
        }
        let (choice, why) = choose(rule, &req.options);
        let reason = if why.is_empty() { reason } else { format!("{reason}; {why}") };
        (choice, rule_json(rule), reason)
    }

    /// Remembers a granted tool call until an update says it ended.
    fn note_grant(&self, id: &str, kind: ToolKind, choice: &Choice) {
        use agent_client_protocol_schema::v1::PermissionOptionKind as K;
        if matches!(choice, Choice::Select { kind: K::AllowOnce | K::AllowAlways, .. }) {
            lock(&self.granted).insert(id.to_owned(), kind);
        }
    }

    /// Whether a client method of `kind` may be served: the same rule as a tool call of
    /// that kind (`fs/read_text_file` = read, `fs/write_text_file` = edit,
    /// `terminal/create` = execute). *Ask* is answered by a granted tool call of the kind
    /// that is still running, else by the person (the host's asker or the terminal);
    /// with nobody to ask it is refused, and the error says which setting allows it.
    async fn admit(
        &self,
        kind: ToolKind,
        method: &str,
        session_id: &str,
        target: &str,
        gone: &CancellationToken,
    ) -> Result<(), Error> {
        let name = kind.as_str();
        match self.policy.rule(kind) {
            Rule::Allow | Rule::AllowAlways => return Ok(()),
            Rule::Deny | Rule::DenyAlways => {
                return Err(internal(format!("{method} is refused: pier's policy denies {name} tools")));
            }
            Rule::Ask => {}
        }
        if lock(&self.granted).values().any(|k| *k == kind) {
            return Ok(());
        }
        let cancelling = self.cancelling();
        if cancelling.is_cancelled() {
            return Err(internal(format!("{method} is refused: the turn is being cancelled and nobody is asked")));
        }
        let title = format!("{method} {target}");
        let asker = lock(&self.asker).clone();
        let _asking = Asking::start(&self.asking);
        let answer = if let Some(asker) = asker {
            let request = client_method_question(session_id, &title, kind)?;
            let answer = tokio::select! {
                answer = asker.ask(&request) => answer,
                _ = cancelling.cancelled() => AskAnswer::Nobody,
                _ = gone.cancelled() => AskAnswer::Withdrawn,
            };
            Some(answer == AskAnswer::Option(ALLOW_ONCE.to_owned()))
        } else if self.interactive {
            tokio::select! {
                answer = ask_on_terminal(title, kind) => answer,
                _ = cancelling.cancelled() => None,
                _ = gone.cancelled() => None,
            }
        } else {
            None
        };
        match answer {
            Some(true) => Ok(()),
            Some(false) => Err(internal(format!("{method} is refused: a person rejected it"))),
            None => {
                if self.policy.non_interactive == NonInteractive::Fail {
                    self.permission_failed.cancel();
                }
                Err(internal(format!(
                    "{method} is refused: it is a tool call of kind {name}, pier's policy asks before {name} \
                     tools and nobody can be asked; --approve-all, or `{name} = \"allow\"` under \
                     [client.permissions], allows it"
                )))
            }
        }
    }

    async fn client_method(
        self: Arc<Self>,
        method: String,
        request: AgentRequest,
        gone: CancellationToken,
    ) -> Result<Value, Error> {
        let target: String;
        let result: Result<Value, Error> = match request {
            AgentRequest::ReadTextFileRequest(r) if self.fs => {
                target = r.path.display().to_string();
                match self.admit(ToolKind::Read, &method, &r.session_id.0, &target, &gone).await {
                    Err(e) => Err(e),
                    Ok(()) => fs::read_text_file(&self.sandbox, r).await.and_then(|v| to_value(&v)),
                }
            }
            AgentRequest::WriteTextFileRequest(r) if self.fs => {
                target = r.path.display().to_string();
                match self.admit(ToolKind::Edit, &method, &r.session_id.0, &target, &gone).await {
                    Err(e) => Err(e),
                    Ok(()) => fs::write_text_file(&self.sandbox, r).await.and_then(|v| to_value(&v)),
                }
            }
            AgentRequest::CreateTerminalRequest(r) if self.terminal => {
                target = std::iter::once(r.command.clone()).chain(r.args.iter().cloned()).collect::<Vec<_>>().join(" ");
                match self.admit(ToolKind::Execute, &method, &r.session_id.0, &target, &gone).await {
                    Err(e) => Err(e),
                    Ok(()) => self.terminals.create(&self.sandbox, &self.cwd, r).await.and_then(|v| to_value(&v)),
                }
            }
            AgentRequest::TerminalOutputRequest(r) if self.terminal => {
                target = r.terminal_id.0.to_string();
                self.terminals.output(&target).and_then(|v| to_value(&v))
            }
            AgentRequest::WaitForTerminalExitRequest(r) if self.terminal => {
                target = r.terminal_id.0.to_string();
                match self.terminals.wait_for_exit(&target).await {
                    Ok(status) => to_value(&agent_client_protocol_schema::v1::WaitForTerminalExitResponse::new(status)),
                    Err(e) => Err(e),
                }
            }
            AgentRequest::KillTerminalRequest(r) if self.terminal => {
                target = r.terminal_id.0.to_string();
                self.terminals.kill(&target).map(|()| json!({}))
            }
            AgentRequest::ReleaseTerminalRequest(r) if self.terminal => {
                target = r.terminal_id.0.to_string();
                self.terminals.release(&target).map(|()| json!({}))
            }
            _ => {
                target = String::new();
                Err(Error::method_not_found()
                    .data(json!({ "method": method, "reason": "this client does not serve it" })))
            }
        };
        self.emit(ClientEvent::ClientCall {
            method: method.clone(),
            target,
            error: result.as_ref().err().map(|e| serde_json::to_value(e).unwrap_or(Value::Null)),
        });
        result
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The option a person picks to let a client method through.
const ALLOW_ONCE: &str = "allow-once";

/// A client method put to the host's asker as a permission request of its kind.
fn client_method_question(session_id: &str, title: &str, kind: ToolKind) -> Result<RequestPermissionRequest, Error> {
    serde_json::from_value(json!({
        "sessionId": session_id,
        "toolCall": { "toolCallId": format!("client-method-{title}"), "title": title, "kind": kind.as_str() },
        "options": [
            { "optionId": ALLOW_ONCE, "name": "Allow once", "kind": "allow_once" },
            { "optionId": "reject-once", "name": "Reject", "kind": "reject_once" },
        ],
    }))
    .map_err(|e| internal(e.to_string()))
}

fn to_value<T: Serialize>(v: &T) -> Result<Value, Error> {
    serde_json::to_value(v).map_err(|e| internal(e.to_string()))
}

/// Asks the person at the terminal; `None` when nobody answers.
async fn ask_on_terminal(title: String, kind: ToolKind) -> Option<bool> {
    tokio::task::spawn_blocking(move || {
        if !std::io::stdin().is_terminal() {
            return None;
        }
        eprint!("\npier: the agent asks to run {title} ({}). Allow once? [y/N] ", kind.as_str());
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).ok()?;
        Some(matches!(line.trim(), "y" | "Y" | "yes"))
    })
    .await
    .ok()
    .flatten()
}

/// The connection handler over shared [`ClientState`].
pub struct ClientHandler(pub Arc<ClientState>);

impl Handler for ClientHandler {
    fn request(&self, cx: RequestCx, method: String, params: Value) -> BoxFuture<'static, Result<Value, Error>> {
        let state = self.0.clone();
        match AgentRequest::from_method_and_params(&method, &params) {
            Ok(AgentRequest::RequestPermissionRequest(req)) => Box::pin(state.permission(req, cx.cancel)),
            Ok(AgentRequest::CreateElicitationRequest(req)) => Box::pin(state.elicitation(req, cx.cancel)),
            Ok(request) => Box::pin(state.client_method(method, request, cx.cancel)),
            Err(agent_client_protocol_schema::MethodDispatchError::UnknownMethod { .. }) => {
                Box::pin(async move { Err(Error::method_not_found().data(json!({ "method": method }))) })
            }
            Err(_) => {
                let error =
                    pier_acp::error::invalid_params(format!("the params of `{method}` do not match its schema"));
                Box::pin(async move { Err(error) })
            }
        }
    }

    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        if method != "session/update" {
            tracing::debug!(method, "ignored a notification");
            return;
        }
        // Decoded once, here; everything above this edge matches on types.
        let notification = match serde_json::from_value::<SessionNotification>(params) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "ignored a malformed session/update");
                return;
            }
        };
        self.0.remember_kind(&notification.update);
        if self.0.replaying.load(Ordering::SeqCst) {
            return;
        }
        let notification = self.0.with_terminal_output(notification);
        self.0.emit(ClientEvent::Update(Box::new(notification)));
    }

    fn backpressure(&self) -> Option<BoxFuture<'static, ()>> {
        self.0.events.backpressure()
    }

    fn protocol_error(&self, _conn: &Connection, description: &str) {
        self.0
            .protocol_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_or_insert_with(|| description.to_owned());
        self.0.protocol_broken.cancel();
        self.0.emit(ClientEvent::ProtocolError(description.to_owned()));
    }
}

/// The text of an `agent_message_chunk` update, if it is one.
pub fn message_text(update: &SessionUpdate) -> Option<&str> {
    match update {
        SessionUpdate::AgentMessageChunk(chunk) => match &chunk.content {
            agent_client_protocol_schema::v1::ContentBlock::Text(t) => Some(&t.text),
            _ => None,
        },
        _ => None,
    }
}
