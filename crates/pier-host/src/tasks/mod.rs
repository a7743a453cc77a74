//! [`Tasks`]: the host's API, the one handle the faces call (`pier-server`, the dashboard, the
//! binary's `pier run`, `pier show`, `pier events`, `pier approve` …). Its methods are the use
//! cases of a task's life: submit, lease / heartbeat / report for pull workers, answer / say /
//! retry / cancel for people, the read views, and [`Tasks::follow`], the one follower of the
//! event log. The rules behind them are written once, here and in the modules this one
//! calls ([`crate::person`], [`crate::caps`], the store's operations); a face only converts.
//!
//! API Boundary: nothing outside pier-host calls the store; the store's calls block, so every
//! method runs them on a blocking thread and is `async`.

mod agent_tools;
mod cancel;
mod follow;
mod handle;
mod people;
mod remote;
mod schedules;
mod select;
mod submit;
mod turns;
mod views;
mod workers;

pub use agent_tools::{FollowUp, FollowedUp, PersonSaid, TaskResult};
pub use cancel::{CANCEL_WAIT, CancelledRun};
pub use follow::{Delivered, Follow, Follower};
pub use handle::Tasks;
pub use remote::{MAX_BATCH_EVENTS, MAX_WAIT, Notice, Progress};
pub use schedules::ScheduleView;
pub use select::{EventFilter, merge_deltas};
pub use submit::{Submission, Submitted, TYPES_FILE, one_task_plan, parse_plan, plan_types};
pub use turns::{Opened, Turn, TurnCall, turns};
pub use views::{
    AttemptTime, KeyLoad, RUN_STATES, RunFilter, RunList, RunSummary, RunView, StoreCounts, TaskView, counts,
};
pub use workers::Leased;
