//! An attempt driven from another machine (`/v1` of the HTTP API, `pier worker`): the same
//! channels a local attempt has, each fenced on the attempt holding its task. Progress events
//! go into the task's log in order, once per batch number; a permission request or a question
//! parks the task for a person exactly as a local one does, and the worker waits for the
//! answer; people's messages are taken by the attempt; and one long-poll (`notice`) tells the
//! worker, as soon as it is so, that a person cancelled its task (it then ends the task with
//! its output), that the task was lost, or that a message or an answer waits.

use std::time::Duration;

use pier_store::{Attempt, ErrorCode, Idem, QuestionRequest, StoreError, TaskState, is_agent_event};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::handle::Tasks;
use crate::person::ActionError;

/// The most events one progress batch may carry.
pub const MAX_BATCH_EVENTS: usize = 1_000;
/// The largest output an attempt keeps (its text is bounded to 64 KiB by the client already).
const MAX_OUTPUT_BYTES: usize = 1 << 20;
/// How often, at most, a long-poll looks again after commits of the store.
const CHECK_EVERY: Duration = Duration::from_millis(50);
/// The longest a worker's long-poll is held.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// One batch of an attempt's progress, as a worker sends it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Progress {
    /// The batch's number within the attempt (1, 2, …): a batch seen before is ignored.
    pub seq: i64,
    /// Each `{"type": KIND, …}` as `pier exec --format json` prints the agent's events.
    #[serde(default)]
    pub events: Vec<Value>,
    /// Side effects the agent reported in this batch (for the decision at the ending).
    #[serde(default)]
    pub evidence: Vec<Value>,
}

/// A progress batch checked: its number, its events as the log's rows, and its side effects.
pub(crate) type Checked = (i64, Vec<(String, Value)>, Vec<Value>);

impl Progress {
    /// The batch checked, or why it cannot be written.
    pub(crate) fn rows(self) -> Result<Checked, ActionError> {
        if self.seq < 1 {
            return Err(ActionError::bad_request("seq numbers an attempt's batches from 1"));
        }
        if self.events.len() > MAX_BATCH_EVENTS || self.evidence.len() > MAX_BATCH_EVENTS {
            return Err(ActionError::bad_request(format!(
                "a batch carries at most {MAX_BATCH_EVENTS} events and {MAX_BATCH_EVENTS} side effects; send more batches"
            )));
        }
        let mut events = Vec::with_capacity(self.events.len());
        for (i, e) in self.events.into_iter().enumerate() {
            let Value::Object(mut data) = e else {
                return Err(ActionError::bad_request(format!("events[{i}] is not an object")));
            };
            let kind = match data.remove("type") {
                Some(Value::String(k)) => k,
                _ => return Err(ActionError::bad_request(format!("events[{i}] has no `type`"))),
            };
            let data = Value::Object(data);
            if !is_agent_event(&kind, &data) {
                return Err(ActionError::bad_request(format!(
                    "events[{i}] is not an agent event the log knows (`{kind}`); send what `pier exec --format json` prints"
                )));
            }
            events.push((kind, data));
        }
        Ok((self.seq, events, self.evidence))
    }
}

/// What a worker's long-poll says about its attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Notice {
    /// The attempt still holds its task (false: stop the agent; the task was cancelled,
    /// its lease expired or someone else holds it).
    pub held: bool,
    pub state: TaskState,
    /// Messages from people waiting to be taken, and whether one asks to interrupt.
    pub messages: bool,
    pub interrupt: bool,
    /// The attempt's question that has an answer now, if any.
    pub answered: Option<i64>,
    /// A person cancelled the task (the reason): stop the agent's turn and report the
    /// ending with its output; the task ends cancelled, whatever the report says.
    pub cancel: Option<String>,
}

pub(super) fn lost(a: &Attempt) -> ActionError {
    ActionError::Refused {
        code: ErrorCode::LeaseLost,
        message: format!(
            "attempt {} of task `{}` does not hold the task any more; stop its agent and lease again",
            a.n, a.task
        ),
    }
}

impl Tasks {
    /// Writes a progress batch of `attempt`; `false` when this batch was written before.
    pub async fn progress(&self, attempt: &Attempt, body: Value) -> Result<bool, ActionError> {
        let batch = Progress::deserialize(&body)
            .map_err(|e| ActionError::bad_request(format!("the progress batch is not valid: {e}")))?;
        let (seq, events, evidence) = batch.rows()?;
        let idem = Idem::progress(attempt, seq, &body, events);
        let a = attempt.clone();
        let written = self.blocking(move |s| Ok(s.record_once(&a, &idem, &evidence)?)).await;
        match written {
            Err(ActionError::Store(StoreError::LeaseLost { .. })) => Err(lost(attempt)),
            other => other,
        }
    }

    /// Parks the task on a question of `attempt`'s agent (a permission request or an
    /// elicitation, as a local attempt's): its number within the attempt.
    pub async fn ask(&self, attempt: &Attempt, request: Value) -> Result<i64, ActionError> {
        let request: QuestionRequest = serde_json::from_value(request)
            .map_err(|e| ActionError::bad_request(format!("the question is not valid: {e}")))?;
        self.park_on(attempt, request).await
    }

    /// Parks the task on `request`, a question of `attempt`'s: its number within the attempt.
    pub(super) async fn park_on(&self, attempt: &Attempt, request: QuestionRequest) -> Result<i64, ActionError> {
        let a = attempt.clone();
        match self.blocking(move |s| Ok(s.park(&a, &request)?)).await {
            Err(ActionError::Store(StoreError::LeaseLost { .. })) => Err(lost(attempt)),
            other => other,
        }
    }

    /// Waits (at most `wait`, bounded by [`MAX_WAIT`]) for a person's answer to question `n`
    /// of `attempt`; with one, the task runs again and the answer is returned. `None`: not yet.
    /// A question voided (the task cancelled, the attempt lost) is `lease_lost`.
    pub async fn wait_answer(&self, attempt: &Attempt, n: i64, wait: Duration) -> Result<Option<String>, ActionError> {
        let mut commits = self.store.subscribe();
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        loop {
            let a = attempt.clone();
            match self.blocking(move |s| Ok(s.answer_of(&a, n)?)).await? {
                Some(answer) if !answer.is_empty() => {
                    let a = attempt.clone();
                    if !self.blocking(move |s| Ok(s.resume(&a)?)).await? {
                        return Err(lost(attempt));
                    }
                    return Ok(Some(answer));
                }
                Some(_) => return Err(lost(attempt)),
                None => {}
            }
            match tokio::time::timeout_at(deadline, commits.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Ok(None),
            }
        }
    }

    /// The agent stopped waiting for question `n` (its turn was cancelled).
    pub async fn withdraw(&self, attempt: &Attempt, n: i64) -> Result<(), ActionError> {
        let a = attempt.clone();
        self.blocking(move |s| Ok(s.withdraw(&a, n)?)).await
    }

    /// People's messages to `attempt`'s task not sent yet, oldest first; taken (marked sent).
    pub async fn take_messages(&self, attempt: &Attempt) -> Result<Vec<(i64, String)>, ActionError> {
        let a = attempt.clone();
        match self.blocking(move |s| Ok(s.take_messages(&a)?)).await {
            Err(ActionError::Store(StoreError::LeaseLost { .. })) => Err(lost(attempt)),
            other => other,
        }
    }

    /// Keeps what `attempt` showed (its text and tool calls) after its task was taken from it
    /// (cancelled, lost): a cancelled task keeps its partial output, wherever its agent ran.
    /// Only the attempt the task last started takes it.
    pub async fn keep_output(&self, attempt: &Attempt, output: Value) -> Result<(), ActionError> {
        if output.to_string().len() > MAX_OUTPUT_BYTES {
            return Err(ActionError::bad_request(format!("an attempt's output is at most {MAX_OUTPUT_BYTES} bytes")));
        }
        let a = attempt.clone();
        self.blocking(move |s| {
            let row = s.task(&a.run, &a.task)?.ok_or_else(|| StoreError::UnknownTask(a.task.clone()))?;
            if row.attempt != a.n {
                return Err(lost(&a));
            }
            Ok(s.keep_output(&a, &output)?)
        })
        .await
    }

    /// How `attempt` stands, once something concerns it or `wait` passed (bounded by
    /// [`MAX_WAIT`]): returns at once when the task is lost, a message waits, or its question
    /// `question` (if given) has an answer; else when one of those happens.
    pub async fn notice(
        &self,
        attempt: &Attempt,
        question: Option<i64>,
        wait: Duration,
    ) -> Result<Notice, ActionError> {
        let mut commits = self.store.subscribe();
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        loop {
            let a = attempt.clone();
            let notice = self
                .blocking(move |s| {
                    let row = s.task(&a.run, &a.task)?.ok_or_else(|| StoreError::UnknownTask(a.task.clone()))?;
                    let held = row.attempt == a.n
                        && row.lease_owner.as_deref() == Some(a.owner.as_str())
                        && matches!(row.state, TaskState::Running | TaskState::AwaitingInput)
                        && row.lease_expires_at_ms.is_some_and(|e| e >= pier_store::now_ms());
                    let cancel = if held { row.cancel_requested } else { None };
                    let open = held && cancel.is_none();
                    let waiting = if open { s.waiting(&a.run, &a.task)? } else { Default::default() };
                    let (messages, interrupt) = (waiting.messages, waiting.interrupt);
                    let answered = match question {
                        Some(n) if open => s.answer_of(&a, n)?.filter(|x| !x.is_empty()).map(|_| n),
                        _ => None,
                    };
                    Ok(Notice { held, state: row.state, messages, interrupt, answered, cancel })
                })
                .await?;
            if !notice.held || notice.cancel.is_some() || notice.messages || notice.answered.is_some() {
                return Ok(notice);
            }
            let looked = tokio::time::Instant::now();
            match tokio::time::timeout_at(deadline, commits.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Ok(notice),
            }
            // Every commit of the store rings (other tasks' too): a look at most every
            // CHECK_EVERY, as a local attempt takes it.
            tokio::time::sleep_until((looked + CHECK_EVERY).min(deadline)).await;
        }
    }
}
