//! A session and its turns: the agent loop model → tools → model until a stop reason.
//!
//! State ownership: [`Session`] is shared (`Arc`) by whoever routes prompts to it.
//! Its conversation lives in [`SessionState`] behind an async mutex that a turn
//! holds for its whole length: taking it with `try_lock` is how a second prompt
//! on a busy session is refused without disturbing the first.

use std::path::PathBuf;
use std::sync::Arc;

use futures::StreamExt;
use pier_model::{ChatMessage, FinishReason, ModelEvent, ModelProvider, ModelRequest, Role, Usage};
use tokio::sync::{Mutex, OwnedMutexGuard, mpsc};
use tokio_util::sync::CancellationToken;

use crate::error::EngineError;
use crate::log::{LogRecord, SessionLog};
use crate::tools::ToolHost;
use crate::{EngineConfig, EventMsg, StopReason};

/// Everything a session shares with its turns.
pub(crate) struct SessionServices {
    pub config: EngineConfig,
    pub model: Arc<dyn ModelProvider>,
    pub tools: Arc<dyn ToolHost>,
}

/// The conversation of one session. Created by [`Session`], mutated only by the
/// turn that holds the lock.
#[derive(Default)]
pub struct SessionState {
    history: Vec<ChatMessage>,
    turns: u64,
}

/// One session: an id, a working directory, a log and a conversation.
pub struct Session {
    pub id: String,
    pub cwd: PathBuf,
    log: SessionLog,
    state: Arc<Mutex<SessionState>>,
    services: Arc<SessionServices>,
}

/// The right to run one turn, held from acceptance to the stop reason.
pub struct TurnPermit {
    state: OwnedMutexGuard<SessionState>,
    log: SessionLog,
    cwd: PathBuf,
    services: Arc<SessionServices>,
}

impl Session {
    pub(crate) fn new(id: String, cwd: PathBuf, log: SessionLog, services: Arc<SessionServices>) -> Session {
        Session { id, cwd, log, state: Arc::new(Mutex::new(SessionState::default())), services }
    }

    pub fn log(&self) -> &SessionLog {
        &self.log
    }

    /// Reserves the session for a turn, or fails with [`EngineError::Busy`].
    pub fn begin_turn(&self) -> Result<TurnPermit, EngineError> {
        let state = self.state.clone().try_lock_owned().map_err(|_| EngineError::Busy)?;
        Ok(TurnPermit { state, log: self.log.clone(), cwd: self.cwd.clone(), services: self.services.clone() })
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

impl TurnPermit {
    /// Runs the turn for `prompt` until a stop reason.
    ///
    /// Events go to `events` as they happen; a dropped receiver is ignored. When
    /// `cancel` fires, the model stream is dropped and the turn ends
    /// [`StopReason::Cancelled`], whatever the aborted request does (R090, R091).
    /// An error leaves the conversation as it was before the turn.
    pub async fn run(
        mut self,
        prompt: String,
        cancel: CancellationToken,
        events: mpsc::Sender<EventMsg>,
    ) -> Result<StopReason, EngineError> {
        self.state.turns += 1;
        let turn = self.state.turns;
        let before = self.state.history.len();
        self.log.append(turn, &LogRecord::Prompt { text: prompt.clone() });
        self.state.history.push(ChatMessage::new(Role::User, prompt));

        let result = self.run_loop(turn, before, &cancel, &events).await;
        match &result {
            Ok(stop) => self.log.append(turn, &LogRecord::TurnEnded { stop_reason: stop.as_str().to_owned() }),
            Err(e) => {
                self.state.history.truncate(before);
                self.log.append(turn, &LogRecord::TurnFailed { error: e.to_string() });
            }
        }
        self.log.flush().await?;
        result
    }

    async fn run_loop(
        &mut self,
        turn: u64,
        before: usize,
        cancel: &CancellationToken,
        events: &mpsc::Sender<EventMsg>,
    ) -> Result<StopReason, EngineError> {
        let mut requests = 0u32;
        loop {
            if cancel.is_cancelled() {
                return Ok(StopReason::Cancelled);
            }
            if requests >= self.services.config.max_turn_requests {
                return Ok(StopReason::MaxTurnRequests);
            }
            requests += 1;
            match self.model_request(turn, requests, before, cancel, events).await? {
                Step::Stop(stop) => return Ok(stop),
                Step::Continue => {}
            }
        }
    }

    async fn model_request(
        &mut self,
        turn: u64,
        n: u32,
        before: usize,
        cancel: &CancellationToken,
        events: &mpsc::Sender<EventMsg>,
    ) -> Result<Step, EngineError> {
        let services = self.services.clone();
        let mut messages = Vec::with_capacity(self.state.history.len() + 1);
        if let Some(system) = services.config.system_prompt(&self.cwd) {
            messages.push(ChatMessage::new(Role::System, system));
        }
        messages.extend(self.state.history.iter().cloned());
        let request = ModelRequest { messages, tools: services.tools.specs() };
        self.log.append(turn, &LogRecord::ModelRequest { n, provider: services.model.describe() });

        let mut stream = services.model.stream(request);
        let (mut text, mut reasoning, mut refusal) = (String::new(), String::new(), String::new());
        let mut usage: Option<Usage> = None;
        let (reason, tool_calls) = loop {
            let event = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Ok(Step::Stop(StopReason::Cancelled)),
                event = stream.next() => event,
            };
            match event {
                Some(Ok(ModelEvent::TextDelta(t))) => {
                    text.push_str(&t);
                    let _ = events.send(EventMsg::TextDelta(t)).await;
                }
                Some(Ok(ModelEvent::ReasoningDelta(t))) => {
                    reasoning.push_str(&t);
                    let _ = events.send(EventMsg::ReasoningDelta(t)).await;
                }
                Some(Ok(ModelEvent::RefusalDelta(t))) => refusal.push_str(&t),
                Some(Ok(ModelEvent::ToolCallDelta { .. })) => {}
                Some(Ok(ModelEvent::Usage(u))) => usage = Some(u),
                Some(Ok(ModelEvent::Finish { reason, tool_calls })) => break (reason, tool_calls),
                Some(Err(e)) => {
                    if cancel.is_cancelled() {
                        return Ok(Step::Stop(StopReason::Cancelled));
                    }
                    return Err(e.into());
                }
                None => {
                    return Err(pier_model::ModelError::StreamCut(
                        "the provider ended the stream without finishing".into(),
                    )
                    .into());
                }
            }
        };
        drop(stream);
        let finish = match &reason {
            FinishReason::Other(other) => other.clone(),
            r => serde_json::to_value(r).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default(),
        };
        self.log.append(turn, &LogRecord::ModelResponse { n, finish, usage });
        if let Some(u) = usage {
            let _ = events.send(EventMsg::Usage(u)).await;
        }
        if !reasoning.is_empty() {
            self.log.append(turn, &LogRecord::Reasoning { text: reasoning });
        }

        match reason {
            FinishReason::Refusal => {
                let said = if text.is_empty() { refusal } else { text };
                self.log.append(turn, &LogRecord::Refusal { text: said.clone() });
                if !said.is_empty() {
                    let _ = events.send(EventMsg::MessageCommitted(said)).await;
                }
                // A refused prompt and everything after it stay out of later turns.
                self.state.history.truncate(before);
                Ok(Step::Stop(StopReason::Refusal))
            }
            FinishReason::Stop | FinishReason::Other(_) | FinishReason::Length => {
                self.commit(turn, text, Vec::new(), events).await;
                Ok(Step::Stop(if reason == FinishReason::Length { StopReason::MaxTokens } else { StopReason::EndTurn }))
            }
            FinishReason::ToolCalls => {
                self.commit(turn, text, tool_calls.clone(), events).await;
                for call in tool_calls {
                    let id = call.id.clone();
                    let (name, arguments) = (call.name.clone(), call.arguments.clone());
                    let outcome = tokio::select! {
                        biased;
                        _ = cancel.cancelled() => return Ok(Step::Stop(StopReason::Cancelled)),
                        outcome = services.tools.call(call) => outcome,
                    };
                    self.log.append(
                        turn,
                        &LogRecord::ToolCall {
                            id: id.clone(),
                            name,
                            arguments,
                            status: if outcome.success { "completed" } else { "failed" }.to_owned(),
                            output: outcome.raw,
                        },
                    );
                    let mut answer = ChatMessage::new(Role::Tool, outcome.output);
                    answer.tool_call_id = Some(id);
                    self.state.history.push(answer);
                }
                Ok(Step::Continue)
            }
        }
    }

    /// Records a finished assistant message and hands it to the profile.
    async fn commit(
        &mut self,
        turn: u64,
        text: String,
        tool_calls: Vec<pier_model::ToolCall>,
        events: &mpsc::Sender<EventMsg>,
    ) {
        if !text.is_empty() {
            self.log.append(turn, &LogRecord::Message { text: text.clone() });
            let _ = events.send(EventMsg::MessageCommitted(text.clone())).await;
        }
        let mut message = ChatMessage::new(Role::Assistant, text);
        message.tool_calls = tool_calls;
        self.state.history.push(message);
    }
}
