//! Concurrency keys: a task's claim counts the live holders of each of its keys and is refused
//! when one is at its limit, in the claim's own transaction, so a key's limit holds across every
//! node and worker on the store. Holders are the attempts claims recorded in `key_holders`; one
//! counts while its task runs that attempt under a lease (a task waiting for a person's decision
//! after its attempt ended holds none), and a stale row is deleted by a later claim of its key
//! rather than by every way an attempt can end.
//!
//! Claims of one key never count at once: on PostgreSQL each takes the key's advisory lock
//! for its transaction (waited for, first come first served), and a keyed claim never runs
//! beside other jobs in the rounds (`pg::tx`'s `alone`); `hold` still counts and inserts in one
//! statement after the task row moved, and if that finds the key full the claim fails with
//! [`StoreError::KeyFull`] and its transaction undoes it.

use crate::StoreError;
use crate::ops::{Arg, Tx};
use crate::plan::ConcurrencyKey;

/// The live holders of key `?1`.
pub(crate) const LIVE_HOLDERS: &str = "SELECT COUNT(*) FROM key_holders h JOIN tasks t
    ON t.run_id = h.run_id AND t.id = h.task_id
    WHERE h.key = ?1 AND t.attempt = h.attempt AND t.state IN ('running', 'awaiting_input')
        AND t.lease_owner IS NOT NULL";

/// Whether every one of `keys` has room for task `task` of run `run` (SQLite's claim; PostgreSQL's
/// is `CLAIM_KEYED`): each locked, its stale
/// holders dropped, its live ones counted. Writes nothing of the claim.
pub(crate) fn free(tx: &mut dyn Tx, keys: &[ConcurrencyKey], run: &str, task: &str) -> Result<bool, StoreError> {
    for k in keys {
        if !tx.lock_key(&k.key)? {
            return Ok(false);
        }
        tx.exec(
            "DELETE FROM key_holders WHERE key = ?1 AND NOT EXISTS (SELECT 1 FROM tasks t
                 WHERE t.run_id = key_holders.run_id AND t.id = key_holders.task_id
                     AND t.attempt = key_holders.attempt AND t.state IN ('running', 'awaiting_input')
                     AND t.lease_owner IS NOT NULL)",
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

/// Takes a place of each of `keys` for attempt `attempt` of the task, which the caller has
/// just moved to running: counted and written in one statement, so a claim beside it in the
/// transaction either is counted here or counts this one.
pub(crate) fn hold(
    tx: &mut dyn Tx,
    keys: &[ConcurrencyKey],
    run: &str,
    task: &str,
    attempt: i64,
) -> Result<(), StoreError> {
    for k in keys {
        let held = tx.exec(
            "INSERT INTO key_holders (key, run_id, task_id, attempt)
             SELECT ?1, ?2, ?3, ?4 WHERE (SELECT COUNT(*) FROM key_holders h JOIN tasks t
                     ON t.run_id = h.run_id AND t.id = h.task_id
                 WHERE h.key = ?1 AND NOT (h.run_id = ?2 AND h.task_id = ?3) AND t.attempt = h.attempt
                     AND t.state IN ('running', 'awaiting_input') AND t.lease_owner IS NOT NULL) < ?5
             ON CONFLICT (key, run_id, task_id) DO UPDATE SET attempt = excluded.attempt",
            &[Arg::Text(&k.key), Arg::Text(run), Arg::Text(task), Arg::Int(attempt), Arg::Int(i64::from(k.limit))],
        )?;
        if held == 0 {
            return Err(StoreError::KeyFull { key: k.key.clone() });
        }
    }
    Ok(())
}
