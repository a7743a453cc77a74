//! The durable task host behind `pier run`: plans, the task state machine, the
//! SQLite store with leases and a gap-free event log, and the scheduler that hands
//! tasks to ACP agents through `pier-client`.

pub mod plan;
pub mod pool;
pub mod scheduler;
pub mod state;
pub mod store;

pub use plan::{Plan, PlanError, TaskSpec};
pub use state::TaskState;
pub use store::{Event, SqliteStore, StoreError, TaskRow, TaskStore, Transition};
