//! The read views every face shows — the JSON API, the dashboard, `pier show`, `pier run`'s
//! summary — written once, so a page can never show what the API would not.

use std::collections::BTreeMap;

use pier_store::{
    AgentRow, AttemptRow, Entry, Event, LogEvent, MODEL_REQUEST, NodeRow, Question, Spend, StoreError, TRANSITION,
    TaskRow, TaskState, TaskStore,
};
use serde::Serialize;

use super::handle::Tasks;
use super::workers::dependency_results;
use crate::person::{self, ActionError};

/// Most events a task's transcript shows: a chatty task shows its last attempt, not its first.
const TRANSCRIPT_EVENTS: usize = 20_000;

/// How many tasks are in each state.
pub fn counts<'a>(tasks: impl IntoIterator<Item = &'a TaskRow>) -> BTreeMap<&'static str, usize> {
    let mut c = BTreeMap::new();
    for t in tasks {
        *c.entry(t.state.as_str()).or_default() += 1;
    }
    c
}

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
    /// Its model requests through the gateway.
    #[serde(skip)]
    pub spend: Spend,
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

    /// Whether the run is in state `state` as a list filters it: `running`, `completed` or
    /// `failed` (its [`RunSummary::state`]), or `waiting` (a task waits on a person).
    pub fn is(&self, state: &str) -> bool {
        if state == "waiting" { self.waiting() > 0 } else { self.state() == state }
    }
}

/// The states a list of runs filters on.
pub const RUN_STATES: [&str; 4] = ["running", "waiting", "completed", "failed"];

/// Which runs a list shows (`pier runs`, `GET /runs`, the dashboard): newest first, of one
/// state if given, whose id contains `search` (any case) if given, past the first `offset`,
/// at most `limit` if given.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub state: Option<String>,
    pub limit: Option<usize>,
    pub search: Option<String>,
    pub offset: usize,
}

/// A list of runs, and how many more matched beyond its limit.
#[derive(Debug, Clone)]
pub struct RunList {
    pub runs: Vec<RunSummary>,
    pub more: usize,
}

/// A run's tasks in plan order, each waiting task with the question it waits on.
#[derive(Debug, Clone)]
pub struct RunView {
    pub run: String,
    pub tasks: Vec<(TaskRow, Option<Question>)>,
    /// Its model requests through the gateway, in all and per task.
    pub spend: Spend,
    pub task_spend: BTreeMap<String, Spend>,
    /// When each task's attempts started and ended (tasks that never started have none).
    pub times: BTreeMap<String, Vec<AttemptTime>>,
}

impl RunView {
    pub fn counts(&self) -> BTreeMap<&'static str, usize> {
        counts(self.tasks.iter().map(|(t, _)| t))
    }

    /// The tasks waiting on a person, each with its question (none: a re-run decision).
    pub fn waiting(&self) -> impl Iterator<Item = &(TaskRow, Option<Question>)> {
        self.tasks.iter().filter(|(t, _)| t.state == TaskState::AwaitingInput)
    }
}

/// One task whole.
#[derive(Debug, Clone)]
pub struct TaskView {
    pub row: TaskRow,
    pub attempts: Vec<AttemptRow>,
    pub question: Option<Question>,
    /// Its agent's last `initialize` answer, when known.
    pub agent: Option<AgentRow>,
    /// Its prompt as its agent gets it: the results of its dependencies filled in.
    pub prompt: String,
    /// How its agent is confined ([`crate::SandboxConfig::describe_task`]).
    pub sandbox: String,
    /// Its model requests through the gateway, over all its attempts.
    pub spend: Spend,
    /// Its concurrency keys, each with its limit and the live attempts holding it now.
    pub keys: Vec<KeyLoad>,
    /// When each attempt started and ended, from its transitions in the log.
    pub times: Vec<AttemptTime>,
}

/// When an attempt started (claimed: `pending → running`) and ended (left `running` and
/// `awaiting_input`), and the state it ended in; an attempt still on has no end.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AttemptTime {
    pub attempt: i64,
    pub started_at_ms: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended: Option<TaskState>,
}

impl AttemptTime {
    /// Each attempt's times, from a task's transition events in log order.
    pub fn from_transitions(events: &[Event]) -> Vec<AttemptTime> {
        let on = |s: TaskState| matches!(s, TaskState::Running | TaskState::AwaitingInput);
        let mut times: Vec<AttemptTime> = Vec::new();
        for e in events {
            let Entry::Host(LogEvent::Transition { from, to, attempt, .. }) = e.entry() else { continue };
            if from == TaskState::Pending && to == TaskState::Running {
                times.push(AttemptTime { attempt, started_at_ms: e.at_ms, ended_at_ms: None, ended: None });
            } else if on(from)
                && !on(to)
                && let Some(t) = times.iter_mut().rev().find(|t| t.attempt == attempt && t.ended_at_ms.is_none())
            {
                t.ended_at_ms = Some(e.at_ms);
                t.ended = Some(to);
            }
        }
        times
    }

    /// How long it took, once it has ended.
    pub fn took_ms(&self) -> Option<i64> {
        self.ended_at_ms.map(|end| end - self.started_at_ms)
    }

    /// How long `attempts` ran together, one still on counted to `now_ms`.
    pub fn ran_ms(attempts: &[AttemptTime], now_ms: i64) -> i64 {
        attempts.iter().map(|a| a.ended_at_ms.unwrap_or(now_ms) - a.started_at_ms).sum::<i64>().max(0)
    }
}

/// A concurrency key of a task, as it stands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KeyLoad {
    pub key: String,
    pub limit: u32,
    pub running: i64,
}

impl TaskView {
    /// The current attempt's side effects.
    pub fn evidence(&self) -> &[serde_json::Value] {
        self.attempts.iter().find(|a| a.attempt == self.row.attempt).map_or(&[], |a| &a.evidence)
    }
}

/// How many tasks of the whole store are in each state, and the last event's sequence.
#[derive(Debug, Clone)]
pub struct StoreCounts {
    pub tasks: Vec<(String, i64)>,
    pub last_seq: i64,
}

fn run_view(s: &dyn TaskStore, run: &str) -> Result<RunView, ActionError> {
    if !s.run_exists(run)? {
        return Err(pier_store::StoreError::UnknownRun(run.to_owned()).into());
    }
    let mut tasks = Vec::new();
    for t in s.tasks(run)? {
        let q = match t.state {
            TaskState::AwaitingInput => s.open_question(run, &t.id)?,
            _ => None,
        };
        tasks.push((t, q));
    }
    let requests = s.events_of_kind(run, None, MODEL_REQUEST)?;
    let mut task_spend: BTreeMap<String, Spend> = BTreeMap::new();
    for e in &requests {
        if let Some(task) = &e.task {
            task_spend.entry(task.clone()).or_default().add_event(e);
        }
    }
    // One read of the run's transitions (their own index), split by task in log order.
    let mut transitions: BTreeMap<String, Vec<Event>> = BTreeMap::new();
    for e in s.events_of_kind(run, None, TRANSITION)? {
        if let Some(task) = e.task.clone() {
            transitions.entry(task).or_default().push(e);
        }
    }
    let times = transitions.into_iter().map(|(task, events)| (task, AttemptTime::from_transitions(&events))).collect();
    Ok(RunView { run: run.to_owned(), tasks, spend: Spend::from_events(&requests), task_spend, times })
}

impl Tasks {
    /// The runs `filter` names, newest first: the one order of `pier runs`, `GET /runs` and the
    /// dashboard. Two aggregate reads whatever the number of runs; spend is read for the runs
    /// returned only.
    pub async fn list_runs(&self, filter: &RunFilter) -> Result<RunList, ActionError> {
        if let Some(state) = filter.state.as_deref().filter(|s| !RUN_STATES.contains(s)) {
            return Err(ActionError::bad_request(format!(
                "no run state `{state}`; give one of {}",
                RUN_STATES.join(", ")
            )));
        }
        let filter = filter.clone();
        self.blocking(move |s| {
            // Each run's tasks by state, then the runs newest first with theirs.
            let mut tasks_of: std::collections::HashMap<String, (BTreeMap<&'static str, usize>, i64)> =
                std::collections::HashMap::new();
            for (run, state, n, attempts) in s.run_task_states()? {
                let Some(state) = TaskState::parse(&state) else { continue };
                let (counts, started) = tasks_of.entry(run).or_default();
                *counts.entry(state.as_str()).or_default() += usize::try_from(n).unwrap_or(0);
                *started += attempts;
            }
            let mut runs: Vec<RunSummary> = s
                .run_times()?
                .into_iter()
                .rev()
                .map(|(run, created_at_ms, updated_at_ms)| {
                    let (counts, attempts) = tasks_of.remove(&run).unwrap_or_default();
                    let tasks = counts.values().sum();
                    RunSummary { run, created_at_ms, updated_at_ms, counts, tasks, attempts, spend: Spend::default() }
                })
                .collect();
            let needle = filter.search.as_deref().map(str::to_lowercase).filter(|n| !n.trim().is_empty());
            runs.retain(|r| {
                filter.state.as_deref().is_none_or(|st| r.is(st))
                    && needle.as_deref().is_none_or(|n| r.run.to_lowercase().contains(n))
            });
            let runs: Vec<RunSummary> = runs.into_iter().skip(filter.offset).collect();
            let more = filter.limit.map_or(0, |l| runs.len().saturating_sub(l));
            let mut runs = runs;
            runs.truncate(runs.len() - more);
            for r in &mut runs {
                r.spend = Spend::from_events(&s.events_of_kind(&r.run, None, MODEL_REQUEST)?);
            }
            Ok(RunList { runs, more })
        })
        .await
    }

    pub async fn run(&self, run: &str) -> Result<RunView, ActionError> {
        let run = run.to_owned();
        self.blocking(move |s| run_view(s, &run)).await
    }

    pub async fn task(&self, run: &str, task: &str) -> Result<TaskView, ActionError> {
        let (run, task) = (run.to_owned(), task.to_owned());
        let config = self.config.clone();
        self.blocking(move |s| {
            let row = person::task_of(s, &run, &task)?;
            let prompt = pier_store::plan::render(&row.spec.prompt, &dependency_results(s, &row)?);
            let keys = row
                .spec
                .concurrency
                .iter()
                .map(|k| Ok(KeyLoad { key: k.key.clone(), limit: k.limit, running: s.key_holders(&k.key)? }))
                .collect::<Result<_, StoreError>>()?;
            Ok(TaskView {
                keys,
                times: AttemptTime::from_transitions(&s.events_of_kind(&run, Some(&task), TRANSITION)?),
                spend: Spend::from_events(&s.events_of_kind(&run, Some(&task), MODEL_REQUEST)?),
                sandbox: config.sandbox.describe_task(&row.spec),
                attempts: s.attempts(&run, &task)?,
                question: s.open_question(&run, &task)?,
                agent: s.agent(&row.spec.agent)?,
                prompt,
                row,
            })
        })
        .await
    }

    /// A task's latest events, oldest first (picked out by the store, not read from the run's log).
    pub async fn transcript(&self, run: &str, task: &str) -> Result<Vec<Event>, ActionError> {
        let (run, task) = (run.to_owned(), task.to_owned());
        self.blocking(move |s| Ok(s.task_events(&run, &task, TRANSCRIPT_EVENTS)?)).await
    }

    /// Every task of the store waiting on a person, with its question (none: a re-run decision).
    pub async fn waiting(&self) -> Result<Vec<(TaskRow, Option<Question>)>, ActionError> {
        self.blocking(|s| {
            let mut out = Vec::new();
            for t in s.unfinished_tasks()?.into_iter().filter(|t| t.state == TaskState::AwaitingInput) {
                let q = s.open_question(&t.run_id, &t.id)?;
                out.push((t, q));
            }
            Ok(out)
        })
        .await
    }

    /// Each agent spec's last `initialize` answer, as the host recorded it.
    pub async fn agents(&self) -> Result<Vec<AgentRow>, ActionError> {
        self.blocking(|s| Ok(s.agents()?)).await
    }

    /// The live host nodes on this store and the runs each drives.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>, ActionError> {
        self.blocking(|s| Ok(s.nodes()?)).await
    }

    /// The store's counts by state and its last sequence (`/metrics`): one aggregate query.
    pub async fn counts(&self) -> Result<StoreCounts, ActionError> {
        self.blocking(|s| Ok(StoreCounts { tasks: s.task_counts()?, last_seq: s.last_seq()? })).await
    }
}

#[cfg(test)]
mod times_tests {
    use super::*;
    use serde_json::json;

    fn moved(at_ms: i64, from: &str, to: &str, attempt: i64) -> Event {
        Event {
            seq: at_ms,
            run: "r".into(),
            task: Some("t".into()),
            kind: TRANSITION.into(),
            at_ms,
            data: json!({"from": from, "to": to, "attempt": attempt, "reason": "", "version": 1}),
        }
    }

    #[test]
    fn an_attempt_runs_from_its_claim_to_its_end_waiting_on_a_person_included() {
        let events = [
            moved(10, "pending", "running", 1),
            moved(20, "running", "awaiting_input", 1),
            moved(30, "awaiting_input", "running", 1),
            moved(40, "running", "pending", 1),
            moved(50, "pending", "running", 2),
        ];
        let times = AttemptTime::from_transitions(&events);
        assert_eq!(
            times,
            [
                AttemptTime { attempt: 1, started_at_ms: 10, ended_at_ms: Some(40), ended: Some(TaskState::Pending) },
                AttemptTime { attempt: 2, started_at_ms: 50, ended_at_ms: None, ended: None },
            ]
        );
    }
}
