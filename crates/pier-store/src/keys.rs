//! Concurrency keys: a task's claim counts the live holders of each of its keys and is refused
//! when one is at its limit, in the claim's own transaction, so a key's limit holds across every
//! node and worker on the store. A key's holders are its tasks' live attempts: a task with the
//! key in its `concurrency` column that runs (or waits for an answer) under a lease — one
//! waiting for a person's decision after its attempt ended holds none. They are read from the
//! tasks themselves through the `tasks_holding` index ([`holders!`]), so nothing beside a task
//! has to be kept in step with its attempts, and nothing is left behind when one ends.
//!
//! Claims of one key never count at once. SQLite's writers take turns (one connection per
//! process, `BEGIN IMMEDIATE` across processes), and its claim is [`free`] and the move. On
//! PostgreSQL each key has a count (`key_counts.held`, never below its live holders) that a
//! claim raises under the row's lock while it has room and an ending lowers
//! (`pg::tx::CLAIM_HELD`, `pg::tx::END_KEYED`): one statement, no holder read. A claim that
//! finds a count at the limit (or none) locks the counts' rows (`pg::tx::LOCK_KEYS`, waited for,
//! first come first served, in the keys' order), then in the next statement counts the holders
//! and sets the counts to them (`pg::tx::CLAIM_KEYED`) — in the same round trip; side by side
//! with other jobs a keyed claim's statements go last in each round and its events after
//! theirs (`pg::rounds`).

use crate::StoreError;
use crate::ops::{Arg, Tx};
use crate::plan::ConcurrencyKey;

/// The live holders of key `$key`, in `$dialect` (how it reads a task's keys: [`task_keys!`])
/// with `$index` (SQLite's `INDEXED BY`). A task being
/// claimed is pending, so never one of them.
///
/// The tasks are found by `tasks_holding` (`keyed = 1` is its column's key, and the state list
/// its predicate), whatever the planner's statistics: with the state tested alone, a generic
/// plan took the partial index of unfinished tasks and walked every pending one.
#[macro_export]
#[doc(hidden)]
macro_rules! holders {
    ($key:literal, $dialect:ident, $index:literal) => {
        concat!(
            "(SELECT COUNT(*) FROM tasks t ",
            $index,
            ", ",
            $crate::task_keys!($dialect, rows),
            " WHERE t.keyed = 1 AND t.state IN ('running', 'awaiting_input') AND t.lease_owner IS NOT NULL
                 AND ",
            $crate::task_keys!($dialect, key),
            " = ",
            $key,
            ")"
        )
    };
}

/// How each backend reads a task's keys in [`holders!`]: `(rows)` of `t`'s JSON, and the
/// `(key)` of each. A keyed task without its `concurrency` column (written by a pier from
/// before it, still running beside a newer one) is read from its spec.
#[macro_export]
#[doc(hidden)]
macro_rules! task_keys {
    (sqlite, rows) => {
        "json_each(COALESCE(t.concurrency, json_extract(t.spec, '$.concurrency'))) j"
    };
    (sqlite, key) => {
        "json_extract(j.value, '$.key')"
    };
    (postgres, rows) => {
        "jsonb_to_recordset(COALESCE(t.concurrency::jsonb, t.spec::jsonb -> 'concurrency')) AS y(key text)"
    };
    (postgres, key) => {
        "y.key"
    };
}

/// SQLite's live holders of key `?1`.
pub(crate) const SQLITE_HOLDERS: &str = concat!("SELECT ", holders!("?1", sqlite, "INDEXED BY tasks_holding"));

/// PostgreSQL's.
pub(crate) const PG_HOLDERS: &str = concat!("SELECT ", holders!("?1", postgres, ""));

/// Whether every one of `keys` has room for one more holder, in SQLite's claim: each
/// key's live holders counted. Writes nothing.
pub(crate) fn free(tx: &mut dyn Tx, keys: &[ConcurrencyKey]) -> Result<bool, StoreError> {
    for k in keys {
        let held = tx.int(SQLITE_HOLDERS, &[Arg::Text(&k.key)])?.unwrap_or(0);
        if held >= i64::from(k.limit) {
            return Ok(false);
        }
    }
    Ok(true)
}
