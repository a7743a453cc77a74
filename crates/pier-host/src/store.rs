//! The durable store: runs, tasks, attempts, idempotent updates and the event log,
//! in SQLite (WAL, `synchronous = FULL`: a commit is on disk before it returns).
//!
//! Every write is one transaction. A task update names the version it read
//! (optimistic concurrency) and carries an idempotency key: a replayed key gets
//! the first answer back and changes nothing. Events get their sequence number
//! from `INTEGER PRIMARY KEY` inside the writing transaction, so the log is
//! gap-free and strictly increasing in commit order.
//!
//! The [`TaskStore`] trait is all the scheduler and the server use (`Arc<dyn TaskStore>`); a PostgreSQL backend (claims
//! with `FOR UPDATE SKIP LOCKED`) can implement it without touching the scheduler.

use std::collections::BTreeMap;
use std::path::Path;
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
    pub not_before_ms: Option<i64>,
    /// Extra fields for the transition event (evidence, outcome).
    pub data: Option<Value>,
}

/// What the scheduler needs from a store.
pub trait TaskStore: Send + Sync + 'static {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError>;
    fn run_exists(&self, run: &str) -> Result<bool, StoreError>;
    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError>;
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
    conn: Mutex<Connection>,
    seq_tx: watch::Sender<i64>,
}

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
];

fn lock(m: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn row_to_task(r: &rusqlite::Row<'_>) -> rusqlite::Result<(TaskRow, String)> {
    let state: String = r.get("state")?;
    let spec: String = r.get("spec")?;
    let usage: Option<String> = r.get("usage")?;
    Ok((
        TaskRow {
            run_id: r.get("run_id")?,
            id: r.get("id")?,
            state: TaskState::parse(&state).unwrap_or(TaskState::Failed),
            version: r.get("version")?,
            attempt: r.get("attempt")?,
            failures: r.get("failures")?,
            lease_owner: r.get("lease_owner")?,
            lease_expires_at_ms: r.get("lease_expires_at_ms")?,
            not_before_ms: r.get("not_before_ms")?,
            result: r.get("result")?,
            usage: usage.and_then(|u| serde_json::from_str(&u).ok()),
            error: r.get("error")?,
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
            },
        },
        spec,
    ))
}

fn load_task(c: &Connection, run: &str, task: &str) -> Result<TaskRow, StoreError> {
    let found =
        c.query_row("SELECT * FROM tasks WHERE run_id = ?1 AND id = ?2", params![run, task], row_to_task).optional()?;
    let (mut row, spec) = found.ok_or_else(|| StoreError::UnknownTask(task.to_owned()))?;
    row.spec = serde_json::from_str(&spec)?;
    Ok(row)
}

fn insert_event(c: &Connection, run: &str, task: Option<&str>, kind: &str, data: &Value) -> Result<i64, StoreError> {
    c.execute(
        "INSERT INTO events (run_id, task_id, type, at_ms, data) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![run, task, kind, now_ms(), data.to_string()],
    )?;
    Ok(c.last_insert_rowid())
}

impl SqliteStore {
    /// Opens (and migrates) the store at `path`.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Db(format!("{}: {e}", dir.display())))?;
        }
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = conn.unchecked_transaction()?;
            tx.execute_batch(migration)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
            tx.commit()?;
        }
        let last: i64 = conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get(0))?;
        let (seq_tx, _) = watch::channel(last);
        Ok(SqliteStore { conn: Mutex::new(conn), seq_tx })
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

impl TaskStore for SqliteStore {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError> {
        let mut c = lock(&self.conn);
        let tx = c.transaction()?;
        let exists: bool =
            tx.query_row("SELECT COUNT(*) FROM runs WHERE id = ?1", params![run], |r| r.get::<_, i64>(0))? > 0;
        if exists {
            return Err(StoreError::RunExists(run.to_owned()));
        }
        tx.execute(
            "INSERT INTO runs (id, source, plan, created_at_ms) VALUES (?1, ?2, ?3, ?4)",
            params![run, source, serde_json::to_string(plan)?, now_ms()],
        )?;
        let mut last =
            insert_event(&tx, run, None, "run_created", &json!({"tasks": plan.tasks.len(), "source": source}))?;
        for (i, t) in plan.tasks.iter().enumerate() {
            tx.execute(
                "INSERT INTO tasks (run_id, id, ord, state, version, spec) VALUES (?1, ?2, ?3, 'pending', 1, ?4)",
                params![run, t.id, i as i64, serde_json::to_string(t)?],
            )?;
            last = insert_event(
                &tx,
                run,
                Some(&t.id),
                "task_created",
                &json!({"depends_on": t.depends_on, "agent": t.agent, "metadata": t.metadata, "to": "pending"}),
            )?;
        }
        tx.commit()?;
        drop(c);
        self.published(last);
        Ok(())
    }

    fn run_exists(&self, run: &str) -> Result<bool, StoreError> {
        let c = lock(&self.conn);
        Ok(c.query_row("SELECT COUNT(*) FROM runs WHERE id = ?1", params![run], |r| r.get::<_, i64>(0))? > 0)
    }

    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError> {
        let c = lock(&self.conn);
        let mut stmt = c.prepare("SELECT * FROM tasks WHERE run_id = ?1 ORDER BY ord")?;
        let rows = stmt.query_map(params![run], row_to_task)?;
        let mut out = Vec::new();
        for r in rows {
            let (mut row, spec) = r?;
            row.spec = serde_json::from_str(&spec)?;
            out.push(row);
        }
        Ok(out)
    }

    fn transition(&self, t: &Transition) -> Result<TaskRow, StoreError> {
        let mut c = lock(&self.conn);
        let tx = c.transaction()?;
        let replay: Option<String> = tx
            .query_row(
                "SELECT answer FROM updates WHERE run_id = ?1 AND task_id = ?2 AND key = ?3",
                params![t.run, t.task, t.key],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(answer) = replay {
            return Ok(serde_json::from_str(&answer)?);
        }
        let row = load_task(&tx, &t.run, &t.task)?;
        if row.version != t.expected_version {
            return Err(StoreError::Conflict {
                task: t.task.clone(),
                expected: t.expected_version,
                actual: row.version,
            });
        }
        let to = t.to.unwrap_or(row.state);
        if t.to.is_some() && !row.state.can_move_to(to) {
            return Err(StoreError::IllegalTransition {
                task: t.task.clone(),
                from: row.state.as_str(),
                to: to.as_str(),
            });
        }
        let attempt = row.attempt + i64::from(t.start_attempt);
        let failures = row.failures + i64::from(t.count_failure);
        let (owner, expires) = match (&t.lease, to) {
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
        let seq = insert_event(&tx, &t.run, Some(&t.task), "transition", &data)?;
        let new_row = load_task(&tx, &t.run, &t.task)?;
        tx.execute(
            "INSERT INTO updates (run_id, task_id, key, answer) VALUES (?1, ?2, ?3, ?4)",
            params![t.run, t.task, t.key, serde_json::to_string(&new_row)?],
        )?;
        tx.commit()?;
        drop(c);
        self.published(seq);
        Ok(new_row)
    }

    fn heartbeat(
        &self,
        run: &str,
        task: &str,
        attempt: i64,
        owner: &str,
        expires_at_ms: i64,
    ) -> Result<bool, StoreError> {
        let c = lock(&self.conn);
        let n = c.execute(
            "UPDATE tasks SET lease_expires_at_ms = ?5
             WHERE run_id = ?1 AND id = ?2 AND state IN ('running', 'awaiting_input') AND attempt = ?3 AND lease_owner = ?4",
            params![run, task, attempt, owner, expires_at_ms],
        )?;
        Ok(n == 1)
    }

    fn append_events(&self, events: &[(String, Option<String>, String, Value)]) -> Result<i64, StoreError> {
        if events.is_empty() {
            return self.last_seq();
        }
        let mut c = lock(&self.conn);
        let tx = c.transaction()?;
        let mut last = 0;
        for (run, task, kind, data) in events {
            last = insert_event(&tx, run, task.as_deref(), kind, data)?;
        }
        tx.commit()?;
        drop(c);
        self.published(last);
        Ok(last)
    }

    fn add_evidence(&self, run: &str, task: &str, attempt: i64, evidence: &Value) -> Result<(), StoreError> {
        let c = lock(&self.conn);
        c.execute(
            "UPDATE attempts SET evidence = json_insert(evidence, '$[#]', json(?4)) WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
            params![run, task, attempt, evidence.to_string()],
        )?;
        Ok(())
    }

    fn evidence(&self, run: &str, task: &str, attempt: i64) -> Result<Vec<Value>, StoreError> {
        let c = lock(&self.conn);
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
        let c = lock(&self.conn);
        let mut stmt = c.prepare(
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
        let c = lock(&self.conn);
        Ok(c.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get(0))?)
    }

    fn ask(&self, run: &str, task: &str, attempt: i64, request: &Value) -> Result<i64, StoreError> {
        let mut c = lock(&self.conn);
        let tx = c.transaction()?;
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
            &tx,
            run,
            Some(task),
            "question",
            &json!({"attempt": attempt, "question": n, "request": request}),
        )?;
        tx.commit()?;
        drop(c);
        self.published(seq);
        Ok(n)
    }

    fn answer_of(&self, run: &str, task: &str, attempt: i64, n: i64) -> Result<Option<String>, StoreError> {
        let c = lock(&self.conn);
        Ok(c.query_row(
            "SELECT answer FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4",
            params![run, task, attempt, n],
            |r| r.get::<_, Option<String>>(0),
        )
        .optional()?
        .flatten())
    }

    fn open_question(&self, run: &str, task: &str) -> Result<Option<(i64, i64, Value)>, StoreError> {
        let c = lock(&self.conn);
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
        let mut c = lock(&self.conn);
        let tx = c.transaction()?;
        let changed = tx.execute(
            "UPDATE questions SET answer = ?5, answered_by = ?6
             WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4 AND answer IS NULL",
            params![run, task, attempt, n, option, by],
        )?;
        let mut seq = 0;
        if changed == 1 {
            seq = insert_event(
                &tx,
                run,
                Some(task),
                "answer",
                &json!({"attempt": attempt, "question": n, "option": option, "by": by}),
            )?;
        }
        tx.commit()?;
        drop(c);
        if seq > 0 {
            self.published(seq);
        }
        Ok(changed == 1)
    }

    fn subscribe(&self) -> watch::Receiver<i64> {
        self.seq_tx.subscribe()
    }

    fn run_ids(&self) -> Result<Vec<String>, StoreError> {
        let c = lock(&self.conn);
        let mut stmt = c.prepare("SELECT id FROM runs ORDER BY created_at_ms, id")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    fn runs_with_task(&self, task: &str) -> Result<Vec<String>, StoreError> {
        let c = lock(&self.conn);
        let mut stmt = c.prepare(
            "SELECT t.run_id FROM tasks t JOIN runs r ON r.id = t.run_id WHERE t.id = ?1 ORDER BY r.created_at_ms DESC",
        )?;
        let rows = stmt.query_map(params![task], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }
}
