//! The open write transaction of the committer: statements pipelined, or noted and answered
//! from a replay when its group runs in rounds.

use std::collections::{HashMap, HashSet};

use serde_json::Value;
use tokio_postgres::{Client, Statement};

use super::conn::*;
use super::replay::*;
use crate::backend::{Cell, Row};
use crate::ops::{self, Arg, RawTask, Tx};
use crate::state::TaskState;
use crate::{Attempt, StoreError, TaskRow};

pub(crate) struct Pending {
    pub(super) run: String,
    pub(super) task: Option<String>,
    pub(super) kind: String,
    pub(super) at_ms: i64,
    pub(super) data: String,
}

/// The open transaction: statements go through the connection's cache; events wait for the commit.
pub(crate) struct PgTx<'c> {
    /// In a transaction this code opened (`BEGIN`) and ends (`COMMIT`, or by dropping the
    /// connection): no `Transaction` guard, so both ride with other statements.
    pub(crate) tx: &'c Client,
    pub(super) statements: &'c mut HashMap<&'static str, Statement>,
    pub(crate) events: Vec<Pending>,
    /// The last statement failed in a way that rolled the transaction back: run it again.
    pub(crate) retry: bool,
    /// How the last job that ran statements ends its savepoint (`RELEASE job; SAVEPOINT job`
    /// or `ROLLBACK TO job`), not yet sent: it rides in the pipeline of the next statement,
    /// so closing a job costs no round trip of its own.
    pub(crate) step: Option<&'static str>,
    /// The current job has run a statement (so its savepoint holds work to keep or undo).
    pub(super) dirty: bool,
    /// Sending `step` failed: the transaction is gone, and the group with it.
    pub(super) broken: Option<tokio_postgres::Error>,
    /// Each job in a savepoint of its own. Without (the usual way, see `run_group`), a failed
    /// job that changed something sends the whole group back to be run this way.
    pub(super) careful: bool,
    /// The current job ran a statement other than a read of a task (which only locks).
    pub(crate) wrote: bool,
    /// A statement failed: PostgreSQL aborted the transaction (or the savepoint).
    pub(crate) aborted: bool,
    /// In rounds (`rounds`): the current job's answers so far, and where it stops.
    pub(super) replay: Option<Replay>,
    /// In rounds, the current job claimed a task with concurrency keys: it read what other
    /// jobs' endings change (the keys' counts and holders), so its events go after theirs in
    /// the log (see `rounds`).
    pub(super) late: bool,
    pub(super) keyed_runs: &'c mut KeyedRuns,
    /// The tasks whose concurrency keys' counts this transaction has locked (without
    /// savepoints: a lock taken in one that is rolled back goes with it). Row locks are held to
    /// the end of the transaction, and a task's keys never change, so another claim of one of
    /// them in the group (two claimers racing for it) needs no second `LOCK_KEYS`.
    keys_locked: HashSet<(String, String)>,
    /// The `LOCK_KEYS` statements sent on their own (outside rounds), for the tests.
    pub(super) locks_sent: usize,
}

/// The runs a connection's claims found tasks with concurrency keys in. A claim of a task of
/// one is sent as `CLAIM_HELD` at once, instead of `CLAIM` finding the task keyed and
/// `CLAIM_HELD` following in the next round. A hint only: both ways claim alike, and a task
/// without keys in such a run is claimed by `CLAIM_HELD` too. What a group learns is used from
/// the next group on: a job run again in rounds must ask for the same statements each time.
#[derive(Default)]
pub(crate) struct KeyedRuns {
    known: HashSet<String>,
    learned: Vec<String>,
}

impl KeyedRuns {
    /// At most this many runs are remembered; past it the hint starts again from nothing.
    const MAX: usize = 4096;

    /// `run` holds keyed tasks: known from the next group on.
    fn learn(&mut self, run: &str) {
        if !self.learned.iter().any(|r| r == run) {
            self.learned.push(run.to_owned());
        }
    }

    /// What the last group learned, known from now on.
    fn fold(&mut self) {
        if self.known.len() + self.learned.len() > Self::MAX {
            self.known.clear();
        }
        self.known.extend(self.learned.drain(..));
    }
}

/// Opens a group's transaction; `BEGIN_CAREFUL` with the first job's savepoint.
pub(super) const BEGIN: &str = "BEGIN";
pub(super) const BEGIN_CAREFUL: &str = "BEGIN; SAVEPOINT job";
/// Keeps a job's work and opens the next job's savepoint.
pub(super) const KEEP: &str = "RELEASE job; SAVEPOINT job";
/// Undoes a job's work; the savepoint stays for the next job.
pub(super) const UNDO: &str = "ROLLBACK TO job";

impl PgTx<'_> {
    /// A group's transaction on `c`. `BEGIN`, and the step that ends each job's savepoint,
    /// ride ahead of the next statement (`PgTx::pipelined`): no round trip of their own. A
    /// group that fails before its `COMMIT` is abandoned with its connection (the caller
    /// drops it), which rolls it back.
    pub(super) fn begin(c: &mut Conn, careful: bool) -> PgTx<'_> {
        c.keyed_runs.fold();
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
            late: false,
            keyed_runs: &mut c.keyed_runs,
            keys_locked: HashSet::new(),
            locks_sent: 0,
        }
    }

    pub(super) fn prepared(&mut self, sql: &'static str) -> Result<Statement, StoreError> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        self.flush()?;
        self.statement(sql)
    }

    /// `sql` prepared on the connection, once (outside the transaction's order: preparing
    /// runs nothing).
    pub(super) fn statement(&mut self, sql: &'static str) -> Result<Statement, StoreError> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = block_on(self.tx.prepare(&dialect(sql))).map_err(|e| self.failed(e))?;
        self.statements.insert(sql, s.clone());
        Ok(s)
    }

    /// Runs one job with `replay`'s answers (see `rounds`): its outcome, the replay with
    /// where it stopped, and the events it buffered.
    pub(crate) fn replaying(
        &mut self,
        replay: Replay,
        job: impl FnOnce(&mut Self) -> Result<(), StoreError>,
    ) -> (Result<(), StoreError>, Replay, Vec<Pending>) {
        self.replay = Some(replay);
        (self.retry, self.wrote, self.aborted, self.late) = (false, false, false, false);
        let outcome = job(self);
        let replay = self.replay.take().unwrap_or_default();
        (outcome, replay, std::mem::take(&mut self.events))
    }

    /// In rounds: the answers to a call of `wants` (statement, arguments, whether rows are
    /// wanted), or `Err` with the call noted as where the job stops. `None` outside rounds.
    pub(super) fn replayed(
        &mut self,
        wants: &[(&'static str, &[Arg<'_>], bool)],
    ) -> Option<Result<Vec<Answer>, StoreError>> {
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
    pub(super) fn flush(&mut self) -> Result<(), StoreError> {
        self.dirty = true;
        let Some(step) = self.step.take() else { return Ok(()) };
        block_on(self.tx.batch_execute(step)).map_err(|e| self.lost(e))
    }

    pub(super) fn lost(&mut self, e: tokio_postgres::Error) -> StoreError {
        let error = StoreError::from(&e);
        self.broken = Some(e);
        error
    }

    /// Runs `statement` with the pending savepoint step sent ahead of it in one pipeline:
    /// PostgreSQL runs them in order, so the statement sees the step done.
    pub(super) fn pipelined<T>(
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
    pub(super) fn end_job(&mut self, kept: bool) {
        if std::mem::take(&mut self.dirty) && self.careful {
            self.step = Some(if kept { KEEP } else { UNDO });
        }
    }

    pub(super) fn failed(&mut self, e: tokio_postgres::Error) -> StoreError {
        self.retry |= retryable(&e);
        self.aborted = true;
        e.into()
    }

    pub(super) fn rows(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        self.wrote = true;
        self.query(sql, a)
    }

    pub(super) fn query(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        if let Some(answers) = self.replayed(&[(sql, a, true)]) {
            return answers?.pop().map(Answer::rows).ok_or_else(no_answer)?;
        }
        let s = self.prepared(sql)?;
        let tx = self.tx;
        self.pipelined(tx.query(&s, &args(a)))
    }

    pub(super) fn one_task(&mut self, sql: &'static str, run: &str, task: &str) -> Result<Option<RawTask>, StoreError> {
        let rows = self.query(sql, &[Arg::Text(run), Arg::Text(task)])?;
        let row = rows.first().map(cells).transpose().map_err(|e| self.failed(e))?;
        row.map(Row::raw_task).transpose()
    }
}

pub(super) const TASK_FOR_UPDATE: &str =
    "SELECT run_id, id, state, version, attempt, failures, lease_owner, lease_expires_at_ms,
     not_before_ms, result, usage, error, spec, cancel_requested FROM tasks WHERE run_id = ?1 AND id = ?2 FOR UPDATE";
/// A claim's move of the task its `c` found and locked, if pending, due and `$also`: the task
/// running under the claimer's lease (`u`, the row as it left it), and its attempt's row (`a`).
macro_rules! moved {
    ($also:literal) => {
        concat!(
            "
     u AS (UPDATE tasks t SET state = 'running', version = t.version + 1, attempt = t.attempt + 1,
             lease_owner = ?3, lease_expires_at_ms = ?4
         FROM c WHERE t.ctid = c.ctid AND c.state = 'pending' AND c.not_before_ms <= ?5 AND ",
            $also,
            "
         RETURNING t.run_id, t.id, t.state, t.version, t.attempt, t.failures, t.lease_owner,
             t.lease_expires_at_ms, t.not_before_ms, t.result, t.usage, t.error, t.spec, t.cancel_requested),
     a AS (INSERT INTO attempts (run_id, task_id, attempt) SELECT run_id, id, attempt FROM u
         ON CONFLICT DO NOTHING)"
        )
    };
}

/// The concurrency keys (`k`: key, limit) of the task `c` found, read from `$json`, if it is
/// pending and due; none otherwise.
macro_rules! due_keys {
    ($json:literal) => {
        concat!(
            "
     k AS (SELECT x.key, x.\"limit\" AS lim FROM c, jsonb_to_recordset(",
            $json,
            ") AS x(key text, \"limit\" bigint)
             WHERE c.state = 'pending' AND c.not_before_ms <= ?5),"
        )
    };
}

/// A claim in one statement: the row locked by primary key, skipped if another claimer holds
/// it; updated through its `ctid` only if pending and due; the attempt's row added; the row
/// as the claim left it, and whether a pending, due task was left for its concurrency keys
/// (`CLAIM_HELD` claims it). The state is tested on the locked row, never in the lookup: with
/// `state = 'pending'` there the generic plan of the prepared statement walked the
/// `tasks_pending` partial index over the run's pending tasks (0.5 ms per claim at 10,000 of
/// them, against 0.01 ms).
pub(super) const CLAIM: &str = concat!(
    "WITH c AS (SELECT ctid, state, not_before_ms, keyed FROM tasks
         WHERE run_id = ?1 AND id = ?2 FOR UPDATE SKIP LOCKED),",
    moved!("c.keyed IS NULL"),
    " SELECT u.*, CASE WHEN c.state = 'pending' AND c.not_before_ms <= ?5 THEN c.keyed END
     FROM c LEFT JOIN u ON true"
);

/// The claim of a task with concurrency keys while each key's count (`key_counts.held`, never
/// below its live holders) has room, in one statement: the task's row locked as by `CLAIM`;
/// each key's count raised only if it has room, under the count row's lock (waited for, so a
/// key's places go first come first served; a row another transaction changed is re-read as it
/// committed it, so the test and the raise see the last commit); the task moved, and its
/// attempt's row added, only if every count was raised (those raised for a task refused on
/// another key stay high until a claim counts the holders). Besides the row, whether a pending,
/// due task was left (a key without a count, or at its limit, or a keyed task without its keys'
/// column, written by a pier from before it): `CLAIM_KEYED` then counts the key's holders. The
/// count rows are found through their primary key (`= ANY`: a join with the task's keys chose a
/// sequential scan of every key on an empty table's generic plan). A cycle of lock waits with
/// another node's group (two claims of several keys, or a claim and an ending, which lowers
/// counts too) is broken by PostgreSQL, and the group it aborts runs again.
pub(super) const CLAIM_HELD: &str = concat!(
    "WITH c AS (SELECT ctid, state, not_before_ms, keyed, concurrency FROM tasks WHERE run_id = ?1 AND id = ?2 FOR UPDATE SKIP LOCKED),",
    due_keys!("c.concurrency::jsonb"),
    "
     n AS (UPDATE key_counts s SET held = s.held + 1
         WHERE s.key = ANY (ARRAY(SELECT k.key FROM k)) AND s.held < (SELECT k.lim FROM k WHERE k.key = s.key)
         RETURNING 1),",
    moved!("(SELECT COUNT(*) FROM n) = (SELECT COUNT(*) FROM k) AND (c.keyed IS NULL OR c.concurrency IS NOT NULL)"),
    " SELECT u.*, CASE WHEN c.state = 'pending' AND c.not_before_ms <= ?5 THEN 1 END FROM c LEFT JOIN u ON true"
);

/// Locks the count rows of task `?1`/`?2`'s concurrency keys, each made if the key has none
/// (at 0: `CLAIM_KEYED` sets it), in the keys' order, for a `CLAIM_KEYED` after it (in the same
/// pipeline: [`KeyedRuns`]), whose snapshot is then taken with them held. Whatever the task's
/// state: the row is not locked here, and a task this statement's snapshot shows running may
/// be pending again (a retry, a person's) in the claim's. A task's keys never change. The
/// `WHERE false` locks an existing row without writing a version of it.
pub(super) const LOCK_KEYS: &str = "INSERT INTO key_counts (key, held) SELECT DISTINCT x.key, 0
         FROM tasks s, jsonb_to_recordset(COALESCE(s.concurrency::jsonb, s.spec::jsonb -> 'concurrency')) AS x(key text)
         WHERE s.run_id = ?1 AND s.id = ?2 AND s.keyed IS NOT NULL ORDER BY x.key
     ON CONFLICT (key) DO UPDATE SET held = key_counts.held WHERE false";

/// `LOCK_KEYS` of every task of `?1`/`?2` (runs and tasks, side by side) in one statement, in
/// one order of all their keys: how a round sends its keyed claims' locks (`rounds`).
pub(super) const LOCK_KEYS_OF: &str = "INSERT INTO key_counts (key, held) SELECT DISTINCT x.key, 0
         FROM UNNEST(?1::text[], ?2::text[]) AS w(run_id, id) JOIN tasks s ON s.run_id = w.run_id AND s.id = w.id,
             jsonb_to_recordset(COALESCE(s.concurrency::jsonb, s.spec::jsonb -> 'concurrency')) AS x(key text)
         WHERE s.keyed IS NOT NULL ORDER BY x.key
     ON CONFLICT (key) DO UPDATE SET held = key_counts.held WHERE false";

/// A claim of a task with concurrency keys that counts each key's holders, once the keys'
/// count rows are locked (by `LOCK_KEYS`; a task row another transaction holds is skipped, as
/// by `CLAIM`, and the keys of a task that cannot be claimed are not even read): in one
/// statement each key's live holders counted from the tasks ([`crate::keys`]), the task moved
/// only if every key has room, its attempt's row added, and each key's count set to its
/// holders. The count sees every commit before the statement began, which is after the locks
/// were taken, and every claim and every ending of the key takes the same lock: none commits a
/// change it misses. Sent only when `CLAIM_HELD` found a key at its count's limit (or without
/// one), so on every claim of a key that is full, and rarely otherwise. As in `CLAIM`, the task
/// is found (and locked) by primary key and its state tested on the row found.
pub(super) const CLAIM_KEYED: &str = concat!(
    "WITH c AS (SELECT ctid, state, not_before_ms, concurrency, spec FROM tasks WHERE run_id = ?1 AND id = ?2 FOR UPDATE SKIP LOCKED),",
    due_keys!("COALESCE(c.concurrency::jsonb, c.spec::jsonb -> 'concurrency')"),
    "
     r AS MATERIALIZED (SELECT k.key, k.lim, ",
    crate::holders!("k.key", postgres, ""),
    " AS n FROM k),",
    moved!("NOT EXISTS (SELECT 1 FROM r WHERE r.n >= r.lim)"),
    ",
     w AS (UPDATE key_counts s SET held = (SELECT r.n FROM r WHERE r.key = s.key) + (SELECT COUNT(*) FROM u)
         WHERE s.key = ANY (ARRAY(SELECT r.key FROM r)))
     SELECT * FROM u"
);

/// An ending in one statement: the row locked by primary key, updated through its `ctid`
/// only if the attempt holds it (same attempt and owner, live, lease not expired) and no
/// cancel waits for it (then `ops` ends it cancelled), its state before returned beside the
/// new row. As in `CLAIM`, the state is tested on the locked row.
/// `END_KEEPING` also keeps the attempt's output (`?12`), whether or not the ending applies.
macro_rules! end_statement {
    ([$($keep:tt)*], $open:literal, $($close:tt)*) => {
        concat!(
            "WITH ",
            $($keep)*
            "o AS (SELECT ctid, state, concurrency FROM tasks WHERE run_id = ?1 AND id = ?2 FOR UPDATE)",
            $open,
            "
     UPDATE tasks t SET state = ?3, version = t.version + 1, failures = t.failures + ?4, lease_owner = NULL,
         lease_expires_at_ms = NULL, not_before_ms = COALESCE(?5, t.not_before_ms),
         result = COALESCE(?6, t.result), usage = COALESCE(?7, t.usage), error = ?8
     FROM o WHERE t.ctid = o.ctid AND o.state IN ('running', 'awaiting_input') AND t.attempt = ?9
         AND t.lease_owner = ?10 AND t.lease_expires_at_ms >= ?11 AND t.cancel_requested IS NULL
     RETURNING t.run_id, t.id, t.state, t.version, t.attempt, t.failures, t.lease_owner,
         t.lease_expires_at_ms, t.not_before_ms, t.result, t.usage, t.error, t.spec, t.cancel_requested,
         o.state AS was",
            $($close)*
        )
    };
}

/// The ending (`e`) of an attempt that holds concurrency keys gives each key's place back: its
/// count lowered by one, only when the ending applies (an attempt stops holding once, and only
/// by the ending that applies to it), so a count stays at or above its live holders. An ending
/// sent without it (`END`, where the connection does not know the run holds keyed tasks) is
/// followed by `GIVE_BACK` once its row shows the keys.
macro_rules! released {
    () => {
        "), d AS (UPDATE key_counts s SET held = s.held - 1 WHERE EXISTS (SELECT 1 FROM e)
             AND s.key = ANY (ARRAY(SELECT x.key FROM o, jsonb_to_recordset(o.concurrency::jsonb) AS x(key text)))
             AND s.held > 0)
     SELECT * FROM e"
    };
}

/// `END_KEEPING`'s keeping of the attempt's output, whether or not the ending applies.
macro_rules! keeping {
    () => {
        "k AS (UPDATE attempts SET output = ?12 WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?9),
     "
    };
}

pub(super) const END: &str = end_statement!([], "",);
pub(super) const END_KEEPING: &str = end_statement!([keeping!(),], "",);
/// A place of key `?1` given back by an operation that ends a live attempt's hold other than
/// by `END_KEYED` ([`ops::Tx::gives_back`]).
pub(super) const GIVE_BACK: &str = "UPDATE key_counts SET held = held - 1 WHERE key = ?1 AND held > 0";

/// `END` and `END_KEEPING` of a task of a run known to hold keyed tasks ([`KeyedRuns`]); where
/// the run is not known, `END` finds the task keyed and [`GIVE_BACK`] follows.
pub(super) const END_KEYED: &str = end_statement!([], ", e AS (", released!());
pub(super) const END_KEEPING_KEYED: &str = end_statement!([keeping!(),], ", e AS (", released!());

impl PgTx<'_> {
    /// [`Tx::take`] of a task with concurrency keys (or of any task of a run known to hold
    /// some): `CLAIM_HELD`, and only if it left the task for a key at its count's limit (or
    /// without one), the keys locked by `LOCK_KEYS` and the claim that counts their holders,
    /// `CLAIM_KEYED`, in one round trip. A second such claim of the task in the transaction
    /// sends `CLAIM_KEYED` alone: its keys are still locked.
    fn take_keyed(&mut self, c: &ops::Claim<'_>) -> Result<Option<TaskRow>, StoreError> {
        let ops::Claim { run, task, owner, until, now } = *c;
        let a = [Arg::Text(run), Arg::Text(task), Arg::Text(owner), Arg::Int(until), Arg::Int(now)];
        // It may count on a place an ending in the same round gave back (see `rounds`).
        self.late = self.replay.is_some();
        let rows = self.rows(CLAIM_HELD, &a)?;
        let Some(mut row) = rows.first().map(cells).transpose().map_err(|e| self.failed(e))? else { return Ok(None) };
        match (matches!(row.0.first(), Some(Cell::Text(_))), row.opt_int(14)?) {
            (true, _) => return Ok(Some(ops::decode(row.raw_task()?)?)),
            (false, None) => return Ok(None),
            (false, Some(_)) => {}
        }
        // A job of the rounds asks the same each time it runs again, so only one run after
        // them (the group's second claim of a task) skips the lock its first took.
        let locked = self.replay.is_none() && self.keys_locked.contains(&(run.to_owned(), task.to_owned()));
        let rows = if locked {
            self.rows(CLAIM_KEYED, &a)?
        } else if let Some(answers) = self.replayed(&[(LOCK_KEYS, &a[..2], true), (CLAIM_KEYED, &a, true)]) {
            answers?.pop().map(Answer::rows).ok_or_else(no_answer)??
        } else {
            self.locks_sent += 1;
            let (locks, claim) = (self.prepared(LOCK_KEYS)?, self.prepared(CLAIM_KEYED)?);
            let tx = self.tx;
            let (lock_args, claim_args) = (args(&a[..2]), args(&a));
            self.pipelined(async {
                let (locked, claimed) =
                    futures::future::join(tx.query(&locks, &lock_args), tx.query(&claim, &claim_args)).await;
                locked?;
                claimed
            })?
        };
        if !self.careful {
            self.keys_locked.insert((run.to_owned(), task.to_owned()));
        }
        let row = rows.first().map(cells).transpose().map_err(|e| self.failed(e))?;
        row.map(|r| ops::decode(r.raw_task()?)).transpose()
    }
}

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

    fn end_held(&mut self, e: &ops::EndHeld<'_>) -> Result<Option<(TaskState, TaskRow)>, StoreError> {
        let (a, c, now, b) = (e.attempt, e.columns, e.now, e.beside);
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
        let keyed = self.keyed_runs.known.contains(&a.run);
        let end_sql = match (b.output.is_some(), keyed) {
            (true, false) => END_KEEPING,
            (false, false) => END,
            (true, true) => END_KEEPING_KEYED,
            (false, true) => END_KEYED,
        };
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
        let from = row.text(14)?;
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
        let row = ops::decode(raw)?;
        // A keyed task of a run this connection did not know: `END` gave nothing back.
        if !keyed && !row.spec.concurrency.is_empty() {
            self.gives_back(&row.spec.concurrency)?;
            self.keyed_runs.learn(&a.run);
        }
        Ok(Some((from, row)))
    }

    fn gives_back(&mut self, keys: &[crate::plan::ConcurrencyKey]) -> Result<(), StoreError> {
        for k in keys {
            self.exec(GIVE_BACK, &[Arg::Text(&k.key)])?;
        }
        Ok(())
    }

    fn take(&mut self, c: &ops::Claim<'_>) -> Result<Option<TaskRow>, StoreError> {
        let ops::Claim { run, task, owner, until, now } = *c;
        if self.keyed_runs.known.contains(run) {
            return self.take_keyed(c);
        }
        let rows =
            self.rows(CLAIM, &[Arg::Text(run), Arg::Text(task), Arg::Text(owner), Arg::Int(until), Arg::Int(now)])?;
        let Some(mut row) = rows.first().map(cells).transpose().map_err(|e| self.failed(e))? else { return Ok(None) };
        let taken = matches!(row.0.first(), Some(Cell::Text(_)));
        match (taken, row.opt_int(14)?) {
            (true, _) => Ok(Some(ops::decode(row.raw_task()?)?)),
            // A task with concurrency keys: the claim that counts them.
            (_, Some(_)) => {
                self.keyed_runs.learn(run);
                self.take_keyed(c)
            }
            _ => Ok(None),
        }
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
