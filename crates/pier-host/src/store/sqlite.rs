//! The SQLite backend (WAL, `synchronous = FULL`: a commit is on disk before it returns).
//!
//! Every write is atomic: its own savepoint inside a *group commit*. Writers queue
//! their work; whoever holds the write connection runs everything queued in one
//! transaction, commits once (one fsync for all of them) and only then hands each
//! writer its answer, so nothing is announced before it is on disk. Under load,
//! eight workers' updates cost one fsync instead of eight. Reads use a connection
//! of their own and see committed data only. Events get their sequence number
//! from `INTEGER PRIMARY KEY` inside the writing transaction, so the log is
//! gap-free and strictly increasing in commit order. The operations' SQL is in
//! [`super::ops`]; this file is the machinery around it.
//!
//! Commits of other processes sharing the file (a second `pier serve`, `pier approve`)
//! reach [`TaskStore::subscribe`] through a watcher thread that asks SQLite's
//! `PRAGMA data_version` (one read of a page header, no query of the data) every
//! [`WATCH_INTERVAL`]; this process's commits are published at once.

use std::path::Path;
use std::sync::mpsc::TryRecvError;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;
use tokio::sync::{broadcast, watch};

use super::ops::{self, Arg, RawTask, TASK_COLUMNS, Tx, decode_all, load_task, plain_row};
use super::{
    Attempt, Ending, Event, Held, Idem, OwnCommit, Question, RawEvent, StoreError, TaskRow, TaskStore, lock, publish,
};
use crate::plan::Plan;
use crate::state::TaskState;

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

/// The SQLite store.
pub struct SqliteStore {
    /// The write connection; whoever holds it commits the queued writes.
    conn: Mutex<Connection>,
    /// Writes waiting for the next group commit.
    queue: Mutex<Vec<Job>>,
    /// For reads, which never wait for a commit.
    reader: Mutex<Connection>,
    /// Shared with the watcher thread, which holds it weakly and ends with the store.
    seq_tx: Arc<watch::Sender<i64>>,
    /// This process's commits with the tasks they changed (`TaskStore::own_commits`).
    own: broadcast::Sender<Arc<OwnCommit>>,
    /// Whether the watcher of other processes' commits runs (started by the first subscriber).
    watching: std::sync::Once,
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
    // The body an idempotency key first came with (a repeat with another body is refused),
    // and the tasks a host drives.
    r#"
ALTER TABLE updates ADD COLUMN request TEXT;
CREATE INDEX tasks_unfinished ON tasks(run_id, ord) WHERE state IN ('pending', 'running', 'awaiting_input');
"#,
    // `pier serve` nodes and the runs each drives.
    r#"
CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    started_at_ms INTEGER NOT NULL,
    heartbeat_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL
);
CREATE TABLE run_leases (
    run_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at_ms INTEGER NOT NULL
);
CREATE INDEX run_leases_by_owner ON run_leases(owner);
"#,
    // What each attempt showed (its text, its tool calls), kept when it ends, whatever ended it.
    r#"
ALTER TABLE attempts ADD COLUMN output TEXT;
"#,
    // Each agent spec's last `initialize` answer: what it can do.
    r#"
CREATE TABLE agents (
    spec TEXT PRIMARY KEY,
    init TEXT NOT NULL,
    seen_at_ms INTEGER NOT NULL
);
"#,
    // People's messages to running tasks (`pier say`), and which attempt sent each.
    r#"
CREATE TABLE messages (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    text TEXT NOT NULL,
    interrupt INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    sent_attempt INTEGER,
    PRIMARY KEY (run_id, task_id, n)
);
CREATE TABLE messages_closed (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    PRIMARY KEY (run_id, task_id, attempt)
);
"#,
    // The inbox closes with the attempt's ending (`Last::unless_messages`), not with a row.
    "DROP TABLE messages_closed;",
];

/// How often the watcher asks SQLite whether another process committed.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// Runs `work` in a savepoint: kept if it succeeds, undone if it fails.
fn savepoint<T>(
    c: &Connection,
    work: impl FnOnce(&mut dyn Tx) -> Result<(T, i64), StoreError>,
) -> Result<(T, i64), StoreError> {
    c.execute_batch("SAVEPOINT job")?;
    match work(&mut SqliteTx(c)) {
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

/// Switches the file to WAL (a no-op once it is). Another connection switching it at the same
/// moment (processes opening a new store together) makes SQLite answer "database is locked"
/// at once, without the busy handler: the switch is tried again until the busy timeout's
/// worth of time has passed.
fn wal(conn: &Connection) -> Result<(), StoreError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match conn.pragma_update(None, "journal_mode", "WAL") {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if matches!(e.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            other => return Ok(other?),
        }
    }
}

/// Brings the schema up to date. Processes opening a new store at once (two `pier serve`
/// on one file, `pier run` beside `pier answer`) migrate one after another: the write lock
/// is taken first and the version read again under it, so each migration runs once.
fn migrate(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let migrated = (|| -> Result<(), StoreError> {
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
            conn.execute_batch(migration)?;
            conn.pragma_update(None, "user_version", (i + 1) as i64)?;
        }
        Ok(())
    })();
    match migrated {
        Ok(()) => Ok(conn.execute_batch("COMMIT")?),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
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
        wal(&conn)?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        if version < MIGRATIONS.len() as i64 {
            migrate(&conn)?;
        }
        let last: i64 = conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get(0))?;
        let seq_tx = Arc::new(watch::Sender::new(last));
        let reader = Connection::open(path)?;
        reader.busy_timeout(std::time::Duration::from_secs(10))?;
        reader.set_prepared_statement_cache_capacity(64);
        Ok(SqliteStore {
            conn: Mutex::new(conn),
            queue: Mutex::new(Vec::new()),
            reader: Mutex::new(reader),
            seq_tx,
            own: super::own_commits(),
            watching: std::sync::Once::new(),
            path: path.display().to_string(),
        })
    }

    /// Runs `work` atomically in the next group commit and returns its answer once
    /// the commit is on disk. `work` returns its answer and the highest event
    /// sequence it wrote (0 for none); an error undoes only this work.
    fn write<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send + 'static,
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
        // Where the log stood before the group, if anyone follows this store's own commits:
        // the transaction holds the file, so the group's events are exactly those after it.
        let before = if state.is_ok() && self.own.receiver_count() > 0 { last_seq(conn).ok() } else { None };
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
        // The tasks the group changed, as it left them; unread (the commit goes unsent, a gap
        // its followers fill by reading) if anything here fails.
        let own = match (before, &state) {
            (Some(after), Ok(())) => (|| {
                let upto = last_seq(conn)?;
                if upto <= after {
                    return Ok(OwnCommit { after, upto, tasks: Vec::new(), events: Vec::new() });
                }
                let (tasks, events) = (changed_between(conn, after, upto)?, events_between(conn, after, upto)?);
                Ok::<_, StoreError>(OwnCommit { after, upto, tasks, events })
            })()
            .ok()
            .filter(|c| c.upto > c.after),
            _ => None,
        };
        let committed = state.and_then(|()| conn.execute_batch("COMMIT").map_err(|e| self.named(e.into())));
        if committed.is_err() && !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        for finish in finishes {
            finish(committed.clone());
        }
        if committed.is_ok() {
            let last = last.max(own.as_ref().map_or(0, |c| c.upto));
            if last > 0 {
                super::announce(&self.own, &self.seq_tx, own, last);
            }
        }
    }

    /// Starts the thread that publishes other processes' commits. It has a connection of
    /// its own and ends when the store is dropped (it holds the sender weakly).
    fn watch_others(&self) {
        let Ok(conn) = Connection::open(&self.path) else {
            tracing::warn!(path = %self.path, "cannot watch the store for other processes' commits");
            return;
        };
        // The baseline is taken before `subscribe` returns, and what committed before it is
        // published now: a commit between the store's opening and the watcher thread's first
        // look would otherwise go unseen until the next one.
        let seen = data_version(&conn);
        if let Ok(last) = conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get::<_, i64>(0)) {
            publish(&self.seq_tx, last);
        }
        let seq_tx = Arc::downgrade(&self.seq_tx);
        let spawned =
            std::thread::Builder::new().name("pier-store-watch".into()).spawn(move || watch_loop(&conn, &seq_tx, seen));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot watch the store for other processes' commits");
        }
    }
}

fn last_seq(c: &Connection) -> Result<i64, StoreError> {
    Ok(c.prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM events")?.query_row([], |r| r.get(0))?)
}

/// The tasks with an event in `(after, upto]`, as they are now.
fn changed_between(c: &Connection, after: i64, upto: i64) -> Result<Vec<TaskRow>, StoreError> {
    let mut stmt = c.prepare_cached(&format!(
        "SELECT {TASK_COLUMNS} FROM tasks WHERE (run_id, id) IN
             (SELECT run_id, task_id FROM events WHERE seq > ?1 AND seq <= ?2 AND task_id IS NOT NULL)"
    ))?;
    let rows = stmt.query_map(params![after, upto], row_to_task)?;
    collect(rows)
}

/// An event row (`seq, run_id, task_id, type, at_ms, data`), its data as text.
fn row_to_raw_event(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawEvent> {
    Ok(RawEvent { seq: r.get(0)?, run: r.get(1)?, task: r.get(2)?, kind: r.get(3)?, at_ms: r.get(4)?, data: r.get(5)? })
}

fn row_to_event(r: &rusqlite::Row<'_>) -> rusqlite::Result<Event> {
    row_to_raw_event(r).map(RawEvent::into_event)
}

/// The events of `(after, upto]`, in order, their data as text.
fn events_between(c: &Connection, after: i64, upto: i64) -> Result<Vec<RawEvent>, StoreError> {
    let mut stmt = c.prepare_cached(
        "SELECT seq, run_id, task_id, type, at_ms, data FROM events WHERE seq > ?1 AND seq <= ?2 ORDER BY seq",
    )?;
    let rows = stmt.query_map(params![after, upto], row_to_raw_event)?;
    Ok(rows.collect::<Result<Vec<_>, _>>()?)
}

/// `data_version` changes when another connection commits to the file; only then is the
/// last sequence read and published.
fn watch_loop(conn: &Connection, seq_tx: &Weak<watch::Sender<i64>>, mut seen: Option<i64>) {
    loop {
        std::thread::sleep(WATCH_INTERVAL);
        let Some(tx) = seq_tx.upgrade() else { return };
        let now = data_version(conn);
        if now != seen {
            seen = now;
            if let Ok(last) = conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get::<_, i64>(0)) {
                publish(&tx, last);
            }
        }
    }
}

fn data_version(c: &Connection) -> Option<i64> {
    c.pragma_query_value(None, "data_version", |r| r.get::<_, i64>(0)).ok()
}

/// Whether a SQLite error message is a full disk (`SQLITE_FULL`, or `ENOSPC` under an I/O error).
fn is_full(message: &str) -> bool {
    message.contains("database or disk is full") || message.contains("No space left")
}

impl SqliteStore {
    fn read<T>(&self, f: impl FnOnce(&Connection) -> Result<T, StoreError>) -> Result<T, StoreError> {
        f(&lock(&self.reader))
    }

    /// The agents' answers, all or `spec`'s.
    fn agents_where(&self, spec: Option<&str>) -> Result<Vec<super::AgentRow>, StoreError> {
        let rows: Vec<(String, String, i64)> = self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT spec, init, seen_at_ms FROM agents WHERE ?1 IS NULL OR spec = ?1 ORDER BY spec",
            )?;
            let rows = stmt.query_map(params![spec], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })?;
        rows.into_iter()
            .map(|(spec, init, seen_at_ms)| {
                Ok(super::AgentRow { spec, init: serde_json::from_str(&init)?, seen_at_ms })
            })
            .collect()
    }
}

impl TaskStore for SqliteStore {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError> {
        let (run, plan, source) = (run.to_owned(), plan.clone(), source.to_owned());
        self.write(move |tx| ops::create_run(tx, &run, &plan, &source).map(|seq| ((), seq)))
    }

    fn run_exists(&self, run: &str) -> Result<bool, StoreError> {
        self.read(|c| {
            Ok(c.query_row("SELECT COUNT(*) FROM runs WHERE id = ?1", params![run], |r| r.get::<_, i64>(0))? > 0)
        })
    }

    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError> {
        self.read(|c| {
            let mut stmt =
                c.prepare_cached(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE run_id = ?1 ORDER BY ord"))?;
            let rows = stmt.query_map(params![run], row_to_task)?;
            collect(rows)
        })
    }

    fn task(&self, run: &str, task: &str) -> Result<Option<TaskRow>, StoreError> {
        match self.read(|c| load_task(&mut SqliteTx(c), run, task)) {
            Ok(row) => Ok(Some(row)),
            Err(StoreError::UnknownTask(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn pending_tasks(&self) -> Result<Vec<TaskRow>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(&format!(
                "SELECT {} FROM tasks t INDEXED BY tasks_pending JOIN runs r ON r.id = t.run_id
                 WHERE t.state = 'pending' ORDER BY r.created_at_ms, r.id, t.ord",
                qualified("t")
            ))?;
            let rows = stmt.query_map([], row_to_task)?;
            collect(rows)
        })
    }

    fn unfinished_tasks(&self) -> Result<Vec<TaskRow>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(&format!(
                "SELECT {} FROM tasks t INDEXED BY tasks_unfinished JOIN runs r ON r.id = t.run_id
                 WHERE t.state IN ('pending', 'running', 'awaiting_input') ORDER BY r.created_at_ms, r.id, t.ord",
                qualified("t")
            ))?;
            let rows = stmt.query_map([], row_to_task)?;
            collect(rows)
        })
    }

    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError> {
        self.read(|c| {
            // The bound is read first: a change that lands after it is reported again next time.
            let upto = last_seq(c)?;
            if upto <= after {
                return Ok((Vec::new(), after));
            }
            Ok((changed_between(c, after, upto)?, upto))
        })
    }

    fn claim(
        &self,
        run: &str,
        task: &str,
        owner: &str,
        lease_until_ms: i64,
    ) -> Result<Option<(Attempt, TaskRow)>, StoreError> {
        let (run, task, owner) = (run.to_owned(), task.to_owned(), owner.to_owned());
        self.write(move |tx| ops::claim(tx, &run, &task, &owner, lease_until_ms))
    }

    fn heartbeat(&self, attempt: &Attempt, lease_until_ms: i64) -> Result<bool, StoreError> {
        let a = attempt.clone();
        self.write(move |tx| ops::heartbeat(tx, &a, lease_until_ms))
    }

    fn park(&self, attempt: &Attempt, request: &Value) -> Result<i64, StoreError> {
        let (a, request) = (attempt.clone(), request.clone());
        self.write(move |tx| ops::park(tx, &a, &request))
    }

    fn resume(&self, attempt: &Attempt) -> Result<bool, StoreError> {
        let a = attempt.clone();
        self.write(move |tx| ops::resume(tx, &a))
    }

    fn finish(&self, attempt: &Attempt, ending: &Ending, idem: Option<&Idem>) -> Result<TaskRow, StoreError> {
        let (a, ending, idem) = (attempt.clone(), ending.clone(), idem.cloned());
        self.write(move |tx| ops::finish(tx, &a, &ending, idem.as_ref()))
    }

    fn release_lost(&self, held: &Held, ending: &Ending) -> Result<Option<TaskRow>, StoreError> {
        let (held, ending) = (held.clone(), ending.clone());
        self.write(move |tx| ops::release_lost(tx, &held, &ending))
    }

    fn record(&self, attempt: &Attempt, events: &[(String, Value)], evidence: &[Value]) -> Result<i64, StoreError> {
        let (a, events, evidence) = (attempt.clone(), events.to_vec(), evidence.to_vec());
        self.write(move |tx| ops::record(tx, &a, &events, &evidence))
    }

    fn cancel(&self, run: &str, task: &str, reason: &str) -> Result<Option<TaskRow>, StoreError> {
        let (run, task, reason) = (run.to_owned(), task.to_owned(), reason.to_owned());
        self.write(move |tx| ops::cancel(tx, &run, &task, &reason))
    }

    fn retry(&self, run: &str, task: &str, dependents: bool, by: &str) -> Result<Vec<TaskRow>, StoreError> {
        let (run, task, by) = (run.to_owned(), task.to_owned(), by.to_owned());
        self.write(move |tx| ops::retry(tx, &run, &task, dependents, &by))
    }

    fn decide_rerun(&self, run: &str, task: &str, again: bool, by: &str) -> Result<TaskRow, StoreError> {
        let (run, task, by) = (run.to_owned(), task.to_owned(), by.to_owned());
        self.write(move |tx| ops::decide_rerun(tx, &run, &task, again, &by))
    }

    fn answer(&self, run: &str, task: &str, question: &Question, option: &str, by: &str) -> Result<bool, StoreError> {
        let (run, task, q, option, by) =
            (run.to_owned(), task.to_owned(), question.clone(), option.to_owned(), by.to_owned());
        self.write(move |tx| ops::answer(tx, &run, &task, &q, &option, &by))
    }

    fn answer_of(&self, a: &Attempt, n: i64) -> Result<Option<String>, StoreError> {
        self.read(|c| {
            Ok(c.query_row(
                "SELECT answer FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4",
                params![a.run, a.task, a.n, n],
                |r| r.get::<_, Option<String>>(0),
            )
            .optional()?
            .flatten())
        })
    }

    fn open_question(&self, run: &str, task: &str) -> Result<Option<Question>, StoreError> {
        let row: Option<(i64, i64, String)> = self.read(|c| {
            Ok(c.query_row(
                "SELECT attempt, n, request FROM questions WHERE run_id = ?1 AND task_id = ?2 AND answer IS NULL
                 ORDER BY attempt DESC, n DESC LIMIT 1",
                params![run, task],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?)
        })?;
        Ok(row.map(|(attempt, n, req)| Question {
            attempt,
            n,
            request: serde_json::from_str(&req).unwrap_or(Value::Null),
        }))
    }

    fn append_events(&self, events: &[(String, Option<String>, String, Value)]) -> Result<i64, StoreError> {
        if events.is_empty() {
            return self.last_seq();
        }
        let events = events.to_vec();
        self.write(move |tx| ops::append_events(tx, &events))
    }

    fn finish_keeping(&self, attempt: &Attempt, last: &super::Last, ending: &Ending) -> Result<TaskRow, StoreError> {
        let (a, last, ending) = (attempt.clone(), last.clone(), ending.clone());
        self.write(move |tx| ops::finish_keeping(tx, &a, &last, &ending))?
    }

    fn keep_output(&self, attempt: &Attempt, output: &Value) -> Result<(), StoreError> {
        let (a, output) = (attempt.clone(), output.clone());
        self.write(move |tx| ops::keep_output(tx, &a, &output.to_string()))
    }

    fn attempts(&self, run: &str, task: &str) -> Result<Vec<super::AttemptRow>, StoreError> {
        let rows: Vec<(i64, String, Option<String>)> = self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT attempt, evidence, output FROM attempts WHERE run_id = ?1 AND task_id = ?2 ORDER BY attempt",
            )?;
            let rows = stmt.query_map(params![run, task], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })?;
        rows.into_iter()
            .map(|(n, evidence, output)| super::AttemptRow::decode(n, &evidence, output.as_deref()))
            .collect()
    }

    fn withdraw(&self, attempt: &Attempt, question: i64) -> Result<(), StoreError> {
        let a = attempt.clone();
        self.write(move |tx| ops::withdraw(tx, &a, question)).map(|_| ())
    }

    fn say(&self, run: &str, task: &str, text: &str, interrupt: bool, by: &str) -> Result<Option<i64>, StoreError> {
        let (run, task, text, by) = (run.to_owned(), task.to_owned(), text.to_owned(), by.to_owned());
        self.write(move |tx| ops::say(tx, &run, &task, &text, interrupt, &by))
    }

    fn take_messages(&self, attempt: &Attempt) -> Result<Vec<(i64, String)>, StoreError> {
        let a = attempt.clone();
        self.write(move |tx| ops::take_messages(tx, &a))
    }

    fn interrupt_waiting(&self, run: &str, task: &str) -> Result<bool, StoreError> {
        self.read(|c| {
            Ok(c.query_row(
                "SELECT EXISTS (SELECT 1 FROM messages WHERE run_id = ?1 AND task_id = ?2 AND sent_attempt IS NULL
                 AND interrupt = 1)",
                params![run, task],
                |r| r.get(0),
            )?)
        })
    }

    fn record_agent(&self, spec: &str, init: &Value) -> Result<(), StoreError> {
        let (spec, init) = (spec.to_owned(), init.clone());
        self.write(move |tx| ops::record_agent(tx, &spec, &init))
    }

    fn agent(&self, spec: &str) -> Result<Option<super::AgentRow>, StoreError> {
        Ok(self.agents_where(Some(spec))?.pop())
    }

    fn agents(&self) -> Result<Vec<super::AgentRow>, StoreError> {
        self.agents_where(None)
    }

    fn evidence(&self, run: &str, task: &str, attempt: i64) -> Result<Vec<Value>, StoreError> {
        let text: Option<String> = self.read(|c| {
            Ok(c.query_row(
                "SELECT evidence FROM attempts WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
                params![run, task, attempt],
                |r| r.get(0),
            )
            .optional()?)
        })?;
        Ok(text.map(|t| serde_json::from_str(&t)).transpose()?.unwrap_or_default())
    }

    fn events_after(&self, run: Option<&str>, after: i64, limit: usize) -> Result<Vec<Event>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT seq, run_id, task_id, type, at_ms, data FROM events
                 WHERE seq > ?1 AND (?2 IS NULL OR run_id = ?2) ORDER BY seq LIMIT ?3",
            )?;
            let rows = stmt.query_map(params![after, run, limit as i64], row_to_event)?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    fn task_events(&self, run: &str, task: &str, last: usize) -> Result<Vec<Event>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT seq, run_id, task_id, type, at_ms, data FROM events
                 WHERE run_id = ?1 AND task_id = ?2 ORDER BY seq DESC LIMIT ?3",
            )?;
            let rows = stmt.query_map(params![run, task, last as i64], row_to_event)?;
            let mut events = rows.collect::<Result<Vec<_>, _>>()?;
            events.reverse();
            Ok(events)
        })
    }

    fn last_seq(&self) -> Result<i64, StoreError> {
        self.read(last_seq)
    }

    fn lease_runs(&self, node: &str, until_ms: i64) -> Result<Vec<String>, StoreError> {
        let node = node.to_owned();
        self.write(move |tx| ops::lease_runs(tx, &node, until_ms))
    }

    fn lease_run(&self, node: &str, run: &str, until_ms: i64) -> Result<bool, StoreError> {
        let (node, run) = (node.to_owned(), run.to_owned());
        self.write(move |tx| ops::lease_run(tx, &node, &run, until_ms))
    }

    fn release_runs(&self, node: &str) -> Result<(), StoreError> {
        let node = node.to_owned();
        self.write(move |tx| ops::release_runs(tx, &node))
    }

    fn nodes(&self) -> Result<Vec<super::NodeRow>, StoreError> {
        let now = super::now_ms();
        let rows = self.read(|c| {
            let mut stmt = c.prepare_cached(ops::NODES)?;
            let rows = stmt.query_map([now], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))?;
            Ok(rows.collect::<Result<Vec<ops::NodeLease>, _>>()?)
        })?;
        Ok(ops::nodes(rows))
    }

    fn subscribe(&self) -> watch::Receiver<i64> {
        self.watching.call_once(|| self.watch_others());
        self.seq_tx.subscribe()
    }

    fn own_commits(&self) -> broadcast::Receiver<Arc<OwnCommit>> {
        self.own.subscribe()
    }

    fn run_ids(&self) -> Result<Vec<String>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached("SELECT id FROM runs ORDER BY created_at_ms, id")?;
            let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    fn run_times(&self) -> Result<Vec<(String, i64, i64)>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT r.id, r.created_at_ms, COALESCE((SELECT e.at_ms FROM events e WHERE e.run_id = r.id ORDER BY e.seq DESC LIMIT 1), r.created_at_ms) FROM runs r ORDER BY r.created_at_ms, r.id",
            )?;
            let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?)))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    fn task_counts(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached("SELECT state, COUNT(*) FROM tasks GROUP BY state ORDER BY state")?;
            let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    fn runs_with_task(&self, task: &str) -> Result<Vec<String>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT t.run_id FROM tasks t JOIN runs r ON r.id = t.run_id WHERE t.id = ?1
                 ORDER BY r.created_at_ms DESC",
            )?;
            let rows = stmt.query_map(params![task], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }
}

fn row_to_task(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawTask> {
    let row = plain_row(
        r.get(0)?,
        r.get(1)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        (r.get(6)?, r.get(7)?),
        r.get(8)?,
        r.get(9)?,
        r.get(11)?,
    );
    Ok((row, r.get(12)?, r.get(10)?, r.get(2)?))
}

fn collect(rows: impl Iterator<Item = rusqlite::Result<RawTask>>) -> Result<Vec<TaskRow>, StoreError> {
    decode_all(rows.collect::<Result<Vec<_>, _>>()?)
}

/// The open transaction of the write connection (or, for reads, the reader).
struct SqliteTx<'c>(&'c Connection);

impl rusqlite::ToSql for Arg<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        match self {
            Arg::Int(i) => i.to_sql(),
            Arg::OptInt(i) => i.to_sql(),
            Arg::Text(t) => t.to_sql(),
            Arg::OptText(t) => t.to_sql(),
        }
    }
}

impl Tx for SqliteTx<'_> {
    fn exec(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<u64, StoreError> {
        Ok(self.0.prepare_cached(sql)?.execute(rusqlite::params_from_iter(args))? as u64)
    }

    fn int(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Option<i64>, StoreError> {
        Ok(self.0.prepare_cached(sql)?.query_row(rusqlite::params_from_iter(args), |r| r.get(0)).optional()?)
    }

    fn texts(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Option<Vec<Option<String>>>, StoreError> {
        let mut stmt = self.0.prepare_cached(sql)?;
        let n = stmt.column_count();
        Ok(stmt.query_row(rusqlite::params_from_iter(args), |r| (0..n).map(|i| r.get(i)).collect()).optional()?)
    }

    fn task(&mut self, run: &str, task: &str) -> Result<Option<RawTask>, StoreError> {
        // SQLite has no row locks: the write transaction (BEGIN IMMEDIATE) holds the whole file.
        Ok(self
            .0
            .prepare_cached(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE run_id = ?1 AND id = ?2"))?
            .query_row(params![run, task], row_to_task)
            .optional()?)
    }

    fn take(
        &mut self,
        run: &str,
        task: &str,
        owner: &str,
        until: i64,
        now: i64,
    ) -> Result<Option<TaskRow>, StoreError> {
        // The transaction holds the file: nobody races the read and the update.
        ops::take_by_statements(self, run, task, owner, until, now)
    }

    fn end_held(
        &mut self,
        a: &Attempt,
        c: &ops::Columns,
        now: i64,
        b: ops::Beside<'_>,
    ) -> Result<Option<(TaskState, TaskRow)>, StoreError> {
        ops::end_held_by_statements(self, a, c, now, b)
    }

    fn event(&mut self, run: &str, task: Option<&str>, kind: &str, data: &Value) -> Result<i64, StoreError> {
        // `seq` is the INTEGER PRIMARY KEY: numbered in the writing transaction, which
        // holds the file, so gap-free and in commit order.
        self.0
            .prepare_cached("INSERT INTO events (run_id, task_id, type, at_ms, data) VALUES (?1, ?2, ?3, ?4, ?5)")?
            .execute(params![run, task, kind, super::now_ms(), data.to_string()])?;
        Ok(self.0.last_insert_rowid())
    }

    fn strings(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Vec<String>, StoreError> {
        let mut stmt = self.0.prepare_cached(sql)?;
        let rows = stmt.query_map(rusqlite::params_from_iter(args), |r| r.get(0))?;
        Ok(rows.collect::<Result<Vec<String>, _>>()?)
    }

    fn add_evidence(&mut self, a: &Attempt, effect: &Value) -> Result<(), StoreError> {
        self.0
            .prepare_cached(
                "UPDATE attempts SET evidence = json_insert(evidence, '$[#]', json(?4))
                 WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
            )?
            .execute(params![a.run, a.task, a.n, effect.to_string()])?;
        Ok(())
    }
}

/// [`TASK_COLUMNS`] qualified by a table alias.
fn qualified(alias: &str) -> String {
    TASK_COLUMNS.split(", ").map(|c| format!("{alias}.{}", c.trim())).collect::<Vec<_>>().join(", ")
}
