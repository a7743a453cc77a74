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
//! [`crate::ops`]; this file is the machinery around it.
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

use crate::backend::{Backend, Cell, Query, Row, Work};
use crate::log::{OwnCommit, RawEvent, publish};
use crate::ops::{self, Arg, RawTask, Tx};
use crate::schema::{self, *};
use crate::state::TaskState;
use crate::store::Store;
use crate::{Attempt, SqliteStore, StoreError, TaskRow, lock, task_columns};

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
pub struct Sqlite {
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

/// SQLite's migrations, in the order its stores met them.
const FIRST: &[Migration] = &[
    &[RUNS, TASKS, ATTEMPTS, UPDATES, EVENTS, EVENTS_BY_RUN],
    &[QUESTIONS],
    &[TASKS_PENDING],
    &[UPDATES_REQUEST, TASKS_UNFINISHED],
];

/// The files of the SQLite stores this process opened, for [`checkpoint_open_stores`].
static OPENED: Mutex<Vec<std::path::PathBuf>> = Mutex::new(Vec::new());

/// Moves every commit of the SQLite stores this process opened from their `-wal` into the
/// database file itself (`PRAGMA wal_checkpoint(PASSIVE)`), so the file alone holds the
/// store: one copied or backed up is whole. Called as a process ends (a handle still held
/// somewhere then never closes, and SQLite checkpoints only at the last close); what cannot
/// be checkpointed (another process reading) is left for the next one, and said.
pub fn checkpoint_open_stores() {
    let paths = std::mem::take(&mut *lock(&OPENED));
    for path in paths {
        if let Err(e) = checkpoint(&path) {
            tracing::warn!(store = %path.display(), error = %e, "could not fold the store's -wal into it; the next close will");
        }
    }
}

fn checkpoint(path: &Path) -> Result<(), StoreError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(2))?;
    // PASSIVE: it takes no lock another process (a `pier serve` on the same file) would wait
    // for, and copies every frame no reader still needs, which is all of them once this
    // process is done.
    let (_, logged, copied): (i64, i64, i64) =
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    if copied < logged {
        return Err(StoreError::Db(format!(
            "{} of {logged} frames are still read by another process",
            logged - copied
        )));
    }
    Ok(())
}

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

/// Stores up to this size are checked page by page at open (`PRAGMA quick_check`: every
/// command pays it, about 1 ms a MiB from the page cache and 30 ms a MiB from a cold disk);
/// a larger one has its header and schema read.
const QUICK_CHECK_UP_TO: u64 = 16 << 20;

/// Whether the store at `path` reads whole, through a read-only connection (nothing is
/// written, not even the -wal's commits folded in): a new or empty file is. A damaged one is
/// refused, saying what SQLite found; so is one a newer pier wrote (a connection that could
/// write would fold that pier's -wal into the file as it closed).
fn check_whole(path: &Path) -> Result<(), StoreError> {
    let size = std::fs::metadata(path).map_or(0, |m| m.len());
    if size == 0 {
        return Ok(());
    }
    let damaged = |what: String| StoreError::Damaged { path: path.display().to_string(), what };
    let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = match Connection::open_with_flags(path, flags) {
        Ok(conn) => conn,
        Err(rusqlite::Error::SqliteFailure(e, m))
            if matches!(e.code, rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase) =>
        {
            return Err(damaged(m.unwrap_or_else(|| e.to_string())));
        }
        Err(e) => return Err(e.into()),
    };
    conn.busy_timeout(Duration::from_secs(10))?;
    let read = if size <= QUICK_CHECK_UP_TO {
        conn.query_row("PRAGMA quick_check(1)", [], |r| r.get::<_, String>(0))
    } else {
        conn.query_row("SELECT COUNT(*) FROM sqlite_schema", [], |r| r.get::<_, i64>(0)).map(|_| "ok".to_owned())
    };
    match read {
        Ok(verdict) if verdict == "ok" => {
            let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
            refuse_newer(path, version)
        }
        Ok(verdict) => Err(damaged(verdict)),
        Err(rusqlite::Error::SqliteFailure(e, m))
            if matches!(e.code, rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase) =>
        {
            Err(damaged(m.unwrap_or_else(|| e.to_string())))
        }
        Err(e) => Err(e.into()),
    }
}

/// A store from a newer pier is refused before anything is written to it.
fn refuse_newer(path: &Path, version: i64) -> Result<(), StoreError> {
    if version > schema::version_count(FIRST) as i64 {
        return Err(StoreError::Db(format!(
            "{} was written by a newer pier (store version {version}; this pier knows versions up to {}); upgrade pier",
            path.display(),
            schema::version_count(FIRST)
        )));
    }
    Ok(())
}

/// Brings the schema up to date. Processes opening a new store at once (two `pier serve`
/// on one file, `pier run` beside `pier answer`) migrate one after another: the write lock
/// is taken first and the version read again under it, so each migration runs once.
fn migrate(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let migrated = (|| -> Result<(), StoreError> {
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        for (i, migration) in schema::migrations(FIRST).enumerate().skip(version.max(0) as usize) {
            conn.execute_batch(&schema::batch(migration, &schema::SQLITE))?;
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

impl Store<Sqlite> {
    /// Opens (and migrates) the store at `path`.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        let db = Sqlite::open(path).map_err(|e| match e {
            StoreError::Db(m) if is_full(&m) => StoreError::Full { path: path.display().to_string() },
            e => e,
        })?;
        Ok(Store { db })
    }
}

impl Sqlite {
    fn open(path: &Path) -> Result<Sqlite, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Db(format!("{}: {e}", dir.display())))?;
        }
        // A damaged store is refused before anything is written to it (or folded into it).
        check_whole(path)?;
        let conn = Connection::open(path)?;
        // Read again: a newer pier may have migrated the file since.
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        refuse_newer(path, version)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        // Statements are reused by every commit; the default cache of 16 is too small.
        conn.set_prepared_statement_cache_capacity(64);
        wal(&conn)?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        if version < schema::version_count(FIRST) as i64 {
            migrate(&conn)?;
        }
        let last: i64 = conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM events", [], |r| r.get(0))?;
        let seq_tx = Arc::new(watch::Sender::new(last));
        let reader = Connection::open(path)?;
        reader.busy_timeout(std::time::Duration::from_secs(10))?;
        reader.set_prepared_statement_cache_capacity(64);
        {
            let mut opened = lock(&OPENED);
            if !opened.iter().any(|p| p == path) {
                opened.push(path.to_owned());
            }
        }
        Ok(Sqlite {
            conn: Mutex::new(conn),
            queue: Mutex::new(Vec::new()),
            reader: Mutex::new(reader),
            seq_tx,
            own: crate::log::own_commits(),
            watching: std::sync::Once::new(),
            path: path.display().to_string(),
        })
    }

    /// Runs `work` atomically in the next group commit and returns its answer once
    /// the commit is on disk. `work` returns its answer and the highest event
    /// sequence it wrote (0 for none); an error undoes only this work.
    fn group_commit<T: Send + 'static>(
        &self,
        mut work: impl FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send + 'static,
    ) -> Result<(T, i64), StoreError> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(T, i64), StoreError>>(1);
        let job: Job = Box::new(move |c: Result<&Connection, &StoreError>| {
            let outcome = match c {
                Ok(c) => savepoint(c, &mut work),
                Err(e) => Err(e.clone()),
            };
            let seq = outcome.as_ref().map(|(_, seq)| *seq).map_err(Clone::clone);
            let finish: Finish = Box::new(move |committed: Result<(), StoreError>| {
                let _ = tx.send(committed.and(outcome));
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
                crate::log::announce(&self.own, &self.seq_tx, own, last);
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
    let sql = concat!(
        "SELECT ",
        task_columns!(),
        " FROM tasks WHERE (run_id, id) IN
             (SELECT run_id, task_id FROM events WHERE seq > ?1 AND seq <= ?2 AND task_id IS NOT NULL)"
    );
    crate::store::tasks(SqliteTx(c).rows(sql, &[Arg::Int(after), Arg::Int(upto)])?)
}

/// The events of `(after, upto]`, in order, their data as text.
fn events_between(c: &Connection, after: i64, upto: i64) -> Result<Vec<RawEvent>, StoreError> {
    let sql = "SELECT seq, run_id, task_id, type, at_ms, data FROM events WHERE seq > ?1 AND seq <= ?2 ORDER BY seq";
    SqliteTx(c).rows(sql, &[Arg::Int(after), Arg::Int(upto)])?.into_iter().map(crate::store::raw_event).collect()
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

impl Backend for Sqlite {
    const QUEUE_PAGE: &'static str = crate::queue_page!("INDEXED BY tasks_queue");
    const UNFINISHED_TASKS: &'static str = crate::tasks_in!(
        "IN ('pending', 'running', 'awaiting_input')",
        "INDEXED BY tasks_unfinished",
        "INDEXED BY runs_age"
    );
    const RUNS_WITH_TASK: &'static str = crate::runs_with_task!("INDEXED BY runs_age");
    const LAST_SEQ: &'static str = "SELECT COALESCE(MAX(seq), 0) FROM events";
    const KEY_HOLDERS: &'static str = crate::keys::SQLITE_HOLDERS;

    fn write<T: Send + 'static>(&self, _task: Option<(&str, &str)>, work: Work<T>) -> Result<(T, i64), StoreError> {
        self.group_commit(work)
    }

    fn read<T>(&self, f: impl Fn(&mut dyn Query) -> Result<T, StoreError>) -> Result<T, StoreError> {
        f(&mut SqliteTx(&lock(&self.reader)))
    }

    fn backup(&self, to: &Path) -> Result<(), StoreError> {
        if std::fs::symlink_metadata(to).is_ok() {
            return Err(StoreError::Db(format!(
                "{} exists; a backup goes to a new file: remove it or name another",
                to.display()
            )));
        }
        let target = to.to_str().ok_or_else(|| StoreError::Db(format!("{} is not a UTF-8 path", to.display())))?;
        // One read transaction: the copy is the store as of one commit, and writers go on.
        lock(&self.reader).execute("VACUUM INTO ?1", params![target]).map_err(|e| self.named(e.into()))?;
        Ok(())
    }

    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError> {
        let c = lock(&self.reader);
        // The bound is read first: a change that lands after it is reported again next time.
        let upto = last_seq(&c)?;
        if upto <= after {
            return Ok((Vec::new(), after));
        }
        Ok((changed_between(&c, after, upto)?, upto))
    }

    fn subscribe(&self) -> watch::Receiver<i64> {
        self.watching.call_once(|| self.watch_others());
        self.seq_tx.subscribe()
    }

    fn own_commits(&self) -> broadcast::Receiver<Arc<OwnCommit>> {
        self.own.subscribe()
    }
}

impl Query for SqliteTx<'_> {
    fn rows(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Vec<Row>, StoreError> {
        use rusqlite::types::ValueRef;
        let mut stmt = self.0.prepare_cached(sql)?;
        let n = stmt.column_count();
        let rows = stmt.query_map(rusqlite::params_from_iter(args), |r| {
            let mut cells = Vec::with_capacity(n);
            for i in 0..n {
                cells.push(match r.get_ref(i)? {
                    ValueRef::Null => Cell::Null,
                    ValueRef::Integer(v) => Cell::Int(v),
                    ValueRef::Real(v) => Cell::Int(v as i64),
                    ValueRef::Text(t) | ValueRef::Blob(t) => Cell::Text(String::from_utf8_lossy(t).into_owned()),
                });
            }
            Ok(Row(cells))
        })?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }
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
        let sql = concat!("SELECT ", task_columns!(), " FROM tasks WHERE run_id = ?1 AND id = ?2");
        self.rows(sql, &[Arg::Text(run), Arg::Text(task)])?.into_iter().next().map(Row::raw_task).transpose()
    }

    fn take(&mut self, c: &ops::Claim<'_>) -> Result<Option<TaskRow>, StoreError> {
        // The transaction holds the file: nobody races the read and the update.
        ops::take_by_statements(self, c)
    }

    fn end_held(&mut self, e: &ops::EndHeld<'_>) -> Result<Option<(TaskState, TaskRow)>, StoreError> {
        ops::end_held_by_statements(self, e)
    }

    fn event(&mut self, run: &str, task: Option<&str>, kind: &str, data: &Value) -> Result<i64, StoreError> {
        // `seq` is the INTEGER PRIMARY KEY: numbered in the writing transaction, which
        // holds the file, so gap-free and in commit order.
        self.0
            .prepare_cached("INSERT INTO events (run_id, task_id, type, at_ms, data) VALUES (?1, ?2, ?3, ?4, ?5)")?
            .execute(params![run, task, kind, crate::now_ms(), data.to_string()])?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The steps SQLite's planner takes for `sql` in a new store.
    fn query_plan(sql: &str) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = Sqlite::open(&dir.path().join("pier.db")).unwrap_or_else(|e| panic!("{e}"));
        let conn = lock(&store.reader);
        conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .and_then(|mut s| {
                let none = vec![rusqlite::types::Null; s.parameter_count()];
                s.query_map(rusqlite::params_from_iter(none), |r| r.get::<_, String>(3))?.collect()
            })
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// A page of the queue seeks in `tasks_queue` past the last key read: a lease deep in a long
    /// queue reads its page, not every pending task before it.
    #[test]
    fn a_page_of_the_queue_is_a_seek_in_its_index() {
        let plan = query_plan(<Sqlite as Backend>::QUEUE_PAGE);
        assert_eq!(plan.len(), 1, "no sort: {plan:?}");
        assert!(plan[0].starts_with("SEARCH tasks USING INDEX tasks_queue ((rank_ms,run_id,ord)>(?,?,?))"), "{plan:?}");
    }

    /// A run's age is read from `runs_age`, never from the run's row: there it comes after the
    /// plan, and reading it walked the plan's every overflow page (on each lease of a worker).
    #[test]
    fn queries_of_runs_by_age_never_read_a_runs_row() {
        let runs = [
            <Sqlite as Backend>::UNFINISHED_TASKS,
            <Sqlite as Backend>::RUNS_WITH_TASK,
            "SELECT id FROM runs ORDER BY created_at_ms, id",
            "SELECT r.id, r.created_at_ms FROM runs r ORDER BY r.created_at_ms, r.id",
        ];
        for sql in runs {
            let plan = query_plan(sql);
            let runs: Vec<&String> =
                plan.iter().filter(|step| step.contains(" runs") || step.contains(" r ")).collect();
            assert!(!runs.is_empty(), "{sql}: {plan:?}");
            assert!(runs.iter().all(|step| step.contains("COVERING INDEX runs_age")), "{sql}: {plan:?}");
        }
    }
}
