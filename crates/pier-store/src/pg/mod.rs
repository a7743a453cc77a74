//! The PostgreSQL backend: several hosts (`pier serve` nodes) over one database.
//!
//! The operations are [`crate::ops`], run by the committer in group transactions (READ
//! COMMITTED; see `run_group`), those of different tasks side by side ([`rounds`]). Row locks do what SQLite's single writer does: [`Tx::task`]
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

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio_postgres::Client;

use target::Target;

use crate::backend::{Backend, Cell, Query, Work};
use crate::log::{OwnCommit, publish};
use crate::ops::{self, Arg, Tx};
use crate::schema::{self, *};
use crate::store::Store;
use crate::{PgStore, StoreError, TaskRow, lock, task_columns};

mod commit;
mod conn;
mod job;
mod replay;
mod rounds;
mod target;
mod tx;

use commit::*;
use conn::*;
use job::Op;

pub use target::redacted;

/// How often the listener re-reads the counter when no notification came.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(2);
/// PostgreSQL's migrations: its first is SQLite's first four, with the event counter.
const FIRST: &[Migration] = &[&[
    RUNS,
    TASKS,
    TASKS_PENDING,
    TASKS_UNFINISHED,
    ATTEMPTS,
    UPDATES,
    UPDATES_REQUEST,
    QUESTIONS,
    EVENTS,
    EVENTS_BY_RUN,
    "CREATE TABLE pier_seq (id INT PRIMARY KEY CHECK (id = 1), n BIGINT NOT NULL)",
    "INSERT INTO pier_seq VALUES (1, 0)",
]];

/// Any lock key of ours: migrations run under it, once, however many nodes start together.
const MIGRATION_LOCK: i64 = 0x0070_6965_726d_6967; // "piermig"

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

    /// The database's URL, for `--store` or [`crate::open`].
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

fn migrate(client: &mut Client) -> Result<(), StoreError> {
    block_on(client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]))?;
    let done = (|| -> Result<(), StoreError> {
        block_on(client.batch_execute(
            "CREATE TABLE IF NOT EXISTS pier_migrations (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)",
        ))?;
        let have: i64 =
            block_on(client.query_one("SELECT COALESCE(MAX(version), 0) FROM pier_migrations", &[]))?.try_get(0)?;
        if have > schema::version_count(FIRST) as i64 {
            return Err(StoreError::Db(format!(
                "the database was written by a newer pier (schema version {have}; this pier knows versions up to {}); \
                 upgrade pier",
                schema::version_count(FIRST)
            )));
        }
        for (i, migration) in schema::migrations(FIRST).enumerate().skip(have as usize) {
            let tx = block_on(client.transaction())?;
            block_on(tx.batch_execute(&schema::batch(migration, &schema::POSTGRES)))?;
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

/// Every task touched by an event after `?1` ([`TaskStore::tasks_changed`]). The bound is the
/// committed counter, in the statement's snapshot with the events: every event up to it is
/// visible (a commit that moved it had all of its own, and every earlier one had committed
/// before it could take the counter row). One statement: the counter's row, with each changed
/// task beside it (or none), each read by its key whatever the statistics say (see
/// `commit::NUMBER`).
pub(super) const CHANGED: &str = concat!(
    "SELECT t.*, s.n FROM (SELECT n FROM pier_seq WHERE id = 1) s
     LEFT JOIN LATERAL (SELECT ",
    task_columns!(),
    " FROM (SELECT DISTINCT run_id AS r, task_id AS k FROM events
            WHERE s.n > ?1 AND seq > ?1 AND seq <= s.n AND task_id IS NOT NULL) e
         CROSS JOIN LATERAL (SELECT * FROM tasks WHERE run_id = e.r AND id = e.k LIMIT 1) tasks) t
     ON true"
);

impl Backend for Pg {
    const QUEUE_PAGE: &'static str = crate::queue_page!("");
    const UNFINISHED_TASKS: &'static str = crate::tasks_in!("IN ('pending', 'running', 'awaiting_input')", "", "");
    const RUNS_WITH_TASK: &'static str = crate::runs_with_task!("");
    const LAST_SEQ: &'static str = "SELECT n FROM pier_seq";
    const KEY_HOLDERS: &'static str = crate::keys::PG_HOLDERS;

    fn write<T: Send + 'static>(&self, task: Option<(&str, &str)>, work: Work<T>) -> Result<(T, i64), StoreError> {
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

    fn backup(&self, _to: &std::path::Path) -> Result<(), StoreError> {
        Err(StoreError::Db(
            "a PostgreSQL store is backed up by PostgreSQL: run `pg_dump --format=custom DATABASE_URL > pier.dump` \
             (restore into an empty database with `pg_restore --dbname DATABASE_URL pier.dump`)"
                .into(),
        ))
    }

    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError> {
        let rows = self.read(|q| q.rows(CHANGED, &[Arg::Int(after)]))?;
        let mut upto = after;
        let mut changed = Vec::with_capacity(rows.len());
        for mut r in rows {
            upto = upto.max(r.int(14)?);
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

#[cfg(test)]
mod tests;
