//! The durable store: runs, tasks, attempts, idempotent updates and the event log,
//! in SQLite (WAL, `synchronous = FULL`: a commit is on disk before it returns).
//!
//! Every write is atomic: its own savepoint inside a *group commit*. Writers queue
//! their work; whoever holds the write connection runs everything queued in one
//! transaction, commits once (one fsync for all of them) and only then hands each
//! writer its answer, so nothing is announced before it is on disk. Under load,
//! eight workers' updates cost one fsync instead of eight. Reads use a connection
//! of their own and see committed data only. A task update names the version it read
//! (optimistic concurrency) and carries an idempotency key: a replayed key gets
//! the first answer back and changes nothing. Events get their sequence number
//! from `INTEGER PRIMARY KEY` inside the writing transaction, so the log is
//! gap-free and strictly increasing in commit order.
//!
//! The [`TaskStore`] trait is all the scheduler and the server use (`Arc<dyn TaskStore>`); a PostgreSQL backend (claims
//! with `FOR UPDATE SKIP LOCKED`) can implement it without touching the scheduler.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc::TryRecvError;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::plan::{Plan, TaskSpec};
use crate::state::TaskState;

/// Why a store operation was refused or failed. `code()` is stable.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("version conflict on task `{task}`: the update read version {expected}, the task is at {actual}")]
    Conflict { task: String, expected: i64, actual: i64 },
    #[error("illegal transition of task `{task}`: {from} -> {to}")]
    IllegalTransition { task: String, from: &'static str, to: &'static str },
    #[error("unknown task `{0}`")]
    UnknownTask(String),
    #[error("unknown run `{0}`")]
    UnknownRun(String),
    #[error("run `{0}` already exists")]
    RunExists(String),
    /// A row that does not decode: the store was damaged or edited; nothing is written.
    #[error("the store is corrupt: task `{task}` of run `{run}`: {what}")]
    Corrupt { run: String, task: String, what: String },
    /// The disk (or file system) holding the store is full; nothing of the failed write was kept.
    #[error("the disk is full: cannot write the store {path}; free some space and resume")]
    Full { path: String },
    #[error("the store failed: {0}")]
    Db(String),
}

impl StoreError {
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::Conflict { .. } => "version_conflict",
            StoreError::IllegalTransition { .. } => "bad_transition",
            StoreError::UnknownTask(_) => "unknown_task",
            StoreError::UnknownRun(_) => "unknown_run",
            StoreError::RunExists(_) => "run_exists",
            StoreError::Corrupt { .. } => "store_corrupt",
            StoreError::Full { .. } => "disk_full",
            StoreError::Db(_) => "store",
        }
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Db(e.to_string())
    }
}

impl From<serde_json::Error> for StoreError {
    fn from(e: serde_json::Error) -> Self {
        StoreError::Db(format!("corrupt JSON in the store: {e}"))
    }
}

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
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

/// A requested state change.
#[derive(Debug, Clone, Default)]
pub struct Transition {
    pub run: String,
    pub task: String,
    pub expected_version: i64,
    pub to: Option<TaskState>,
    /// Unique per (task, attempt, update); a replay returns the first answer.
    pub key: String,
    pub reason: String,
    pub result: Option<String>,
    pub usage: Option<Value>,
    pub error: Option<String>,
    pub start_attempt: bool,
    pub count_failure: bool,
    pub lease: Option<(String, i64)>,
    /// Ends the attempt's hold on the task whatever the target state: the lease is
    /// cleared and the attempt's unanswered questions are void (its asker is gone).
    pub release_lease: bool,
    pub not_before_ms: Option<i64>,
    /// Extra fields for the transition event (evidence, outcome).
    pub data: Option<Value>,
}

/// What the scheduler needs from a store.
pub trait TaskStore: Send + Sync + 'static {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError>;
    fn run_exists(&self, run: &str) -> Result<bool, StoreError>;
    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError>;
    /// One task, or `None` if the run has no such task.
    fn task(&self, run: &str, task: &str) -> Result<Option<TaskRow>, StoreError>;
    /// Every pending task of every run, oldest run first, in plan order.
    fn pending_tasks(&self) -> Result<Vec<TaskRow>, StoreError>;
    /// The run's tasks touched by an event after sequence `after`, and the sequence
    /// they are current to (pass it back next time). How the scheduler stays current
    /// without reading every task on every pass.
    fn tasks_changed(&self, run: &str, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError>;
    fn transition(&self, t: &Transition) -> Result<TaskRow, StoreError>;
    /// Renews a lease if the task is still running this attempt for this owner (fencing).
    fn heartbeat(
        &self,
        run: &str,
        task: &str,
        attempt: i64,
        owner: &str,
        expires_at_ms: i64,
    ) -> Result<bool, StoreError>;
    fn append_events(&self, events: &[(String, Option<String>, String, Value)]) -> Result<i64, StoreError>;
    fn add_evidence(&self, run: &str, task: &str, attempt: i64, evidence: &Value) -> Result<(), StoreError>;
    fn evidence(&self, run: &str, task: &str, attempt: i64) -> Result<Vec<Value>, StoreError>;
    fn events_after(&self, run: Option<&str>, after: i64, limit: usize) -> Result<Vec<Event>, StoreError>;
    fn last_seq(&self) -> Result<i64, StoreError>;
    /// Records a question for a person; returns its number within the attempt.
    fn ask(&self, run: &str, task: &str, attempt: i64, request: &Value) -> Result<i64, StoreError>;
    /// The answer to a question, once there is one.
    fn answer_of(&self, run: &str, task: &str, attempt: i64, n: i64) -> Result<Option<String>, StoreError>;
    /// The open question of a task: (attempt, number, request).
    fn open_question(&self, run: &str, task: &str) -> Result<Option<(i64, i64, Value)>, StoreError>;
    /// Answers an open question; false if it was already answered.
    fn answer(&self, run: &str, task: &str, attempt: i64, n: i64, option: &str, by: &str) -> Result<bool, StoreError>;
    /// The runs that have a task with this id, newest first.
    fn runs_with_task(&self, task: &str) -> Result<Vec<String>, StoreError>;
    /// Every run id, oldest first.
    fn run_ids(&self) -> Result<Vec<String>, StoreError>;
    /// Changes whenever events are committed through this handle: the last sequence number.
    fn subscribe(&self) -> watch::Receiver<i64>;
}

/// The SQLite store.
pub struct SqliteStore {
    /// The write connection; whoever holds it commits the queued writes.
    conn: Mutex<Connection>,
    /// Writes waiting for the next group commit.
    queue: Mutex<Vec<Job>>,
    /// For reads, which never wait for a commit.
    reader: Mutex<Connection>,
    seq_tx: watch::Sender<i64>,
    /// The store's file, for messages.
    path: String,
}

/// A queued write: runs against the open transaction (or, given why there is none,
/// does not run) and returns the highest event sequence it wrote (0 for none) or
/// its error, and how to hand its answer over once the commit is known (`Err` if
/// the commit failed).
type Job = Box<dyn FnOnce(Result<&Connection, &StoreError>) -> (Result<i64, StoreError>, Finish) + Send>;
type Finish = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    plan TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE tasks (
    run_id TEXT NOT NULL REFERENCES runs(id),
    id TEXT NOT NULL,
    ord INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending','running','awaiting_input','completed','failed','cancelled')),
    version INTEGER NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_expires_at_ms INTEGER,
    not_before_ms INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    usage TEXT,
    error TEXT,
    spec TEXT NOT NULL,
    PRIMARY KEY (run_id, id)
);
CREATE TABLE attempts (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    evidence TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (run_id, task_id, attempt)
);
CREATE TABLE updates (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    key TEXT NOT NULL,
    answer TEXT NOT NULL,
    PRIMARY KEY (run_id, task_id, key)
);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    task_id TEXT,
    type TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX events_by_run ON events(run_id, seq);
"#,
    r#"
CREATE TABLE questions (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    n INTEGER NOT NULL,
    request TEXT NOT NULL,
    answer TEXT,
    answered_by TEXT,
    PRIMARY KEY (run_id, task_id, attempt, n)
);
"#,
    // Pending tasks across all runs, for handing worker tasks out without reading every run.
    r#"
CREATE INDEX tasks_pending ON tasks(run_id, ord) WHERE state = 'pending';
"#,
];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The columns [`row_to_task`] reads, in its order (by index: looking columns up
/// by name was a tenth of the host's time in the B5 profile).
const TASK_COLUMNS: &str = "run_id, id, state, version, attempt, failures, lease_owner, lease_expires_at_ms, \
                            not_before_ms, result, usage, error, spec";

/// A task row as read, before its JSON columns are decoded by [`decode`].
type RawTask = (TaskRow, String, Option<String>, String);

fn row_to_task(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawTask> {
    let state: String = r.get(2)?;
    let spec: String = r.get(12)?;
    let usage: Option<String> = r.get(10)?;
    Ok((
        TaskRow {
            run_id: r.get(0)?,
            id: r.get(1)?,
            state: TaskState::parse(&state).unwrap_or(TaskState::Failed),
            version: r.get(3)?,
            attempt: r.get(4)?,
            failures: r.get(5)?,
            lease_owner: r.get(6)?,
            lease_expires_at_ms: r.get(7)?,
            not_before_ms: r.get(8)?,
            result: r.get(9)?,
            usage: None,
            error: r.get(11)?,
            spec: TaskSpec {
                id: String::new(),
                prompt: String::new(),
                agent: String::new(),
                depends_on: vec![],
                cwd: None,
                timeout: None,
                max_time: None,
                max_attempts: 1,
                retry_on: vec![],
                idempotent: false,
                metadata: BTreeMap::new(),
                permissions: BTreeMap::new(),
                roots: vec![],
                writable: None,
                fresh_agent: false,
            },
        },
        spec,
        usage,
        state,
    ))
}

/// Decodes a row's JSON columns and state; a row that does not decode fails the
/// read with its run and task named, so nothing is written on top of it.
fn decode((mut row, spec, usage, state): RawTask) -> Result<TaskRow, StoreError> {
    let corrupt = |what: String| StoreError::Corrupt { run: row.run_id.clone(), task: row.id.clone(), what };
    row.spec = serde_json::from_str(&spec).map_err(|e| corrupt(format!("its spec is not a valid task ({e})")))?;
    row.usage = usage
        .map(|u| serde_json::from_str(&u))
        .transpose()
        .map_err(|e| corrupt(format!("its usage is not valid JSON ({e})")))?;
    row.state = TaskState::parse(&state).ok_or_else(|| corrupt(format!("unknown state `{state}`")))?;
    if row.spec.id != row.id {
        return Err(corrupt(format!("its spec names task `{}`", row.spec.id)));
    }
    Ok(row)
}

fn load_task(c: &Connection, run: &str, task: &str) -> Result<TaskRow, StoreError> {
    let found = c
        .prepare_cached(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE run_id = ?1 AND id = ?2"))?
        .query_row(params![run, task], row_to_task)
        .optional()?;
    decode(found.ok_or_else(|| StoreError::UnknownTask(task.to_owned()))?)
}

fn insert_event(c: &Connection, run: &str, task: Option<&str>, kind: &str, data: &Value) -> Result<i64, StoreError> {
    c.prepare_cached("INSERT INTO events (run_id, task_id, type, at_ms, data) VALUES (?1, ?2, ?3, ?4, ?5)")?
        .execute(params![run, task, kind, now_ms(), data.to_string()])?;
    Ok(c.last_insert_rowid())
}

fn collect_tasks(rows: impl Iterator<Item = rusqlite::Result<RawTask>>) -> Result<Vec<TaskRow>, StoreError> {
    rows.map(|r| decode(r?)).collect()
}

/// Runs `work` in a savepoint: kept if it succeeds, undone if it fails.
fn savepoint<T>(
    c: &Connection,
    work: impl FnOnce(&Connection) -> Result<(T, i64), StoreError>,
) -> Result<(T, i64), StoreError> {
    c.execute_batch("SAVEPOINT job")?;
    match work(c) {
        Ok(done) => {
            c.execute_batch("RELEASE job")?;
            Ok(done)
        }
        Err(e) => {
            let _ = c.execute_batch("ROLLBACK TO job; RELEASE job");
            Err(e)
        }
    }
}

impl SqliteStore {
    /// Opens (and migrates) the store at `path`.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_inner(path).map_err(|e| match e {
            StoreError::Db(m) if is_full(&m) => StoreError::Full { path: path.display().to_string() },
            e => e,
        })
    }

    fn open_inner(path: &Path) -> Result<SqliteStore, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Db(format!("{}: {e}", dir.display())))?;
        }
        let conn = Connection::open(path)?;
        // A store from a newer pier is refused before anything is written to it.
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version > MIGRATIONS.len() as i64 {
            return Err(StoreError::Db(format!(
                "{} was written by a newer pier (store version {version}; this pier knows versions up to {}); upgrade pier",
                path.display(),
                MIGRATIONS.len()
            )));
        }
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        // Statements are reused by every commit; the default cache of 16 is too small.
        conn.set_prepared_statement_cache_capacity(64);
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = conn.unchecked_transaction()?;
            tx.execute_batch(migration)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
            tx.commit()?;
        }
        let last: i64 = conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get(0))?;
        let (seq_tx, _) = watch::channel(last);
        let reader = Connection::open(path)?;
        reader.busy_timeout(std::time::Duration::from_secs(10))?;
        reader.set_prepared_statement_cache_capacity(64);
        Ok(SqliteStore {
            conn: Mutex::new(conn),
            queue: Mutex::new(Vec::new()),
            reader: Mutex::new(reader),
            seq_tx,
            path: path.display().to_string(),
        })
    }

    /// Runs `work` atomically in the next group commit and returns its answer once
    /// the commit is on disk. `work` returns its answer and the highest event
    /// sequence it wrote (0 for none); an error undoes only this work.
    fn write<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Connection) -> Result<(T, i64), StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<T, StoreError>>(1);
        let job: Job = Box::new(move |c: Result<&Connection, &StoreError>| {
            let outcome = match c {
                Ok(c) => savepoint(c, work),
                Err(e) => Err(e.clone()),
            };
            let seq = outcome.as_ref().map(|(_, seq)| *seq).map_err(Clone::clone);
            let finish: Finish = Box::new(move |committed: Result<(), StoreError>| {
                let _ = tx.send(committed.and(outcome.map(|(answer, _)| answer)));
            });
            (seq, finish)
        });
        lock(&self.queue).push(job);
        loop {
            // The previous committer may have taken this work: its answer is handed
            // over before the write connection is released.
            let conn = lock(&self.conn);
            match rx.try_recv() {
                Ok(answer) => return answer.map_err(|e| self.named(e)),
                // The committer that took this work died before answering (a panic):
                // say so rather than wait for an answer that will never come.
                Err(TryRecvError::Disconnected) => {
                    return Err(StoreError::Db("the store's committing thread failed before answering".into()));
                }
                Err(TryRecvError::Empty) => {}
            }
            let jobs = std::mem::take(&mut *lock(&self.queue));
            if jobs.is_empty() {
                continue;
            }
            self.commit(&conn, jobs);
            drop(conn);
            if let Ok(answer) = rx.try_recv() {
                return answer.map_err(|e| self.named(e));
            }
        }
    }

    /// A SQLite error as a store error: a full disk says so, with the store's path.
    fn named(&self, e: StoreError) -> StoreError {
        match e {
            StoreError::Db(m) if is_full(&m) => StoreError::Full { path: self.path.clone() },
            e => e,
        }
    }

    /// One group commit: every job in one transaction, one fsync, then the answers.
    ///
    /// SQLite may roll the whole transaction back on its own when a statement fails
    /// (a full disk, an I/O error): then the savepoint is gone, the jobs before it
    /// were undone too, and a later `SAVEPOINT` would silently open (and commit) a
    /// transaction of its own. So after each job the transaction is checked; once it
    /// is lost, no later job runs and every writer of the group hears the error.
    fn commit(&self, conn: &Connection, jobs: Vec<Job>) {
        let mut state: Result<(), StoreError> = conn.execute_batch("BEGIN IMMEDIATE").map_err(|e| self.named(e.into()));
        let mut finishes = Vec::with_capacity(jobs.len());
        let mut last = 0;
        for job in jobs {
            // Without a transaction nothing runs, and every writer hears why.
            let (outcome, finish) = job(state.as_ref().map(|()| conn));
            if state.is_ok() && conn.is_autocommit() {
                let why = outcome.as_ref().err().map_or_else(|| "no reason given".to_owned(), ToString::to_string);
                state = Err(self.named(StoreError::Db(format!("SQLite rolled the transaction back: {why}"))));
            }
            last = last.max(outcome.unwrap_or(0));
            finishes.push(finish);
        }
        let committed = state.and_then(|()| conn.execute_batch("COMMIT").map_err(|e| self.named(e.into())));
        if committed.is_err() && !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        for finish in finishes {
            finish(committed.clone());
        }
        if committed.is_ok() && last > 0 {
            self.published(last);
        }
    }

    fn published(&self, seq: i64) {
        self.seq_tx.send_if_modified(|s| {
            if seq > *s {
                *s = seq;
                true
            } else {
                false
            }
        });
    }
}

/// Whether a SQLite error message is a full disk (`SQLITE_FULL`, or `ENOSPC` under an I/O error).
fn is_full(message: &str) -> bool {
    message.contains("database or disk is full") || message.contains("No space left")
}

fn create_run(tx: &Connection, run: &str, plan: &Plan, source: &str) -> Result<i64, StoreError> {
    let exists: bool =
        tx.query_row("SELECT COUNT(*) FROM runs WHERE id = ?1", params![run], |r| r.get::<_, i64>(0))? > 0;
    if exists {
        return Err(StoreError::RunExists(run.to_owned()));
    }
    tx.execute(
        "INSERT INTO runs (id, source, plan, created_at_ms) VALUES (?1, ?2, ?3, ?4)",
        params![run, source, serde_json::to_string(plan)?, now_ms()],
    )?;
    let mut last = insert_event(tx, run, None, "run_created", &json!({"tasks": plan.tasks.len(), "source": source}))?;
    for (i, t) in plan.tasks.iter().enumerate() {
        tx.execute(
            "INSERT INTO tasks (run_id, id, ord, state, version, spec) VALUES (?1, ?2, ?3, 'pending', 1, ?4)",
            params![run, t.id, i as i64, serde_json::to_string(t)?],
        )?;
        last = insert_event(
            tx,
            run,
            Some(&t.id),
            "task_created",
            &json!({"depends_on": t.depends_on, "agent": t.agent, "metadata": t.metadata, "to": "pending"}),
        )?;
    }
    Ok(last)
}

fn transition(tx: &Connection, t: &Transition) -> Result<(TaskRow, i64), StoreError> {
    let replay: Option<String> = tx
        .query_row(
            "SELECT answer FROM updates WHERE run_id = ?1 AND task_id = ?2 AND key = ?3",
            params![t.run, t.task, t.key],
            |r| r.get(0),
        )
        .optional()?;
    if let Some(answer) = replay {
        return Ok((serde_json::from_str(&answer)?, 0));
    }
    let row = load_task(tx, &t.run, &t.task)?;
    if row.version != t.expected_version {
        return Err(StoreError::Conflict { task: t.task.clone(), expected: t.expected_version, actual: row.version });
    }
    let to = t.to.unwrap_or(row.state);
    if t.to.is_some() && !row.state.can_move_to(to) {
        return Err(StoreError::IllegalTransition { task: t.task.clone(), from: row.state.as_str(), to: to.as_str() });
    }
    let attempt = row.attempt + i64::from(t.start_attempt);
    let failures = row.failures + i64::from(t.count_failure);
    let (owner, expires) = match (&t.lease, to) {
        _ if t.release_lease => (None, None),
        (Some((o, e)), TaskState::Running) => (Some(o.clone()), Some(*e)),
        // A task waiting for a person keeps its lease: its agent is still alive.
        (_, TaskState::Running | TaskState::AwaitingInput) => (row.lease_owner.clone(), row.lease_expires_at_ms),
        _ => (None, None),
    };
    tx.execute(
        "UPDATE tasks SET state = ?3, version = version + 1, attempt = ?4, failures = ?5, lease_owner = ?6,
             lease_expires_at_ms = ?7, not_before_ms = ?8, result = COALESCE(?9, result),
             usage = COALESCE(?10, usage), error = ?11
         WHERE run_id = ?1 AND id = ?2",
        params![
            t.run,
            t.task,
            to.as_str(),
            attempt,
            failures,
            owner,
            expires,
            t.not_before_ms.unwrap_or(row.not_before_ms),
            t.result,
            t.usage.as_ref().map(Value::to_string),
            t.error,
        ],
    )?;
    if t.release_lease {
        tx.prepare_cached(
            "UPDATE questions SET answer = '', answered_by = 'void: the attempt was lost'
             WHERE run_id = ?1 AND task_id = ?2 AND answer IS NULL",
        )?
        .execute(params![t.run, t.task])?;
    }
    if t.start_attempt {
        tx.execute(
            "INSERT OR IGNORE INTO attempts (run_id, task_id, attempt) VALUES (?1, ?2, ?3)",
            params![t.run, t.task, attempt],
        )?;
    }
    let mut data = json!({"from": row.state.as_str(), "to": to.as_str(), "attempt": attempt, "reason": t.reason, "version": row.version + 1});
    if let (Some(extra), Some(obj)) = (&t.data, data.as_object_mut())
        && let Some(e) = extra.as_object()
    {
        obj.extend(e.clone());
    }
    if let Some(err) = &t.error {
        data["error"] = json!(err);
    }
    let seq = insert_event(tx, &t.run, Some(&t.task), "transition", &data)?;
    let new_row = load_task(tx, &t.run, &t.task)?;
    tx.execute(
        "INSERT INTO updates (run_id, task_id, key, answer) VALUES (?1, ?2, ?3, ?4)",
        params![t.run, t.task, t.key, serde_json::to_string(&new_row)?],
    )?;
    Ok((new_row, seq))
}

impl TaskStore for SqliteStore {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError> {
        let (run, plan, source) = (run.to_owned(), plan.clone(), source.to_owned());
        self.write(move |tx| create_run(tx, &run, &plan, &source).map(|seq| ((), seq)))
    }

    fn run_exists(&self, run: &str) -> Result<bool, StoreError> {
        let c = lock(&self.reader);
        Ok(c.query_row("SELECT COUNT(*) FROM runs WHERE id = ?1", params![run], |r| r.get::<_, i64>(0))? > 0)
    }

    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError> {
        let c = lock(&self.reader);
        let mut stmt = c.prepare_cached(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE run_id = ?1 ORDER BY ord"))?;
        let rows = stmt.query_map(params![run], row_to_task)?;
        collect_tasks(rows)
    }

    fn task(&self, run: &str, task: &str) -> Result<Option<TaskRow>, StoreError> {
        match load_task(&lock(&self.reader), run, task) {
            Ok(row) => Ok(Some(row)),
            Err(StoreError::UnknownTask(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn pending_tasks(&self) -> Result<Vec<TaskRow>, StoreError> {
        let c = lock(&self.reader);
        let columns = TASK_COLUMNS.split(", ").map(|c| format!("t.{}", c.trim())).collect::<Vec<_>>().join(", ");
        let mut stmt = c.prepare_cached(&format!(
            "SELECT {columns} FROM tasks t INDEXED BY tasks_pending JOIN runs r ON r.id = t.run_id
             WHERE t.state = 'pending' ORDER BY r.created_at_ms, r.id, t.ord"
        ))?;
        let rows = stmt.query_map([], row_to_task)?;
        collect_tasks(rows)
    }

    fn tasks_changed(&self, run: &str, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError> {
        let c = lock(&self.reader);
        // The bound is read first: a change that lands after it is reported again next time.
        let upto: i64 = c
            .prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id = ?1")?
            .query_row(params![run], |r| r.get(0))?;
        if upto <= after {
            return Ok((Vec::new(), after));
        }
        let mut stmt = c.prepare_cached(&format!(
            "SELECT {TASK_COLUMNS} FROM tasks WHERE run_id = ?1 AND id IN
                 (SELECT task_id FROM events WHERE run_id = ?1 AND seq > ?2 AND seq <= ?3 AND task_id IS NOT NULL)
             ORDER BY ord"
        ))?;
        let rows = stmt.query_map(params![run, after, upto], row_to_task)?;
        Ok((collect_tasks(rows)?, upto))
    }

    fn transition(&self, t: &Transition) -> Result<TaskRow, StoreError> {
        let t = t.clone();
        self.write(move |tx| transition(tx, &t))
    }

    fn heartbeat(
        &self,
        run: &str,
        task: &str,
        attempt: i64,
        owner: &str,
        expires_at_ms: i64,
    ) -> Result<bool, StoreError> {
        let (run, task, owner) = (run.to_owned(), task.to_owned(), owner.to_owned());
        self.write(move |c| {
            let n = c.prepare_cached(
                "UPDATE tasks SET lease_expires_at_ms = ?5
                 WHERE run_id = ?1 AND id = ?2 AND state IN ('running', 'awaiting_input') AND attempt = ?3 AND lease_owner = ?4",
            )?
            .execute(params![run, task, attempt, owner, expires_at_ms])?;
            Ok((n == 1, 0))
        })
    }

    fn append_events(&self, events: &[(String, Option<String>, String, Value)]) -> Result<i64, StoreError> {
        if events.is_empty() {
            return self.last_seq();
        }
        let events = events.to_vec();
        self.write(move |tx| {
            let mut last = 0;
            for (run, task, kind, data) in &events {
                last = insert_event(tx, run, task.as_deref(), kind, data)?;
            }
            Ok((last, last))
        })
    }

    fn add_evidence(&self, run: &str, task: &str, attempt: i64, evidence: &Value) -> Result<(), StoreError> {
        let (run, task, evidence) = (run.to_owned(), task.to_owned(), evidence.to_string());
        self.write(move |c| {
            c.prepare_cached(
                "UPDATE attempts SET evidence = json_insert(evidence, '$[#]', json(?4)) WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
            )?
            .execute(params![run, task, attempt, evidence])?;
            Ok(((), 0))
        })
    }

    fn evidence(&self, run: &str, task: &str, attempt: i64) -> Result<Vec<Value>, StoreError> {
        let c = lock(&self.reader);
        let text: Option<String> = c
            .query_row(
                "SELECT evidence FROM attempts WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
                params![run, task, attempt],
                |r| r.get(0),
            )
            .optional()?;
        Ok(text.map(|t| serde_json::from_str(&t)).transpose()?.unwrap_or_default())
    }

    fn events_after(&self, run: Option<&str>, after: i64, limit: usize) -> Result<Vec<Event>, StoreError> {
        let c = lock(&self.reader);
        let mut stmt = c.prepare_cached(
            "SELECT seq, run_id, task_id, type, at_ms, data FROM events
             WHERE seq > ?1 AND (?2 IS NULL OR run_id = ?2) ORDER BY seq LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![after, run, limit as i64], |r| {
            let data: String = r.get(5)?;
            Ok(Event {
                seq: r.get(0)?,
                run: r.get(1)?,
                task: r.get(2)?,
                kind: r.get(3)?,
                at_ms: r.get(4)?,
                data: serde_json::from_str(&data).unwrap_or(Value::Null),
            })
        })?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    fn last_seq(&self) -> Result<i64, StoreError> {
        let c = lock(&self.reader);
        Ok(c.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get(0))?)
    }

    fn ask(&self, run: &str, task: &str, attempt: i64, request: &Value) -> Result<i64, StoreError> {
        let (run, task, request) = (run.to_owned(), task.to_owned(), request.clone());
        self.write(move |tx| {
            let (run, task, request) = (run.as_str(), task.as_str(), &request);
            let n: i64 = tx.query_row(
                "SELECT COALESCE(MAX(n), 0) + 1 FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
                params![run, task, attempt],
                |r| r.get(0),
            )?;
            tx.execute(
                "INSERT INTO questions (run_id, task_id, attempt, n, request) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![run, task, attempt, n, request.to_string()],
            )?;
            let seq = insert_event(
                tx,
                run,
                Some(task),
                "question",
                &json!({"attempt": attempt, "question": n, "request": request}),
            )?;
            Ok((n, seq))
        })
    }

    fn answer_of(&self, run: &str, task: &str, attempt: i64, n: i64) -> Result<Option<String>, StoreError> {
        let c = lock(&self.reader);
        Ok(c.query_row(
            "SELECT answer FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4",
            params![run, task, attempt, n],
            |r| r.get::<_, Option<String>>(0),
        )
        .optional()?
        .flatten())
    }

    fn open_question(&self, run: &str, task: &str) -> Result<Option<(i64, i64, Value)>, StoreError> {
        let c = lock(&self.reader);
        let row: Option<(i64, i64, String)> = c
            .query_row(
                "SELECT attempt, n, request FROM questions WHERE run_id = ?1 AND task_id = ?2 AND answer IS NULL
                 ORDER BY attempt DESC, n DESC LIMIT 1",
                params![run, task],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        Ok(row.map(|(a, n, req)| (a, n, serde_json::from_str(&req).unwrap_or(Value::Null))))
    }

    fn answer(&self, run: &str, task: &str, attempt: i64, n: i64, option: &str, by: &str) -> Result<bool, StoreError> {
        let (run, task, option, by) = (run.to_owned(), task.to_owned(), option.to_owned(), by.to_owned());
        self.write(move |tx| {
            let (run, task, option, by) = (run.as_str(), task.as_str(), option.as_str(), by.as_str());
            let changed = tx.execute(
                "UPDATE questions SET answer = ?5, answered_by = ?6
             WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4 AND answer IS NULL",
                params![run, task, attempt, n, option, by],
            )?;
            let mut seq = 0;
            if changed == 1 {
                seq = insert_event(
                    tx,
                    run,
                    Some(task),
                    "answer",
                    &json!({"attempt": attempt, "question": n, "option": option, "by": by}),
                )?;
            }
            Ok((changed == 1, seq))
        })
    }

    fn subscribe(&self) -> watch::Receiver<i64> {
        self.seq_tx.subscribe()
    }

    fn run_ids(&self) -> Result<Vec<String>, StoreError> {
        let c = lock(&self.reader);
        let mut stmt = c.prepare("SELECT id FROM runs ORDER BY created_at_ms, id")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    fn runs_with_task(&self, task: &str) -> Result<Vec<String>, StoreError> {
        let c = lock(&self.reader);
        let mut stmt = c.prepare(
            "SELECT t.run_id FROM tasks t JOIN runs r ON r.id = t.run_id WHERE t.id = ?1 ORDER BY r.created_at_ms DESC",
        )?;
        let rows = stmt.query_map(params![task], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }
}
