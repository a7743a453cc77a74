//! The durable store: runs, tasks, attempts, questions and the gap-free event log.
//!
//! Writes are *named operations*, each fenced in its own SQL, never a generic "move this
//! task" with a bag of flags. An attempt is held through an [`Attempt`] token that only
//! [`TaskStore::claim`] hands out; every operation of a running attempt (`heartbeat`,
//! `park`, `resume`, `finish`) names it and changes nothing unless the task is still on
//! that attempt under that owner, so a stale or foreign holder is refused by construction.
//! A lost attempt is taken back by [`TaskStore::release_lost`], fenced on what the caller
//! saw (attempt, owner and lease expiry): a heartbeat in between makes it a no-op.
//!
//! Idempotency: an operation that a remote caller may repeat (a pull worker's update)
//! carries an [`Idem`] built in one place from typed parts; the first answer is kept with
//! the request's body, a repeat with the same body gets that answer back and changes
//! nothing, and a repeat with another body is refused (`idempotency_conflict`).

mod ops;
mod pg;
mod pg_rounds;
mod pg_target;
mod sqlite;

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{broadcast, watch};

use crate::plan::{Plan, TaskSpec};
use crate::state::TaskState;

pub use pg::{PgStore, ScratchDatabase};
pub use pg_target::redacted;
pub use sqlite::SqliteStore;

/// Opens the store `spec` names: `postgres://…` (or `postgresql://…`) is a [`PgStore`];
/// `sqlite://PATH` or a plain path is a [`SqliteStore`].
pub fn open(spec: &str) -> Result<Arc<dyn TaskStore>, StoreError> {
    if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        return Ok(Arc::new(PgStore::open(spec)?));
    }
    let path = spec.strip_prefix("sqlite://").unwrap_or(spec);
    Ok(Arc::new(SqliteStore::open(std::path::Path::new(path))?))
}

/// Why a store operation was refused or failed. `code()` is stable.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("illegal transition of task `{task}`: {from} -> {to}")]
    IllegalTransition { task: String, from: &'static str, to: &'static str },
    /// The attempt named is not the one holding the task (any more): another owner, a
    /// later attempt, an expired lease, or a task that ended.
    #[error("task `{task}` is not held by attempt {attempt} of `{owner}` (any more); stop working on it")]
    LeaseLost { task: String, attempt: i64, owner: String },
    #[error("idempotency key `{key}` was used before with another request; use a new key for a new request")]
    IdempotencyConflict { key: String },
    #[error("unknown task `{0}`")]
    UnknownTask(String),
    #[error("unknown run `{0}`")]
    UnknownRun(String),
    #[error("run `{0}` already exists")]
    RunExists(String),
    /// A row that must be unique was written twice (two writers racing to create it).
    #[error("the store refused a duplicate: {0}")]
    Duplicate(String),
    /// A row that does not decode: the store was damaged or edited; nothing is written.
    #[error("the store is corrupt: task `{task}` of run `{run}`: {what}")]
    Corrupt { run: String, task: String, what: String },
    /// The disk (or file system) holding the store is full; nothing of the failed write was kept.
    #[error("the disk is full: cannot write the store {path}; free some space and resume")]
    Full { path: String },
    #[error("the store failed: {0}")]
    Db(String),
    /// An ending asked to wait for the task's inbox found a message there: nothing of it was
    /// written, and the attempt's agent is to be told the message instead.
    #[error("a message waits for task `{task}`; send it to the agent before ending the attempt")]
    MessagesWaiting { task: String },
}

impl StoreError {
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode;
        match self {
            StoreError::IllegalTransition { .. } => ErrorCode::BadTransition,
            StoreError::LeaseLost { .. } => ErrorCode::LeaseLost,
            StoreError::IdempotencyConflict { .. } => ErrorCode::IdempotencyConflict,
            StoreError::UnknownTask(_) => ErrorCode::UnknownTask,
            StoreError::UnknownRun(_) => ErrorCode::UnknownRun,
            StoreError::RunExists(_) => ErrorCode::RunExists,
            StoreError::Duplicate(_) => ErrorCode::Duplicate,
            StoreError::Corrupt { .. } => ErrorCode::StoreCorrupt,
            StoreError::Full { .. } => ErrorCode::DiskFull,
            StoreError::Db(_) => ErrorCode::Store,
            StoreError::MessagesWaiting { .. } => ErrorCode::BadTransition,
        }
    }

    /// Whether the operation lost a race (another writer moved the task first): the caller
    /// re-reads and decides again; nothing is wrong with the store.
    pub fn is_race(&self) -> bool {
        matches!(self, StoreError::IllegalTransition { .. } | StoreError::LeaseLost { .. })
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What one of this process's group commits changed: every task with an event in
/// `(after, upto]`, as the commit left it (read in the commit's own transaction). A follower
/// current to `after` applies it and is current to `upto` without reading the store; one at
/// another point (another process committed in between) reads instead.
#[derive(Debug)]
pub struct OwnCommit {
    pub after: i64,
    pub upto: i64,
    pub tasks: Vec<TaskRow>,
    /// Every event of `(after, upto]`, in order: what a follower of the log would read.
    pub events: Vec<RawEvent>,
}

/// An event as its commit wrote it, its data still text: whoever takes it parses it, not the
/// committer.
#[derive(Debug, Clone)]
pub struct RawEvent {
    pub seq: i64,
    pub run: String,
    pub task: Option<String>,
    pub kind: String,
    pub at_ms: i64,
    pub data: String,
}

impl RawEvent {
    /// The event as a read of the log gives it: both stores' reads come through here.
    pub fn into_event(self) -> Event {
        let data = serde_json::from_str(&self.data).unwrap_or(Value::Null);
        Event { seq: self.seq, run: self.run, task: self.task, kind: self.kind, at_ms: self.at_ms, data }
    }
}

/// How many of its own commits a store keeps for a follower that has not taken them yet (a
/// commit's value is dropped once every follower has taken it, so this bounds only what a
/// stalled follower, such as a slow `/events` client, holds); one further behind reads the
/// store instead.
const OWN_COMMITS: usize = 256;

fn own_commits() -> broadcast::Sender<Arc<OwnCommit>> {
    broadcast::Sender::new(OWN_COMMITS)
}

/// This process's commits waiting in `own` that follow on from `at` (each starts where the one
/// before ended), in order, with `at` moved to the last one's end. The others are passed over:
/// what a commit holds that another process's commit came before (or that a follower fell too
/// far behind for) is read from the store, which the commit watch calls for.
pub fn own_following(own: &mut broadcast::Receiver<Arc<OwnCommit>>, at: &mut i64) -> Vec<Arc<OwnCommit>> {
    let mut taken = Vec::new();
    loop {
        match own.try_recv() {
            Ok(commit) if commit.after == *at => {
                *at = commit.upto;
                taken.push(commit);
            }
            Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
            Err(_) => return taken,
        }
    }
}

/// Makes a commit of this process up to `last` known: its [`OwnCommit`] first (if its rows
/// were read), then the watch, so a follower woken by the watch finds the commit waiting.
fn announce(
    own: &broadcast::Sender<Arc<OwnCommit>>,
    seq_tx: &watch::Sender<i64>,
    commit: Option<OwnCommit>,
    last: i64,
) {
    if let Some(commit) = commit {
        // No follower is not an error: the rows were read for one that has just gone.
        let _ = own.send(Arc::new(commit));
    }
    publish(seq_tx, last);
}

/// Publishes `seq` on a store's commit watch if it is newer than what was published.
fn publish(seq_tx: &watch::Sender<i64>, seq: i64) {
    seq_tx.send_if_modified(|s| {
        if seq > *s {
            *s = seq;
            true
        } else {
            false
        }
    });
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Where a follower of the log stands: the last event it read, and how far the log is read
/// through. Every event up to the sequence the commit watch shows is committed (both stores
/// number events in commit order), so a read that comes back short has seen all of them,
/// other runs' too: the follower reads again only when the watch moves past that, not once
/// more after every batch to find nothing.
#[derive(Debug, Clone, Copy)]
pub struct LogCursor {
    after: i64,
    read_to: i64,
    full: bool,
}

impl LogCursor {
    /// A follower that has read the events up to `after`.
    pub fn new(after: i64) -> LogCursor {
        LogCursor { after, read_to: after, full: true }
    }

    /// The last event read: the next read is of the events after it.
    pub fn after(&self) -> i64 {
        self.after
    }

    /// Whether a read can find anything, when the watch shows `seen`.
    pub fn due(&self, seen: i64) -> bool {
        self.full || seen > self.read_to
    }

    /// Takes this process's commits waiting in `own` that follow on from what has been read
    /// ([`own_following`]); none while a full batch is pending (the reads it calls for get
    /// them). The follower is then current to the last one's end.
    pub fn take_own(&mut self, own: &mut broadcast::Receiver<Arc<OwnCommit>>) -> Vec<Arc<OwnCommit>> {
        if self.full {
            // Taken out of the channel all the same, not held there for nothing.
            while !matches!(
                own.try_recv(),
                Err(broadcast::error::TryRecvError::Empty | broadcast::error::TryRecvError::Closed)
            ) {}
            return Vec::new();
        }
        let taken = own_following(own, &mut self.read_to);
        if !taken.is_empty() {
            self.after = self.read_to;
        }
        taken
    }

    /// Takes in a read of at most `limit` events, begun when the watch showed `seen`.
    pub fn read(&mut self, events: &[Event], limit: usize, seen: i64) {
        if let Some(last) = events.last() {
            self.after = last.seq;
            self.read_to = self.read_to.max(last.seq);
        }
        self.full = events.len() >= limit;
        if !self.full {
            self.read_to = self.read_to.max(seen);
        }
    }
}

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

/// One event of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub seq: i64,
    pub run: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub at_ms: i64,
    pub data: Value,
}

/// What the host itself writes to the event log (the agents' events are `ClientEvent`s,
/// recorded as they serialize). One type, so the log's shape is checked by the compiler:
/// `type` is the event's name, the other fields its data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LogEvent {
    RunCreated {
        tasks: usize,
        source: String,
    },
    TaskCreated {
        depends_on: Vec<String>,
        agent: String,
        metadata: std::collections::BTreeMap<String, Value>,
        to: TaskState,
    },
    Transition {
        from: TaskState,
        to: TaskState,
        attempt: i64,
        reason: String,
        /// The task's version after the move.
        version: i64,
        /// Who claimed the attempt (on `pending → running`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        class: Option<ErrorClass>,
        /// The side effects behind a decision that a person re-runs the task.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        evidence: Option<Vec<Value>>,
    },
    Question {
        attempt: i64,
        question: i64,
        request: Value,
    },
    Answer {
        attempt: i64,
        question: i64,
        option: String,
        by: String,
    },
    /// A person's message to a running task (`pier say`): queued for the next prompt, or
    /// (`interrupt`) sent at once after the current turn is cancelled.
    Message {
        n: i64,
        text: String,
        interrupt: bool,
        by: String,
    },
    /// A message went to the agent as a prompt of this attempt.
    MessageSent {
        n: i64,
        attempt: i64,
    },
}

impl LogEvent {
    /// The event's name and its data, as stored.
    pub fn split(&self) -> (String, Value) {
        let mut data = serde_json::to_value(self).unwrap_or(Value::Null);
        let kind = data.as_object_mut().and_then(|o| o.remove("type")).and_then(|t| t.as_str().map(str::to_owned));
        (kind.unwrap_or_default(), data)
    }
}

/// The token of a live attempt: attempt `n` of a task, held by `owner`. Only
/// [`TaskStore::claim`] makes one; every operation of the attempt is fenced on it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Attempt {
    pub run: String,
    pub task: String,
    pub n: i64,
    pub owner: String,
}

/// An attempt as another party saw it, with the lease expiry it saw: what
/// [`TaskStore::release_lost`] fences on, so a renewal in between wins.
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
}

/// What the end of an attempt does to its task. Made by [`crate::decide::decide`] (or a
/// person's or a worker's report); applied by [`TaskStore::finish`] and
/// [`TaskStore::release_lost`]. The lease is released whatever the ending.
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idem {
    key: String,
    request: String,
}

impl Idem {
    /// A pull worker's report on its attempt: the worker's own key, scoped to the attempt
    /// (so keys of different attempts never meet), with the report's body.
    pub fn worker_report(attempt: &Attempt, client_key: &str, body: &Value) -> Idem {
        Idem { key: format!("report:{}:{}:{client_key}", attempt.n, attempt.owner), request: body.to_string() }
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

/// One attempt of a task as stored: its side effects and what it showed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttemptRow {
    pub attempt: i64,
    pub evidence: Vec<Value>,
    /// Its text and tool calls, once it ended.
    pub output: Option<Value>,
}

impl AttemptRow {
    fn decode(attempt: i64, evidence: &str, output: Option<&str>) -> Result<AttemptRow, StoreError> {
        Ok(AttemptRow {
            attempt,
            evidence: serde_json::from_str(evidence)?,
            output: output.map(serde_json::from_str).transpose()?,
        })
    }
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
#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    pub attempt: i64,
    pub n: i64,
    pub request: Value,
}

/// What the host needs from a store. Every backend passes the conformance suite
/// (`tests/conformance.rs`), which is written against this trait only.
pub trait TaskStore: Send + Sync + 'static {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError>;
    fn run_exists(&self, run: &str) -> Result<bool, StoreError>;
    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError>;
    /// One task, or `None` if the run has no such task.
    fn task(&self, run: &str, task: &str) -> Result<Option<TaskRow>, StoreError>;
    /// Every pending task of every run, oldest run first, in plan order.
    fn pending_tasks(&self) -> Result<Vec<TaskRow>, StoreError>;
    /// Every task of every run that has not ended, oldest run first, in plan order.
    fn unfinished_tasks(&self) -> Result<Vec<TaskRow>, StoreError>;
    /// The tasks (of any run) touched by an event after sequence `after`, and the
    /// sequence they are current to (pass it back next time).
    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError>;

    /// Starts the next attempt of a pending task whose `not_before` has passed, for
    /// `owner`, with a lease until `lease_until_ms`. `None` if the task is not claimable
    /// (another claimer won, or it moved on): exactly one of many racing claimers wins.
    fn claim(
        &self,
        run: &str,
        task: &str,
        owner: &str,
        lease_until_ms: i64,
    ) -> Result<Option<(Attempt, TaskRow)>, StoreError>;
    /// Renews the lease; false if the attempt does not hold the task any more.
    fn heartbeat(&self, attempt: &Attempt, lease_until_ms: i64) -> Result<bool, StoreError>;
    /// Puts a question for a person on the task (`running → awaiting_input`) and returns its
    /// number within the attempt. The lease stays: the agent is alive and waiting.
    fn park(&self, attempt: &Attempt, request: &Value) -> Result<i64, StoreError>;
    /// `awaiting_input → running` once the question is answered; false if not held.
    fn resume(&self, attempt: &Attempt) -> Result<bool, StoreError>;
    /// Ends the attempt: the task moves as `ending` says, the lease is released and the
    /// attempt's unanswered questions are void. Refused (`lease_lost`) unless `attempt`
    /// holds the task with a live lease. With `idem`, a repeat gets the first answer.
    fn finish(&self, attempt: &Attempt, ending: &Ending, idem: Option<&Idem>) -> Result<TaskRow, StoreError>;
    /// Ends an attempt its holder lost (lease expired, host dead), if the task is still as
    /// `held` describes it (same attempt, owner and expiry); `None` if it moved on.
    fn release_lost(&self, held: &Held, ending: &Ending) -> Result<Option<TaskRow>, StoreError>;
    /// Appends an attempt's events to the log and its side effects to its evidence.
    fn record(&self, attempt: &Attempt, events: &[(String, Value)], evidence: &[Value]) -> Result<i64, StoreError>;

    /// Cancels a task that has not ended (a person's or a dependency's cancel); a running
    /// attempt finds out through its fence. `None` if it had ended already.
    fn cancel(&self, run: &str, task: &str, reason: &str) -> Result<Option<TaskRow>, StoreError>;
    /// A person's decision on a task that waits for one with no attempt alive: run it
    /// again (`pending`) or not (`cancelled`).
    fn decide_rerun(&self, run: &str, task: &str, again: bool, by: &str) -> Result<TaskRow, StoreError>;
    /// A person's retry of a failed or cancelled task, and with `dependents` of the cancelled
    /// tasks below it: back to `pending`, failures forgotten; the rows as they are now.
    fn retry(&self, run: &str, task: &str, dependents: bool, by: &str) -> Result<Vec<TaskRow>, StoreError>;
    /// Answers an open question; false if it was answered (or voided) already.
    fn answer(&self, run: &str, task: &str, question: &Question, option: &str, by: &str) -> Result<bool, StoreError>;
    /// The answer to a question, once there is one.
    fn answer_of(&self, attempt: &Attempt, n: i64) -> Result<Option<String>, StoreError>;
    /// The open question of a task, if any.
    fn open_question(&self, run: &str, task: &str) -> Result<Option<Question>, StoreError>;

    /// Appends events that belong to no attempt (notes, benchmarks).
    fn append_events(&self, events: &[(String, Option<String>, String, Value)]) -> Result<i64, StoreError>;
    fn evidence(&self, run: &str, task: &str, attempt: i64) -> Result<Vec<Value>, StoreError>;
    /// Keeps what an attempt showed (`pier_client::Partial`: its text and tool calls), when
    /// it ends, however it ends.
    fn keep_output(&self, attempt: &Attempt, output: &Value) -> Result<(), StoreError>;
    /// [`TaskStore::finish`] with what the attempt writes last ([`Last`]) in one write: its
    /// last events first, its output kept even when the ending is refused (as a race).
    fn finish_keeping(&self, attempt: &Attempt, last: &Last, ending: &Ending) -> Result<TaskRow, StoreError>;
    /// A task's attempts, oldest first.
    fn attempts(&self, run: &str, task: &str) -> Result<Vec<AttemptRow>, StoreError>;
    /// The attempt stopped waiting for its question `n` (withdrawn, or its turn cancelled):
    /// the question is void and the task runs again if it waits on nothing else. Fenced.
    fn withdraw(&self, attempt: &Attempt, question: i64) -> Result<(), StoreError>;
    /// Queues a person's message for a running task; its number, or `None` when the task is
    /// not running (nothing is queued).
    fn say(&self, run: &str, task: &str, text: &str, interrupt: bool, by: &str) -> Result<Option<i64>, StoreError>;
    /// The messages not sent yet, oldest first, taken by the attempt holding the task (they
    /// are marked sent by it); fenced on the attempt.
    fn take_messages(&self, attempt: &Attempt) -> Result<Vec<(i64, String)>, StoreError>;
    /// Whether a message asking to interrupt waits for the task.
    fn interrupt_waiting(&self, run: &str, task: &str) -> Result<bool, StoreError>;
    /// Keeps the `initialize` answer of a process of agent spec `spec` (the latest wins).
    fn record_agent(&self, spec: &str, init: &Value) -> Result<(), StoreError>;
    /// The last `initialize` answer recorded for `spec`.
    fn agent(&self, spec: &str) -> Result<Option<AgentRow>, StoreError>;
    /// Every agent spec's last `initialize` answer.
    fn agents(&self) -> Result<Vec<AgentRow>, StoreError>;
    fn events_after(&self, run: Option<&str>, after: i64, limit: usize) -> Result<Vec<Event>, StoreError>;
    /// Task `task`'s latest `last` events, oldest first (picked out in the database from its
    /// run's log, not read whole by the caller).
    fn task_events(&self, run: &str, task: &str, last: usize) -> Result<Vec<Event>, StoreError>;
    fn last_seq(&self) -> Result<i64, StoreError>;
    /// The runs that have a task with this id, newest first.
    fn runs_with_task(&self, task: &str) -> Result<Vec<String>, StoreError>;
    /// Every run id, oldest first.
    fn run_ids(&self) -> Result<Vec<String>, StoreError>;
    /// Every run with when it was created and when its last event was written, oldest
    /// first: `(id, created_at_ms, last_event_at_ms)`.
    fn run_times(&self) -> Result<Vec<(String, i64, i64)>, StoreError>;
    /// How many tasks of the whole store are in each state (for `/metrics`): one aggregate
    /// query, whatever the number of runs.
    fn task_counts(&self) -> Result<Vec<(String, i64)>, StoreError>;
    /// Renews node `node`'s presence and its run leases until `until_ms`, hands back runs
    /// beyond its fair share and takes free or expired ones up to it; the runs it drives.
    /// Exactly one live node holds a run's lease at a time.
    fn lease_runs(&self, node: &str, until_ms: i64) -> Result<Vec<String>, StoreError>;
    /// Node `node` drives run `run` alone (`pier run`): renews its presence and takes or
    /// renews that run's lease (never another node's live one); whether it holds it.
    fn lease_run(&self, node: &str, run: &str, until_ms: i64) -> Result<bool, StoreError>;
    /// Node `node` stops: its runs are handed back at once.
    fn release_runs(&self, node: &str) -> Result<(), StoreError>;
    /// The live nodes and the runs each drives.
    fn nodes(&self) -> Result<Vec<NodeRow>, StoreError>;
    /// The last committed event sequence, changed on every commit: this process's at once,
    /// other processes' (sharing the store) within the backend's watch interval.
    fn subscribe(&self) -> watch::Receiver<i64>;
    /// This process's own commits, each with the tasks it changed, in commit order: what a
    /// follower of [`TaskStore::subscribe`] would otherwise read back with
    /// [`TaskStore::tasks_changed`]. The rows are read (in the committing transaction) only
    /// while someone follows. A commit whose rows could not be read is not sent: the next
    /// one's `after` shows the gap.
    fn own_commits(&self) -> broadcast::Receiver<Arc<OwnCommit>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_again_only_past_what_a_short_read_saw() {
        let event = |seq| Event { seq, run: "r".into(), task: None, kind: "note".into(), at_ms: 0, data: Value::Null };
        let mut c = LogCursor::new(0);
        assert!(c.due(0), "a new follower reads once");
        c.read(&[event(1), event(2)], 2, 5);
        assert_eq!((c.after(), c.due(5)), (2, true), "a full batch reads on");
        c.read(&[event(3)], 2, 5);
        assert_eq!((c.after(), c.due(5), c.due(6)), (3, false, true), "a short read saw up to 5");
        c.read(&[], 2, 9);
        assert_eq!((c.after(), c.due(9), c.due(10)), (3, false, true), "other runs' events passed over");
        // This process's commits are taken while each starts where the cursor has read to.
        let tx = broadcast::Sender::new(8);
        let mut rx = tx.subscribe();
        let own = |after, upto| {
            let _ = tx.send(Arc::new(OwnCommit { after, upto, tasks: Vec::new(), events: Vec::new() }));
        };
        let follows = |c: &mut LogCursor, rx: &mut broadcast::Receiver<Arc<OwnCommit>>| !c.take_own(rx).is_empty();
        own(10, 12);
        assert!(!follows(&mut c, &mut rx), "another's commit came in between");
        own(9, 12);
        assert!(follows(&mut c, &mut rx));
        assert_eq!((c.after(), c.due(12), c.due(13)), (12, false, true));
        c.read(&[event(13), event(14)], 2, 20);
        own(12, 15);
        own(14, 15);
        assert!(!follows(&mut c, &mut rx), "not while a full batch is pending");
    }
}
