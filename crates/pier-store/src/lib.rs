//! The durable store: runs, tasks, attempts, questions and the gap-free event log.
//!
//! Writes are *named operations*, each fenced in its own SQL, never a generic "move this
//! task" with a bag of flags. An attempt is held through an [`Attempt`] token that only
//! [`TaskStore::claim`] hands out; every operation of a running attempt (`heartbeat`,
//! `park`, `resume`, `finish`) names it and changes nothing unless the task is still on
//! that attempt under that owner, so a stale or foreign holder is refused by construction.
//! A lost attempt is taken back by [`TaskStore::release_lost`], fenced on what the caller
//! saw (attempt, owner and lease expiry): a heartbeat in between makes it a no-op.
//!
//! Idempotency: an operation that a remote caller may repeat (a pull worker's update)
//! carries an [`Idem`] built in one place from typed parts; the first answer is kept with
//! the request's body, a repeat with the same body gets that answer back and changes
//! nothing, and a repeat with another body is refused (`idempotency_conflict`).

mod api;
mod backend;
mod entry;
mod error;
mod follow_up;
mod keys;
mod log;
mod ops;
mod pg;
mod rows;
mod schedules;
mod schema;
mod spend;
mod sqlite;
mod store;

pub mod code;
pub mod plan;
pub mod queue;
pub mod requires;
pub mod schedule;
pub mod state;

use std::sync::Arc;

pub use api::TaskStore;
pub use code::ErrorCode;
pub use entry::{AgentEvent, Entry, is_agent_event};
pub use error::StoreError;
pub use follow_up::{Added, MAX_RUN_TASKS};
pub use log::{Event, LogCursor, LogEvent, OwnCommit, RawEvent, TRANSITION, own_following};
pub use ops::{Candidate, NextClaim};
pub use pg::{Pg, ScratchDatabase, redacted};
pub use plan::{Budget, Plan, PlanError, TaskSpec};
pub use rows::{
    AgentRow, Attempt, AttemptRow, Ending, ErrorClass, Held, Idem, Last, NodeRow, Question, QuestionRequest, Reported,
    TaskRow, Waiting, WorkerRow, offered_option, option_kind,
};
pub use schedules::{Advance, Fire, Put, ScheduleRow};
pub use spend::{MODEL_REQUEST, ModelRequest, Spend, Subtotal, Tokens};
pub use sqlite::{Sqlite, checkpoint_open_stores};
pub use store::Store;

/// The store in a SQLite file: the embedded default.
pub type SqliteStore = Store<Sqlite>;
/// The store in a PostgreSQL database, which several host nodes share.
pub type PgStore = Store<Pg>;
pub use state::TaskState;

/// Opens the store `spec` names: `postgres://…` (or `postgresql://…`) is a [`PgStore`];
/// `sqlite://PATH` or a plain path is a [`SqliteStore`].
pub fn open(spec: &str) -> Result<Arc<dyn TaskStore>, StoreError> {
    if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        return Ok(Arc::new(PgStore::open(spec)?));
    }
    let path = spec.strip_prefix("sqlite://").unwrap_or(spec);
    Ok(Arc::new(SqliteStore::open(std::path::Path::new(path))?))
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
