//! A group's jobs side by side: each job's statements go to PostgreSQL in *rounds*, one round
//! trip carrying the next statement of every job, instead of one round trip per statement.
//!
//! The operations ([`crate::ops`]) are synchronous code over [`crate::ops::Tx`] and stay so
//! (SQLite runs the same code). A job runs until it asks for a statement whose answer it does
//! not have yet: the call is noted and the job stops there (`Replay::wanted`; the error it
//! returns is dropped). Once every job has stopped or ended, the noted statements are sent in
//! one pipeline, and each stopped job runs again from its start, its earlier calls answered
//! from what it was given (`Replay::calls`), up to its next new call. Replaying is cheap (an
//! operation is a handful of branches between statements) and safe because an operation's
//! only effects are its statements and its buffered events; a run that asks for other
//! statements than before (it read the clock on a lease's edge) *diverges*, and the group goes
//! back to be run job by job.
//!
//! Jobs side by side must not see each other half done, so at most one job per task runs in
//! the rounds (an operation touches its own task's rows only: the task, its attempts,
//! questions and messages). A small run's creation is keyed by its run alone: it touches the
//! rows of a run that does not exist yet, which no other job can (a second creation of the
//! same id has the same key). Jobs without a key (a big run's creation, leases, a retry that
//! moves dependents) and a second job of the same key run one by one after the rounds.
//!
//! A claim of a task with concurrency keys reads rows other tasks' jobs change: its keys'
//! counts, which an ending lowers, and (when a count is full) the keys' holders, which only
//! endings change, and only from live to stale. Run side by side, it sees some of the group's
//! endings and not others, so its events go after every other job's of the rounds
//! (`PgTx::late`): in the log a key's claims then never come before an ending they counted on,
//! and a claim that missed an ending only declined a place it could have had (the host tries
//! again on that ending's event). In each round a keyed claim's statements are sent after every
//! other job's, so it reads the counts and holders as that round's endings left them. A claim
//! of a task of a run known to hold keyed tasks is sent as `CLAIM_HELD` at once
//! (`tx::KeyedRuns`), others as `CLAIM` first. Claims of one key in one round are statements
//! PostgreSQL runs one after another in the transaction, each reading the count those before it
//! left.
//! A statement that fails aborts the transaction: the group is rolled back and run job by
//! job in savepoints, which finds the job it belongs to.

use std::collections::HashSet;

use tokio_postgres::types::ToSql;

use super::conn::block_on;
use super::job::Job;
use super::replay::{Answer, Owned, Replay, Want};
use super::tx::{LOCK_KEYS, LOCK_KEYS_OF, Pending, PgTx};
use crate::StoreError;

/// A group's jobs.
pub(crate) type Jobs = Vec<Box<dyn Job>>;

/// How a job of the rounds ended: its events, or its error (it changed nothing) and whether
/// that may pass on another try.
pub(crate) type Ending = Result<Vec<Pending>, (StoreError, bool)>;

/// How the rounds went.
pub(crate) enum Rounds {
    /// Every job ended: those that succeeded with their events, in order; those that failed
    /// (having changed nothing) with their error and whether it may pass on another try; the
    /// claims of tasks with concurrency keys last. With the number of rounds sent (the round
    /// trips).
    Ended(Vec<(Box<dyn Job>, Ending)>, usize),
    /// The group is to be run job by job: a statement failed, a job that changed something
    /// failed, or a job diverged. The transaction (if begun) is left for the caller to roll back.
    Redo(Jobs),
    /// The connection broke: nothing of the group happened.
    Lost(Jobs, StoreError),
}

/// Splits a group's jobs into those that run side by side (the first job of each task) and
/// the rest, each part in queue order.
pub(crate) fn side_by_side(jobs: Jobs) -> (Jobs, Jobs) {
    let mut tasks = HashSet::new();
    let (mut together, mut rest) = (Vec::new(), Vec::new());
    for job in jobs {
        let first = match job.task() {
            Some(key) => tasks.insert(key.clone()),
            None => false,
        };
        if first { together.push(job) } else { rest.push(job) }
    }
    // One job alone gains nothing from rounds.
    if together.len() < 2 {
        together.append(&mut rest);
        return (Vec::new(), together);
    }
    (together, rest)
}

struct Slot {
    job: Box<dyn Job>,
    replay: Replay,
    ended: Option<Ending>,
    /// The job's events go after the others' (`PgTx::late`).
    late: bool,
}

/// Runs `jobs` in rounds in `t`'s transaction (its pending `BEGIN` rides with the first).
pub(crate) fn run(t: &mut PgTx<'_>, jobs: Jobs) -> Rounds {
    let mut slots: Vec<Slot> =
        jobs.into_iter().map(|job| Slot { job, replay: Replay::default(), ended: None, late: false }).collect();
    let every = |slots: Vec<Slot>| slots.into_iter().map(|s| s.job).collect::<Vec<_>>();
    let mut sent = 0;
    loop {
        let mut round: Vec<(usize, Vec<Want>)> = Vec::new();
        for (i, slot) in slots.iter_mut().enumerate().filter(|(_, s)| s.ended.is_none()) {
            let (outcome, mut replay, events) = t.replaying(std::mem::take(&mut slot.replay), |t| slot.job.run(t));
            slot.late = t.late;
            if replay.diverged {
                tracing::debug!("a job asked for other statements when run again; the group runs job by job");
                return Rounds::Redo(every(slots));
            }
            if let Some(wants) = replay.wanted.take() {
                replay.next = 0;
                slot.replay = replay;
                round.push((i, wants));
                continue;
            }
            slot.ended = Some(match outcome {
                Ok(()) => Ok(events),
                // A failure after a write must be undone, and only a savepoint undoes one job.
                Err(_) if t.wrote || t.aborted => return Rounds::Redo(every(slots)),
                Err(e) => Err((e, t.retry)),
            });
        }
        if round.is_empty() {
            break;
        }
        // A keyed claim's statements go after the rest of its round (a stable sort): it counts
        // the holders that every ending in the round left.
        round.sort_by_key(|(i, _)| slots.get(*i).is_some_and(|s| s.late));
        sent += 1;
        match send(t, &round) {
            Ok(answers) => {
                for ((i, wants), answers) in round.into_iter().zip(answers) {
                    if let Some(slot) = slots.get_mut(i) {
                        slot.replay.calls.push((wants.iter().map(|w| w.sql).collect(), answers));
                    }
                }
            }
            Err(Sent::Lost(e)) => return Rounds::Lost(every(slots), e),
            Err(Sent::Failed) => return Rounds::Redo(every(slots)),
        }
    }
    let (late, early): (Vec<Slot>, Vec<Slot>) = slots.into_iter().partition(|s| s.late);
    let ended = early.into_iter().chain(late).filter_map(|s| s.ended.map(|ended| (s.job, ended))).collect();
    Rounds::Ended(ended, sent)
}

enum Sent {
    /// The connection broke.
    Lost(StoreError),
    /// A statement failed (the transaction is aborted).
    Failed,
}

/// Sends a round in one pipeline, the transaction's pending step (`BEGIN`) ahead of it. The
/// keyed claims' `LOCK_KEYS` of a round go as one `LOCK_KEYS_OF` where the first was (each
/// is answered with its answer): a statement less per claim, and every key locked in one order.
fn send(t: &mut PgTx<'_>, round: &[(usize, Vec<Want>)]) -> Result<Vec<Vec<Answer>>, Sent> {
    let wants: Vec<&Want> = round.iter().flat_map(|(_, wants)| wants).collect();
    let locks: Vec<&Want> = wants.iter().copied().filter(|w| w.sql == LOCK_KEYS).collect();
    let merged = if locks.len() > 1 {
        let column = |n: usize| -> Vec<String> {
            locks.iter().map(|w| w.args.get(n).map(Owned::text).unwrap_or_default()).collect()
        };
        let statement = t.statement(LOCK_KEYS_OF).map_err(|_| Sent::Failed)?;
        Some((statement, column(0), column(1)))
    } else {
        None
    };
    // Each want's statement: its own, or the merged locks' (sent once, where the first was).
    let mut sent_as = Vec::with_capacity(wants.len());
    let mut statements = Vec::with_capacity(wants.len());
    let mut locks_at = None;
    for w in &wants {
        match (&merged, locks_at) {
            (Some(_), Some(at)) if w.sql == LOCK_KEYS => sent_as.push(at),
            _ => {
                if merged.is_some() && w.sql == LOCK_KEYS {
                    locks_at = Some(statements.len());
                }
                sent_as.push(statements.len());
                statements.push(*w);
            }
        }
    }
    let client = t.tx;
    let step = t.step.take();
    let stepped = async {
        match step {
            Some(s) => client.batch_execute(s).await,
            None => Ok(()),
        }
    };
    let merged = &merged;
    let sending = statements.iter().map(|w| async move {
        if let (Some((statement, runs, tasks)), LOCK_KEYS) = (merged, w.sql) {
            let params: [&(dyn ToSql + Sync); 2] = [runs, tasks];
            return client.query(statement, &params).await.map(Answer::Rows);
        }
        let params: Vec<&(dyn ToSql + Sync)> = w.args.iter().map(|a| a as &(dyn ToSql + Sync)).collect();
        if w.rows {
            client.query(&w.statement, &params).await.map(Answer::Rows)
        } else {
            client.execute(&w.statement, &params).await.map(Answer::Count)
        }
    });
    let (stepped, answers) = block_on(futures::future::join(stepped, futures::future::join_all(sending)));
    if let Err(e) = stepped {
        return Err(if client.is_closed() { Sent::Lost((&e).into()) } else { Sent::Failed });
    }
    let mut at = sent_as.into_iter();
    let mut out = Vec::with_capacity(round.len());
    for (_, wants) in round {
        let mut these = Vec::with_capacity(wants.len());
        for _ in wants {
            match at.next().and_then(|i| answers.get(i)) {
                Some(Ok(answer)) => these.push(answer.clone()),
                Some(Err(e)) if client.is_closed() => return Err(Sent::Lost(e.into())),
                _ => return Err(Sent::Failed),
            }
        }
        out.push(these);
    }
    Ok(out)
}
