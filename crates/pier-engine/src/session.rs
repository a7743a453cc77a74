//! A session and its turns: the agent loop model → tools → model until a stop reason.
//!
//! State ownership: [`Session`] is shared (`Arc`) by whoever routes prompts to it.
//! Its conversation lives in [`SessionState`] behind an async mutex that a turn
//! holds for its whole length: taking it with `try_lock` is how a second prompt
//! on a busy session is refused without disturbing the first.
//!
//! Tool calls of one model message run one after another, in the order the model
//! gave them. Running read-only calls concurrently would save little next to a
//! model round trip, and in-order execution keeps the log and the permission
//! requests in an order a reader can follow.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use pier_model::{ChatMessage, FinishReason, ModelEvent, ModelRequest, Role, ToolCall, Usage};
use pier_tools::{PlanEntry, ToolContext, ToolKind, Workspace};
use serde_json::Value;
use tokio::sync::{Mutex, OwnedMutexGuard, mpsc};
use tokio_util::sync::CancellationToken;

use crate::error::EngineError;
use crate::log::{LogRecord, SessionLog};
use crate::permission::{Approver, Decision, PermissionAnswer};
use crate::tool_call::ToolCallRecord;
use crate::{EventMsg, Services, StopReason};

/// How long a cancelled tool gets to clean up (kill its process group) before it is dropped.
const TOOL_SETTLE: Duration = Duration::from_secs(5);

/// The conversation of one session. Created by [`Session`], mutated only by the
/// turn that holds the lock.
#[derive(Default)]
pub struct SessionState {
    history: Vec<ChatMessage>,
    turns: u64,
    plan: Vec<PlanEntry>,
}

/// One session: an id, a working directory, a log and a conversation.
pub struct Session {
    pub id: String,
    pub cwd: PathBuf,
    workspace: Workspace,
    log: SessionLog,
    state: Arc<Mutex<SessionState>>,
    services: Arc<Services>,
}

/// What a turn runs with, besides its prompt.
pub struct TurnContext {
    /// Fires on `session/cancel` (or close): the turn ends `cancelled`.
    pub cancel: CancellationToken,
    /// Where the turn's events go; a dropped receiver is ignored.
    pub events: mpsc::Sender<EventMsg>,
    /// Who answers *ask* permission decisions.
    pub approver: Arc<dyn Approver>,
}

/// The right to run one turn, held from acceptance to the stop reason.
pub struct TurnPermit {
    state: OwnedMutexGuard<SessionState>,
    log: SessionLog,
    cwd: PathBuf,
    workspace: Workspace,
    services: Arc<Services>,
}

impl Session {
    pub(crate) fn new(
        id: String,
        cwd: PathBuf,
        workspace: Workspace,
        log: SessionLog,
        services: Arc<Services>,
    ) -> Self {
        Session { id, cwd, workspace, log, state: Arc::new(Mutex::new(SessionState::default())), services }
    }

    pub fn log(&self) -> &SessionLog {
        &self.log
    }

    /// Reserves the session for a turn, or fails with [`EngineError::Busy`].
    pub fn begin_turn(&self) -> Result<TurnPermit, EngineError> {
        let state = self.state.clone().try_lock_owned().map_err(|_| EngineError::Busy)?;
        Ok(TurnPermit {
            state,
            log: self.log.clone(),
            cwd: self.cwd.clone(),
            workspace: self.workspace.clone(),
            services: self.services.clone(),
        })
    }

    /// Records the session's end and flushes its log.
    pub async fn close(&self) -> Result<(), EngineError> {
        let turn = self.state.try_lock().map_or(0, |s| s.turns);
        self.log.append(turn, &LogRecord::SessionClosed);
        self.log.flush().await
    }
}

/// How a model request ended, as the loop sees it.
enum Step {
    Stop(StopReason),
    Continue,
}

/// Everything one turn touches, borrowed for its length.
struct Turn<'a> {
    permit: &'a mut TurnPermit,
    n: u64,
    before: usize,
    cx: &'a TurnContext,
}

impl TurnPermit {
    /// Runs the turn for `prompt` until a stop reason.
    ///
    /// When `cx.cancel` fires, the model stream is dropped, a running tool is
    /// stopped, and the turn ends [`StopReason::Cancelled`] whatever the aborted
    /// work does (R090, R091). An error leaves the conversation as it was before.
    pub async fn run(mut self, prompt: String, cx: TurnContext) -> Result<StopReason, EngineError> {
        self.state.turns += 1;
        let n = self.state.turns;
        let before = self.state.history.len();
        self.log.append(n, &LogRecord::Prompt { text: prompt.clone() });
        self.state.history.push(ChatMessage::new(Role::User, prompt));

        let log = self.log.clone();
        let result = Turn { permit: &mut self, n, before, cx: &cx }.run().await;
        match &result {
            Ok(stop) => log.append(n, &LogRecord::TurnEnded { stop_reason: stop.as_str().to_owned() }),
            Err(e) => {
                self.state.history.truncate(before);
                log.append(n, &LogRecord::TurnFailed { error: e.to_string() });
            }
        }
        log.flush().await?;
        result
    }
}

impl Turn<'_> {
    async fn run(&mut self) -> Result<StopReason, EngineError> {
        let mut requests = 0u32;
        loop {
            if self.cx.cancel.is_cancelled() {
                return Ok(StopReason::Cancelled);
            }
            if requests >= self.permit.services.config.max_turn_requests {
                return Ok(StopReason::MaxTurnRequests);
            }
            requests += 1;
            match self.model_request(requests).await? {
                Step::Stop(stop) => return Ok(stop),
                Step::Continue => {}
            }
        }
    }

    fn log(&self, record: LogRecord) {
        self.permit.log.append(self.n, &record);
    }

    async fn emit(&self, event: EventMsg) {
        let _ = self.cx.events.send(event).await;
    }

    async fn model_request(&mut self, k: u32) -> Result<Step, EngineError> {
        let services = self.permit.services.clone();
        let mut messages = Vec::with_capacity(self.permit.state.history.len() + 1);
        if let Some(system) = services.config.system_prompt(&self.permit.cwd) {
            messages.push(ChatMessage::new(Role::System, system));
        }
        messages.extend(self.permit.state.history.iter().cloned());
        let tools = services.tool_specs();
        self.log(LogRecord::ModelRequest { n: k, provider: services.model.describe() });

        let mut stream = services.model.stream(ModelRequest { messages, tools });
        let (mut text, mut reasoning, mut refusal) = (String::new(), String::new(), String::new());
        let mut usage: Option<Usage> = None;
        let (reason, tool_calls) = loop {
            let event = tokio::select! {
                biased;
                _ = self.cx.cancel.cancelled() => return Ok(Step::Stop(StopReason::Cancelled)),
                event = stream.next() => event,
            };
            match event {
                Some(Ok(ModelEvent::TextDelta(t))) => {
                    text.push_str(&t);
                    self.emit(EventMsg::TextDelta(t)).await;
                }
                Some(Ok(ModelEvent::ReasoningDelta(t))) => {
                    reasoning.push_str(&t);
                    self.emit(EventMsg::ReasoningDelta(t)).await;
                }
                Some(Ok(ModelEvent::RefusalDelta(t))) => refusal.push_str(&t),
                Some(Ok(ModelEvent::ToolCallDelta { .. })) => {}
                Some(Ok(ModelEvent::Usage(u))) => usage = Some(u),
                Some(Ok(ModelEvent::Finish { reason, tool_calls })) => break (reason, tool_calls),
                Some(Err(e)) => {
                    if self.cx.cancel.is_cancelled() {
                        return Ok(Step::Stop(StopReason::Cancelled));
                    }
                    return Err(e.into());
                }
                None => {
                    let e = pier_model::ModelError::StreamCut("the provider ended the stream without finishing".into());
                    return Err(e.into());
                }
            }
        };
        drop(stream);
        let finish = match &reason {
            FinishReason::Other(other) => other.clone(),
            r => serde_json::to_value(r).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default(),
        };
        self.log(LogRecord::ModelResponse { n: k, finish, usage });
        if let Some(u) = usage {
            self.emit(EventMsg::Usage(u)).await;
        }
        if !reasoning.is_empty() {
            self.log(LogRecord::Reasoning { text: reasoning });
        }

        match reason {
            FinishReason::Refusal => {
                let said = if text.is_empty() { refusal } else { text };
                self.log(LogRecord::Refusal { text: said.clone() });
                if !said.is_empty() {
                    self.emit(EventMsg::MessageCommitted(said)).await;
                }
                // A refused prompt and everything after it stay out of later turns.
                self.permit.state.history.truncate(self.before);
                Ok(Step::Stop(StopReason::Refusal))
            }
            FinishReason::Stop | FinishReason::Other(_) | FinishReason::Length => {
                self.commit(text, Vec::new()).await;
                Ok(Step::Stop(if reason == FinishReason::Length { StopReason::MaxTokens } else { StopReason::EndTurn }))
            }
            FinishReason::ToolCalls => {
                self.commit(text, tool_calls.clone()).await;
                for call in tool_calls {
                    let id = call.id.clone();
                    let (answer, stop) = self.tool_call(call).await;
                    let mut message = ChatMessage::new(Role::Tool, answer);
                    message.tool_call_id = Some(id);
                    self.permit.state.history.push(message);
                    if let Some(stop) = stop {
                        return Ok(Step::Stop(stop));
                    }
                }
                Ok(Step::Continue)
            }
        }
    }

    /// Records a finished assistant message and hands it to the profile.
    async fn commit(&mut self, text: String, tool_calls: Vec<ToolCall>) {
        if !text.is_empty() {
            self.log(LogRecord::Message { text: text.clone() });
            self.emit(EventMsg::MessageCommitted(text.clone())).await;
        }
        let mut message = ChatMessage::new(Role::Assistant, text);
        message.tool_calls = tool_calls;
        self.permit.state.history.push(message);
    }

    /// Publishes a tool call's current state: to the profile and to the log.
    async fn publish(&self, record: &ToolCallRecord, first: bool) {
        self.log(LogRecord::ToolCall { call: Box::new(record.clone()) });
        let event = if first { EventMsg::ToolCall(record.clone()) } else { EventMsg::ToolCallUpdate(record.clone()) };
        self.emit(event).await;
    }

    /// Fails `record` with `reason`, publishes it, and returns what the model reads.
    async fn fail(&self, record: &mut ToolCallRecord, reason: String) -> String {
        if let Err(e) = record.fail(reason.clone()) {
            tracing::error!(error = %e, call = %record.id, "tool call state machine");
        }
        self.publish(record, false).await;
        format!("error: {reason}")
    }

    /// Runs one tool call through its states. Returns the text the model reads
    /// as the result and, when the turn must stop here, the stop reason.
    async fn tool_call(&mut self, call: ToolCall) -> (String, Option<StopReason>) {
        let services = self.permit.services.clone();
        let parsed: Result<Value, String> = if call.arguments.trim().is_empty() {
            Ok(Value::Object(Default::default()))
        } else {
            serde_json::from_str(&call.arguments).map_err(|e| format!("the arguments are not valid JSON ({e})"))
        };
        let tool = services.toolbox.get(&call.name);
        let raw_input = parsed.clone().unwrap_or_else(|_| Value::String(call.arguments.clone()));
        let (title, kind, locations) = match (&tool, &parsed) {
            (Some(t), Ok(args)) => {
                let p = t.preview(args, &self.permit.workspace);
                (p.title, t.kind(), p.locations)
            }
            (Some(t), Err(_)) => (t.name().to_owned(), t.kind(), Vec::new()),
            (None, _) => (call.name.clone(), ToolKind::Other, Vec::new()),
        };
        let mut record = ToolCallRecord::new(call.id.clone(), call.name.clone(), title, kind, raw_input);
        record.locations = locations;
        self.publish(&record, true).await;

        let Some(tool) = tool else {
            let known: Vec<&str> = services.toolbox.tools().iter().map(|t| t.name()).collect();
            let reason = format!("there is no tool named `{}`; the tools are: {}", call.name, known.join(", "));
            return (self.fail(&mut record, reason).await, None);
        };
        let args = match parsed {
            Ok(args) => args,
            Err(reason) => return (self.fail(&mut record, reason).await, None),
        };

        match services.policy.decide(kind) {
            Decision::Allow => {}
            Decision::Deny => {
                let reason = format!(
                    "the permission policy denies {} tools, so `{}` did not run; do the task another way or explain \
                     what you need",
                    kind.as_str(),
                    call.name
                );
                return (self.fail(&mut record, reason).await, None);
            }
            Decision::Ask => {
                let answer = tokio::select! {
                    biased;
                    _ = self.cx.cancel.cancelled() => PermissionAnswer::Cancelled,
                    answer = self.cx.approver.ask(&record) => answer,
                };
                // A cancel that raced the answer wins: the tool never runs.
                let answer = if self.cx.cancel.is_cancelled() { PermissionAnswer::Cancelled } else { answer };
                self.log(LogRecord::Permission { call_id: record.id.clone(), answer: format!("{answer:?}") });
                match answer {
                    PermissionAnswer::AllowOnce => {}
                    PermissionAnswer::RejectOnce => {
                        let reason = "the client rejected this tool call, so it did not run; do not repeat it \
                                      unchanged, adapt your approach"
                            .to_owned();
                        return (self.fail(&mut record, reason).await, None);
                    }
                    PermissionAnswer::Unavailable(why) => {
                        let reason = format!("permission was unavailable ({why}), so the tool did not run");
                        return (self.fail(&mut record, reason).await, None);
                    }
                    PermissionAnswer::Cancelled => {
                        let text = self.fail(&mut record, "cancelled before it ran".into()).await;
                        return (text, Some(StopReason::Cancelled));
                    }
                }
            }
        }

        if let Err(e) = record.start() {
            tracing::error!(error = %e, call = %record.id, "tool call state machine");
        }
        self.publish(&record, false).await;
        let cx = ToolContext {
            workspace: self.permit.workspace.clone(),
            cancel: self.cx.cancel.clone(),
            limits: services.toolbox.limits().clone(),
        };
        let run = services.toolbox.run(&tool, args, cx);
        tokio::pin!(run);
        let result = tokio::select! {
            result = &mut run => Some(result),
            _ = self.cx.cancel.cancelled() => tokio::time::timeout(TOOL_SETTLE, &mut run).await.ok(),
        };
        if self.cx.cancel.is_cancelled() {
            let text = self.fail(&mut record, "cancelled while running".into()).await;
            return (text, Some(StopReason::Cancelled));
        }
        let text = match result {
            Some(Ok(output)) => {
                let text = output.text.clone();
                if let Some(plan) = output.plan.clone() {
                    self.permit.state.plan = plan.clone();
                    self.log(LogRecord::Plan { entries: plan.clone() });
                    self.emit(EventMsg::Plan(plan)).await;
                }
                if let Err(e) = record.finish(output) {
                    tracing::error!(error = %e, call = %record.id, "tool call state machine");
                }
                self.publish(&record, false).await;
                text
            }
            Some(Err(e)) => self.fail(&mut record, e.0).await,
            None => self.fail(&mut record, "the tool did not finish".into()).await,
        };
        (text, None)
    }
}
