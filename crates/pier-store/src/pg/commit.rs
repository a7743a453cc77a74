//! The committer: queued jobs, the group commit, its numbering of events and its doorbell.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, watch};
use tokio_postgres::types::ToSql;

use super::conn::*;
use super::job::*;
use super::rounds::*;
use super::tx::*;
use crate::backend::Row;
use crate::log::{OwnCommit, RawEvent, announce};
use crate::{StoreError, lock};

/// The rows of the tasks a group touched and its events, numbered: what its own commit carries.
pub(super) type Read = (Vec<Row>, Vec<RawEvent>);

pub(super) fn retry_or_fail(jobs: Vec<Box<dyn Job>>, error: &StoreError) -> Vec<Box<dyn Job>> {
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
pub(super) enum Group {
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
        own: Option<Read>,
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
pub(super) struct Committer {
    pub(super) queue: Mutex<Vec<Box<dyn Job>>>,
    pub(super) ready: Condvar,
    pub(super) stop: std::sync::atomic::AtomicBool,
}

/// The committer thread: commits whatever is queued, one group at a time, on the write
/// connection its own runtime drives, until the store is dropped and the queue is empty.
pub(super) fn commit_loop(
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
pub(super) const RING_EVERY: Duration = Duration::from_millis(10);

/// When the doorbell last rang, and the newest commit it has not rung for.
#[derive(Default)]
pub(super) struct Doorbell {
    pub(super) rang_at: Option<Instant>,
    pub(super) owed: Option<i64>,
}

impl Doorbell {
    /// Whether the next commit rings (in its numbering statement).
    pub(super) fn due(&self) -> bool {
        self.rang_at.is_none_or(|at| at.elapsed() >= RING_EVERY)
    }

    /// A commit up to sequence `last` that rang, or did not.
    pub(super) fn committed(&mut self, last: i64, rang: bool) {
        if rang {
            self.rang_at = Some(Instant::now());
            self.owed = None;
        } else {
            self.owed = Some(last);
        }
    }

    /// When a ring is owed and falls due.
    pub(super) fn owed_until(&self) -> Option<Instant> {
        self.owed.map(|_| self.rang_at.map_or_else(Instant::now, |at| at + RING_EVERY))
    }

    /// Rings for the commits not rung for yet, on its own (no group is coming to carry it).
    /// A ring that fails is not retried: listeners also look on a slow timer.
    pub(super) fn ring_owed(&mut self, conn: Option<&Conn>) {
        let (Some(n), Some(conn)) = (self.owed.take(), conn) else { return };
        if let Err(e) = block_on(conn.client.execute("SELECT pg_notify('pier_commits', $1)", &[&n.to_string()])) {
            tracing::debug!(error = %e, "could not ring the doorbell; other nodes see the commit on their timer");
        }
        self.rang_at = Some(Instant::now());
    }
}

/// One group commit. Returns the jobs to run again (rolled back with a lost connection
/// or alone by a deadlock or serialization failure); every other job is answered.
pub(super) fn commit(
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
pub(super) fn run_group(c: &mut Conn, jobs: Vec<Box<dyn Job>>, careful: bool, ring: bool, rows: bool) -> Group {
    let mut t = PgTx::begin(c, careful);
    // (job, its first event's index, one past its last).
    let mut ran: Vec<(Box<dyn Job>, usize, usize)> = Vec::with_capacity(jobs.len());
    let mut failed = Vec::new();
    let mut again = Vec::new();
    // Jobs of different tasks first, side by side in rounds (`rounds`); the rest after them,
    // one by one.
    let (together, rest) = if careful { (Vec::new(), jobs) } else { super::rounds::side_by_side(jobs) };
    if !together.is_empty() {
        match super::rounds::run(&mut t, together) {
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
pub(super) fn redo(t: &PgTx<'_>, jobs: Vec<Box<dyn Job>>) -> Group {
    match block_on(t.tx.batch_execute("ROLLBACK")) {
        Ok(()) => Group::Redo { jobs },
        Err(e) => Group::Lost { jobs, error: (&e).into() },
    }
}

/// Every job of a group that did not commit, whatever became of each: those that ran, failed
/// or are to run again, and those not reached.
pub(super) fn every_job(
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

/// The numbering statement of a group commit ([`number_and_commit`]).
///
/// `r` holds the counter and the ring; a volatile function (`pg_notify`) keeps it from being
/// folded into the outer query, so it rings once whatever number of task rows follow. The
/// tasks are read one primary-key lookup per task named (a lateral join on its key whose
/// `LIMIT` keeps the planner from flattening it into a join): a join left the plan to the
/// table's statistics, and on a table that grew since they were taken (a new store under
/// load, before autovacuum's analyze) it hashed the keys and scanned every task, 2 ms a
/// commit at 3,000 tasks.
pub(super) const NUMBER: &str = "WITH c AS (UPDATE pier_seq SET n = n + ?1 WHERE id = 1 RETURNING n),
     e AS (INSERT INTO events (seq, run_id, task_id, type, at_ms, data)
           SELECT (SELECT n FROM c) - ?1 + u.ord, u.run_id, u.task_id, u.type, u.at_ms, u.data
           FROM UNNEST(?2::text[], ?3::text[], ?4::text[], ?5::bigint[], ?6::text[]) WITH ORDINALITY
               AS u(run_id, task_id, type, at_ms, data, ord)),
     r AS (SELECT n, CASE WHEN ?7 THEN pg_notify('pier_commits', n::text)::text END AS rang FROM c)
     SELECT t.*, r.n, r.rang FROM r LEFT JOIN LATERAL
         (SELECT x.run_id, x.id, x.state, x.version, x.attempt, x.failures, x.lease_owner,
              x.lease_expires_at_ms, x.not_before_ms, x.result, x.usage, x.error, x.spec, x.cancel_requested
          FROM (SELECT DISTINCT k.run_id, k.task_id FROM UNNEST(?2::text[], ?3::text[]) AS k(run_id, task_id)
                WHERE ?8 AND k.task_id IS NOT NULL) k
          CROSS JOIN LATERAL (SELECT * FROM tasks WHERE run_id = k.run_id AND id = k.task_id LIMIT 1) x) t ON true";

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
pub(super) fn number_and_commit(
    t: &mut PgTx<'_>,
    ring: bool,
    rows: bool,
) -> (Result<((i64, i64), Option<Read>), StoreError>, Result<(), tokio_postgres::Error>) {
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
    (numbered(t, answer, k, rows), committed)
}

/// What the numbering statement answered: the group's sequences and, if asked for (`rows`),
/// the rows of the tasks it touched with its events numbered.
fn numbered(
    t: &mut PgTx<'_>,
    answer: Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>,
    k: i64,
    rows: bool,
) -> Result<((i64, i64), Option<Read>), StoreError> {
    let numbered = answer.and_then(|answer| {
        let last = answer.first().map(|r| r.try_get::<_, i64>(14)).transpose()?;
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
    match numbered {
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
    }
}
