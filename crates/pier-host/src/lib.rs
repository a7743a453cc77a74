//! The durable task host behind `pier run` and `pier serve`: plans, the task state
//! machine, the store (named fenced operations over attempt tokens, a gap-free event
//! log), the decision of what an attempt's end means, and the [`Host`] that hands tasks
//! to ACP agents through `pier-client`.

pub mod attempt;
pub mod caps;
pub mod code;
pub mod decide;
pub mod host;
pub mod person;
pub mod plan;
pub mod pool;
pub mod state;
pub mod store;
pub mod telemetry;

pub use code::ErrorCode;
pub use host::{Host, HostConfig, Scope};
pub use plan::{Plan, PlanError, TaskSpec};
pub use state::TaskState;
pub use store::{
    AgentRow, Attempt, AttemptRow, Ending, ErrorClass, Event, Held, Idem, Last, LogCursor, LogEvent, NodeRow, PgStore,
    Question, SqliteStore, StoreError, TaskRow, TaskStore,
};
