//! Budgets, held at the gateway: a task's own (over all its attempts) and its run's (over all
//! its tasks). A request is let through while neither is spent; the one that spends it
//! completes (its size is known only from its answer), and the next is refused, in the
//! provider's own error shape, naming the budget. The attempt then ends and the task waits for
//! a person, who raises the budget (`pier budget`) to resume it, or cancels it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use pier_store::{Budget, MODEL_REQUEST, Spend, StoreError, TaskStore};

/// What the task error of a task stopped by its budget starts with; `pier budget` resumes those.
pub const OVER_BUDGET: &str = "over budget";

/// Tokens and cost spent so far.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Spent {
    tokens: u64,
    cost: f64,
}

type Total = Arc<Mutex<Spent>>;

/// This process's running totals per run and per task, read from the log the first time a
/// budgeted attempt of them starts here and kept current by every call this process records.
/// (Calls other nodes record later are seen when this process next starts with a fresh ledger.)
#[derive(Default)]
pub struct Ledger {
    totals: Mutex<HashMap<(String, Option<String>), Total>>,
}

impl Ledger {
    /// The totals of run `run` and of its task `task`.
    fn totals(&self, store: &dyn TaskStore, run: &str, task: &str) -> Result<(Total, Total), StoreError> {
        let mut out = Vec::with_capacity(2);
        for key in [(run.to_owned(), None), (run.to_owned(), Some(task.to_owned()))] {
            let known = self.totals.lock().unwrap_or_else(PoisonError::into_inner).get(&key).cloned();
            let total = match known {
                Some(t) => t,
                None => {
                    let spend = Spend::from_events(&store.events_of_kind(run, key.1.as_deref(), MODEL_REQUEST)?);
                    let spent = Spent { tokens: spend.total.tokens.total(), cost: spend.total.cost.unwrap_or(0.0) };
                    let mut totals = self.totals.lock().unwrap_or_else(PoisonError::into_inner);
                    totals.entry(key).or_insert_with(|| Arc::new(Mutex::new(spent))).clone()
                }
            };
            out.push(total);
        }
        let task = out.pop().unwrap_or_default();
        let run = out.pop().unwrap_or_default();
        Ok((run, task))
    }
}

/// What one attempt may still spend.
pub(crate) struct Allowance {
    task: Option<Budget>,
    run: Option<Budget>,
    task_spent: Total,
    run_spent: Total,
    /// Names the task and run in messages.
    run_id: String,
    task_id: String,
}

impl Allowance {
    /// The allowance of task `task` of run `run` under `budget` and `run_budget` (either may be
    /// none), from the totals so far; `None` when neither budget is set.
    pub(crate) fn open(
        ledger: &Ledger,
        store: &dyn TaskStore,
        run: &str,
        task: &str,
        budget: Option<Budget>,
        run_budget: Option<Budget>,
    ) -> Result<Option<Allowance>, StoreError> {
        if budget.is_none() && run_budget.is_none() {
            return Ok(None);
        }
        let (run_spent, task_spent) = ledger.totals(store, run, task)?;
        Ok(Some(Allowance {
            task: budget,
            run: run_budget,
            task_spent,
            run_spent,
            run_id: run.to_owned(),
            task_id: task.to_owned(),
        }))
    }

    /// Why no further request may go, if none may.
    pub(crate) fn check(&self) -> Result<(), String> {
        let spent = |t: &Total| *t.lock().unwrap_or_else(PoisonError::into_inner);
        let (run, task) = (&self.run_id, &self.task_id);
        if let Some(b) = self.task
            && let Some(used) = {
                let s = spent(&self.task_spent);
                b.spent(s.tokens, s.cost)
            }
        {
            return Err(format!(
                "{OVER_BUDGET}: the budget of task `{task}` is spent ({used}); raise it with `pier budget {run} {task} --tokens N --cost X` and the task resumes, or cancel it"
            ));
        }
        if let Some(b) = self.run
            && let Some(used) = {
                let s = spent(&self.run_spent);
                b.spent(s.tokens, s.cost)
            }
        {
            return Err(format!(
                "{OVER_BUDGET}: the budget of run `{run}` is spent ({used}); raise it with `pier budget {run} --tokens N --cost X` and its tasks resume, or cancel them"
            ));
        }
        Ok(())
    }

    /// Adds a recorded call; a call whose cost is unknown under a cost budget spends it (the
    /// budget cannot be held without a price), and says so.
    pub(crate) fn add(&self, tokens: u64, cost: Option<f64>, model: Option<&str>) -> Result<(), String> {
        for total in [&self.task_spent, &self.run_spent] {
            let mut t = total.lock().unwrap_or_else(PoisonError::into_inner);
            t.tokens += tokens;
            t.cost += cost.unwrap_or(0.0);
        }
        let cost_budget = self.task.and_then(|b| b.cost).or(self.run.and_then(|b| b.cost));
        match (cost_budget, cost) {
            (Some(_), None) if tokens > 0 => Err(format!(
                "{OVER_BUDGET}: task `{}` has a cost budget and model `{}` has no price; add `[prices.\"{}\"]` to pier.toml, then raise or keep the budget with `pier budget`",
                self.task_id,
                model.unwrap_or("unknown"),
                model.unwrap_or("MODEL")
            )),
            _ => Ok(()),
        }
    }
}
