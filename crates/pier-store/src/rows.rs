//! The rows of the store as its callers see them: tasks, attempts and the tokens that
//! hold them, endings, questions, agents and nodes.

use agent_client_protocol_schema::v1::{
    CreateElicitationRequest, PermissionOption, PermissionOptionKind, RequestPermissionRequest,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::StoreError;
use crate::plan::TaskSpec;
use crate::state::TaskState;

/// A task as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRow {
    pub run_id: String,
    pub id: String,
    pub state: TaskState,
    pub version: i64,
    /// Attempts started so far.
    pub attempt: i64,
    /// Attempts that failed (crash, timeout, garbage); retries stop at `max_attempts`.
    pub failures: i64,
    pub lease_owner: Option<String>,
    pub lease_expires_at_ms: Option<i64>,
    pub not_before_ms: i64,
    pub result: Option<String>,
    pub usage: Option<Value>,
    pub error: Option<String>,
    pub spec: TaskSpec,
    /// A person cancelled the task while an attempt held it: the reason, until that attempt
    /// ends it (cancelled, whatever its own ending would have been, with its output in the
    /// same commit) or its lease lapses.
    #[serde(default)]
    pub cancel_requested: Option<String>,
}

impl TaskRow {
    /// The attempt holding the task, as the row says: for `release_lost`, which fences on it.
    pub fn held(&self) -> Option<Held> {
        let live = matches!(self.state, TaskState::Running | TaskState::AwaitingInput);
        match (&self.lease_owner, self.lease_expires_at_ms) {
            (Some(owner), Some(expires_at_ms)) if live => Some(Held {
                attempt: Attempt {
                    run: self.run_id.clone(),
                    task: self.id.clone(),
                    n: self.attempt,
                    owner: owner.clone(),
                },
                expires_at_ms,
            }),
            _ => None,
        }
    }
}

/// What a worker's report with a claim of its next task did: the task as it ended, and the
/// task claimed for the worker in the same commit (none when it was taken first).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reported {
    pub task: TaskRow,
    pub next: Option<TaskRow>,
    /// This is a repeat of the report: the first answer, as stored.
    #[serde(skip)]
    pub repeat: bool,
}

/// The token of a live attempt: attempt `n` of a task, held by `owner`. Only
/// [`crate::TaskStore::claim`] makes one; every operation of the attempt is fenced on it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Attempt {
    pub run: String,
    pub task: String,
    pub n: i64,
    pub owner: String,
}

/// An attempt as another party saw it, with the lease expiry it saw: what
/// [`crate::TaskStore::release_lost`] fences on, so a renewal in between wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub attempt: Attempt,
    pub expires_at_ms: i64,
}

/// Whether a failure is worth another attempt (seed 001 §5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The agent broke the protocol (garbage, a broken handshake, -32601/-32602): a bug,
    /// which another attempt would meet again. Not retried.
    Protocol,
    /// A model outage, a tool failure, a timeout, a crash: retried with backoff.
    Business,
    /// The agent went past a limit of its sandbox (memory, processes) and was stopped: another
    /// attempt under the same limit would meet it again. Not retried.
    Resource,
}

/// What the end of an attempt does to its task. Made by the host's `decide` (or a
/// person's or a worker's report); applied by [`crate::TaskStore::finish`] and
/// [`crate::TaskStore::release_lost`]. The lease is released whatever the ending.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "to", rename_all = "snake_case")]
pub enum Ending {
    /// `completed`, with the answer.
    Completed { result: String, usage: Option<Value> },
    /// `failed` for good.
    Failed { error: String, class: ErrorClass, reason: String, failure: bool },
    /// `cancelled`.
    Cancelled { reason: String },
    /// `pending` again, not before `not_before_ms`; `failure` counts it against `max_attempts`.
    Retry { error: Option<String>, reason: String, not_before_ms: i64, failure: bool },
    /// `awaiting_input`: a person decides whether to run the task again (it reported
    /// side effects that another attempt would repeat).
    AskPerson { error: Option<String>, reason: String, failure: bool, evidence: Vec<Value> },
}

impl Ending {
    pub fn state(&self) -> TaskState {
        match self {
            Ending::Completed { .. } => TaskState::Completed,
            Ending::Failed { .. } => TaskState::Failed,
            Ending::Cancelled { .. } => TaskState::Cancelled,
            Ending::Retry { .. } => TaskState::Pending,
            Ending::AskPerson { .. } => TaskState::AwaitingInput,
        }
    }

    pub fn reason(&self) -> &str {
        match self {
            Ending::Completed { .. } => "end_turn",
            Ending::Failed { reason, .. }
            | Ending::Cancelled { reason }
            | Ending::Retry { reason, .. }
            | Ending::AskPerson { reason, .. } => reason,
        }
    }

    /// Whether the ending counts against `max_attempts`.
    pub fn is_failure(&self) -> bool {
        match self {
            Ending::Failed { failure, .. } | Ending::Retry { failure, .. } | Ending::AskPerson { failure, .. } => {
                *failure
            }
            Ending::Completed { .. } | Ending::Cancelled { .. } => false,
        }
    }
}

/// What an attempt writes with its ending, in the same transaction: its events and side
/// effects not recorded yet, and what it showed (`pier_client::Partial`), kept even when the
/// ending is refused.
#[derive(Debug, Clone, PartialEq)]
pub struct Last {
    pub events: Vec<(String, Value)>,
    pub evidence: Vec<Value>,
    pub output: Value,
    /// The attempt's agent could still be told more: the ending is refused while a message
    /// waits for the task (`StoreError::MessagesWaiting`, nothing written). Ending this way
    /// is what closes the inbox: `say` takes messages only for a live attempt.
    pub unless_messages: bool,
}

/// An idempotency key and the request it stands for. Built here, from typed parts only.
#[derive(Debug, Clone, PartialEq)]
pub struct Idem {
    key: String,
    request: String,
    /// Events the request writes with its effect, in the same commit (a worker's model
    /// requests with its ending): written once, whatever the number of repeats.
    events: Vec<(String, Value)>,
    /// Side effects the request reports with its events (a worker's last progress batch),
    /// added to the attempt's evidence in the same commit.
    evidence: Vec<Value>,
    /// What the attempt showed, kept with an ending in its commit.
    output: Option<String>,
    /// The ending is refused while a message waits for the task (as [`Last::unless_messages`]).
    unless_messages: bool,
}

impl Idem {
    /// A pull worker's report on its attempt: the worker's own key, scoped to the attempt
    /// (so keys of different attempts never meet), with the report's body.
    pub fn worker_report(attempt: &Attempt, client_key: &str, body: &Value) -> Idem {
        Idem {
            key: format!("report:{}:{}:{client_key}", attempt.n, attempt.owner),
            request: body.to_string(),
            events: Vec::new(),
            evidence: Vec::new(),
            output: None,
            unless_messages: false,
        }
    }

    /// A remote attempt's batch `seq` of progress (`body` as sent), whose events it writes.
    pub fn progress(attempt: &Attempt, seq: i64, body: &Value, events: Vec<(String, Value)>) -> Idem {
        let key = format!("progress:{}:{}:{seq}", attempt.n, attempt.owner);
        Idem { key, request: body.to_string(), events, evidence: Vec::new(), output: None, unless_messages: false }
    }

    /// With `events` written in the commit of the request's effect.
    pub fn with_events(mut self, events: Vec<(String, Value)>) -> Idem {
        self.events = events;
        self
    }

    /// With side effects `evidence` added to the attempt's in the commit of the request's effect.
    pub fn with_evidence(mut self, evidence: Vec<Value>) -> Idem {
        self.evidence = evidence;
        self
    }

    /// With `output` (the attempt's, as JSON text) kept in the commit of the ending.
    pub fn with_output(mut self, output: Option<String>) -> Idem {
        self.output = output;
        self
    }

    /// Refused while a message waits for the task (the worker's agent can still be told it).
    pub fn unless_messages(mut self, unless: bool) -> Idem {
        self.unless_messages = unless;
        self
    }

    pub fn refuses_with_messages(&self) -> bool {
        self.unless_messages
    }

    pub fn output(&self) -> Option<&str> {
        self.output.as_deref()
    }

    pub fn events(&self) -> &[(String, Value)] {
        &self.events
    }

    pub fn evidence(&self) -> &[Value] {
        &self.evidence
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn request(&self) -> &str {
        &self.request
    }
}

/// What an agent spec answered to `initialize` when a process of it last started.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentRow {
    pub spec: String,
    /// The whole answer: `agentInfo`, `agentCapabilities`, `authMethods`.
    pub init: Value,
    pub seen_at_ms: i64,
}

impl AgentRow {
    /// The agent's name and version, as its `initialize` answer gave them.
    pub fn info(&self) -> Option<agent_client_protocol_schema::v1::Implementation> {
        #[derive(Deserialize)]
        struct Init {
            #[serde(rename = "agentInfo")]
            agent_info: Option<agent_client_protocol_schema::v1::Implementation>,
        }
        serde_json::from_value::<Init>(self.init.clone()).ok()?.agent_info
    }
}

/// The people's messages that wait for a running task, as one look saw them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Waiting {
    /// Some message waits.
    pub messages: bool,
    /// One of them asks to interrupt the turn (so `messages` too).
    pub interrupt: bool,
}

/// One attempt of a task as stored: its side effects and what it showed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttemptRow {
    pub attempt: i64,
    pub evidence: Vec<Value>,
    /// Its text and tool calls, once it ended.
    pub output: Option<Value>,
}

impl AttemptRow {
    pub(crate) fn decode(attempt: i64, evidence: &str, output: Option<&str>) -> Result<AttemptRow, StoreError> {
        Ok(AttemptRow {
            attempt,
            evidence: serde_json::from_str(evidence)?,
            output: output.map(serde_json::from_str).transpose()?,
        })
    }
}

/// A pull worker as the store knows it: when it last asked for work, and what it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkerRow {
    pub name: String,
    pub capabilities: Vec<String>,
    pub seen_at_ms: i64,
    /// The attempts it holds now: `(run, task, attempt)`.
    pub running: Vec<(String, String, i64)>,
}

/// A host node (a `pier serve` process driving runs) as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeRow {
    pub id: String,
    pub started_at_ms: i64,
    pub heartbeat_at_ms: i64,
    /// Past this without a heartbeat, its runs are another node's to take.
    pub expires_at_ms: i64,
    /// The runs it drives (holds the run lease of).
    pub runs: Vec<String>,
}

/// A question for a person, as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Question {
    pub attempt: i64,
    pub n: i64,
    pub request: QuestionRequest,
}

/// What an attempt asks a person, as the agent sent it: decoded once, where it is read, so
/// no reader picks it apart by key.
#[derive(Debug, Clone, PartialEq)]
pub enum QuestionRequest {
    /// `session/request_permission`: the person picks one of the options it offers.
    Permission(Box<RequestPermissionRequest>),
    /// `elicitation/create`: the person fills in the form it asks for.
    Elicitation(Box<CreateElicitationRequest>),
}

/// The key under which an elicitation is kept in the store (a permission request is kept as
/// it came): the stored shape of [`QuestionRequest`].
const ELICITATION: &str = "elicitation";

impl QuestionRequest {
    /// The request as stored: a permission request as it came, an elicitation under its key.
    pub fn to_stored(&self) -> Value {
        match self {
            QuestionRequest::Permission(p) => serde_json::to_value(p).unwrap_or(Value::Null),
            QuestionRequest::Elicitation(e) => {
                serde_json::json!({ ELICITATION: serde_json::to_value(e).unwrap_or(Value::Null) })
            }
        }
    }

    /// A stored request; what does not decode says why.
    pub fn from_stored(mut v: Value) -> Result<QuestionRequest, String> {
        match v.get_mut(ELICITATION).map(Value::take) {
            Some(e) => serde_json::from_value(e)
                .map(|e| QuestionRequest::Elicitation(Box::new(e)))
                .map_err(|e| format!("its question is not an elicitation request ({e})")),
            None => serde_json::from_value(v)
                .map(|p| QuestionRequest::Permission(Box::new(p)))
                .map_err(|e| format!("its question is not a permission request ({e})")),
        }
    }

    /// The permission request, if that is what it is.
    pub fn permission(&self) -> Option<&RequestPermissionRequest> {
        match self {
            QuestionRequest::Permission(p) => Some(p),
            QuestionRequest::Elicitation(_) => None,
        }
    }

    /// The elicitation, if that is what it is.
    pub fn elicitation(&self) -> Option<&CreateElicitationRequest> {
        match self {
            QuestionRequest::Elicitation(e) => Some(e),
            QuestionRequest::Permission(_) => None,
        }
    }
}

/// An option kind's wire name (`allow_once`, `reject_always`, …).
pub fn option_kind(kind: PermissionOptionKind) -> &'static str {
    match kind {
        PermissionOptionKind::AllowOnce => "allow_once",
        PermissionOptionKind::AllowAlways => "allow_always",
        PermissionOptionKind::RejectOnce => "reject_once",
        PermissionOptionKind::RejectAlways => "reject_always",
        _ => "other",
    }
}

/// The option of a permission request named by its id or its kind (`allow_once`,
/// `reject_once`, …); an error lists what was offered.
pub fn offered_option<'r>(request: &'r RequestPermissionRequest, wanted: &str) -> Result<&'r PermissionOption, String> {
    let options = &request.options;
    options
        .iter()
        .find(|o| &*o.option_id.0 == wanted)
        .or_else(|| options.iter().find(|o| option_kind(o.kind) == wanted))
        .ok_or_else(|| {
            let offered: Vec<String> =
                options.iter().map(|o| format!("{} ({})", o.option_id.0, option_kind(o.kind))).collect();
            format!("the agent offered no option `{wanted}`; it offered: {}", offered.join(", "))
        })
}

impl Serialize for QuestionRequest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_stored().serialize(s)
    }
}

impl<'de> Deserialize<'de> for QuestionRequest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        QuestionRequest::from_stored(Value::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}
