//! The reads both faces of `pier serve` make — the JSON API and the dashboard — written
//! once over the store's operations, so a page can never show what the API would not.
//! Each runs on a blocking thread (the caller's `blocking`).

use std::collections::BTreeMap;

use pier_host::{AttemptRow, Event, NodeRow, Question, StoreError, TaskRow, TaskState, TaskStore};
use serde::Serialize;
use serde_json::Value;

/// One run in a list of runs.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub run: String,
    pub created_at_ms: i64,
    /// When its last event was written.
    pub updated_at_ms: i64,
    pub counts: BTreeMap<&'static str, usize>,
    pub tasks: usize,
    /// Attempts started, over all its tasks.
    pub attempts: i64,
}

impl RunSummary {
    /// `running` while anything is unfinished, then `completed` if everything completed,
    /// else `failed`.
    pub fn state(&self) -> &'static str {
        let n = |s: TaskState| self.counts.get(s.as_str()).copied().unwrap_or(0);
        if n(TaskState::Pending) + n(TaskState::Running) + n(TaskState::AwaitingInput) > 0 {
            "running"
        } else if n(TaskState::Completed) == self.tasks {
            "completed"
        } else {
            "failed"
        }
    }

    pub fn waiting(&self) -> usize {
        self.counts.get(TaskState::AwaitingInput.as_str()).copied().unwrap_or(0)
    }
}

pub fn counts(tasks: &[TaskRow]) -> BTreeMap<&'static str, usize> {
    let mut c = BTreeMap::new();
    for t in tasks {
        *c.entry(t.state.as_str()).or_default() += 1;
    }
    c
}

/// Every run, oldest first.
pub fn runs(s: &dyn TaskStore) -> Result<Vec<RunSummary>, StoreError> {
    let mut out = Vec::new();
    for (run, created_at_ms, updated_at_ms) in s.run_times()? {
        let tasks = s.tasks(&run)?;
        out.push(RunSummary {
            counts: counts(&tasks),
            tasks: tasks.len(),
            attempts: tasks.iter().map(|t| t.attempt).sum(),
            run,
            created_at_ms,
            updated_at_ms,
        });
    }
    Ok(out)
}

/// A run's tasks in plan order, each waiting task with the question it waits on.
pub fn run(s: &dyn TaskStore, run: &str) -> Result<Vec<(TaskRow, Option<Question>)>, StoreError> {
    if !s.run_exists(run)? {
        return Err(StoreError::UnknownRun(run.to_owned()));
    }
    let mut out = Vec::new();
    for t in s.tasks(run)? {
        let q = match t.state {
            TaskState::AwaitingInput => s.open_question(run, &t.id)?,
            _ => None,
        };
        out.push((t, q));
    }
    Ok(out)
}

/// One task whole.
pub struct TaskView {
    pub row: TaskRow,
    pub attempts: Vec<AttemptRow>,
    pub question: Option<Question>,
    /// Its agent's last `initialize` answer, when known.
    pub agent: Option<Value>,
}

pub fn task(s: &dyn TaskStore, run: &str, task: &str) -> Result<TaskView, StoreError> {
    if !s.run_exists(run)? {
        return Err(StoreError::UnknownRun(run.to_owned()));
    }
    let row = s.task(run, task)?.ok_or_else(|| StoreError::UnknownTask(task.to_owned()))?;
    let agent = s.agent(&row.spec.agent)?.map(|a| serde_json::to_value(a).unwrap_or(Value::Null));
    Ok(TaskView { attempts: s.attempts(run, task)?, question: s.open_question(run, task)?, agent, row })
}

/// Most events a task page shows.
const TASK_EVENTS: usize = 20_000;

/// A task's latest events (at most [`TASK_EVENTS`]), oldest first: a chatty task shows its
/// last attempt, not its first. Picked out by the store, not by reading the run's log.
pub fn task_events(s: &dyn TaskStore, run: &str, task: &str) -> Result<Vec<Event>, StoreError> {
    s.task_events(run, task, TASK_EVENTS)
}

/// Every task of the store waiting on a person, with its question (none: a re-run decision).
pub fn approvals(s: &dyn TaskStore) -> Result<Vec<(TaskRow, Option<Question>)>, StoreError> {
    let mut out = Vec::new();
    for t in s.unfinished_tasks()?.into_iter().filter(|t| t.state == TaskState::AwaitingInput) {
        let q = s.open_question(&t.run_id, &t.id)?;
        out.push((t, q));
    }
    Ok(out)
}

/// Cancels every unfinished task of run `run` (the API's and the dashboard's "cancel run");
/// how many it cancelled.
pub fn cancel_run(s: &dyn TaskStore, run: &str, reason: &str) -> Result<usize, StoreError> {
    let mut n = 0;
    for (t, _) in self::run(s, run)?.into_iter().filter(|(t, _)| !t.state.is_terminal()) {
        n += usize::from(s.cancel(run, &t.id, reason)?.is_some());
    }
    Ok(n)
}

pub fn nodes(s: &dyn TaskStore) -> Result<Vec<NodeRow>, StoreError> {
    s.nodes()
}
