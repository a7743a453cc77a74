//! A task added to a running run by the agent of one of its tasks (the host's MCP tool
//! `submit_task`): fenced by the adding attempt's lease, so an attempt that lost its task adds
//! nothing, and idempotent by the new task's id, so a call sent again adds it once.

use crate::error::StoreError;
use crate::now_ms;
use crate::ops::{Arg, Tx, holds, insert_task, lease_lost, load_task};
use crate::plan::TaskSpec;
use crate::rows::Attempt;

/// The most tasks a run may hold once tasks are added to it: a loop of agents adding tasks
/// stops here, however the run was started.
pub const MAX_RUN_TASKS: i64 = 10_000;

/// Whether the task was added, or was there already with the same spec (a repeated call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    Added,
    AlreadyThere,
}

/// Adds `spec` to `a`'s run, the task `a` holds named as its adder. Refused without a write:
/// `a` not holding its task (or its task being cancelled), an id another task of the run has with another spec, a
/// dependency that is not in the run or ended failed or cancelled, a run at
/// [`MAX_RUN_TASKS`].
pub(crate) fn add_task(tx: &mut dyn Tx, a: &Attempt, spec: &TaskSpec) -> Result<(Added, i64), StoreError> {
    // The run's row is locked first: two adds to one run (from two nodes) take their places
    // one after the other, never the same `ord`, and the run's size is read whole.
    tx.exec("UPDATE runs SET id = id WHERE id = ?1", &[Arg::Text(&a.run)])?;
    let caller = load_task(tx, &a.run, &a.task)?;
    if !holds(&caller, a, now_ms()) {
        return Err(lease_lost(a));
    }
    // A task a person is cancelling adds no more work.
    if let Some(reason) = &caller.cancel_requested {
        return Err(StoreError::CancelRequested { task: a.task.clone(), reason: reason.clone() });
    }
    let refuse = |why: String| StoreError::NotAdded { task: spec.id.clone(), why };
    if spec.added_by.as_deref() != Some(a.task.as_str()) {
        return Err(refuse(format!("it must name task `{}` as the task that added it", a.task)));
    }
    if let Some(raw) = tx.task(&a.run, &spec.id)? {
        let there = crate::ops::decode(raw)?;
        if there.spec == *spec {
            return Ok((Added::AlreadyThere, 0));
        }
        return Err(refuse(format!("run `{}` has a task `{}` already; give the new task another id", a.run, spec.id)));
    }
    for dep in &spec.depends_on {
        let Some(raw) = tx.task(&a.run, dep)? else {
            return Err(refuse(format!("it depends on `{dep}`, which is not a task of run `{}`", a.run)));
        };
        let row = crate::ops::decode(raw)?;
        if row.state.retryable() {
            return Err(refuse(format!("it depends on `{dep}`, which ended {}", row.state.as_str())));
        }
    }
    let run = [Arg::Text(&a.run)];
    let count = tx.int("SELECT COUNT(*) FROM tasks WHERE run_id = ?1", &run)?.unwrap_or(0);
    if count >= MAX_RUN_TASKS {
        return Err(refuse(format!("run `{}` holds {count} tasks, the most a run may", a.run)));
    }
    let ord = tx.int("SELECT COALESCE(MAX(ord), -1) + 1 FROM tasks WHERE run_id = ?1", &run)?.unwrap_or(0);
    let seq = insert_task(tx, &a.run, ord, spec, Some(&a.task))?;
    Ok((Added::Added, seq))
}
