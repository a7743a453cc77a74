//! Concurrency keys: a task's claim counts the live holders of each of its keys and is refused
//! when one is at its limit, in the claim's own transaction, so a key's limit holds across every
//! node and worker on the store. Holders are the attempts claims recorded in `key_holders`; one
//! counts while its task runs that attempt under a lease ([`holder_is_live!`]: a task waiting for
//! a person's decision after its attempt ended holds none), and a stale row is deleted by a later
//! claim of its key (on PostgreSQL, one that finds the key's rows filling it) rather than by
//! every way an attempt can end.
//!
//! Claims of one key never count at once. SQLite's writers take turns (one connection per
//! process, `BEGIN IMMEDIATE` across processes), and its claim is [`free`] then [`hold`]. On
//! PostgreSQL the claim that finds a task keyed takes each key's advisory lock (waited for, first
//! come first served, in the keys' order), then the next statement claims (`pg::tx::CLAIM_KEYED`)
//! on the same rule — in the same round trip once the connection knows the run holds keyed
//! tasks (`pg::tx::KeyedRuns`); side by side with other jobs its statements go last in each
//! round and its events after theirs (`pg::rounds`).

use crate::StoreError;
use crate::ops::{Arg, Tx};
use crate::plan::ConcurrencyKey;

/// The condition that holder `h` (a `key_holders` row) is live.
///
/// Its task is looked up by primary key in a scalar subquery, whose `WHERE` names nothing else:
/// with the state tested there (or in a join), PostgreSQL's generic plan took the partial index
/// of unfinished tasks, which the state implies, and walked the run's thousands of unfinished
/// tasks for each holder (2 ms a claim at 5,000 of them), or hashed them all.
#[macro_export]
#[doc(hidden)]
macro_rules! holder_is_live {
    () => {
        "COALESCE((SELECT CASE WHEN t.attempt = h.attempt AND t.lease_owner IS NOT NULL
             AND t.state IN ('running', 'awaiting_input') THEN 1 ELSE 0 END
             FROM tasks t WHERE t.run_id = h.run_id AND t.id = h.task_id), 0) = 1"
    };
}

/// The live holders of key `?1`.
pub(crate) const LIVE_HOLDERS: &str =
    concat!("SELECT COUNT(*) FROM key_holders h WHERE h.key = ?1 AND ", holder_is_live!());

/// Whether every one of `keys` has room for task `task` of run `run`, in SQLite's claim: each
/// key's stale holders dropped, its live ones (but the task's own) counted. Writes nothing of
/// the claim.
pub(crate) fn free(tx: &mut dyn Tx, keys: &[ConcurrencyKey], run: &str, task: &str) -> Result<bool, StoreError> {
    for k in keys {
        tx.exec(
            concat!("DELETE FROM key_holders AS h WHERE h.key = ?1 AND NOT ", holder_is_live!()),
            &[Arg::Text(&k.key)],
        )?;
        let held = tx
            .int(
                "SELECT COUNT(*) FROM key_holders WHERE key = ?1 AND NOT (run_id = ?2 AND task_id = ?3)",
                &[Arg::Text(&k.key), Arg::Text(run), Arg::Text(task)],
            )?
            .unwrap_or(0);
        if held >= i64::from(k.limit) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Records attempt `attempt` of the task, which [`free`] found room for and the caller has just
/// moved to running, as a holder of each of `keys`.
pub(crate) fn hold(
    tx: &mut dyn Tx,
    keys: &[ConcurrencyKey],
    run: &str,
    task: &str,
    attempt: i64,
) -> Result<(), StoreError> {
    for k in keys {
        tx.exec(
            "INSERT INTO key_holders (key, run_id, task_id, attempt) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (key, run_id, task_id) DO UPDATE SET attempt = excluded.attempt",
            &[Arg::Text(&k.key), Arg::Text(run), Arg::Text(task), Arg::Int(attempt)],
        )?;
    }
    Ok(())
}
