//! Schedules over the API: declared (pier.toml at start, `POST /schedules`), listed, paused,
//! resumed, deleted. Each is checked whole when declared, its plan too, so an occurrence
//! never meets a problem a person could have been told about. [`crate::clock`] fires them.

use pier_store::plan::{PlanError, Problem};
use pier_store::schedule::{Schedule, ScheduleSpec, What, rfc3339};
use pier_store::{ErrorCode, Plan, Put, ScheduleRow, now_ms};
use serde::Serialize;

use super::handle::Tasks;
use crate::person::ActionError;

/// A schedule as `pier schedules` and `GET /schedules` show it: the stored row, its id, and
/// its next and last occurrences in RFC 3339 (UTC).
#[derive(Debug, Clone, Serialize)]
pub struct ScheduleView {
    pub id: String,
    #[serde(flatten)]
    pub row: ScheduleRow,
    pub next_at: Option<String>,
    pub last_at: Option<String>,
}

impl ScheduleView {
    fn of(row: ScheduleRow) -> ScheduleView {
        ScheduleView {
            id: row.spec.id.clone(),
            next_at: row.next_at_ms.map(rfc3339),
            last_at: row.last_at_ms.map(rfc3339),
            row,
        }
    }
}

/// A schedule's problems as a refused plan's: each with the schedule's id, line 0.
fn refused(id: &str, problems: Vec<String>) -> ActionError {
    let problems = problems.into_iter().map(|p| Problem { line: 0, message: format!("schedule `{id}`: {p}") });
    ActionError::Plan(PlanError(problems.collect()))
}

impl Tasks {
    /// The plan an occurrence of `schedule` submits, parsed as any submitted plan is.
    pub(crate) fn schedule_plan(&self, schedule: &Schedule) -> Result<Plan, PlanError> {
        let c = &self.config;
        let text = match schedule.spec.what() {
            Some(What::Plan(text)) => text.to_owned(),
            Some(What::Type { task_type, input, priority }) => super::one_task_plan(task_type, input, priority, None)?,
            None => {
                return Err(PlanError(vec![Problem { line: 0, message: "the schedule says nothing to run".into() }]));
            }
        };
        let types = super::plan_types(&c.types, schedule.spec.types.as_deref())?;
        super::parse_plan(&text, &c.agents, &c.pier_exe, &types)
    }

    /// Checks `spec` whole (its timing, its plan, what its tasks need of this machine).
    async fn check_schedule(&self, spec: ScheduleSpec) -> Result<Schedule, ActionError> {
        let id = spec.id.clone();
        let schedule = spec.compile().map_err(|p| refused(&id, p))?;
        let plan = self
            .schedule_plan(&schedule)
            .map_err(|e| refused(&id, e.0.into_iter().map(|p| p.to_string()).collect()))?;
        super::submit::check_sandbox(&plan, &self.config).map_err(ActionError::Plan)?;
        crate::caps::check(&plan, &self.store, &self.config).await.map_err(ActionError::Plan)?;
        Ok(schedule)
    }

    /// Declares schedule `spec` (`POST /schedules`, `pier schedules add`), by `by`: the same
    /// spec again is accepted and changes nothing; another under its id is refused.
    pub async fn add_schedule(&self, spec: ScheduleSpec, by: &str) -> Result<(ScheduleView, bool), ActionError> {
        let schedule = self.check_schedule(spec).await?;
        let source = format!("api by {by}");
        let put = self.put(schedule, source, false).await?;
        self.schedules_changed.notify_one();
        let id = put.1;
        Ok((self.schedule(&id).await?, put.0 == Put::Created))
    }

    /// Declares pier.toml's schedules at a node's start: each checked (the first problem stops
    /// the start, naming it), a changed one replaced (it starts again at its next occurrence).
    pub async fn install_schedules(&self, specs: Vec<ScheduleSpec>) -> Result<(), ActionError> {
        let mut checked = Vec::new();
        for spec in specs {
            checked.push(self.check_schedule(spec).await?);
        }
        for schedule in checked {
            self.put(schedule, "pier.toml".into(), true).await?;
        }
        self.schedules_changed.notify_one();
        Ok(())
    }

    async fn put(&self, schedule: Schedule, source: String, replace: bool) -> Result<(Put, String), ActionError> {
        let next = schedule.first_after(now_ms());
        self.blocking(move |s| {
            let put = s.put_schedule(&schedule.spec, &source, next, replace)?;
            Ok((put, schedule.spec.id))
        })
        .await
    }

    /// Every schedule, by id.
    pub async fn schedules(&self) -> Result<Vec<ScheduleView>, ActionError> {
        let rows = self.blocking(|s| Ok(s.schedules(None)?)).await?;
        Ok(rows.into_iter().map(ScheduleView::of).collect())
    }

    pub async fn schedule(&self, id: &str) -> Result<ScheduleView, ActionError> {
        let i = id.to_owned();
        let row = self.blocking(move |s| Ok(s.schedules(Some(&i))?.pop())).await?;
        row.map(ScheduleView::of).ok_or_else(|| unknown(id))
    }

    /// Pauses (`paused`) or resumes schedule `id`, by `by`. A resumed schedule starts at its
    /// next occurrence from now: what came due while it was paused does not run.
    pub async fn pause_schedule(&self, id: &str, paused: bool, by: &str) -> Result<ScheduleView, ActionError> {
        let view = self.schedule(id).await?;
        let next = view.row.spec.clone().compile().ok().and_then(|s| s.first_after(now_ms()));
        let (i, by) = (id.to_owned(), by.to_owned());
        self.blocking(move |s| Ok(s.pause_schedule(&i, paused, &by, next)?)).await?.ok_or_else(|| unknown(id))?;
        self.schedules_changed.notify_one();
        self.schedule(id).await
    }

    /// Deletes schedule `id`; its runs stay. A pier.toml schedule comes back at a node's next
    /// start unless it is taken out of pier.toml.
    pub async fn delete_schedule(&self, id: &str) -> Result<(), ActionError> {
        let i = id.to_owned();
        if self.blocking(move |s| Ok(s.delete_schedule(&i)?)).await? { Ok(()) } else { Err(unknown(id)) }
    }
}

fn unknown(id: &str) -> ActionError {
    ActionError::Refused {
        code: ErrorCode::UnknownSchedule,
        message: format!("no schedule `{id}`; `pier schedules` lists them"),
    }
}
