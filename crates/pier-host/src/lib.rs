//! The durable task host behind `pier run` and `pier serve`: plans, the task state
//! machine, the store (named fenced operations over attempt tokens, a gap-free event
//! log), the decision of what an attempt's end means, and the [`Host`] that hands tasks
//! to ACP agents through `pier-client`.

pub mod attempt;
pub mod budget;
mod caps;
mod clock;
mod config;
mod converse;
pub mod decide;
pub mod gateway;
pub mod host;
pub mod host_mcp;
mod person;
mod pick;
pub mod pool;
mod share;
pub mod tasks;
pub mod telemetry;
pub mod worker;

pub use config::{HostConfig, SandboxConfig, Summary};
pub use host::Scope;
pub use person::{ActionError, Answered, Input};
pub use pier_store::{
    AgentEvent, AgentRow, Attempt, AttemptRow, Budget, Ending, Entry, ErrorClass, ErrorCode, Event, Held, Idem, Last,
    LogCursor, LogEvent, ModelRequest, NodeRow, PgStore, Plan, PlanError, Question, QuestionRequest, Spend,
    SqliteStore, StoreError, TaskRow, TaskSpec, TaskState, TaskStore, Tokens, WorkerRow, code, offered_option,
    option_kind, plan, requires, schedule, state,
};
pub use tasks::{
    AttemptTime, CANCEL_WAIT, CancelledRun, Delivered, EventFilter, Follow, Follower, Leased, RunSummary, RunView,
    ScheduleView, Submission, Submitted, TaskView, Tasks,
};

/// The store below the host (`pier-store`), for the wiring that opens one.
pub mod store {
    pub use pier_store::*;
}
