//! What differs between the databases, and nothing else: how a write job reaches a group
//! commit, how a read reaches a connection, how commits are watched, and the few statements
//! whose dialects part. [`crate::Store`] implements [`crate::TaskStore`] once over it; the
//! operations' SQL is written once too ([`crate::ops`] for writes, `store.rs` for reads).

use std::sync::Arc;

use tokio::sync::{broadcast, watch};

use crate::StoreError;
use crate::log::OwnCommit;
use crate::ops::{Arg, RawTask, Tx, plain_row};
use crate::rows::TaskRow;

/// A write job: a named operation over the open transaction, its answer and the last event
/// sequence it wrote (0 for none).
pub(crate) type Work<T> = Box<dyn FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send>;

/// A database the store can live in.
pub(crate) trait Backend: Send + Sync + 'static {
    /// A page of the queue ([`crate::queue`]): `?1` pending tasks after the key `?2..?4` (rank,
    /// run, place in the plan), each with its key.
    const QUEUE_PAGE: &'static str;
    /// Every task not ended, oldest run first, in plan order.
    const UNFINISHED_TASKS: &'static str;
    /// The runs with a task `?1`, newest first.
    const RUNS_WITH_TASK: &'static str;
    /// The last event sequence committed.
    const LAST_SEQ: &'static str;
    /// The live holders of concurrency key `?1` ([`crate::keys`]).
    const KEY_HOLDERS: &'static str;

    /// Runs `work` atomically in the next group commit and returns its answer and the last
    /// event sequence it wrote (0 for none) once the commit is durable. `work` may run more
    /// than once (a group rolled back runs again); `task` names the task whose rows alone it
    /// touches, if it is one (jobs of different tasks may run side by side).
    fn write<T: Send + 'static>(&self, task: Option<(&str, &str)>, work: Work<T>) -> Result<(T, i64), StoreError>;

    /// Runs `f` on a read connection, which sees committed data only. `f` may run again on
    /// a fresh connection if the first one broke.
    fn read<T>(&self, f: impl Fn(&mut dyn Query) -> Result<T, StoreError>) -> Result<T, StoreError>;

    /// The tasks touched by an event after `after`, and the sequence they are current to.
    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError>;

    /// Writes a consistent copy of the whole store, taken while it is in use, to the new
    /// file `to`.
    fn backup(&self, to: &std::path::Path) -> Result<(), StoreError>;

    /// The commit watch (see [`crate::TaskStore::subscribe`]).
    fn subscribe(&self) -> watch::Receiver<i64>;

    /// This process's commits (see [`crate::TaskStore::own_commits`]).
    fn own_commits(&self) -> broadcast::Receiver<Arc<OwnCommit>>;
}

/// A read connection: statements in the shared dialect (`?N` placeholders), rows as cells.
pub(crate) trait Query {
    fn rows(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Vec<Row>, StoreError>;
}

/// One column of a row as read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cell {
    Null,
    Int(i64),
    Text(String),
}

/// A row as read: its columns in the statement's order.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Row(pub Vec<Cell>);

impl Row {
    fn cell(&mut self, i: usize) -> Cell {
        self.0.get_mut(i).map_or(Cell::Null, |c| std::mem::replace(c, Cell::Null))
    }

    fn mistyped(i: usize, wanted: &str) -> StoreError {
        StoreError::Db(format!("column {i} of a row read is not {wanted}"))
    }

    pub fn int(&mut self, i: usize) -> Result<i64, StoreError> {
        self.opt_int(i)?.ok_or_else(|| Row::mistyped(i, "an integer"))
    }

    pub fn opt_int(&mut self, i: usize) -> Result<Option<i64>, StoreError> {
        match self.cell(i) {
            Cell::Int(n) => Ok(Some(n)),
            Cell::Null => Ok(None),
            Cell::Text(_) => Err(Row::mistyped(i, "an integer")),
        }
    }

    pub fn text(&mut self, i: usize) -> Result<String, StoreError> {
        self.opt_text(i)?.ok_or_else(|| Row::mistyped(i, "text"))
    }

    pub fn opt_text(&mut self, i: usize) -> Result<Option<String>, StoreError> {
        match self.cell(i) {
            Cell::Text(t) => Ok(Some(t)),
            Cell::Null => Ok(None),
            Cell::Int(_) => Err(Row::mistyped(i, "text")),
        }
    }

    /// A row of [`task_columns!`], its JSON columns still text.
    pub fn raw_task(mut self) -> Result<RawTask, StoreError> {
        let mut row = plain_row(
            self.text(0)?,
            self.text(1)?,
            self.int(3)?,
            self.int(4)?,
            self.int(5)?,
            (self.opt_text(6)?, self.opt_int(7)?),
            self.int(8)?,
            self.opt_text(9)?,
            self.opt_text(11)?,
        );
        row.cancel_requested = self.opt_text(13)?;
        Ok((row, self.text(12)?, self.opt_text(10)?, self.text(2)?))
    }
}

/// The tasks of every run whose state meets `$state` (`= 'pending'`, `IN (…)`: the very terms
/// of the partial index, which SQLite uses only for a condition that implies its own), oldest
/// run first, in plan order; `$hint` names the index where the dialect takes one (SQLite's
/// `INDEXED BY`), `$runs` the runs' index that holds their age (`runs_age`: SQLite would
/// otherwise read the age from the run's row, past its plan).
#[macro_export]
#[doc(hidden)]
macro_rules! tasks_in {
    ($state:literal, $hint:literal, $runs:literal) => {
        concat!(
            "SELECT ",
            $crate::task_columns!(t),
            " FROM tasks t ",
            $hint,
            " JOIN runs r ",
            $runs,
            " ON r.id = t.run_id WHERE t.state ",
            $state,
            " ORDER BY r.created_at_ms, r.id, t.ord"
        )
    };
}

/// [`Backend::QUEUE_PAGE`] with SQLite's index hint `$hint` or none: a seek in `tasks_queue`
/// walked in its order, no read (let alone a sort) of every pending task. Pages are keyed by the
/// last row's key, not by an OFFSET that walks every page before it again.
#[macro_export]
#[doc(hidden)]
macro_rules! queue_page {
    ($hint:literal) => {
        concat!(
            "SELECT ",
            $crate::task_columns!(),
            ", rank_ms, ord FROM tasks ",
            $hint,
            " WHERE state = 'pending' AND (rank_ms, run_id, ord) > (?2, ?3, ?4) ORDER BY rank_ms, run_id, ord LIMIT ?1"
        )
    };
}

/// [`Backend::RUNS_WITH_TASK`] with the runs' index `$runs` (see [`tasks_in!`]) or none.
#[macro_export]
#[doc(hidden)]
macro_rules! runs_with_task {
    ($runs:literal) => {
        concat!(
            "SELECT t.run_id FROM tasks t JOIN runs r ",
            $runs,
            " ON r.id = t.run_id WHERE t.id = ?1 ORDER BY r.created_at_ms DESC"
        )
    };
}

/// The columns of a task row, in the order [`Row::raw_task`] reads them; `t` is the table
/// alias where one is needed.
#[macro_export]
#[doc(hidden)]
macro_rules! task_columns {
    () => {
        "run_id, id, state, version, attempt, failures, lease_owner, lease_expires_at_ms, not_before_ms, result, \
         usage, error, spec, cancel_requested"
    };
    (t) => {
        "t.run_id, t.id, t.state, t.version, t.attempt, t.failures, t.lease_owner, t.lease_expires_at_ms, \
         t.not_before_ms, t.result, t.usage, t.error, t.spec, t.cancel_requested"
    };
}

/// How many columns [`task_columns!`] names: a query's own columns come after them.
pub(crate) const TASK_COLUMN_COUNT: usize = 14;

#[cfg(test)]
mod column_count {
    #[test]
    fn the_count_is_the_macro_s() {
        assert_eq!(task_columns!().split(',').count(), super::TASK_COLUMN_COUNT);
        assert_eq!(task_columns!(t).split(',').count(), super::TASK_COLUMN_COUNT);
    }
}
