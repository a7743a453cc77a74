//! The PostgreSQL backend: several hosts (`pier serve` nodes) over one database.
//!
//! The operations are [`super::ops`], run by the committer in group transactions (READ
//! COMMITTED; see `run_group`), those of different tasks side by side ([`super::pg_rounds`]). Row locks do what SQLite's single writer does: [`Tx::task`]
//! reads a task `FOR UPDATE`, and a claim (one statement, `CLAIM`) locks it `FOR UPDATE SKIP
//! LOCKED`, so of racing claimers one wins and the others skip the row at once.
//!
//! The event log keeps SQLite's promise: one gap-free sequence across the store, in commit
//! order. PostgreSQL sequences are neither, so events are buffered while the operation
//! runs and numbered at its end from a single counter row (`pier_seq`), incremented in the
//! same transaction just before `COMMIT`: the counter's row lock orders commits, and a
//! reader that saw `seq N` committed has seen every event up to `N`. The lock is held only
//! for the group's last statement and the commit's WAL flush.
//!
//! Wake-ups: commits that wrote events ring `NOTIFY pier_commits`, at most every
//! [`RING_EVERY`] (a commit in between owes a ring, sent when due: see `Doorbell`); a listener
//! re-reads the counter on each notification and on a slow timer ([`WATCH_INTERVAL`]),
//! because notifications sent while it reconnects are lost.
//!
//! Threads: `TaskStore` is synchronous and is called from blocking threads and from async
//! code alike. Reads use connections driven by a runtime the store owns; a read waits with
//! `futures::executor::block_on`, which works in any context (a synchronous client that
//! starts a runtime of its own per call would panic inside another runtime). Writes go to
//! the store's committer thread, which owns the write connection on a current-thread
//! runtime of its own and drives it while it waits: a statement costs one round trip to
//! the server and no thread hop, and a caller crosses threads twice per operation, not
//! twice per statement (measured: the hops, not the server, were most of a write's time).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{broadcast, watch};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};

use rounds::{Answer, Owned, Replay, Rounds, Want, no_answer};
use target::{Target, tls_advice};

use crate::backend::{Backend, Cell, Query, Row};
use crate::log::{OwnCommit, RawEvent, announce, publish};
use crate::ops::{self, Arg, RawTask, Tx};
use crate::state::TaskState;
use crate::store::Store;
use crate::{Attempt, PgStore, StoreError, TaskRow, lock, task_columns};

mod rounds;
mod target;

pub use target::redacted;

/// How often the listener re-reads the counter when no notification came.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(2);
/// Connections one store opens at most; callers beyond it wait for one to come back.
const MAX_CONNECTIONS: usize = 16;
// One write connection per store, on the committer thread: measured on B5, four writers
// were slower (115 vs 172 tasks/s): smaller groups, more WAL flushes, and the counter row
// serialises their commits anyway.

thread_local! {
    /// The committer thread's runtime, which drives its connection; none elsewhere.
    static LOCAL: std::cell::RefCell<Option<tokio::runtime::Runtime>> = const { std::cell::RefCell::new(None) };
}

/// Waits for `f`: on the committer thread by driving its own runtime (and with it the
/// connection), elsewhere by parking until the store's runtime has done the work.
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    LOCAL.with(|l| match l.borrow().as_ref() {
        Some(rt) => rt.block_on(f),
        None => futures::executor::block_on(f),
    })
}
/// How long an operation waits for the database to come back before it fails.
const PATIENCE: Duration = Duration::from_secs(60);
/// Transactions retried at most after a serialization failure, a deadlock or a lost connection.
const RETRIES: u32 = 8;

const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    plan TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE tasks (
    run_id TEXT NOT NULL REFERENCES runs(id),
    id TEXT NOT NULL,
    ord BIGINT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending','running','awaiting_input','completed','failed','cancelled')),
    version BIGINT NOT NULL,
    attempt BIGINT NOT NULL DEFAULT 0,
    failures BIGINT NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_expires_at_ms BIGINT,
    not_before_ms BIGINT NOT NULL DEFAULT 0,
    result TEXT,
    usage TEXT,
    error TEXT,
    spec TEXT NOT NULL,
    PRIMARY KEY (run_id, id)
);
CREATE INDEX tasks_pending ON tasks(run_id, ord) WHERE state = 'pending';
CREATE INDEX tasks_unfinished ON tasks(run_id, ord) WHERE state IN ('pending', 'running', 'awaiting_input');
CREATE TABLE attempts (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    evidence TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (run_id, task_id, attempt)
);
CREATE TABLE updates (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    key TEXT NOT NULL,
    answer TEXT NOT NULL,
    request TEXT,
    PRIMARY KEY (run_id, task_id, key)
);
CREATE TABLE questions (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    n BIGINT NOT NULL,
    request TEXT NOT NULL,
    answer TEXT,
    answered_by TEXT,
    PRIMARY KEY (run_id, task_id, attempt, n)
);
CREATE TABLE events (
    seq BIGINT PRIMARY KEY,
    run_id TEXT NOT NULL,
    task_id TEXT,
    type TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX events_by_run ON events(run_id, seq);
CREATE TABLE pier_seq (id INT PRIMARY KEY CHECK (id = 1), n BIGINT NOT NULL);
INSERT INTO pier_seq VALUES (1, 0);
"#,
    // `pier serve` nodes and the runs each drives.
    r#"
CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    started_at_ms BIGINT NOT NULL,
    heartbeat_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL
);
CREATE TABLE run_leases (
    run_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at_ms BIGINT NOT NULL
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
    seen_at_ms BIGINT NOT NULL
);
"#,
    // People's messages to running tasks (`pier say`), and which attempt sent each.
    r#"
CREATE TABLE messages (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    n BIGINT NOT NULL,
    text TEXT NOT NULL,
    interrupt BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    sent_attempt BIGINT,
    PRIMARY KEY (run_id, task_id, n)
);
CREATE TABLE messages_closed (
    run_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt BIGINT NOT NULL,
    PRIMARY KEY (run_id, task_id, attempt)
);
"#,
    // The inbox closes with the attempt's ending (`Last::unless_messages`), not with a row.
    "DROP TABLE messages_closed;",
];

/// Any lock key of ours: migrations run under it, once, however many nodes start together.
const MIGRATION_LOCK: i64 = 0x0070_6965_726d_6967; // "piermig"

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
            return StoreError::Duplicate(describe(&e));
        }
        StoreError::Db(describe(&e))
    }
}

fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("PostgreSQL: {} ({})", db.message(), db.code().code()),
        None => {
            // The cause is in the chain ("error performing TLS handshake" alone says little).
            let mut text = format!("PostgreSQL: {e}");
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                text.push_str(&format!(": {c}"));
                cause = c.source();
            }
            text
        }
    }
}

/// Whether the transaction that met `e` was rolled back and may simply run again.
fn retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    if e.is_closed() {
        return true;
    }
    e.code().is_some_and(|c| {
        [
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
        ]
        .contains(c)
    }) || e.as_db_error().is_none() && e.to_string().contains("connection")
}

/// A pooled connection and its prepared statements.
struct Conn {
    client: Client,
    statements: HashMap<&'static str, Statement>,
    /// A read on it failed in a way that another try on a fresh connection may not.
    broken: bool,
}

struct Pool {
    target: Target,
    /// The store's runtime, which drives the connections.
    rt: tokio::runtime::Handle,
    idle: Mutex<(Vec<Conn>, usize)>,
    returned: Condvar,
    /// When the current outage began, if the database is unreachable (one log line each way).
    outage: Mutex<Option<Instant>>,
}

impl Pool {
    fn connect(&self) -> Result<Conn, StoreError> {
        let deadline = Instant::now() + PATIENCE;
        let mut delay = Duration::from_millis(50);
        loop {
            match connect_on(&self.rt, &self.target) {
                Ok(client) => {
                    if let Some(since) = lock(&self.outage).take() {
                        tracing::warn!(after = ?since.elapsed(), "the database is back");
                    }
                    return Ok(Conn { client, statements: HashMap::new(), broken: false });
                }
                Err(e) if e.permanent => return Err(StoreError::Db(e.text)),
                Err(ConnectError { text: e, .. }) => {
                    {
                        let mut outage = lock(&self.outage);
                        if outage.is_none() {
                            *outage = Some(Instant::now());
                            tracing::warn!(error = %e, "cannot reach the database; retrying with backoff");
                        }
                    }
                    if Instant::now() + delay > deadline {
                        return Err(StoreError::Db(format!(
                            "the database has been unreachable for {}s: {}; check that PostgreSQL runs and the \
                             store URL is right",
                            PATIENCE.as_secs(),
                            e
                        )));
                    }
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    fn get(&self) -> Result<Conn, StoreError> {
        {
            let mut idle = lock(&self.idle);
            loop {
                if let Some(c) = idle.0.pop() {
                    if !c.client.is_closed() {
                        return Ok(c);
                    }
                    idle.1 -= 1;
                    continue;
                }
                if idle.1 < MAX_CONNECTIONS {
                    idle.1 += 1;
                    break;
                }
                idle = self.returned.wait(idle).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
        self.connect().inspect_err(|_| {
            lock(&self.idle).1 -= 1;
            self.returned.notify_one();
        })
    }

    fn put(&self, c: Conn) {
        let mut idle = lock(&self.idle);
        if c.client.is_closed() {
            idle.1 -= 1;
        } else {
            idle.0.push(c);
        }
        self.returned.notify_one();
    }

    /// Runs `f` on a pooled connection, once more on a fresh one if the connection broke.
    fn with<T>(&self, f: impl Fn(&mut Conn) -> Result<T, tokio_postgres::Error>) -> Result<T, StoreError> {
        let mut tries = 0;
        loop {
            let mut c = self.get()?;
            let out = f(&mut c);
            self.put(c);
            match out {
                Err(e) if retryable(&e) && tries < RETRIES => tries += 1,
                out => return out.map_err(StoreError::from),
            }
        }
    }
}

/// Why a connection could not be made, and whether trying again could help: not when the
/// server refused who we are (authentication, `pg_hba.conf`), the database does not exist,
/// or TLS cannot be had or trusted.
struct ConnectError {
    text: String,
    permanent: bool,
}

impl ConnectError {
    fn of(e: &tokio_postgres::Error) -> ConnectError {
        let text = describe(e);
        let refused = e.as_db_error().is_some_and(|db| {
            let code = db.code().code();
            code.starts_with("28") || code == "3D000"
        });
        match tls_advice(&text) {
            Some(advice) => ConnectError { permanent: true, text: format!("{text}; {advice}") },
            None => ConnectError { permanent: refused, text },
        }
    }
}

/// Connects on the store's runtime, which then drives the connection until it closes.
fn connect_on(rt: &tokio::runtime::Handle, target: &Target) -> Result<Client, ConnectError> {
    // Connects, and leaves the connection to the runtime this runs on.
    async fn connect(Target { config, tls }: Target) -> Result<Client, ConnectError> {
        let (client, connection) = config.connect(tls).await.map_err(|e| ConnectError::of(&e))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "a database connection ended");
            }
        });
        Ok(client)
    }
    // The committer thread's connection is driven by its own runtime, while it waits.
    let here = LOCAL.with(|l| l.borrow().as_ref().map(|local| local.block_on(connect(target.clone()))));
    if let Some(connected) = here {
        return connected;
    }
    let connected = rt.spawn(connect(target.clone()));
    // A join error: the runtime is shutting down with the store.
    block_on(connected)
        .unwrap_or_else(|e| Err(ConnectError { text: format!("the database runtime stopped: {e}"), permanent: true }))
}

/// `?N` placeholders as PostgreSQL's `$N`.
fn dialect(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    out
}

impl Conn {
    fn statement(&mut self, sql: &'static str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = block_on(self.client.prepare(&dialect(sql)))?;
        self.statements.insert(sql, s.clone());
        Ok(s)
    }
}

impl ToSql for Arg<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut tokio_postgres::types::private::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Arg::Int(i) => i.to_sql(ty, out),
            Arg::OptInt(i) => i.to_sql(ty, out),
            Arg::Text(t) => t.to_sql(ty, out),
            Arg::OptText(t) => t.to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        <i64 as ToSql>::accepts(ty) || <&str as ToSql>::accepts(ty)
    }

    tokio_postgres::types::to_sql_checked!();
}

fn args<'a>(a: &'a [Arg<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
    a.iter().map(|x| x as &(dyn ToSql + Sync)).collect()
}

/// A row as cells, each column by its type: integers, booleans (as 0 or 1) and text.
fn cells(r: &tokio_postgres::Row) -> Result<Row, tokio_postgres::Error> {
    let mut out = Vec::with_capacity(r.len());
    for (i, column) in r.columns().iter().enumerate() {
        let ty = column.type_();
        let cell = if *ty == Type::INT8 {
            r.try_get::<_, Option<i64>>(i)?.map_or(Cell::Null, Cell::Int)
        } else if *ty == Type::INT4 {
            r.try_get::<_, Option<i32>>(i)?.map_or(Cell::Null, |n| Cell::Int(n.into()))
        } else if *ty == Type::INT2 {
            r.try_get::<_, Option<i16>>(i)?.map_or(Cell::Null, |n| Cell::Int(n.into()))
        } else if *ty == Type::BOOL {
            r.try_get::<_, Option<bool>>(i)?.map_or(Cell::Null, |b| Cell::Int(b.into()))
        } else {
            r.try_get::<_, Option<String>>(i)?.map_or(Cell::Null, Cell::Text)
        };
        out.push(cell);
    }
    Ok(Row(out))
}

/// An event written by the open transaction, numbered at its commit.
pub(crate) struct Pending {
    run: String,
    task: Option<String>,
    kind: String,
    at_ms: i64,
    data: String,
}

/// The open transaction: statements go through the connection's cache; events wait for the commit.
pub(crate) struct PgTx<'c> {
    /// In a transaction this code opened (`BEGIN`) and ends (`COMMIT`, or by dropping the
    /// connection): no `Transaction` guard, so both ride with other statements.
    pub(crate) tx: &'c Client,
    statements: &'c mut HashMap<&'static str, Statement>,
    pub(crate) events: Vec<Pending>,
    /// The last statement failed in a way that rolled the transaction back: run it again.
    pub(crate) retry: bool,
    /// How the last job that ran statements ends its savepoint (`RELEASE job; SAVEPOINT job`
    /// or `ROLLBACK TO job`), not yet sent: it rides in the pipeline of the next statement,
    /// so closing a job costs no round trip of its own.
    pub(crate) step: Option<&'static str>,
    /// The current job has run a statement (so its savepoint holds work to keep or undo).
    dirty: bool,
    /// Sending `step` failed: the transaction is gone, and the group with it.
    broken: Option<tokio_postgres::Error>,
    /// Each job in a savepoint of its own. Without (the usual way, see `run_group`), a failed
    /// job that changed something sends the whole group back to be run this way.
    careful: bool,
    /// The current job ran a statement other than a read of a task (which only locks).
    pub(crate) wrote: bool,
    /// A statement failed: PostgreSQL aborted the transaction (or the savepoint).
    pub(crate) aborted: bool,
    /// In rounds (`pg_rounds`): the current job's answers so far, and where it stops.
    replay: Option<Replay>,
}

/// Opens a group's transaction; `BEGIN_CAREFUL` with the first job's savepoint.
const BEGIN: &str = "BEGIN";
const BEGIN_CAREFUL: &str = "BEGIN; SAVEPOINT job";
/// Keeps a job's work and opens the next job's savepoint.
const KEEP: &str = "RELEASE job; SAVEPOINT job";
/// Undoes a job's work; the savepoint stays for the next job.
const UNDO: &str = "ROLLBACK TO job";

impl PgTx<'_> {
    /// A group's transaction on `c`. `BEGIN`, and the step that ends each job's savepoint,
    /// ride ahead of the next statement (`PgTx::pipelined`): no round trip of their own. A
    /// group that fails before its `COMMIT` is abandoned with its connection (the caller
    /// drops it), which rolls it back.
    fn begin(c: &mut Conn, careful: bool) -> PgTx<'_> {
        PgTx {
            tx: &c.client,
            statements: &mut c.statements,
            events: Vec::new(),
            retry: false,
            step: Some(if careful { BEGIN_CAREFUL } else { BEGIN }),
            dirty: false,
            broken: None,
            careful,
            wrote: false,
            aborted: false,
            replay: None,
        }
    }

    fn prepared(&mut self, sql: &'static str) -> Result<Statement, StoreError> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        self.flush()?;
        self.statement(sql)
    }

    /// `sql` prepared on the connection, once (outside the transaction's order: preparing
    /// runs nothing).
    fn statement(&mut self, sql: &'static str) -> Result<Statement, StoreError> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = block_on(self.tx.prepare(&dialect(sql))).map_err(|e| self.failed(e))?;
        self.statements.insert(sql, s.clone());
        Ok(s)
    }

    /// Runs one job with `replay`'s answers (see `pg_rounds`): its outcome, the replay with
    /// where it stopped, and the events it buffered.
    pub(crate) fn replaying(
        &mut self,
        replay: Replay,
        job: impl FnOnce(&mut Self) -> Result<(), StoreError>,
    ) -> (Result<(), StoreError>, Replay, Vec<Pending>) {
        self.replay = Some(replay);
        (self.retry, self.wrote, self.aborted) = (false, false, false);
        let outcome = job(self);
        let replay = self.replay.take().unwrap_or_default();
        (outcome, replay, std::mem::take(&mut self.events))
    }

    /// In rounds: the answers to a call of `wants` (statement, arguments, whether rows are
    /// wanted), or `Err` with the call noted as where the job stops. `None` outside rounds.
    fn replayed(&mut self, wants: &[(&'static str, &[Arg<'_>], bool)]) -> Option<Result<Vec<Answer>, StoreError>> {
        let sqls: Vec<&'static str> = wants.iter().map(|w| w.0).collect();
        let replay = self.replay.as_mut()?;
        if let Some(answers) = replay.answer(&sqls) {
            return Some(Ok(answers));
        }
        if replay.wanted.is_none() && !replay.diverged {
            let mut noted = Vec::with_capacity(wants.len());
            for &(sql, a, rows) in wants {
                match self.statement(sql) {
                    Ok(statement) => {
                        noted.push(Want { sql, statement, args: a.iter().map(Owned::from).collect(), rows })
                    }
                    Err(e) => return Some(Err(e)),
                }
            }
            if let Some(replay) = self.replay.as_mut() {
                replay.wanted = Some(noted);
            }
        }
        Some(Err(StoreError::Db("a statement waits for its round".into())))
    }

    /// Sends the pending savepoint step on its own (before a statement that cannot carry it).
    fn flush(&mut self) -> Result<(), StoreError> {
        self.dirty = true;
        let Some(step) = self.step.take() else { return Ok(()) };
        block_on(self.tx.batch_execute(step)).map_err(|e| self.lost(e))
    }

    fn lost(&mut self, e: tokio_postgres::Error) -> StoreError {
        let error = StoreError::from(&e);
        self.broken = Some(e);
        error
    }

    /// Runs `statement` with the pending savepoint step sent ahead of it in one pipeline:
    /// PostgreSQL runs them in order, so the statement sees the step done.
    fn pipelined<T>(
        &mut self,
        statement: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, StoreError> {
        self.dirty = true;
        let Some(step) = self.step.take() else { return block_on(statement).map_err(|e| self.failed(e)) };
        let (stepped, answer) = block_on(futures::future::join(self.tx.batch_execute(step), statement));
        if let Err(e) = stepped {
            return Err(self.lost(e));
        }
        answer.map_err(|e| self.failed(e))
    }

    /// Ends the current job's savepoint: kept or undone, sent with the next statement.
    fn end_job(&mut self, kept: bool) {
        if std::mem::take(&mut self.dirty) && self.careful {
            self.step = Some(if kept { KEEP } else { UNDO });
        }
    }

    fn failed(&mut self, e: tokio_postgres::Error) -> StoreError {
        self.retry |= retryable(&e);
        self.aborted = true;
        e.into()
    }

    fn rows(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        self.wrote = true;
        self.query(sql, a)
    }

    fn query(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        if let Some(answers) = self.replayed(&[(sql, a, true)]) {
            return answers?.pop().map(Answer::rows).ok_or_else(no_answer)?;
        }
        let s = self.prepared(sql)?;
        let tx = self.tx;
        self.pipelined(tx.query(&s, &args(a)))
    }

    fn one_task(&mut self, sql: &'static str, run: &str, task: &str) -> Result<Option<RawTask>, StoreError> {
        let rows = self.query(sql, &[Arg::Text(run), Arg::Text(task)])?;
        let row = rows.first().map(cells).transpose().map_err(|e| self.failed(e))?;
        row.map(Row::raw_task).transpose()
    }
}

const TASK_FOR_UPDATE: &str = "SELECT run_id, id, state, version, attempt, failures, lease_owner, lease_expires_at_ms,
     not_before_ms, result, usage, error, spec FROM tasks WHERE run_id = ?1 AND id = ?2 FOR UPDATE";
/// A claim in one statement: the row locked by primary key, skipped if another claimer holds
/// it; updated through its `ctid` only if pending and due; the attempt's row added; the row
/// as the claim left it. The state is tested on the locked row, never in the lookup: with
/// `state = 'pending'` there the generic plan of the prepared statement walked the
/// `tasks_pending` partial index over the run's pending tasks (0.5 ms per claim at 10,000 of
/// them, against 0.01 ms).
const CLAIM: &str = "WITH c AS (SELECT ctid, state, not_before_ms FROM tasks WHERE run_id = ?1 AND id = ?2
         FOR UPDATE SKIP LOCKED),
     u AS (UPDATE tasks t SET state = 'running', version = t.version + 1, attempt = t.attempt + 1,
             lease_owner = ?3, lease_expires_at_ms = ?4
         FROM c WHERE t.ctid = c.ctid AND c.state = 'pending' AND c.not_before_ms <= ?5
         RETURNING t.run_id, t.id, t.state, t.version, t.attempt, t.failures, t.lease_owner,
             t.lease_expires_at_ms, t.not_before_ms, t.result, t.usage, t.error, t.spec),
     a AS (INSERT INTO attempts (run_id, task_id, attempt) SELECT run_id, id, attempt FROM u
         ON CONFLICT DO NOTHING)
     SELECT * FROM u";

/// An ending in one statement: the row locked by primary key, updated through its `ctid`
/// only if the attempt holds it (same attempt and owner, live, lease not expired), its state
/// before returned beside the new row. As in `CLAIM`, the state is tested on the locked row.
/// `END_KEEPING` also keeps the attempt's output (`?12`), whether or not the ending applies.
macro_rules! end_statement {
    ($keep:literal) => {
        concat!(
            "WITH ",
            $keep,
            "o AS (SELECT ctid, state FROM tasks WHERE run_id = ?1 AND id = ?2 FOR UPDATE)
     UPDATE tasks t SET state = ?3, version = t.version + 1, failures = t.failures + ?4, lease_owner = NULL,
         lease_expires_at_ms = NULL, not_before_ms = COALESCE(?5, t.not_before_ms),
         result = COALESCE(?6, t.result), usage = COALESCE(?7, t.usage), error = ?8
     FROM o WHERE t.ctid = o.ctid AND o.state IN ('running', 'awaiting_input') AND t.attempt = ?9
         AND t.lease_owner = ?10 AND t.lease_expires_at_ms >= ?11
     RETURNING t.run_id, t.id, t.state, t.version, t.attempt, t.failures, t.lease_owner,
         t.lease_expires_at_ms, t.not_before_ms, t.result, t.usage, t.error, t.spec, o.state"
        )
    };
}
const END: &str = end_statement!("");
const END_KEEPING: &str = end_statement!(
    "k AS (UPDATE attempts SET output = ?12 WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?9),
     "
);

impl Tx for PgTx<'_> {
    fn exec(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<u64, StoreError> {
        self.wrote = true;
        if let Some(answers) = self.replayed(&[(sql, a, false)]) {
            return answers?.pop().map(Answer::count).ok_or_else(no_answer)?;
        }
        let s = self.prepared(sql)?;
        let tx = self.tx;
        self.pipelined(tx.execute(&s, &args(a)))
    }

    fn int(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Option<i64>, StoreError> {
        let rows = self.rows(sql, a)?;
        rows.first().map(|r| r.try_get::<_, i64>(0)).transpose().map_err(|e| self.failed(e))
    }

    fn texts(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Option<Vec<Option<String>>>, StoreError> {
        let rows = self.rows(sql, a)?;
        let Some(row) = rows.first() else { return Ok(None) };
        (0..row.len()).map(|i| row.try_get(i)).collect::<Result<_, _>>().map(Some).map_err(|e| self.failed(e))
    }

    fn task(&mut self, run: &str, task: &str) -> Result<Option<RawTask>, StoreError> {
        self.one_task(TASK_FOR_UPDATE, run, task)
    }

    fn end_held(
        &mut self,
        a: &Attempt,
        c: &ops::Columns,
        now: i64,
        b: ops::Beside<'_>,
    ) -> Result<Option<(TaskState, TaskRow)>, StoreError> {
        let usage = c.usage.as_ref().map(Value::to_string);
        let mut params = vec![
            Arg::Text(&a.run),
            Arg::Text(&a.task),
            Arg::Text(c.to.as_str()),
            Arg::Int(c.failure),
            Arg::OptInt(c.not_before),
            Arg::OptText(c.result.as_deref()),
            Arg::OptText(usage.as_deref()),
            Arg::OptText(c.error.as_deref()),
            Arg::Int(a.n),
            Arg::Text(&a.owner),
            Arg::Int(now),
        ];
        if let Some(output) = b.output {
            params.push(Arg::Text(output));
        }
        let end_sql = if b.output.is_some() { END_KEEPING } else { END };
        self.wrote = true;
        let mut wants = vec![(end_sql, params.as_slice(), true)];
        if b.unless_messages {
            wants.push((ops::MESSAGE_WAITING, &params[..2], true));
        }
        let (rows, waiting) = if let Some(answers) = self.replayed(&wants) {
            let mut answers = answers?.into_iter().map(Answer::rows);
            let rows = answers.next().ok_or_else(no_answer)??;
            let waiting = match answers.next() {
                Some(looked) => Some(looked?.into_iter().next().ok_or_else(no_answer)?),
                None => None,
            };
            (rows, waiting)
        } else {
            let end = self.prepared(end_sql)?;
            let look = if b.unless_messages { Some(self.prepared(ops::MESSAGE_WAITING)?) } else { None };
            let tx = self.tx;
            {
                let (end_args, look_args) = (args(&params), args(&params[..2]));
                // In one pipeline: the look is a statement of its own, so its snapshot is taken
                // after the ending locked the row and sees a message a `say` holding it committed.
                self.pipelined(async {
                    let ended = tx.query(&end, &end_args);
                    let looked = async {
                        match &look {
                            Some(look) => tx.query_one(look, &look_args).await.map(Some),
                            None => Ok(None),
                        }
                    };
                    let (ended, looked) = futures::future::join(ended, looked).await;
                    Ok((ended?, looked?))
                })?
            }
        };
        let Some(r) = rows.first() else { return Ok(None) };
        let mut row = cells(r).map_err(|e| self.failed(e))?;
        let from = row.text(13)?;
        let raw = row.raw_task()?;
        if let Some(waiting) = waiting
            && waiting.try_get::<_, i64>(0).map_err(|e| self.failed(e))? == 1
        {
            return Err(ops::messages_waiting(a));
        }
        let from = TaskState::parse(&from).ok_or_else(|| StoreError::Corrupt {
            run: a.run.clone(),
            task: a.task.clone(),
            what: format!("unknown state `{from}`"),
        })?;
        Ok(Some((from, ops::decode(raw)?)))
    }

    fn take(
        &mut self,
        run: &str,
        task: &str,
        owner: &str,
        until: i64,
        now: i64,
    ) -> Result<Option<TaskRow>, StoreError> {
        let rows =
            self.rows(CLAIM, &[Arg::Text(run), Arg::Text(task), Arg::Text(owner), Arg::Int(until), Arg::Int(now)])?;
        let row = rows.first().map(cells).transpose().map_err(|e| self.failed(e))?;
        row.map(|r| ops::decode(r.raw_task()?)).transpose()
    }

    fn event(&mut self, run: &str, task: Option<&str>, kind: &str, data: &Value) -> Result<i64, StoreError> {
        self.events.push(Pending {
            run: run.to_owned(),
            task: task.map(str::to_owned),
            kind: kind.to_owned(),
            at_ms: crate::now_ms(),
            data: data.to_string(),
        });
        Ok(self.events.len() as i64)
    }

    fn strings(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Vec<String>, StoreError> {
        let rows = self.rows(sql, a)?;
        rows.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>().map_err(|e| self.failed(e))
    }

    fn add_evidence(&mut self, a: &Attempt, effect: &Value) -> Result<(), StoreError> {
        let effect = effect.to_string();
        self.exec(
            "UPDATE attempts SET evidence = (evidence::jsonb || jsonb_build_array(?4::text::jsonb))::text
             WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
            &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(a.n), Arg::Text(&effect)],
        )?;
        Ok(())
    }
}

/// The PostgreSQL backend.
pub struct Pg {
    /// Drives the connections; shut down in the background when the store is dropped
    /// (dropping a runtime inside another one's context would panic).
    rt: Option<tokio::runtime::Runtime>,
    pool: Arc<Pool>,
    /// Writes waiting for the next group commit, and the thread that commits them.
    committer: Arc<Committer>,
    seq_tx: Arc<watch::Sender<i64>>,
    /// This process's commits with the tasks they changed (`TaskStore::own_commits`).
    own: broadcast::Sender<Arc<OwnCommit>>,
    watching: std::sync::Once,
}

impl Store<Pg> {
    /// Connects to `url` (`postgres://USER@HOST/DB`; the password from the URL, `PGPASSWORD`
    /// or the passfile) and migrates the schema, once across nodes starting together.
    pub fn open(url: &str) -> Result<PgStore, StoreError> {
        Ok(Store { db: Pg::open(url)? })
    }

    /// Creates database `name` on the server at `server` (a URL to any database of it, as
    /// a user that may create databases) and returns the URL of the new one. For tests
    /// and benchmarks, which each want a database of their own.
    pub fn create_database(server: &str, name: &str) -> Result<String, StoreError> {
        if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(StoreError::Db(format!("`{name}` is not a plain database name")));
        }
        let admin = connect_once(server)?;
        block_on(admin.batch_execute(&format!("CREATE DATABASE {name}")))?;
        let (base, query) = server.split_once('?').map_or((server, None), |(b, q)| (b, Some(q)));
        let base = match base.split_once("://").map(|(_, rest)| rest.contains('/')) {
            Some(true) => base.rsplit_once('/').map_or(base, |(b, _)| b),
            _ => base,
        };
        Ok(match query {
            Some(q) => format!("{base}/{name}?{q}"),
            None => format!("{base}/{name}"),
        })
    }

    /// Drops database `name` on the server at `server`, disconnecting whoever uses it.
    pub fn drop_database(server: &str, name: &str) -> Result<(), StoreError> {
        if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(StoreError::Db(format!("`{name}` is not a plain database name")));
        }
        let admin = connect_once(server)?;
        block_on(admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))?;
        Ok(())
    }
}

impl Pg {
    /// Connects to `url` (`postgres://USER@HOST/DB`; the password from the URL, `PGPASSWORD`
    /// or the passfile) and migrates the schema, once across nodes starting together.
    fn open(url: &str) -> Result<Pg, StoreError> {
        let mut target = Target::parse(url)?;
        if target.config.get_application_name().is_none() {
            target.config.application_name("pier");
        }
        target.config.connect_timeout(Duration::from_secs(10));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("pier-pg")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Db(format!("cannot start the database runtime: {e}")))?;
        let pool = Arc::new(Pool {
            target,
            rt: rt.handle().clone(),
            idle: Mutex::new((Vec::new(), 0)),
            returned: Condvar::new(),
            outage: Mutex::new(None),
        });
        let mut c = pool.get()?;
        let migrated = migrate(&mut c.client);
        pool.put(c);
        migrated?;
        let last = pool.with(|c| block_on(c.client.query_one("SELECT n FROM pier_seq", &[]))?.try_get::<_, i64>(0))?;
        let seq_tx = Arc::new(watch::Sender::new(last));
        let committer = Arc::new(Committer::default());
        let local = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StoreError::Db(format!("cannot start the database runtime: {e}")))?;
        let own = crate::log::own_commits();
        let (c, p, tx, o) = (committer.clone(), pool.clone(), seq_tx.clone(), own.clone());
        std::thread::Builder::new()
            .name("pier-pg-commit".into())
            .spawn(move || commit_loop(local, &c, &p, &tx, &o))
            .map_err(|e| StoreError::Db(format!("cannot start the database's committer thread: {e}")))?;
        Ok(Pg { rt: Some(rt), pool, committer, seq_tx, own, watching: std::sync::Once::new() })
    }

    /// Runs `work` atomically in the next *group commit* and returns its answer (and the
    /// last sequence it wrote, 0 for none) once the commit is durable. As in the SQLite
    /// store, writers queue their work and whoever holds a write connection runs all of it
    /// in one transaction (see `run_group` for how a failing one is undone), numbers every
    /// event at the end and commits once: one WAL flush (and one hold of the counter row) for the group.
    fn queue<T: Send + 'static>(
        &self,
        task: Option<(&str, &str)>,
        work: impl FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send + 'static,
    ) -> Result<(T, i64), StoreError> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let task = task.map(|(r, t)| (r.to_owned(), t.to_owned()));
        lock(&self.committer.queue).push(Box::new(Op { work, task, answer: None, tries: 0, reply }));
        self.committer.ready.notify_one();
        answer
            .recv()
            .unwrap_or_else(|_| Err(StoreError::Db("the store's committing thread stopped before answering".into())))
    }

    fn watch_others(&self) {
        let (target, seq_tx) = (self.pool.target.clone(), Arc::downgrade(&self.seq_tx));
        self.pool.rt.spawn(listen(target, seq_tx));
    }
}

/// A queued write. It may run more than once: a job rolled back (with its group, or alone by
/// a deadlock) runs again in the next group.
pub(crate) trait Job: Send {
    /// Runs the operation in the open transaction and keeps its answer.
    fn run(&mut self, tx: &mut dyn Tx) -> Result<(), StoreError>;
    /// Counts a try; false once the job has had its share.
    fn again(&mut self) -> bool;
    /// Hands over the answer with the last sequence the job wrote (0 for none), or the error.
    fn finish(self: Box<Self>, outcome: Result<i64, StoreError>);
    /// The task (run, id) whose rows alone the job touches, if it is one: jobs of different
    /// tasks run side by side (`pg_rounds`).
    fn task(&self) -> Option<&(String, String)>;
}

struct Op<T, F> {
    work: F,
    task: Option<(String, String)>,
    answer: Option<T>,
    tries: u32,
    reply: std::sync::mpsc::SyncSender<Result<(T, i64), StoreError>>,
}

impl<T: Send, F: FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send> Job for Op<T, F> {
    fn run(&mut self, tx: &mut dyn Tx) -> Result<(), StoreError> {
        self.answer = Some((self.work)(tx)?.0);
        Ok(())
    }

    fn again(&mut self) -> bool {
        self.tries += 1;
        self.tries <= RETRIES
    }

    fn finish(self: Box<Self>, outcome: Result<i64, StoreError>) {
        let this = *self;
        let answer = outcome.and_then(|seq| {
            this.answer.map(|a| (a, seq)).ok_or_else(|| StoreError::Db("a write finished without an answer".into()))
        });
        let _ = this.reply.send(answer);
    }

    fn task(&self) -> Option<&(String, String)> {
        self.task.as_ref()
    }
}

fn retry_or_fail(jobs: Vec<Box<dyn Job>>, error: &StoreError) -> Vec<Box<dyn Job>> {
    let mut again = Vec::new();
    for mut job in jobs {
        if job.again() {
            again.push(job);
        } else {
            job.finish(Err(error.clone()));
        }
    }
    again
}

/// How a group commit went.
enum Group {
    /// Committed: each job done with its last sequence, each failed job with its error (it
    /// changed nothing), and the jobs to run again.
    Committed {
        done: Vec<(Box<dyn Job>, i64)>,
        failed: Vec<(Box<dyn Job>, StoreError)>,
        again: Vec<Box<dyn Job>>,
        /// The group's events: `(first, last)`, `(0, 0)` for none.
        numbered: (i64, i64),
        /// The tasks with an event in the group, as it left them, and its events, if they
        /// were asked for.
        own: Option<(Vec<Row>, Vec<RawEvent>)>,
    },
    /// Rolled back before the commit (the connection broke): nothing happened.
    Lost { jobs: Vec<Box<dyn Job>>, error: StoreError },
    /// Rolled back because a job failed after changing something, in a group run without
    /// savepoints: nothing happened, and the jobs run again, each in a savepoint.
    Redo { jobs: Vec<Box<dyn Job>> },
    /// The commit's answer was lost: it may or may not have happened.
    Unknown { jobs: Vec<Box<dyn Job>>, error: StoreError },
}

/// The queue of writes and its committer thread's controls.
#[derive(Default)]
struct Committer {
    queue: Mutex<Vec<Box<dyn Job>>>,
    ready: Condvar,
    stop: std::sync::atomic::AtomicBool,
}

/// The committer thread: commits whatever is queued, one group at a time, on the write
/// connection its own runtime drives, until the store is dropped and the queue is empty.
fn commit_loop(
    local: tokio::runtime::Runtime,
    c: &Committer,
    pool: &Pool,
    seq_tx: &watch::Sender<i64>,
    own: &broadcast::Sender<Arc<OwnCommit>>,
) {
    LOCAL.with(|l| *l.borrow_mut() = Some(local));
    let mut slot: Option<Conn> = None;
    let mut bell = Doorbell::default();
    loop {
        let jobs = {
            let mut q = lock(&c.queue);
            while q.is_empty() && !c.stop.load(std::sync::atomic::Ordering::Acquire) {
                match bell.owed_until() {
                    // Idle with a ring owed: wait for work until it is due, then ring.
                    Some(due) => {
                        let wait = due.saturating_duration_since(Instant::now());
                        let (guard, timeout) =
                            c.ready.wait_timeout(q, wait).unwrap_or_else(std::sync::PoisonError::into_inner);
                        q = guard;
                        if timeout.timed_out() && q.is_empty() {
                            drop(q);
                            bell.ring_owed(slot.as_ref());
                            q = lock(&c.queue);
                        }
                    }
                    None => q = c.ready.wait(q).unwrap_or_else(std::sync::PoisonError::into_inner),
                }
            }
            if q.is_empty() {
                break;
            }
            std::mem::take(&mut *q)
        };
        let mut again = commit(pool, seq_tx, own, &mut slot, &mut bell, jobs);
        while !again.is_empty() {
            again.extend(std::mem::take(&mut *lock(&c.queue)));
            again = commit(pool, seq_tx, own, &mut slot, &mut bell, again);
        }
    }
    bell.ring_owed(slot.as_ref());
    // The connection first, while its runtime still runs; then the runtime.
    drop(slot);
    if let Some(rt) = LOCAL.with(|l| l.borrow_mut().take()) {
        rt.shutdown_background();
    }
}

/// How often, at most, a store rings the doorbell (`NOTIFY pier_commits`) for its commits.
/// Each ring wakes every listening node (its backend and its listener thread); a busy node
/// commits every millisecond or two, and other nodes learn of its commits within this time.
const RING_EVERY: Duration = Duration::from_millis(10);

/// When the doorbell last rang, and the newest commit it has not rung for.
#[derive(Default)]
struct Doorbell {
    rang_at: Option<Instant>,
    owed: Option<i64>,
}

impl Doorbell {
    /// Whether the next commit rings (in its numbering statement).
    fn due(&self) -> bool {
        self.rang_at.is_none_or(|at| at.elapsed() >= RING_EVERY)
    }

    /// A commit up to sequence `last` that rang, or did not.
    fn committed(&mut self, last: i64, rang: bool) {
        if rang {
            self.rang_at = Some(Instant::now());
            self.owed = None;
        } else {
            self.owed = Some(last);
        }
    }

    /// When a ring is owed and falls due.
    fn owed_until(&self) -> Option<Instant> {
        self.owed.map(|_| self.rang_at.map_or_else(Instant::now, |at| at + RING_EVERY))
    }

    /// Rings for the commits not rung for yet, on its own (no group is coming to carry it).
    /// A ring that fails is not retried: listeners also look on a slow timer.
    fn ring_owed(&mut self, conn: Option<&Conn>) {
        let (Some(n), Some(conn)) = (self.owed.take(), conn) else { return };
        if let Err(e) = block_on(conn.client.execute("SELECT pg_notify('pier_commits', $1)", &[&n.to_string()])) {
            tracing::debug!(error = %e, "could not ring the doorbell; other nodes see the commit on their timer");
        }
        self.rang_at = Some(Instant::now());
    }
}

/// One group commit. Returns the jobs to run again (rolled back with a lost connection
/// or alone by a deadlock or serialization failure); every other job is answered.
fn commit(
    pool: &Pool,
    seq_tx: &watch::Sender<i64>,
    own: &broadcast::Sender<Arc<OwnCommit>>,
    slot: &mut Option<Conn>,
    bell: &mut Doorbell,
    jobs: Vec<Box<dyn Job>>,
) -> Vec<Box<dyn Job>> {
    if slot.as_ref().is_none_or(|c| c.client.is_closed()) {
        match pool.connect() {
            Ok(c) => *slot = Some(c),
            Err(e) => {
                for job in jobs {
                    job.finish(Err(e.clone()));
                }
                return Vec::new();
            }
        }
    }
    let Some(conn) = slot.as_mut() else { return jobs };
    let ring = bell.due();
    // The changed tasks are read only for someone to take them.
    let rows = own.receiver_count() > 0;
    let mut outcome = run_group(conn, jobs, false, ring, rows);
    if let Group::Redo { jobs } = outcome {
        outcome = run_group(conn, jobs, true, ring, rows);
    }
    match outcome {
        Group::Committed { done, failed, again, numbered: (first, last), own: read } => {
            if last > 0 {
                bell.committed(last, ring);
                // Rows that do not decode are not sent: followers read them, and hear why.
                let own_commit = read.and_then(|(raw, events)| {
                    let tasks = crate::store::tasks(raw).ok()?;
                    Some(OwnCommit { after: first - 1, upto: last, tasks, events })
                });
                announce(own, seq_tx, own_commit, last);
            }
            for (job, seq) in done {
                job.finish(Ok(seq));
            }
            for (job, e) in failed {
                job.finish(Err(e));
            }
            again
        }
        Group::Lost { jobs, error } => {
            // Nothing of the group was committed: it all runs again, on a new connection.
            *slot = None;
            tracing::debug!(%error, "a group commit was rolled back; running it again");
            retry_or_fail(jobs, &error)
        }
        Group::Unknown { jobs, error } => {
            *slot = None;
            for job in jobs {
                job.finish(Err(error.clone()));
            }
            Vec::new()
        }
        Group::Redo { jobs } => jobs,
    }
}

/// Runs every job in one transaction, numbers their events from the counter row, writes
/// them with one `UNNEST`, rings the doorbell if `ring` and commits.
///
/// A job that fails must leave no trace. Usually one that fails has changed nothing (a lost
/// lease, found by reading the task), and its buffered events are dropped; so the jobs run
/// without savepoints (`careful` false), which would cost two statements per job, parsed
/// and run by PostgreSQL (a third of its statements on B5). When a job fails after a
/// statement that may have changed something, or a statement fails (which aborts the
/// transaction), the group is rolled back and answered `Redo`: the caller runs it again
/// `careful`, each job in savepoint `job`, so that the failure undoes only its own job.
fn run_group(c: &mut Conn, jobs: Vec<Box<dyn Job>>, careful: bool, ring: bool, rows: bool) -> Group {
    let mut t = PgTx::begin(c, careful);
    // (job, its first event's index, one past its last).
    let mut ran: Vec<(Box<dyn Job>, usize, usize)> = Vec::with_capacity(jobs.len());
    let mut failed = Vec::new();
    let mut again = Vec::new();
    // Jobs of different tasks first, side by side in rounds (`pg_rounds`); the rest after them,
    // one by one.
    let (together, rest) = if careful { (Vec::new(), jobs) } else { rounds::side_by_side(jobs) };
    if !together.is_empty() {
        match rounds::run(&mut t, together) {
            Rounds::Ended(ended, rounds) => {
                tracing::trace!(rounds, jobs = ended.len(), "jobs of a group ran side by side");
                for (mut job, ended) in ended {
                    match ended {
                        Ok(events) => {
                            let before = t.events.len();
                            t.events.extend(events);
                            ran.push((job, before, t.events.len()));
                        }
                        Err((_, true)) if job.again() => again.push(job),
                        Err((e, _)) => failed.push((job, e)),
                    }
                }
            }
            Rounds::Redo(jobs) => return redo(&t, jobs.into_iter().chain(rest).collect()),
            Rounds::Lost(jobs, error) => return Group::Lost { jobs: jobs.into_iter().chain(rest).collect(), error },
        }
    }
    let mut rest = rest.into_iter();
    while let Some(mut job) = rest.next() {
        let before = t.events.len();
        t.retry = false;
        t.wrote = false;
        t.aborted = false;
        let outcome = job.run(&mut t);
        if outcome.is_err() {
            t.events.truncate(before);
        }
        t.end_job(outcome.is_ok());
        if !careful && t.broken.is_none() && outcome.is_err() && (t.wrote || t.aborted) {
            return redo(&t, every_job(ran, failed, again, std::iter::once(job).chain(rest)));
        }
        if let Some(e) = t.broken.take() {
            // The transaction is gone (a lost connection): nothing of the group happened.
            let jobs = every_job(ran, failed, again, std::iter::once(job).chain(rest));
            return Group::Lost { jobs, error: (&e).into() };
        }
        match outcome {
            Ok(()) => ran.push((job, before, t.events.len())),
            Err(e) if t.retry => {
                if job.again() {
                    again.push(job);
                } else {
                    failed.push((job, e));
                }
            }
            Err(e) => failed.push((job, e)),
        }
    }
    // The events are numbered and the transaction committed in one round trip (pipelined):
    // if numbering fails, PostgreSQL turns the `COMMIT` behind it into a rollback.
    let (numbered, committed) = number_and_commit(&mut t, ring, rows);
    let ((first, last), own) = match numbered {
        Ok(numbered) => numbered,
        Err(e) => return Group::Lost { jobs: every_job(ran, failed, again, []), error: e },
    };
    if let Err(e) = committed {
        let error = StoreError::Db(format!("{}; the change may or may not have been committed", describe(&e)));
        return Group::Unknown { jobs: every_job(ran, failed, again, []), error };
    }
    let done =
        ran.into_iter().map(|(job, from, to)| (job, if to > from { first + to as i64 - 1 } else { 0 })).collect();
    Group::Committed { done, failed, again, numbered: (first, last), own }
}

/// Rolls the group's transaction back so that `jobs` run again one by one in savepoints.
fn redo(t: &PgTx<'_>, jobs: Vec<Box<dyn Job>>) -> Group {
    match block_on(t.tx.batch_execute("ROLLBACK")) {
        Ok(()) => Group::Redo { jobs },
        Err(e) => Group::Lost { jobs, error: (&e).into() },
    }
}

/// Every job of a group that did not commit, whatever became of each: those that ran, failed
/// or are to run again, and those not reached.
fn every_job(
    ran: Vec<(Box<dyn Job>, usize, usize)>,
    failed: Vec<(Box<dyn Job>, StoreError)>,
    again: Vec<Box<dyn Job>>,
    rest: impl IntoIterator<Item = Box<dyn Job>>,
) -> Vec<Box<dyn Job>> {
    let mut jobs: Vec<Box<dyn Job>> = ran.into_iter().map(|(j, _, _)| j).collect();
    jobs.extend(failed.into_iter().map(|(j, _)| j));
    jobs.extend(again);
    jobs.extend(rest);
    jobs
}

/// Numbers the transaction's buffered events from the counter row, writes them, (with
/// `ring`) rings the doorbell and (with `rows`) reads back every task they name, in one
/// prepared statement, with the `COMMIT` sent right behind it: (((the first sequence, the
/// last) or `(0, 0)` without events, with `rows` the tasks and the numbered events), the
/// commit's outcome).
///
/// The tasks are read in the statement's snapshot, which may predate a commit of another
/// node that the counter row waited for: a task this group wrote an event for without
/// locking it (an attempt's progress) can come back older than that commit left it. Such a
/// row's version is behind the one its follower read, and followers keep the newer version.
#[allow(clippy::type_complexity)]
fn number_and_commit(
    t: &mut PgTx<'_>,
    ring: bool,
    rows: bool,
) -> (Result<((i64, i64), Option<(Vec<Row>, Vec<RawEvent>)>), StoreError>, Result<(), tokio_postgres::Error>) {
    // `r` holds the counter and the ring; a volatile function (`pg_notify`) keeps it from being
    // folded into the outer query, so it rings once whatever number of task rows follow.
    const NUMBER: &str = "WITH c AS (UPDATE pier_seq SET n = n + ?1 WHERE id = 1 RETURNING n),
         e AS (INSERT INTO events (seq, run_id, task_id, type, at_ms, data)
               SELECT (SELECT n FROM c) - ?1 + u.ord, u.run_id, u.task_id, u.type, u.at_ms, u.data
               FROM UNNEST(?2::text[], ?3::text[], ?4::text[], ?5::bigint[], ?6::text[]) WITH ORDINALITY
                   AS u(run_id, task_id, type, at_ms, data, ord)),
         r AS (SELECT n, CASE WHEN ?7 THEN pg_notify('pier_commits', n::text)::text END AS rang FROM c)
         SELECT t.*, r.n, r.rang FROM r LEFT JOIN LATERAL
             (SELECT run_id, id, state, version, attempt, failures, lease_owner, lease_expires_at_ms,
                  not_before_ms, result, usage, error, spec FROM tasks
              WHERE ?8 AND (run_id, id) IN
                  (SELECT k.run_id, k.task_id FROM UNNEST(?2::text[], ?3::text[]) AS k(run_id, task_id)
                   WHERE k.task_id IS NOT NULL)) t ON true";
    // The last step rides too: an `UNDO` must happen before the commit (a `KEEP` need not,
    // but costs nothing in the pipeline), and a group whose jobs ran no statement has not
    // even begun.
    if t.events.is_empty() {
        return match t.step.take() {
            Some(BEGIN | BEGIN_CAREFUL) => (Ok(((0, 0), None)), Ok(())),
            Some(s) => (Ok(((0, 0), None)), block_on(t.tx.batch_execute(&format!("{s}; COMMIT")))),
            None => (Ok(((0, 0), None)), block_on(t.tx.batch_execute("COMMIT"))),
        };
    }
    let statement = match t.prepared(NUMBER) {
        Ok(s) => s,
        Err(e) => return (Err(e), Ok(())),
    };
    let step = t.step.take();
    let k = t.events.len() as i64;
    let runs: Vec<&str> = t.events.iter().map(|e| e.run.as_str()).collect();
    let tasks: Vec<Option<&str>> = t.events.iter().map(|e| e.task.as_deref()).collect();
    let kinds: Vec<&str> = t.events.iter().map(|e| e.kind.as_str()).collect();
    let ats: Vec<i64> = t.events.iter().map(|e| e.at_ms).collect();
    let datas: Vec<&str> = t.events.iter().map(|e| e.data.as_str()).collect();
    let params: [&(dyn ToSql + Sync); 8] = [&k, &runs, &tasks, &kinds, &ats, &datas, &ring, &rows];
    let stepped = async {
        match step {
            Some(s) => t.tx.batch_execute(s).await,
            None => Ok(()),
        }
    };
    let (stepped, answer, committed) =
        block_on(futures::future::join3(stepped, t.tx.query(&statement, &params), t.tx.batch_execute("COMMIT")));
    if let Err(e) = stepped {
        // The transaction is aborted: the `COMMIT` behind it rolled it back.
        return (Err(StoreError::from(&e)), Ok(()));
    }
    let numbered = answer.and_then(|answer| {
        let last = answer.first().map(|r| r.try_get::<_, i64>(13)).transpose()?;
        let tasks = if rows {
            let mut raw = Vec::with_capacity(answer.len());
            for r in answer.iter().filter(|r| r.try_get::<_, Option<String>>(0).is_ok_and(|id| id.is_some())) {
                raw.push(cells(r)?);
            }
            Some(raw)
        } else {
            None
        };
        Ok((last, tasks))
    });
    let numbered = match numbered {
        Ok((Some(last), tasks)) => {
            let first = last - k + 1;
            let own = tasks.map(|tasks| {
                let numbered = std::mem::take(&mut t.events).into_iter().zip(first..);
                let events = numbered
                    .map(|(e, seq)| RawEvent {
                        seq,
                        run: e.run,
                        task: e.task,
                        kind: e.kind,
                        at_ms: e.at_ms,
                        data: e.data,
                    })
                    .collect();
                (tasks, events)
            });
            Ok(((first, last), own))
        }
        Ok((None, _)) => Err(StoreError::Db("numbering the events returned no counter".into())),
        Err(e) => Err(StoreError::from(&e)),
    };
    (numbered, committed)
}

/// A database of its own on a PostgreSQL server, for one test or one measurement: created
/// with a unique name and dropped (disconnecting whoever still uses it) when this is dropped.
pub struct ScratchDatabase {
    server: String,
    name: String,
    url: String,
}

impl ScratchDatabase {
    /// Creates `PREFIX_PID_RANDOM` on the server at `server` (a URL to any of its databases, as
    /// a user that may create databases).
    pub fn create(server: &str, prefix: &str) -> Result<ScratchDatabase, StoreError> {
        let name = format!("{prefix}_{}_{}", std::process::id(), uuid::Uuid::new_v4().simple());
        let url = PgStore::create_database(server, &name)?;
        Ok(ScratchDatabase { server: server.to_owned(), name, url })
    }

    /// The database's URL, for `--store` or [`super::open`].
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        if let Err(e) = PgStore::drop_database(&self.server, &self.name) {
            tracing::warn!(database = %self.name, error = %e, "could not drop a scratch database");
        }
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        // The committer ends once the queue is empty (nothing waits on it after this).
        self.committer.stop.store(true, std::sync::atomic::Ordering::Release);
        self.committer.ready.notify_all();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl From<&tokio_postgres::Error> for StoreError {
    fn from(e: &tokio_postgres::Error) -> Self {
        StoreError::Db(describe(e))
    }
}

/// One connection for an administrative statement, on a runtime of its own.
fn connect_once(url: &str) -> Result<Client, StoreError> {
    let target = Target::parse(url)?;
    let rt = ADMIN.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread().enable_all().build().map(|rt| {
            let handle = rt.handle().clone();
            std::thread::spawn(move || rt.block_on(std::future::pending::<()>()));
            handle
        })
    });
    let rt = rt.as_ref().map_err(|e| StoreError::Db(format!("cannot start a runtime: {e}")))?;
    connect_on(rt, &target).map_err(|e| StoreError::Db(e.text))
}

/// The runtime of administrative connections (tests and benchmarks creating databases).
static ADMIN: std::sync::OnceLock<std::io::Result<tokio::runtime::Handle>> = std::sync::OnceLock::new();

fn migrate(client: &mut Client) -> Result<(), StoreError> {
    block_on(client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]))?;
    let done = (|| -> Result<(), StoreError> {
        block_on(client.batch_execute(
            "CREATE TABLE IF NOT EXISTS pier_migrations (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)",
        ))?;
        let have: i64 =
            block_on(client.query_one("SELECT COALESCE(MAX(version), 0) FROM pier_migrations", &[]))?.try_get(0)?;
        if have > MIGRATIONS.len() as i64 {
            return Err(StoreError::Db(format!(
                "the database was written by a newer pier (schema version {have}; this pier knows versions up to {}); \
                 upgrade pier",
                MIGRATIONS.len()
            )));
        }
        for (i, migration) in MIGRATIONS.iter().enumerate().skip(have as usize) {
            let tx = block_on(client.transaction())?;
            block_on(tx.batch_execute(migration))?;
            block_on(
                tx.execute("INSERT INTO pier_migrations VALUES ($1, $2)", &[&((i + 1) as i64), &crate::now_ms()]),
            )?;
            block_on(tx.commit())?;
        }
        Ok(())
    })();
    let _ = block_on(client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]));
    done
}

/// Other nodes' commits: `LISTEN pier_commits` as a doorbell; the counter is the truth.
/// Runs on the store's runtime until the store is dropped.
async fn listen(Target { config, tls }: Target, seq_tx: Weak<watch::Sender<i64>>) {
    let mut delay = Duration::from_millis(100);
    while seq_tx.strong_count() > 0 {
        let (client, mut connection) = match config.connect(tls.clone()).await {
            Ok(pair) => pair,
            Err(_) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        delay = Duration::from_millis(100);
        // The connection's messages (notifications among them) come through this stream.
        let (bell, mut rang) = tokio::sync::mpsc::unbounded_channel();
        let messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        tokio::spawn(async move {
            use futures::StreamExt;
            let mut messages = std::pin::pin!(messages);
            while let Some(Ok(m)) = messages.next().await {
                if let tokio_postgres::AsyncMessage::Notification(n) = m {
                    let _ = bell.send(n.payload().parse::<i64>().ok());
                }
            }
        });
        if client.batch_execute("LISTEN pier_commits").await.is_err() {
            continue;
        }
        let mut read = true;
        loop {
            let Some(tx) = seq_tx.upgrade() else { return };
            if read {
                match client.query_one("SELECT n FROM pier_seq", &[]).await.and_then(|r| r.try_get::<_, i64>(0)) {
                    Ok(n) => publish(&tx, n),
                    Err(_) => break,
                }
            }
            drop(tx);
            let rung = match tokio::time::timeout(WATCH_INTERVAL, rang.recv()).await {
                Ok(Some(rung)) => rung,
                Ok(None) => break,
                Err(_) => {
                    read = true;
                    continue;
                }
            };
            // Whatever else rang meanwhile is covered by the next read. A bell that names a
            // commit this store has already published (its own, which the committer publishes
            // itself) needs no read: the counter only grows.
            let mut newest = rung;
            while let Ok(r) = rang.try_recv() {
                newest = newest.zip(r).map(|(a, b)| a.max(b));
            }
            let known = seq_tx.upgrade().map_or(i64::MAX, |tx| *tx.borrow());
            read = newest.is_none_or(|n| n > known);
        }
    }
}

impl Backend for Pg {
    const PENDING_TASKS: &'static str = concat!(
        "SELECT ",
        task_columns!(t),
        " FROM tasks t JOIN runs r ON r.id = t.run_id WHERE t.state = 'pending' ORDER BY r.created_at_ms, r.id, t.ord"
    );
    const UNFINISHED_TASKS: &'static str = concat!(
        "SELECT ",
        task_columns!(t),
        " FROM tasks t JOIN runs r ON r.id = t.run_id
         WHERE t.state IN ('pending', 'running', 'awaiting_input') ORDER BY r.created_at_ms, r.id, t.ord"
    );
    const LAST_SEQ: &'static str = "SELECT n FROM pier_seq";

    fn write<T: Send + 'static>(
        &self,
        task: Option<(&str, &str)>,
        work: impl FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send + 'static,
    ) -> Result<(T, i64), StoreError> {
        self.queue(task, work)
    }

    fn read<T>(&self, f: impl Fn(&mut dyn Query) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let mut tries = 0;
        loop {
            let mut c = self.pool.get()?;
            c.broken = false;
            let out = f(&mut c);
            let broken = c.broken;
            self.pool.put(c);
            match out {
                Err(_) if broken && tries < RETRIES => tries += 1,
                out => return out,
            }
        }
    }

    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError> {
        // The bound is the committed counter, in the statement's snapshot with the events:
        // every event up to it is visible (a commit that moved it had all of its own, and
        // every earlier one had committed before it could take the counter row). One
        // statement: the counter's row, with each changed task beside it (or none).
        const CHANGED: &str = concat!(
            "SELECT t.*, s.n FROM (SELECT n FROM pier_seq WHERE id = 1) s
             LEFT JOIN LATERAL (SELECT ",
            task_columns!(),
            " FROM tasks
                 WHERE s.n > ?1 AND (run_id, id) IN
                     (SELECT run_id, task_id FROM events WHERE seq > ?1 AND seq <= s.n AND task_id IS NOT NULL)) t
             ON true"
        );
        let rows = self.read(|q| q.rows(CHANGED, &[Arg::Int(after)]))?;
        let mut upto = after;
        let mut changed = Vec::with_capacity(rows.len());
        for mut r in rows {
            upto = upto.max(r.int(13)?);
            if r.0.first().is_some_and(|c| *c != Cell::Null) {
                changed.push(ops::decode(r.raw_task()?)?);
            }
        }
        Ok((changed, upto))
    }

    fn subscribe(&self) -> watch::Receiver<i64> {
        self.watching.call_once(|| self.watch_others());
        self.seq_tx.subscribe()
    }

    fn own_commits(&self) -> broadcast::Receiver<Arc<OwnCommit>> {
        self.own.subscribe()
    }
}

impl Query for Conn {
    fn rows(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Vec<Row>, StoreError> {
        let read = self.statement(sql).and_then(|s| block_on(self.client.query(&s, &args(a))));
        let rows = read.and_then(|rows| rows.iter().map(cells).collect::<Result<Vec<_>, _>>());
        rows.map_err(|e| {
            self.broken = retryable(&e);
            StoreError::from(e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Last;
    use serde_json::json;

    #[test]
    fn placeholders_become_dollars() {
        assert_eq!(dialect("a = ?1 AND b = ?12 AND c = '?'"), "a = $1 AND b = $12 AND c = '?'");
    }

    // Jobs side by side (`pg_rounds`), against the server `PIER_TEST_PG` names.

    const FAR: i64 = i64::MAX / 2;
    type Reply = std::sync::mpsc::Receiver<Result<(String, i64), StoreError>>;

    /// A store with run `r` of `tasks` (no dependencies), and a connection of the test's own.
    fn store(tasks: &[&str]) -> (PgStore, Conn, ScratchDatabase) {
        let server = std::env::var("PIER_TEST_PG").unwrap_or_else(|_| {
            panic!("PIER_TEST_PG is not set: the PostgreSQL tests need a server (scripts/test starts one)")
        });
        let db = ScratchDatabase::create(&server, "pier_rounds").unwrap_or_else(|e| panic!("{e}"));
        let store = PgStore::open(db.url()).unwrap_or_else(|e| panic!("{e}"));
        let toml: String = tasks.iter().map(|t| format!("[[tasks]]\nid = \"{t}\"\nprompt = \"x\"\n\n")).collect();
        let plan = crate::plan::parse(&toml, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        store.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let conn = store.db.pool.connect().unwrap_or_else(|e| panic!("{e}"));
        (store, conn, db)
    }

    fn job(
        task: Option<&str>,
        work: impl FnMut(&mut dyn Tx) -> Result<(String, i64), StoreError> + Send + 'static,
    ) -> (Box<dyn Job>, Reply) {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let task = task.map(|t| ("r".to_owned(), t.to_owned()));
        (Box::new(Op { work, task, answer: None, tries: 0, reply }), answer)
    }

    fn claim(task: &'static str) -> (Box<dyn Job>, Reply) {
        job(Some(task), move |tx| {
            let (claimed, seq) = ops::claim(tx, "r", task, "o", FAR)?;
            Ok((format!("{:?}", claimed.map(|(a, row)| (a.n, row.state))), seq))
        })
    }

    fn attempt(task: &str) -> Attempt {
        Attempt { run: "r".into(), task: task.into(), n: 1, owner: "o".into() }
    }

    /// Each job's answer, an error as its `Debug` text.
    fn answers(replies: &[Reply]) -> Vec<Result<String, String>> {
        let answer = |r: &Reply| r.try_recv().unwrap_or_else(|e| panic!("no answer: {e}"));
        replies.iter().map(|r| answer(r).map(|(a, _)| a).map_err(|e| format!("{e:?}"))).collect()
    }

    /// Runs `jobs` as one group the usual way (in rounds, then job by job if sent back) and
    /// answers them; whether the group was sent back.
    fn commit_group(conn: &mut Conn, jobs: Vec<Box<dyn Job>>) -> bool {
        let mut outcome = run_group(conn, jobs, false, false, false);
        let redone = matches!(outcome, Group::Redo { .. });
        if let Group::Redo { jobs } = outcome {
            outcome = run_group(conn, jobs, true, false, false);
        }
        let Group::Committed { done, failed, again, .. } = outcome else { panic!("the group did not commit") };
        assert!(again.is_empty());
        for (job, seq) in done {
            job.finish(Ok(seq));
        }
        for (job, e) in failed {
            job.finish(Err(e));
        }
        redone
    }

    #[test]
    fn jobs_of_different_tasks_take_one_round_trip_per_step_between_them() {
        let (store, mut conn, _db) = store(&["a", "b", "c", "d"]);
        let (jobs, replies): (Vec<_>, Vec<_>) = ["a", "b", "c", "d"].into_iter().map(claim).unzip();
        let mut t = PgTx::begin(&mut conn, false);
        let Rounds::Ended(ended, rounds) = rounds::run(&mut t, jobs) else { panic!("the claims were sent back") };
        // One statement each, all four in one round trip.
        assert_eq!(rounds, 1);
        let mut done = Vec::new();
        for (job, ended) in ended {
            let Ok(events) = ended else { panic!("a claim failed") };
            t.events.extend(events);
            done.push(job);
        }
        let (numbered, committed) = number_and_commit(&mut t, false, false);
        assert!(committed.is_ok());
        let ((first, last), _) = numbered.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(last - first + 1, 4, "one transition each");
        for job in done {
            job.finish(Ok(last));
        }
        for (reply, _) in replies.iter().zip(0..) {
            assert_eq!(answers(std::slice::from_ref(reply)), [Ok("Some((1, Running))".to_owned())]);
        }
        // Operations of several statements, side by side: the longest sets the rounds.
        let (park, parked) =
            job(Some("d"), |tx| ops::park(tx, &attempt("d"), &json!({"ask": 1})).map(|(n, s)| (n.to_string(), s)));
        let (beat, beaten) =
            job(Some("a"), |tx| ops::heartbeat(tx, &attempt("a"), FAR + 1).map(|(b, s)| (b.to_string(), s)));
        let ending = Ending::Completed { result: "fine".into(), usage: None };
        let (end, ended) = job(Some("b"), move |tx| {
            ops::finish(tx, &attempt("b"), &ending, None).map(|(r, s)| (r.state.as_str().to_owned(), s))
        });
        let evidence = [json!({"wrote": "x"}), json!({"wrote": "y"})];
        let (note, noted) = job(Some("c"), move |tx| {
            ops::record(tx, &attempt("c"), &[("note".into(), json!({}))], &evidence).map(|(l, s)| (l.to_string(), s))
        });
        assert!(!commit_group(&mut conn, vec![park, beat, end, note]));
        let got = answers(&[parked, beaten, ended, noted]);
        assert_eq!(got[..3], [Ok("1".to_owned()), Ok("true".to_owned()), Ok("completed".to_owned())]);
        assert!(got[3].is_ok());
        let state = |t: &str| store.task("r", t).ok().flatten().map(|r| r.state);
        assert_eq!(
            [state("a"), state("b"), state("d")],
            [Some(TaskState::Running), Some(TaskState::Completed), Some(TaskState::AwaitingInput)]
        );
        assert_eq!(store.task("r", "a").ok().flatten().and_then(|r| r.lease_expires_at_ms), Some(FAR + 1));
        assert_eq!(store.evidence("r", "c", 1).unwrap_or_default().len(), 2);
        assert!(store.open_question("r", "d").ok().flatten().is_some());
    }

    #[test]
    fn a_job_failing_after_a_write_sends_the_group_back_and_fails_alone() {
        let (store, mut conn, _db) = store(&["a", "b"]);
        let (j, r) = claim("a");
        commit_group(&mut conn, vec![j]);
        answers(&[r]);
        store.say("r", "a", "one more thing", false, "p").unwrap_or_else(|e| panic!("{e}"));
        // The ending writes, then finds the message: it must be undone, and only a savepoint
        // undoes one job of a group.
        let last = Last { events: Vec::new(), evidence: Vec::new(), output: json!("out"), unless_messages: true };
        let ending = Ending::Completed { result: "fine".into(), usage: None };
        let (end, ended) = job(Some("a"), move |tx| {
            let (row, seq) = ops::finish_keeping(tx, &attempt("a"), &last, &ending)?;
            Ok((format!("{:?}", row.map(|r| r.state)), seq))
        });
        let (take, took) = claim("b");
        assert!(commit_group(&mut conn, vec![end, take]), "the group was not sent back");
        let got = answers(&[ended, took]);
        assert!(got[0].as_ref().is_err_and(|e| e.starts_with("MessagesWaiting")), "{:?}", got[0]);
        assert_eq!(got[1], Ok("Some((1, Running))".to_owned()));
        assert_eq!(store.task("r", "a").ok().flatten().map(|r| r.state), Some(TaskState::Running));
    }

    #[test]
    fn a_failing_statement_or_a_diverging_job_sends_the_group_back() {
        let (store, mut conn, _db) = store(&["a", "b", "c"]);
        let (bad, failed) = job(Some("a"), |tx| tx.exec("UPDATE nowhere SET x = 1", &[]).map(|n| (n.to_string(), 0)));
        let (take, took) = claim("b");
        assert!(commit_group(&mut conn, vec![bad, take]));
        let got = answers(&[failed, took]);
        assert!(got[0].as_ref().is_err_and(|e| e.contains("nowhere")), "{:?}", got[0]);
        assert_eq!(got[1], Ok("Some((1, Running))".to_owned()));
        // A job that asks for another statement when run again (it read the clock on an edge).
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = runs.clone();
        let (odd, oddly) = job(Some("a"), move |tx| {
            let sql = match seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
                0 => "SELECT 1::BIGINT",
                _ => "SELECT 2::BIGINT",
            };
            tx.int(sql, &[])?;
            Ok((tx.int("SELECT 3::BIGINT", &[])?.unwrap_or_default().to_string(), 0))
        });
        let (take, took) = claim("c");
        assert!(commit_group(&mut conn, vec![odd, take]));
        assert_eq!(answers(&[oddly, took]), [Ok("3".to_owned()), Ok("Some((1, Running))".to_owned())]);
        assert_eq!(store.task("r", "c").ok().flatten().map(|r| r.state), Some(TaskState::Running));
    }

    #[test]
    fn only_the_first_job_of_a_task_goes_side_by_side() {
        let (a1, _r1) = claim("a");
        let (a2, _r2) = claim("a");
        let (b, _r3) = claim("b");
        let (none, _r4) = job(None, |_| Ok((String::new(), 0)));
        let (together, rest) = rounds::side_by_side(vec![a1, a2, b, none]);
        let tasks = |jobs: &[Box<dyn Job>]| jobs.iter().map(|j| j.task().map(|(_, t)| t.clone())).collect::<Vec<_>>();
        assert_eq!(tasks(&together), [Some("a".to_owned()), Some("b".to_owned())]);
        assert_eq!(tasks(&rest), [Some("a".to_owned()), None]);
        // One job alone gains nothing from rounds.
        let (a, _r5) = claim("a");
        let (together, rest) = rounds::side_by_side(vec![a]);
        assert_eq!((together.len(), rest.len()), (0, 1));
    }
}
