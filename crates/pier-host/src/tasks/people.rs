//! What people do to tasks: answer, say, retry (cancel is `cancel.rs`). The rules are
//! [`crate::person`]'s.

use pier_store::{StoreError, TaskRow};
use serde_json::Value;

use super::handle::Tasks;
use crate::person::{self, ActionError, Answered, Input};

impl Tasks {
    /// The run task `task` is in: `run` when given (checked), else the newest run with it.
    pub async fn locate(&self, task: &str, run: Option<&str>) -> Result<String, ActionError> {
        let (task, run) = (task.to_owned(), run.map(str::to_owned));
        self.blocking(move |s| match run {
            Some(run) => {
                person::task_of(s, &run, &task)?;
                Ok(run)
            }
            None => s.runs_with_task(&task)?.into_iter().next().ok_or_else(|| StoreError::UnknownTask(task).into()),
        })
        .await
    }

    /// A person's answer to what task `task` waits on: the open permission question
    /// (`option`, else allow_once / reject_once) or the re-run decision. With `expect`, refused
    /// unless that is still what it waits on (the question's number; 0 for the decision).
    pub async fn answer(
        &self,
        run: &str,
        task: &str,
        expect: Option<i64>,
        allow: bool,
        option: Option<&str>,
        by: &str,
    ) -> Result<Answered, ActionError> {
        let (run, task, option, by) = (run.to_owned(), task.to_owned(), option.map(str::to_owned), by.to_owned());
        self.blocking(move |s| person::answer_to(s, &run, &task, expect, allow, option.as_deref(), &by)).await
    }

    /// A person's answer to the question a task's agent asked (a form), checked against its fields.
    pub async fn answer_input(
        &self,
        run: &str,
        task: &str,
        expect: Option<i64>,
        input: Input,
        by: &str,
    ) -> Result<Value, ActionError> {
        let (run, task, by) = (run.to_owned(), task.to_owned(), by.to_owned());
        self.blocking(move |s| person::answer_input_to(s, &run, &task, expect, input, &by)).await
    }

    /// A person's message to a running task; its number.
    pub async fn say(&self, run: &str, task: &str, text: &str, interrupt: bool, by: &str) -> Result<i64, ActionError> {
        let (run, task, text, by) = (run.to_owned(), task.to_owned(), text.to_owned(), by.to_owned());
        self.blocking(move |s| person::say(s, &run, &task, &text, interrupt, &by)).await
    }

    /// A person's retry of a failed or cancelled task (with `dependents`, the cancelled
    /// tasks below it too); the rows as they are now.
    pub async fn retry(&self, run: &str, task: &str, dependents: bool, by: &str) -> Result<Vec<TaskRow>, ActionError> {
        let (run, task, by) = (run.to_owned(), task.to_owned(), by.to_owned());
        self.blocking(move |s| person::retry(s, &run, &task, dependents, &by)).await
    }

    /// A person's budgets: task `task`'s own (`budget`) and, with `run_budget`, its run's (on
    /// every task of the run). Each task of them that a budget stopped (waiting, no attempt
    /// alive) runs again. The changed tasks as they are now.
    pub async fn set_budget(
        &self,
        run: &str,
        task: Option<&str>,
        budget: Option<pier_store::Budget>,
        run_budget: Option<pier_store::Budget>,
        by: &str,
    ) -> Result<Vec<TaskRow>, ActionError> {
        for b in budget.iter().chain(run_budget.iter()) {
            b.check().map_err(ActionError::bad_request)?;
        }
        if budget.is_some() && task.is_none() {
            return Err(ActionError::bad_request("a task's budget needs the task; the run's is `run_budget`"));
        }
        if budget.is_none() && run_budget.is_none() {
            return Err(ActionError::bad_request("give a budget: tokens, cost or both"));
        }
        let (run, task, by) = (run.to_owned(), task.map(str::to_owned), by.to_owned());
        self.blocking(move |s| {
            if !s.run_exists(&run)? {
                return Err(StoreError::UnknownRun(run).into());
            }
            let mut rows = s.set_budget(&run, task.as_deref(), budget, run_budget, &by)?;
            for row in &mut rows {
                let stopped = row.error.as_deref().is_some_and(|e| e.starts_with(crate::budget::OVER_BUDGET));
                if row.state == pier_store::TaskState::AwaitingInput && row.lease_owner.is_none() && stopped {
                    *row = s.decide_rerun(&run, &row.id, true, &format!("{by}, raising its budget"))?;
                }
            }
            Ok(rows)
        })
        .await
    }
}
