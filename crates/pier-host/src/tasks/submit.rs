//! Submitting a plan: parsed and checked whole (agents, requirements) before anything is
//! stored, then created as a run of the store.

use std::collections::BTreeMap;
use std::path::Path;

use pier_client::AgentDef;
use pier_store::plan::{self, Plan, PlanError};
use pier_store::{ErrorCode, StoreError, TaskSpec};

use super::handle::Tasks;
use crate::person::ActionError;

/// Parses a plan, every agent it names checked: a pull-worker agent, or one the registry
/// (`agents`, pier's own `exe`, `PATH`) resolves. Needs no store: a refused plan leaves
/// nothing behind.
pub fn parse_plan(
    text: &str,
    agents: &BTreeMap<String, AgentDef>,
    exe: &Path,
    types: &plan::Shared,
) -> Result<Plan, PlanError> {
    let path = std::env::var("PATH").ok();
    let known = |agent: &str| {
        if pier_store::requires::is_worker(agent) {
            return Ok(());
        }
        pier_client::registry::resolve(agent, agents, exe, path.as_deref()).map(|_| ()).map_err(|e| e.to_string())
    };
    plan::parse_typed(text, types, &known)
}

/// The file of task types beside a plan file (`types.toml` in its directory).
pub const TYPES_FILE: &str = "types.toml";

/// The types a plan may use: `shared` (pier.toml's) and those of the types file beside the plan,
/// `beside`, whose win on a name. Its problems are named as its own.
pub fn plan_types(shared: &plan::Shared, beside: Option<&str>) -> Result<plan::Shared, PlanError> {
    let Some(text) = beside else { return Ok(shared.clone()) };
    let file = plan::Shared::parse_file(text).map_err(|e| {
        PlanError(e.0.into_iter().map(|p| plan::Problem { line: 0, message: format!("{TYPES_FILE}: {p}") }).collect())
    })?;
    Ok(shared.with(&file))
}

/// An ad-hoc task of a declared type (`pier submit --type`, `POST /runs` with `type`): the
/// text of a one-task plan, parsed and checked as any plan is. The task is `id`, else the type's name.
pub fn one_task_plan(
    task_type: &str,
    input: &serde_json::Value,
    priority: Option<u8>,
    id: Option<&str>,
) -> Result<String, PlanError> {
    let refused = |message: String| PlanError(vec![plan::Problem { line: 0, message }]);
    let input = toml::Value::try_from(input)
        .map_err(|e| refused(format!("the input cannot be a plan's (TOML has no null): {e}")))?;
    let mut task = toml::Table::new();
    task.insert("id".into(), id.unwrap_or(task_type).into());
    task.insert("type".into(), task_type.into());
    task.insert("input".into(), input);
    if let Some(p) = priority {
        task.insert("priority".into(), i64::from(p).into());
    }
    let mut plan = toml::Table::new();
    plan.insert("tasks".into(), toml::Value::Array(vec![toml::Value::Table(task)]));
    toml::to_string(&plan).map_err(|e| refused(format!("the task cannot be written as a plan: {e}")))
}

/// Refuses every task whose confinement this machine cannot give (a strict task where user
/// namespaces are forbidden, a limit without its cgroup controller), with its line.
pub(super) fn check_sandbox(plan: &Plan, config: &crate::HostConfig) -> Result<(), PlanError> {
    let problems: Vec<plan::Problem> = plan
        .tasks
        .iter()
        .filter_map(|t| {
            let why = config.sandbox.refuses(t)?;
            Some(plan::Problem {
                line: plan.lines.get(&t.id).copied().unwrap_or(0),
                message: format!("task `{}`: {why}", t.id),
            })
        })
        .collect();
    if problems.is_empty() { Ok(()) } else { Err(PlanError(problems)) }
}

/// A plan to store as a run.
pub struct Submission {
    pub plan: Plan,
    /// The run's id; a new one is made when none is given.
    pub run: Option<String>,
    /// Where the plan came from (its file, `http`), kept with the run.
    pub source: String,
    /// The run is this process's alone (`pier run`): its lease is taken before it is created.
    /// A shared run (`pier serve`) is driven by whichever node leases it. Either way an
    /// existing run of the same id and plan is joined (a resubmission runs nothing again);
    /// another plan under that id is refused.
    pub own: bool,
}

/// What a submission stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitted {
    pub run: String,
    /// False when a run of the same id and plan was there already (nothing runs again).
    pub created: bool,
}

impl Tasks {
    /// Stores a parsed plan as a run, once what its tasks require of their agents is checked.
    pub async fn submit(&self, s: Submission) -> Result<Submitted, ActionError> {
        if let Some(id) = &s.run {
            plan::check_run_id(id).map_err(|why| ActionError::bad_request(format!("the run id: {why}")))?;
        }
        let run = s.run.clone().unwrap_or_else(new_run_id);
        if s.run.is_some() && self.joins(&run, &s.plan.tasks, s.own).await? {
            return Ok(Submitted { run, created: false });
        }
        check_sandbox(&s.plan, &self.config).map_err(ActionError::Plan)?;
        crate::caps::check(&s.plan, &self.store, &self.config).await.map_err(ActionError::Plan)?;
        let (r, config, tasks, own) = (run.clone(), self.config.clone(), s.plan.tasks.clone(), s.own);
        // A served run is driven by the node it was submitted to when that one has room
        // (`share`): its lease is taken in the commit that creates it.
        let taking = if s.own { None } else { self.host.share.take_one(&run) };
        let driven = taking.is_some();
        let created = self
            .blocking(move |store| {
                let created = if s.own {
                    crate::host::create_own_run(store, &config, &r, &s.plan, &s.source).map(|()| false)
                } else if driven {
                    let until = pier_store::now_ms() + config.lease_ttl.as_millis() as i64;
                    store.create_run_driven(&r, &s.plan, &s.source, &config.node, until)
                } else {
                    store.create_run(&r, &s.plan, &s.source).map(|()| false)
                };
                Ok(created?)
            })
            .await;
        if let Some(taking) = taking {
            taking.done(matches!(created, Ok(true)));
        }
        match created.map(|_| ()) {
            Ok(()) => Ok(Submitted { run, created: true }),
            // The same submission twice at once: the second joins what the first created.
            Err(ActionError::Store(StoreError::RunExists(_))) if self.joins(&run, &tasks, own).await? => {
                Ok(Submitted { run, created: false })
            }
            Err(e) => Err(e),
        }
    }

    /// Whether run `run` exists with these tasks (a second host joining it, a submission
    /// repeated); another plan under an existing id is refused, never silently ignored.
    async fn joins(&self, run: &str, tasks: &[TaskSpec], own: bool) -> Result<bool, ActionError> {
        let (run, tasks) = (run.to_owned(), tasks.to_vec());
        self.blocking(move |s| {
            if !s.run_exists(&run)? {
                return Ok(false);
            }
            // Tasks its agents added as it ran are not the plan's.
            let stored: Vec<TaskSpec> =
                s.tasks(&run)?.into_iter().map(|t| t.spec).filter(|t| t.added_by.is_none()).collect();
            if stored != tasks {
                let fix = if own { format!("resume it with `pier run --resume {run}`, or ") } else { String::new() };
                return Err(ActionError::Refused {
                    code: ErrorCode::RunExists,
                    message: format!(
                        "run `{run}` already exists with another plan; {fix}give this plan another run id (--run-id)"
                    ),
                });
            }
            Ok(true)
        })
        .await
    }

    /// Whether run `run` exists (`pier run --resume`, `pier events --run`).
    pub async fn run_exists(&self, run: &str) -> Result<bool, ActionError> {
        let run = run.to_owned();
        self.blocking(move |s| Ok(s.run_exists(&run)?)).await
    }
}

/// A new run id: `run-` and 12 hex digits.
fn new_run_id() -> String {
    format!("run-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}
