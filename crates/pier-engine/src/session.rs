//! A session and its turns: the agent loop model → tools → model until a stop reason.
//!
//! State ownership: [`Session`] is shared (`Arc`) by whoever routes prompts to it.
//! Its conversation lives in [`SessionState`] behind an async mutex that a turn
//! holds for its whole length: taking it with `try_lock` is how a second prompt
//! on a busy session is refused without disturbing the first. What may change
//! while a turn runs (the mode, the model, from `session/set_mode` and friends)
//! lives in [`Shared`], read by the turn at each decision.
//!
//! Tool calls of one model message run one after another, in the order the model
//! gave them. Running read-only calls concurrently would save little next to a
//! model round trip, and in-order execution keeps the log and the permission
//! requests in an order a reader can follow. The exception is a tool whose calls
//! wait on someone else for long (`delegate`: a subagent's whole turn): it says how
//! many of its calls may run at once (`Tool::concurrency`), and those start when
//! their turn in the order comes and run beside the calls that follow.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use pier_model::{ChatMessage, FinishReason, ModelEvent, ModelProvider, ModelRequest, Role, ToolCall, ToolSpec, Usage};
use pier_tools::{Action, CallLink, CallRequest, Permit, PlanEntry, Tool, ToolContext, ToolKind, Workspace};
use serde_json::Value;
use tokio::sync::{Mutex, OwnedMutexGuard, mpsc};
use tokio_util::sync::CancellationToken;

use crate::error::EngineError;
use crate::log::{LogRecord, SessionLog};
use crate::permission::{Approver, Grants, Mode, PermissionAnswer, Verdict};
use crate::store::{SessionMeta, now_rfc3339};
use crate::tool_call::ToolCallRecord;
use crate::{EventMsg, Services, SessionOptions, StopReason};

/// How long a cancelled tool gets to clean up (kill its process group) before it is dropped.
const TOOL_SETTLE: Duration = Duration::from_secs(5);

/// Longest title taken from a first prompt, in characters.
const TITLE_CHARS: usize = 80;

/// The conversation of one session. Created by [`Session`], mutated only by the
/// turn that holds the lock.
#[derive(Default)]
pub struct SessionState {
    pub(crate) history: Vec<ChatMessage>,
    pub(crate) turns: u64,
    pub(crate) plan: Vec<PlanEntry>,
    /// Behind a lock of its own because the calls of one message that run at once
    /// (`Tool::concurrency`) consult and extend it together.
    pub(crate) grants: std::sync::Mutex<Grants>,
}

/// What may change while a turn runs; each value is read when it is used.
struct Shared {
    mode: std::sync::Mutex<Mode>,
    /// A model chosen for this session, instead of the engine's.
    model: std::sync::Mutex<Option<Arc<dyn ModelProvider>>>,
    title: std::sync::Mutex<Option<String>>,
    /// This session's own tools (its MCP servers').
    tools: Vec<Arc<dyn Tool>>,
    /// Said to the model after the system prompt ([`crate::SessionOptions::note`]).
    note: Option<String>,
}

impl Shared {
    /// The session's chosen model, else the engine's.
    fn model(&self, services: &Services) -> Arc<dyn ModelProvider> {
        lock(&self.model).clone().unwrap_or_else(|| services.model.clone())
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One session: an id, a working directory, a log and a conversation.
pub struct Session {
    pub id: String,
    pub cwd: PathBuf,
    workspace: Workspace,
    log: SessionLog,
    state: Arc<Mutex<SessionState>>,
    shared: Arc<Shared>,
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

/// What the user sent: text, and images for models that take them.
#[derive(Debug, Clone, Default)]
pub struct UserPrompt {
    pub text: String,
    pub images: Vec<pier_model::Image>,
    /// What a first prompt titles its session from, when not `text` itself (a file's text
    /// rather than the wrapper that gives the model its URI).
    pub title_text: Option<String>,
}

impl From<String> for UserPrompt {
    fn from(text: String) -> Self {
        UserPrompt { text, images: Vec::new(), title_text: None }
    }
}

/// The right to run one turn, held from acceptance to the stop reason.
pub struct TurnPermit {
    state: OwnedMutexGuard<SessionState>,
    id: String,
    log: SessionLog,
    cwd: PathBuf,
    workspace: Workspace,
    shared: Arc<Shared>,
    services: Arc<Services>,
}

impl Session {
    pub(crate) fn new(
        id: String,
        options: SessionOptions,
        workspace: Workspace,
        log: SessionLog,
        state: SessionState,
        services: Arc<Services>,
    ) -> Self {
        let shared = Shared {
            mode: std::sync::Mutex::new(options.mode),
            model: std::sync::Mutex::new(None),
            title: std::sync::Mutex::new(None),
            tools: options.tools,
            note: options.note,
        };
        Session {
            id,
            cwd: options.cwd,
            workspace,
            log,
            state: Arc::new(Mutex::new(state)),
            shared: Arc::new(shared),
            services,
        }
    }

    pub fn log(&self) -> &SessionLog {
        &self.log
    }

    /// Every directory the session's tools may touch, `cwd` first.
    pub fn roots(&self) -> Vec<PathBuf> {
        self.workspace.roots().map(std::path::Path::to_path_buf).collect()
    }

    pub fn mode(&self) -> Mode {
        *lock(&self.shared.mode)
    }

    /// Changes the mode; the running turn's next decision sees it. Logged, so it holds on reopen.
    pub fn set_mode(&self, mode: Mode) {
        *lock(&self.shared.mode) = mode;
        let turn = self.state.try_lock().map_or(0, |s| s.turns);
        self.log.append(turn, &LogRecord::Setting { id: "mode".into(), value: mode.id().into() });
    }

    /// Uses `model` (named `name` in the log) for this session's next model requests.
    pub fn set_model(&self, name: &str, model: Arc<dyn ModelProvider>) {
        *lock(&self.shared.model) = Some(model);
        let turn = self.state.try_lock().map_or(0, |s| s.turns);
        self.log.append(turn, &LogRecord::Setting { id: "model".into(), value: name.into() });
    }

    /// The model this session's requests go to.
    pub fn model(&self) -> Arc<dyn ModelProvider> {
        self.shared.model(&self.services)
    }

    pub fn title(&self) -> Option<String> {
        lock(&self.shared.title).clone()
    }

    pub(crate) fn restore_title(&self, title: Option<String>) {
        *lock(&self.shared.title) = title;
    }

    pub(crate) async fn write_meta(&self) -> Result<(), EngineError> {
        write_meta(&self.services, &self.id, &self.cwd, self.title()).await
    }

    /// Reserves the session for a turn, or fails with [`EngineError::Busy`].
    pub fn begin_turn(&self) -> Result<TurnPermit, EngineError> {
        let state = self.state.clone().try_lock_owned().map_err(|_| EngineError::Busy)?;
        Ok(TurnPermit {
            state,
            id: self.id.clone(),
            log: self.log.clone(),
            cwd: self.cwd.clone(),
            workspace: self.workspace.clone(),
            shared: self.shared.clone(),
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

async fn write_meta(
    services: &Services,
    id: &str,
    cwd: &std::path::Path,
    title: Option<String>,
) -> Result<(), EngineError> {
    let meta = SessionMeta { session_id: id.to_owned(), cwd: cwd.to_owned(), title, updated_at: now_rfc3339() };
    services.store.write_meta(&meta).await
}

/// A session's title from its first prompt: the first non-empty line, cut at a character boundary.
fn title_of(prompt: &str) -> Option<String> {
    let line = prompt.lines().map(str::trim).find(|l| !l.is_empty())?;
    let mut title: String = line.chars().take(TITLE_CHARS).collect();
    if line.chars().count() > TITLE_CHARS {
        title.push('…');
    }
    Some(title)
}

/// One model message that asked for tools, and the answers to its calls. It enters the
/// history whole, when it closes: the assistant message with every one of its calls
/// answered (a call that never ran is answered as such). So the history never holds
/// a tool call without its answer, whatever stopped the turn, even a dropped turn.
struct Round {
    message: ChatMessage,
    answers: Vec<Option<String>>,
    /// Images the calls returned, for a model that takes them: shown to it after the answers.
    images: Vec<(String, Vec<pier_model::Image>)>,
}

impl Round {
    fn new(text: String, calls: Vec<ToolCall>) -> Round {
        let mut message = ChatMessage::new(Role::Assistant, text);
        let answers = vec![None; calls.len()];
        message.tool_calls = calls;
        Round { message, answers, images: Vec::new() }
    }

    fn calls(&self) -> Vec<ToolCall> {
        self.message.tool_calls.clone()
    }

    fn answer(&mut self, i: usize, end: CallEnd) {
        if !end.images.is_empty()
            && let Some(call) = self.message.tool_calls.get(i)
        {
            self.images.push((call.id.clone(), end.images));
        }
        if let Some(slot) = self.answers.get_mut(i) {
            *slot = Some(end.text);
        }
    }

    /// The assistant message, then one tool message per call, in the calls' order; then, if
    /// the calls returned images, one user message that shows them (a tool message carries
    /// text only in the Chat Completions API).
    fn close(self) -> Vec<ChatMessage> {
        let Round { message, answers, images } = self;
        let tools: Vec<ChatMessage> = message
            .tool_calls
            .iter()
            .zip(answers)
            .map(|(call, answer)| {
                let text = answer.unwrap_or_else(|| "error: not run; the turn stopped before this call".to_owned());
                let mut m = ChatMessage::new(Role::Tool, text);
                m.tool_call_id = Some(call.id.clone());
                m
            })
            .collect();
        let shown = (!images.is_empty()).then(|| {
            let calls: Vec<String> = images.iter().map(|(id, i)| format!("{} from call {id}", i.len())).collect();
            let mut m = ChatMessage::new(Role::User, format!("[The images the tools returned: {}.]", calls.join(", ")));
            m.images = images.into_iter().flat_map(|(_, i)| i).collect();
            m
        });
        std::iter::once(message).chain(tools).chain(shown).collect()
    }
}

/// How one tool call ended: what the model reads, whether the turn stops there, and
/// the plan it set (applied by the turn once the message's calls are done).
struct CallEnd {
    text: String,
    stop: Option<StopReason>,
    plan: Option<Vec<PlanEntry>>,
    /// What the model is shown besides `text` (only when it takes images).
    images: Vec<pier_model::Image>,
}

impl CallEnd {
    fn answer(text: String) -> CallEnd {
        CallEnd { text, stop: None, plan: None, images: Vec::new() }
    }

    fn stop(text: String, stop: StopReason) -> CallEnd {
        CallEnd { text, stop: Some(stop), plan: None, images: Vec::new() }
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
    pub async fn run(mut self, prompt: impl Into<UserPrompt>, cx: TurnContext) -> Result<StopReason, EngineError> {
        let UserPrompt { text: prompt, images, title_text } = prompt.into();
        self.state.turns += 1;
        let n = self.state.turns;
        let before = self.state.history.len();
        let new_title = {
            let mut title = lock(&self.shared.title);
            if title.is_none() {
                *title = title_text.as_deref().and_then(title_of).or_else(|| title_of(&prompt));
                title.clone()
            } else {
                None
            }
        };
        self.log.append(n, &LogRecord::Prompt { text: prompt.clone() });
        if let Some(title) = new_title {
            self.log.append(n, &LogRecord::Title { title: title.clone() });
            let _ = cx.events.send(EventMsg::Title(title)).await;
        }
        let mut message = ChatMessage::new(Role::User, prompt);
        message.images = images;
        self.state.history.push(message);

        let log = self.log.clone();
        let result = Turn { permit: &mut self, n, before, cx: &cx }.run().await;
        match &result {
            Ok(stop) => {
                let added = &self.state.history[before.min(self.state.history.len())..];
                if !added.is_empty() {
                    log.append(n, &LogRecord::History { messages: added.to_vec() });
                }
                log.append(n, &LogRecord::TurnEnded { stop_reason: stop.as_str().to_owned() });
            }
            Err(e) => log.append(n, &LogRecord::TurnFailed { error: e.to_string() }),
        }
        let flushed = log.flush().await;
        // The one truncation guard: a turn stays in the conversation only if it ended with a
        // stop reason and its record is on disk.
        let result = match (result, flushed) {
            (Ok(stop), Ok(())) => Ok(stop),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        };
        if result.is_err() {
            self.state.history.truncate(before);
            return result;
        }
        let title = lock(&self.shared.title).clone();
        if let Err(e) = write_meta(&self.services, &self.id, &self.cwd, title).await {
            tracing::warn!(session = %self.id, error = %e, "could not update the session summary");
        }
        result
    }

    fn model(&self) -> Arc<dyn ModelProvider> {
        self.shared.model(&self.services)
    }

    /// A session's own tool of a built-in's name stands in for it (pier-agent's `run_command`
    /// through the client's terminal).
    fn tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.shared.tools.iter().find(|t| t.name() == name).cloned().or_else(|| self.services.toolbox.get(name))
    }

    fn tools(&self) -> impl Iterator<Item = &Arc<dyn Tool>> {
        let (own, builtin) = (&self.shared.tools, self.services.toolbox.tools());
        // In the built-ins' order, each in its stand-in's place; then the session's others.
        builtin
            .iter()
            .map(move |t| own.iter().find(|o| o.name() == t.name()).unwrap_or(t))
            .chain(own.iter().filter(move |o| !builtin.iter().any(|t| t.name() == o.name())))
    }

    fn tool_specs(&self) -> Vec<ToolSpec> {
        self.tools()
            .map(|t| ToolSpec {
                name: t.name().to_owned(),
                description: t.description().to_owned(),
                parameters: t.parameters(),
            })
            .collect()
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
        let system = match (services.config.system_prompt(&self.permit.cwd), &self.permit.shared.note) {
            (Some(system), Some(note)) => Some(format!("{system}\n\n{note}")),
            (None, Some(note)) => Some(note.clone()),
            (system, None) => system,
        };
        if let Some(system) = system {
            messages.push(ChatMessage::new(Role::System, system));
        }
        messages.extend(self.permit.state.history.iter().cloned());
        let tools = self.permit.tool_specs();
        let model = self.permit.model();
        self.log(LogRecord::ModelRequest { n: k, provider: model.describe() });

        let mut stream = model.stream(ModelRequest { messages, tools });
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
                Some(Ok(ModelEvent::Retrying { attempt, delay_ms, error })) => {
                    self.log(LogRecord::Retry { n: k, attempt, delay_ms, error });
                }
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
                if text.is_empty() && !refusal.is_empty() {
                    // The refusal came apart from the text stream: a streaming client has not seen it.
                    self.emit(EventMsg::TextDelta(refusal.clone())).await;
                }
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
                self.commit(text).await;
                Ok(Step::Stop(if reason == FinishReason::Length { StopReason::MaxTokens } else { StopReason::EndTurn }))
            }
            FinishReason::ToolCalls => {
                self.say(&text).await;
                let mut round = Round::new(text, tool_calls);
                let mut stop = None;
                for (i, mut end) in self.run_calls(round.calls()).await {
                    stop = stop.or(end.stop);
                    if let Some(plan) = end.plan.take() {
                        self.permit.state.plan = plan;
                    }
                    round.answer(i, end);
                }
                self.permit.state.history.extend(round.close());
                Ok(stop.map_or(Step::Continue, Step::Stop))
            }
        }
    }

    /// Records a finished assistant message and hands it to the profile.
    async fn commit(&mut self, text: String) {
        self.say(&text).await;
        self.permit.state.history.push(ChatMessage::new(Role::Assistant, text));
    }

    /// Logs a finished assistant message and hands it to the profile.
    async fn say(&self, text: &str) {
        if !text.is_empty() {
            self.log(LogRecord::Message { text: text.to_owned() });
            self.emit(EventMsg::MessageCommitted(text.to_owned())).await;
        }
    }

    /// Publishes a tool call's current state: to the log, and to the profile unless the call
    /// shows as the plan it makes.
    async fn publish(&self, record: &ToolCallRecord, first: bool) {
        self.log(LogRecord::ToolCall { call: Box::new(record.clone()) });
        let event = if first { EventMsg::ToolCall(record.clone()) } else { EventMsg::ToolCallUpdate(record.clone()) };
        self.emit_call(event).await;
    }

    /// Hands the profile an event of a tool call, unless the call shows as the plan it makes.
    async fn emit_call(&self, event: EventMsg) {
        let plan = match &event {
            EventMsg::ToolCall(r) | EventMsg::ToolCallUpdate(r) | EventMsg::ToolCallRestated(r) => r.plan,
            _ => false,
        };
        if !plan {
            self.emit(event).await;
        }
    }

    /// Fails `record` with `reason`, publishes it, and returns what the model reads.
    async fn fail(&self, record: &mut ToolCallRecord, reason: String) -> String {
        if let Err(e) = record.fail(reason.clone()) {
            tracing::error!(error = %e, call = %record.id, "tool call state machine");
        }
        self.publish(record, false).await;
        format!("error: {reason}")
    }

    /// Runs the calls of one model message, in order: a call of a tool with
    /// `concurrency() > 1` starts when its turn comes and runs beside the calls after
    /// it, at most that many of that tool at once. Returns each call that ran with
    /// its index; after a call that stops the turn, no further call starts, and the
    /// ones already running finish (they see the same cancel token) before this returns.
    async fn run_calls(&self, calls: Vec<ToolCall>) -> Vec<(usize, CallEnd)> {
        let mut ended: Vec<(usize, CallEnd)> = Vec::with_capacity(calls.len());
        let mut beside: FuturesUnordered<futures::future::BoxFuture<'_, (usize, String, CallEnd)>> =
            FuturesUnordered::new();
        // How many calls of each tool run beside the ordered ones now.
        let mut running: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        let done = |running: &mut std::collections::HashMap<String, usize>, name: &str| {
            if let Some(n) = running.get_mut(name) {
                *n = n.saturating_sub(1);
            }
        };
        for (i, call) in calls.into_iter().enumerate() {
            if ended.iter().any(|(_, end)| end.stop.is_some()) {
                break;
            }
            let limit = self.permit.tool(&call.name).map_or(1, |t| t.concurrency());
            if limit > 1 {
                while running.get(&call.name).copied().unwrap_or(0) >= limit {
                    let Some((j, name, end)) = beside.next().await else { break };
                    done(&mut running, &name);
                    ended.push((j, end));
                }
                let name = call.name.clone();
                match self.prepare(call).await {
                    Prepared::Ended(end) => ended.push((i, end)),
                    Prepared::Ready(ready) => {
                        *running.entry(name.clone()).or_default() += 1;
                        beside.push(Box::pin(async move { (i, name, self.execute(*ready).await) }));
                    }
                }
                continue;
            }
            let one = self.tool_call(call);
            tokio::pin!(one);
            let end = loop {
                tokio::select! {
                    end = &mut one => break end,
                    Some((j, name, end)) = beside.next(), if !beside.is_empty() => {
                        done(&mut running, &name);
                        ended.push((j, end));
                    }
                }
            };
            ended.push((i, end));
        }
        while let Some((j, _, end)) = beside.next().await {
            ended.push((j, end));
        }
        ended
    }

    /// Runs one tool call through its states.
    async fn tool_call(&self, call: ToolCall) -> CallEnd {
        match self.prepare(call).await {
            Prepared::Ended(end) => end,
            Prepared::Ready(ready) => self.execute(*ready).await,
        }
    }

    /// Publishes a call in `pending` (so calls appear in the model's order, whichever runs
    /// first) and checks that it can run at all.
    async fn prepare(&self, call: ToolCall) -> Prepared {
        let parsed: Result<Value, String> = if call.arguments.trim().is_empty() {
            Ok(Value::Object(Default::default()))
        } else {
            serde_json::from_str(&call.arguments).map_err(|e| format!("the arguments are not valid JSON ({e})"))
        };
        let tool = self.permit.tool(&call.name);
        let raw_input = parsed.clone().unwrap_or_else(|_| Value::String(call.arguments.clone()));
        let mut record =
            ToolCallRecord::new(call.id.clone(), call.name.clone(), call.name.clone(), ToolKind::Other, raw_input);
        if let Some(t) = &tool {
            record.kind = t.kind();
            record.title = t.name().to_owned();
            record.plan = t.shows_as_plan();
            if let Ok(args) = &parsed {
                let p = t.preview(args, &self.permit.workspace);
                record.title = p.title;
                record.locations = p.locations;
                record.content = p.content;
            }
        }
        self.publish(&record, true).await;

        let Some(tool) = tool else {
            let known: Vec<&str> = self.permit.tools().map(|t| t.name()).collect();
            let reason = format!("there is no tool named `{}`; the tools are: {}", call.name, known.join(", "));
            return Prepared::Ended(CallEnd::answer(self.fail(&mut record, reason).await));
        };
        match parsed {
            Ok(args) => Prepared::Ready(Box::new(Ready { record, tool, args })),
            Err(reason) => Prepared::Ended(CallEnd::answer(self.fail(&mut record, reason).await)),
        }
    }

    /// Takes a prepared call through its permission, its run and its end.
    async fn execute(&self, ready: Ready) -> CallEnd {
        let Ready { mut record, tool, args } = ready;
        let services = self.permit.services.clone();
        let kind = record.kind;
        let mode = *lock(&self.permit.shared.mode);
        match mode.verdict(kind, services.policy.decide(kind)) {
            Verdict::Allow => {}
            Verdict::Deny(reason) => return CallEnd::answer(self.fail(&mut record, reason).await),
            Verdict::Ask => {
                let keys = Grants::keys(kind, &tool.scope(&args));
                let reason = match self.consult(&record, &keys).await.0 {
                    Consulted::Allowed => None,
                    Consulted::Remembered(key) => Some(format!(
                        "the user rejected `{key}` calls for the rest of this session, so this call did not run; do \
                         the task another way"
                    )),
                    Consulted::Rejected => Some(
                        "the client rejected this tool call, so it did not run; do not repeat it unchanged, adapt \
                         your approach"
                            .to_owned(),
                    ),
                    Consulted::Unavailable(why) => {
                        Some(format!("permission was unavailable ({why}), so the tool did not run"))
                    }
                    Consulted::Cancelled => {
                        let text = self.fail(&mut record, "cancelled before it ran".into()).await;
                        return CallEnd::stop(text, StopReason::Cancelled);
                    }
                };
                if let Some(reason) = reason {
                    return CallEnd::answer(self.fail(&mut record, reason).await);
                }
            }
        }

        // The one gate a tool passes to run: a cancel that landed after the grant stops it here.
        if self.cx.cancel.is_cancelled() {
            let text = self.fail(&mut record, "cancelled before it ran".into()).await;
            return CallEnd::stop(text, StopReason::Cancelled);
        }
        if let Err(e) = record.start() {
            tracing::error!(error = %e, call = %record.id, "tool call state machine");
        }
        self.publish(&record, false).await;
        let (link, mut requests) = CallLink::channel();
        let cx = ToolContext {
            workspace: self.permit.workspace.clone(),
            cancel: self.cx.cancel.clone(),
            limits: services.toolbox.limits().clone(),
            link,
        };
        let run = services.toolbox.run(&tool, args, cx);
        tokio::pin!(run);
        // Questions about the tool's actions are judged beside its run: one waiting on a
        // person holds neither the tool nor its other requests.
        let mut judgments: FuturesUnordered<futures::future::BoxFuture<'_, Option<ToolCallRecord>>> =
            FuturesUnordered::new();
        let result = loop {
            tokio::select! {
                biased;
                _ = self.cx.cancel.cancelled() => {
                    // Open questions end at once, answered `cancelled` (they watch the token);
                    // then the tool gets its time to stop.
                    let settle = async {
                        while judgments.next().await.is_some() {}
                        self.settle(&mut record, &mut run, &mut requests).await
                    };
                    break tokio::time::timeout(TOOL_SETTLE, settle).await.ok();
                }
                result = &mut run => break Some(result),
                Some(request) = requests.recv() => match request {
                    CallRequest::Progress(content) => self.show(&mut record, content).await,
                    CallRequest::Permit { action, answer } => {
                        judgments.push(Box::pin(self.judgment(record.clone(), action, answer)));
                    }
                },
                Some(asked) = judgments.next(), if !judgments.is_empty() => {
                    // The question showed the action on this call: show the call as itself again.
                    if asked.is_some() {
                        self.emit_call(EventMsg::ToolCallRestated(record.clone())).await;
                    }
                }
            }
        };
        // What the tool showed last, on its way out, still counts.
        while let Ok(request) = requests.try_recv() {
            self.settled(&mut record, request).await;
        }
        if self.cx.cancel.is_cancelled() {
            let text = self.fail(&mut record, "cancelled while running".into()).await;
            return CallEnd::stop(text, StopReason::Cancelled);
        }
        match result {
            Some(Ok(output)) => {
                let text = output.text.clone();
                let plan = output.plan.clone();
                let images = if self.permit.model().takes_images() {
                    output
                        .images
                        .iter()
                        .map(|i| pier_model::Image { mime_type: i.mime_type.clone(), data: i.data.clone() })
                        .collect()
                } else {
                    Vec::new()
                };
                if let Some(plan) = &plan {
                    self.log(LogRecord::Plan { entries: plan.clone() });
                    self.emit(EventMsg::Plan(plan.clone())).await;
                }
                if let Err(e) = record.finish(output) {
                    tracing::error!(error = %e, call = %record.id, "tool call state machine");
                }
                self.publish(&record, false).await;
                CallEnd { text, stop: None, plan, images }
            }
            Some(Err(e)) => CallEnd::answer(self.fail(&mut record, e.0).await),
            None => CallEnd::answer(self.fail(&mut record, "the tool did not finish".into()).await),
        }
    }

    /// Shows a running tool's progress on its call (shown, not logged: the call's final
    /// state is logged when it ends).
    async fn show(&self, record: &mut ToolCallRecord, content: Vec<pier_tools::ToolContent>) {
        record.content = content;
        self.emit_call(EventMsg::ToolCallUpdate(record.clone())).await;
    }

    /// Judges one action and answers the tool, unless the tool stops waiting first (its
    /// subagent withdrew the question, or was cancelled): then the question is dropped,
    /// which withdraws it from the approver. Returns the call when a person was (or may have
    /// been) asked, so that it is shown as itself again.
    async fn judgment(
        &self,
        record: ToolCallRecord,
        action: Action,
        mut answer: tokio::sync::oneshot::Sender<Permit>,
    ) -> Option<ToolCallRecord> {
        let judged = {
            let judged = self.judge(&record, action);
            tokio::pin!(judged);
            tokio::select! {
                judged = &mut judged => Some(judged),
                _ = answer.closed() => None,
            }
        };
        match judged {
            Some((permit, asked)) => {
                let _ = answer.send(permit);
                asked.then_some(record)
            }
            // Withdrawn: it may have been put to the person already.
            None => Some(record),
        }
    }

    /// Lets a cancelled tool finish: its progress still shows; its permission requests are
    /// answered `cancelled` (R088's symmetry: nothing new is granted once the turn is being
    /// cancelled).
    async fn settle<F: std::future::Future + Unpin>(
        &self,
        record: &mut ToolCallRecord,
        run: &mut F,
        requests: &mut tokio::sync::mpsc::UnboundedReceiver<CallRequest>,
    ) -> F::Output {
        loop {
            tokio::select! {
                result = &mut *run => return result,
                Some(request) = requests.recv() => self.settled(record, request).await,
            }
        }
    }

    /// A request from a tool that is ending: progress is shown, a permission is not granted.
    async fn settled(&self, record: &mut ToolCallRecord, request: CallRequest) {
        match request {
            CallRequest::Permit { answer, .. } => {
                let _ = answer.send(Permit::Cancelled);
            }
            CallRequest::Progress(content) => self.show(record, content).await,
        }
    }

    /// Judges an action a running tool takes for the user (a subagent's tool call) by the
    /// session's own rules, as if it were a call of its own: the mode over the policy for
    /// its kind, the remembered answers for its scope, else the approver, asked about the
    /// running call showing the action (its title, kind, locations, diff). An *always*
    /// answer is remembered here, by this session; the tool only learns "this once".
    /// Returns the answer and whether the approver was asked.
    async fn judge(&self, record: &ToolCallRecord, action: Action) -> (Permit, bool) {
        // Nothing is granted once the turn is being cancelled.
        if self.cx.cancel.is_cancelled() {
            return (Permit::Cancelled, false);
        }
        let services = &self.permit.services;
        let mode = *lock(&self.permit.shared.mode);
        match mode.verdict(action.kind, services.policy.decide(action.kind)) {
            Verdict::Allow => return (Permit::Allow, false),
            Verdict::Deny(reason) => return (Permit::Reject(reason), false),
            Verdict::Ask => {}
        }
        let keys = Grants::keys(action.kind, &action.scope);
        let mut question = record.clone();
        question.title = action.title;
        question.kind = action.kind;
        question.locations = action.locations;
        question.content = action.content;
        if let Some(raw) = action.raw_input {
            question.raw_input = raw;
        }
        let (consulted, asked) = self.consult(&question, &keys).await;
        let permit = match consulted {
            Consulted::Allowed => Permit::Allow,
            Consulted::Remembered(key) => {
                Permit::Reject(format!("the user rejected `{key}` calls for the rest of this session"))
            }
            Consulted::Rejected => Permit::Reject("the user rejected it".into()),
            Consulted::Unavailable(why) => Permit::Reject(format!("permission was unavailable ({why})")),
            Consulted::Cancelled => Permit::Cancelled,
        };
        (permit, asked)
    }

    /// The *ask* path: a remembered answer for `keys`, else the approver about `question`.
    /// An *always* answer is remembered for `keys`. Also says whether the approver was asked.
    async fn consult(&self, question: &ToolCallRecord, keys: &[String]) -> (Consulted, bool) {
        {
            let grants = lock(&self.permit.state.grants);
            if let Some(key) = grants.rejects(keys) {
                return (Consulted::Remembered(key.to_owned()), false);
            }
            if grants.allows(keys) {
                return (Consulted::Allowed, false);
            }
        }
        let answer = tokio::select! {
            biased;
            _ = self.cx.cancel.cancelled() => PermissionAnswer::Cancelled,
            answer = self.cx.approver.ask(question) => answer,
        };
        // A cancel that raced the answer wins: the tool never runs.
        let answer = if self.cx.cancel.is_cancelled() { PermissionAnswer::Cancelled } else { answer };
        self.log(LogRecord::Permission { call_id: question.id.clone(), answer: format!("{answer:?}") });
        if let PermissionAnswer::AllowAlways | PermissionAnswer::RejectAlways = answer {
            let allow = answer == PermissionAnswer::AllowAlways;
            let mut grants = lock(&self.permit.state.grants);
            for key in keys {
                grants.remember(key.clone(), allow);
                self.log(LogRecord::Grant { key: key.clone(), allow });
            }
        }
        let consulted = match answer {
            PermissionAnswer::AllowOnce | PermissionAnswer::AllowAlways => Consulted::Allowed,
            PermissionAnswer::RejectOnce | PermissionAnswer::RejectAlways => Consulted::Rejected,
            PermissionAnswer::Unavailable(why) => Consulted::Unavailable(why),
            PermissionAnswer::Cancelled => Consulted::Cancelled,
        };
        (consulted, true)
    }
}

/// A call after its pending publication: either already ended, or ready to run.
enum Prepared {
    Ended(CallEnd),
    Ready(Box<Ready>),
}

struct Ready {
    record: ToolCallRecord,
    tool: Arc<dyn Tool>,
    args: Value,
}

/// What the *ask* path concluded.
enum Consulted {
    Allowed,
    /// A remembered *always reject* for this key.
    Remembered(String),
    Rejected,
    Unavailable(String),
    Cancelled,
}
