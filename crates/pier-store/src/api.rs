//! The store's API: what the host needs from a store, whatever holds it.

use std::sync::Arc;

use serde_json::Value;
use tokio::sync::{broadcast, watch};

use crate::StoreError;
use crate::log::{Event, OwnCommit};
use crate::plan::{Plan, TaskSpec};
use crate::rows::{
    AgentRow, Attempt, AttemptRow, Ending, Held, Idem, Last, NodeRow, Question, QuestionRequest, TaskRow, Waiting,
};

/// What the host needs from a store. Every backend passes the conformance suite
/// (`tests/conformance.rs`), which is written against this trait only.
pub trait TaskStore: Send + Sync + 'static {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError>;
    /// [`TaskStore::create_run`] by node `node`, which takes the new run's lease until
    /// `until_ms` in the same commit: the node a run was submitted to drives it, without a
    /// second commit to take it (no node sees it free). Another node's live lease under that
    /// id (a `pier run` creating the same run) is left alone. Whether it took the lease; the
    /// run's `run_created` event names the node when it did (`driven_by`).
    fn create_run_driven(
        &self,
        run: &str,
        plan: &Plan,
        source: &str,
        node: &str,
        until_ms: i64,
    ) -> Result<bool, StoreError>;
    fn run_exists(&self, run: &str) -> Result<bool, StoreError>;
    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError>;
    /// One task, or `None` if the run has no such task.
    fn task(&self, run: &str, task: &str) -> Result<Option<TaskRow>, StoreError>;
    /// Every pending task of every run, in queue order ([`crate::queue`]): by rank, then by run
    /// and place in the plan.
    fn pending_tasks(&self) -> Result<Vec<TaskRow>, StoreError>;
    /// A consistent copy of the whole store, taken while it is in use, written to the new file
    /// `to` (SQLite); a PostgreSQL store says to use `pg_dump`.
    fn backup(&self, to: &std::path::Path) -> Result<(), StoreError>;
    /// [`TaskStore::pending_tasks`] one at a time to `visit` with its rank, until it returns
    /// true; each row is decoded only when reached (a worker's lease usually takes one of the
    /// first).
    fn visit_pending(&self, visit: &mut dyn FnMut(TaskRow, i64) -> Result<bool, StoreError>) -> Result<(), StoreError>;
    /// Every task of every run that has not ended, oldest run first, in plan order.
    fn unfinished_tasks(&self) -> Result<Vec<TaskRow>, StoreError>;
    /// The tasks (of any run) touched by an event after sequence `after`, and the
    /// sequence they are current to (pass it back next time).
    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError>;

    /// Starts the next attempt of a pending task whose `not_before` has passed, for
    /// `owner`, with a lease until `lease_until_ms`. `None` if the task is not claimable
    /// (another claimer won, or it moved on): exactly one of many racing claimers wins.
    fn claim(
        &self,
        run: &str,
        task: &str,
        owner: &str,
        lease_until_ms: i64,
    ) -> Result<Option<(Attempt, TaskRow)>, StoreError>;
    /// Renews the lease; false if the attempt does not hold the task any more.
    fn heartbeat(&self, attempt: &Attempt, lease_until_ms: i64) -> Result<bool, StoreError>;
    /// Puts a question for a person on the task (`running → awaiting_input`) and returns its
    /// number within the attempt. The lease stays: the agent is alive and waiting.
    fn park(&self, attempt: &Attempt, request: &QuestionRequest) -> Result<i64, StoreError>;
    /// `awaiting_input → running` once the question is answered; false if not held.
    fn resume(&self, attempt: &Attempt) -> Result<bool, StoreError>;
    /// Ends the attempt: the task moves as `ending` says, the lease is released and the
    /// attempt's unanswered questions are void. Refused (`lease_lost`) unless `attempt`
    /// holds the task with a live lease. With `idem`, a repeat gets the first answer.
    fn finish(&self, attempt: &Attempt, ending: &Ending, idem: Option<&Idem>) -> Result<TaskRow, StoreError>;
    /// A worker's report ([`TaskStore::finish`] with its key) and, in the same commit, the
    /// claim of `next` for the worker (if it is still pending, due and ready). A repeat of the
    /// key answers what the first did.
    fn report_and_claim(
        &self,
        attempt: &Attempt,
        ending: &Ending,
        idem: &Idem,
        next: Option<&crate::NextClaim>,
    ) -> Result<crate::Reported, StoreError>;
    /// Ends an attempt its holder lost (lease expired, host dead), if the task is still as
    /// `held` describes it (same attempt, owner and expiry); `None` if it moved on.
    fn release_lost(&self, held: &Held, ending: &Ending) -> Result<Option<TaskRow>, StoreError>;
    /// Appends an attempt's events to the log and its side effects to its evidence.
    fn record(&self, attempt: &Attempt, events: &[(String, Value)], evidence: &[Value]) -> Result<i64, StoreError>;
    /// A remote attempt's progress: `idem`'s events and `evidence`, fenced on the attempt
    /// holding the task, written once per key; false for a repeat (nothing written).
    fn record_once(&self, attempt: &Attempt, idem: &Idem, evidence: &[Value]) -> Result<bool, StoreError>;
    /// A pull worker asked for work, able to do `capabilities`.
    fn seen_worker(&self, name: &str, capabilities: &[String]) -> Result<(), StoreError>;
    /// The pull workers seen, with the attempts each holds.
    fn workers(&self) -> Result<Vec<crate::WorkerRow>, StoreError>;
    /// How many live attempts hold concurrency key `key` (anyone's, on every node and worker).
    fn key_holders(&self, key: &str) -> Result<i64, StoreError>;

    /// Stores schedule `spec`, declared by `source`, its first occurrence `next`; another spec
    /// under its id is replaced with `replace` (pier.toml at a node's start), else refused
    /// (`schedule_exists`). The same spec again changes nothing.
    fn put_schedule(
        &self,
        spec: &crate::schedule::ScheduleSpec,
        source: &str,
        next: Option<i64>,
        replace: bool,
    ) -> Result<crate::Put, StoreError>;
    /// Moves a schedule on from the occurrence its caller read, creating the occurrence's run
    /// in the same commit; false if another node (or a pause) moved it first.
    fn advance_schedule(&self, advance: &crate::Advance) -> Result<bool, StoreError>;
    /// Pauses or resumes (starting again at `next`) schedule `id`; `None` if there is none,
    /// else whether it changed.
    fn pause_schedule(&self, id: &str, paused: bool, by: &str, next: Option<i64>) -> Result<Option<bool>, StoreError>;
    /// Deletes schedule `id` (its runs stay); whether there was one.
    fn delete_schedule(&self, id: &str) -> Result<bool, StoreError>;
    /// Every schedule (or `id` alone), by id, with its last run's state.
    fn schedules(&self, id: Option<&str>) -> Result<Vec<crate::ScheduleRow>, StoreError>;

    /// A person's budgets: task `task`'s own (`budget`) and the run's (`run_budget`, on every
    /// task of the run); `None` limits keep what was. The tasks changed, as they are now.
    fn set_budget(
        &self,
        run: &str,
        task: Option<&str>,
        budget: Option<crate::plan::Budget>,
        run_budget: Option<crate::plan::Budget>,
        by: &str,
    ) -> Result<Vec<TaskRow>, StoreError>;

    /// Cancels a task that has not ended (a person's or a dependency's cancel); a running
    /// attempt finds out through its fence. `None` if it had ended already.
    fn cancel(&self, run: &str, task: &str, reason: &str) -> Result<Option<TaskRow>, StoreError>;
    /// A person's decision on a task that waits for one with no attempt alive: run it
    /// again (`pending`) or not (`cancelled`).
    fn decide_rerun(&self, run: &str, task: &str, again: bool, by: &str) -> Result<TaskRow, StoreError>;
    /// Adds `spec` (whose `added_by` is `attempt`'s task) to `attempt`'s run while the attempt
    /// holds its task: a task pending after the run's others, or nothing if one of that id and
    /// spec is there already. Refused ([`StoreError::NotAdded`], `lease_lost`) without a write.
    fn add_task(&self, attempt: &Attempt, spec: &TaskSpec) -> Result<crate::Added, StoreError>;
    /// A person's retry of a failed or cancelled task, and with `dependents` of the cancelled
    /// tasks below it: back to `pending`, failures forgotten; the rows as they are now.
    fn retry(&self, run: &str, task: &str, dependents: bool, by: &str) -> Result<Vec<TaskRow>, StoreError>;
    /// Answers an open question; false if it was answered (or voided) already.
    fn answer(&self, run: &str, task: &str, question: &Question, option: &str, by: &str) -> Result<bool, StoreError>;
    /// The answer to a question, once there is one.
    fn answer_of(&self, attempt: &Attempt, n: i64) -> Result<Option<String>, StoreError>;
    /// The open question of a task, if any.
    fn open_question(&self, run: &str, task: &str) -> Result<Option<Question>, StoreError>;

    /// Appends events that belong to no attempt (notes, benchmarks).
    fn append_events(&self, events: &[(String, Option<String>, String, Value)]) -> Result<i64, StoreError>;
    fn evidence(&self, run: &str, task: &str, attempt: i64) -> Result<Vec<Value>, StoreError>;
    /// Keeps what an attempt showed (`pier_client::Partial`: its text and tool calls), when
    /// it ends, however it ends.
    fn keep_output(&self, attempt: &Attempt, output: &Value) -> Result<(), StoreError>;
    /// [`TaskStore::finish`] with what the attempt writes last ([`Last`]) in one write: its
    /// last events first, its output kept even when the ending is refused (as a race).
    fn finish_keeping(&self, attempt: &Attempt, last: &Last, ending: &Ending) -> Result<TaskRow, StoreError>;
    /// A task's attempts, oldest first.
    fn attempts(&self, run: &str, task: &str) -> Result<Vec<AttemptRow>, StoreError>;
    /// The attempt stopped waiting for its question `n` (withdrawn, or its turn cancelled):
    /// the question is void and the task runs again if it waits on nothing else. Fenced.
    fn withdraw(&self, attempt: &Attempt, question: i64) -> Result<(), StoreError>;
    /// Queues a person's message for a running task; its number, or `None` when the task is
    /// not running (nothing is queued).
    fn say(&self, run: &str, task: &str, text: &str, interrupt: bool, by: &str) -> Result<Option<i64>, StoreError>;
    /// The messages not sent yet, oldest first, taken by the attempt holding the task (they
    /// are marked sent by it); fenced on the attempt.
    fn take_messages(&self, attempt: &Attempt) -> Result<Vec<(i64, String)>, StoreError>;
    /// Which messages wait for the task, both read at one instant.
    fn waiting(&self, run: &str, task: &str) -> Result<Waiting, StoreError>;
    /// Keeps the `initialize` answer of a process of agent spec `spec` (the latest wins).
    fn record_agent(&self, spec: &str, init: &Value) -> Result<(), StoreError>;
    /// The last `initialize` answer recorded for `spec`.
    fn agent(&self, spec: &str) -> Result<Option<AgentRow>, StoreError>;
    /// Every agent spec's last `initialize` answer.
    fn agents(&self) -> Result<Vec<AgentRow>, StoreError>;
    fn events_after(&self, run: Option<&str>, after: i64, limit: usize) -> Result<Vec<Event>, StoreError>;
    /// Task `task`'s latest `last` events, oldest first (picked out in the database from its
    /// run's log, not read whole by the caller).
    fn task_events(&self, run: &str, task: &str, last: usize) -> Result<Vec<Event>, StoreError>;
    /// The events of one `kind` in run `run` (of task `task` alone, when given), oldest first:
    /// what a spend is summed from, picked out in the database.
    fn events_of_kind(&self, run: &str, task: Option<&str>, kind: &str) -> Result<Vec<Event>, StoreError>;
    fn last_seq(&self) -> Result<i64, StoreError>;
    /// The runs that have a task with this id, newest first.
    fn runs_with_task(&self, task: &str) -> Result<Vec<String>, StoreError>;
    /// Every run id, oldest first.
    fn run_ids(&self) -> Result<Vec<String>, StoreError>;
    /// Every run with when it was created and when its last event was written, oldest
    /// first: `(id, created_at_ms, last_event_at_ms)`.
    fn run_times(&self) -> Result<Vec<(String, i64, i64)>, StoreError>;
    /// When each task of run `run` last moved (its last transition, else its creation), in
    /// milliseconds: how long a ready task has waited, whichever host reads it.
    fn tasks_moved_at(&self, run: &str) -> Result<Vec<(String, i64)>, StoreError>;
    /// When task `task` of run `run` completed (its last transition), in milliseconds; `None`
    /// unless it is completed: whether a dependency is done and since when, for a pull
    /// worker's queue, in one read.
    fn completed_at(&self, run: &str, task: &str) -> Result<Option<i64>, StoreError>;
    /// How many tasks of the whole store are in each state (for `/metrics`): one aggregate
    /// query, whatever the number of runs.
    fn task_counts(&self) -> Result<Vec<(String, i64)>, StoreError>;
    /// Each run's tasks by state, `(run, state, tasks, attempts started)`: one aggregate query
    /// for a list of runs, whatever their number.
    fn run_task_states(&self) -> Result<Vec<(String, String, i64, i64)>, StoreError>;
    /// Renews node `node`'s presence and its run leases until `until_ms`, hands back runs
    /// beyond its fair share and takes free or expired ones up to it; the runs it drives.
    /// Exactly one live node holds a run's lease at a time.
    fn lease_runs(&self, node: &str, until_ms: i64) -> Result<Vec<String>, StoreError>;
    /// Node `node`, driving `driving` unfinished runs as it sees them, takes free or expired
    /// runs between two renewals (a run appeared): up to its fair share less those, and at
    /// least its part of the free ones; it renews nothing. The runs it took (it holds those
    /// besides the ones it held).
    fn take_runs(&self, node: &str, until_ms: i64, driving: usize) -> Result<Vec<String>, StoreError>;
    /// Node `node` drives run `run` alone (`pier run`): renews its presence and takes or
    /// renews that run's lease (never another node's live one); whether it holds it.
    fn lease_run(&self, node: &str, run: &str, until_ms: i64) -> Result<bool, StoreError>;
    /// The node whose live lease drives run `run`, if one does: how a node that came upon a
    /// run in the log learns whether it is its own (taken as it was created), another's or free.
    fn run_driver(&self, run: &str) -> Result<Option<String>, StoreError>;
    /// Node `node` stops: its runs are handed back at once.
    fn release_runs(&self, node: &str) -> Result<(), StoreError>;
    /// The live nodes and the runs each drives.
    fn nodes(&self) -> Result<Vec<NodeRow>, StoreError>;
    /// The last committed event sequence, changed on every commit: this process's at once,
    /// other processes' (sharing the store) within the backend's watch interval.
    fn subscribe(&self) -> watch::Receiver<i64>;
    /// This process's own commits, each with the tasks it changed, in commit order: what a
    /// follower of [`TaskStore::subscribe`] would otherwise read back with
    /// [`TaskStore::tasks_changed`]. The rows are read (in the committing transaction) only
    /// while someone follows. A commit whose rows could not be read is not sent: the next
    /// one's `after` shows the gap.
    fn own_commits(&self) -> broadcast::Receiver<Arc<OwnCommit>>;
}
