//! A person's cancel. A task no attempt holds ends at once; one a live attempt holds is asked
//! of that attempt (the store's `cancel_requested`), which stops its agent through the cancel
//! handshake and ends the task with its output in one commit — so no reader sees the task
//! ended without what its attempt showed. The caller waits for those endings, bounded: an
//! attempt whose holder is gone (its lease lapsed, its process on this machine died) is ended
//! here, and one still stopping when the wait is over ends on its own (or when its lease lapses).

use std::time::Duration;

use pier_store::{Ending, StoreError, TaskRow, now_ms};
use serde::Serialize;

use super::handle::Tasks;
use crate::person::{self, ActionError};

/// How long a cancel waits by default for the attempts asked to end their tasks: an agent's
/// cancel handshake (5 s at most), then its model requests' last accounting (2 s at most).
pub const CANCEL_WAIT: Duration = Duration::from_secs(10);
/// How often, at most, the wait looks again at the tasks after commits of the store.
const LOOK_EVERY: Duration = Duration::from_millis(20);

/// What cancelling a run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CancelledRun {
    /// Tasks that ended cancelled by this cancel.
    pub cancelled: usize,
    /// Tasks whose attempts were asked to end them and had not yet when the wait was over.
    pub stopping: usize,
}

impl Tasks {
    /// Cancels a task that has not ended, waiting at most `wait` for an attempt holding it to
    /// end it; the task as it is then (cancelled, as it ended before, or still stopping with
    /// `cancel_requested` set).
    pub async fn cancel_task(
        &self,
        run: &str,
        task: &str,
        reason: &str,
        wait: Duration,
    ) -> Result<TaskRow, ActionError> {
        let (r, t, why) = (run.to_owned(), task.to_owned(), reason.to_owned());
        let row = self
            .blocking(move |s| {
                person::task_of(s, &r, &t)?;
                match s.cancel(&r, &t, &why)? {
                    Some(row) => Ok(row),
                    None => Ok(person::task_of(s, &r, &t)?),
                }
            })
            .await?;
        if row.state.is_terminal() {
            return Ok(row);
        }
        let mut rows = self.await_endings(run, vec![row.id], wait).await?;
        Ok(rows.pop().ok_or_else(|| StoreError::UnknownTask(task.to_owned()))?)
    }

    /// Cancels every unfinished task of a run, waiting at most `wait` for the attempts that
    /// hold some of them to end them.
    pub async fn cancel_run(&self, run: &str, reason: &str, wait: Duration) -> Result<CancelledRun, ActionError> {
        let (r, why) = (run.to_owned(), reason.to_owned());
        let (cancelled, asked) = self
            .blocking(move |s| {
                if !s.run_exists(&r)? {
                    return Err(StoreError::UnknownRun(r).into());
                }
                let (mut cancelled, mut asked) = (0, Vec::new());
                for t in s.tasks(&r)?.into_iter().filter(|t| !t.state.is_terminal()) {
                    match s.cancel(&r, &t.id, &why)? {
                        Some(row) if row.state.is_terminal() => cancelled += 1,
                        Some(row) => asked.push(row.id),
                        None => {}
                    }
                }
                Ok((cancelled, asked))
            })
            .await?;
        if asked.is_empty() {
            return Ok(CancelledRun { cancelled, stopping: 0 });
        }
        let rows = self.await_endings(run, asked, wait).await?;
        let ended = rows.iter().filter(|r| r.state.is_terminal()).count();
        Ok(CancelledRun { cancelled: cancelled + ended, stopping: rows.len() - ended })
    }

    /// Waits (at most `wait`) until `tasks` of `run` have ended; a task whose holder is gone
    /// is ended here (cancelled: its cancel was asked). The tasks as they are then.
    async fn await_endings(&self, run: &str, tasks: Vec<String>, wait: Duration) -> Result<Vec<TaskRow>, ActionError> {
        let mut commits = self.store.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let (r, ids) = (run.to_owned(), tasks.clone());
            let rows = self
                .blocking(move |s| {
                    let mut rows = Vec::with_capacity(ids.len());
                    for id in ids {
                        let mut row = person::task_of(s, &r, &id)?;
                        if let Some(held) = row
                            .held()
                            .filter(|h| h.expires_at_ms < now_ms() || crate::host::owner_dead(&h.attempt.owner))
                        {
                            let reason = row.cancel_requested.clone().unwrap_or_else(|| "cancelled".into());
                            if let Some(ended) = s.release_lost(&held, &Ending::Cancelled { reason })? {
                                row = ended;
                            }
                        }
                        rows.push(row);
                    }
                    Ok(rows)
                })
                .await?;
            let now = tokio::time::Instant::now();
            if now >= deadline || rows.iter().all(|r| r.state.is_terminal()) {
                return Ok(rows);
            }
            // A lease lapsing commits nothing: look again when the first one does.
            let lapse = rows
                .iter()
                .filter(|r| !r.state.is_terminal())
                .filter_map(|r| r.lease_expires_at_ms)
                .min()
                .map(|at| now + Duration::from_millis((at - now_ms()).max(0) as u64 + 1));
            let until = lapse.map_or(deadline, |l| l.min(deadline));
            match tokio::time::timeout_at(until, commits.changed()).await {
                Ok(Err(_)) => return Ok(rows),
                Ok(Ok(())) => tokio::time::sleep_until((now + LOOK_EVERY).min(deadline)).await,
                Err(_) => {}
            }
        }
    }
}
