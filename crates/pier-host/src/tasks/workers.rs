//! Pull workers: lease a task that fits, keep the lease, report the ending.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use pier_store::{Attempt, Candidate, ErrorCode, NextClaim, StoreError, TaskRow, TaskStore, now_ms};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::handle::Tasks;
use crate::person::{self, ActionError, Report};

/// How often a worker asking for work is written as seen, at most.
const SEEN_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// The tasks a report with `next` offers its commit to claim, in queue order: enough for the
/// reports of a worker's slots, which come together and race for the first ones.
const NEXT_CANDIDATES: usize = 16;
/// A lease a worker asks for lasts this long by default, and within these bounds.
const DEFAULT_TTL_MS: i64 = 30_000;
const TTL_BOUNDS_MS: (i64, i64) = (1_000, 3_600_000);

/// A task leased by a worker, with its prompt (the results of its dependencies filled in).
#[derive(Clone, Serialize)]
pub struct Leased {
    pub task: TaskRow,
    pub prompt: String,
    /// The attempt's token at the host's MCP endpoint, when the host serves one (`pier serve`):
    /// the worker gives its agent `{server}/mcp` with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mcp_token: Option<String>,
}

impl std::fmt::Debug for Leased {
    /// Names no token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let token = self.mcp_token.as_ref().map(|_| "***");
        f.debug_struct("Leased")
            .field("task", &self.task)
            .field("prompt", &self.prompt)
            .field("mcp_token", &token)
            .finish()
    }
}

impl Leased {
    /// `task` as claimed, with its prompt.
    fn of(s: &dyn TaskStore, task: TaskRow) -> Result<Leased, StoreError> {
        let prompt = pier_store::plan::render(&task.spec.prompt, &dependency_results(s, &task)?);
        Ok(Leased { task, prompt, mcp_token: None })
    }
}

/// Offers `visit` each pending task that is due, whose dependencies completed, and that is
/// either a worker task fitting `capabilities` (its `worker:` capability and what it
/// `requires`) or a task of one of `agents`, until it takes one (`true`), in queue order
/// ([`pier_store::queue`]). The store ranks a task from when it became pending; one that became
/// ready later, when its last dependency completed, is ranked from then here: offered once the
/// walk passes that rank (or at the end), not ahead of tasks that were ready before it.
/// `completing` is a task whose completion is being written: its dependents count as ready
/// from now (the store's claim checks it in the same commit).
fn visit_fitting(
    s: &dyn TaskStore,
    capabilities: &[String],
    agents: &[String],
    completing: Option<(&str, &str)>,
    visit: &mut dyn FnMut(TaskRow) -> Result<bool, StoreError>,
) -> Result<(), StoreError> {
    let now = now_ms();
    // Tasks ready later than the store ranked them: (rank, order seen, task), lowest first.
    let mut later: BinaryHeap<Reverse<(i64, usize, Deferred)>> = BinaryHeap::new();
    let (mut taken, mut n) = (false, 0);
    s.visit_pending(&mut |t, rank| {
        while later.peek().is_some_and(|Reverse((r, _, _))| *r <= rank) {
            if let Some(Reverse((_, _, Deferred(d)))) = later.pop()
                && visit(d)?
            {
                taken = true;
                return Ok(true);
            }
        }
        let fits = t.spec.fits_worker(capabilities) || (!t.spec.is_worker() && agents.contains(&t.spec.agent));
        if !fits || t.not_before_ms > now {
            return Ok(false);
        }
        let mut ready_at = i64::MIN;
        for d in &t.spec.depends_on {
            if completing == Some((t.run_id.as_str(), d.as_str())) {
                ready_at = now;
                continue;
            }
            let Some(done_at) = s.completed_at(&t.run_id, d)? else { return Ok(false) };
            ready_at = ready_at.max(done_at);
        }
        let ranked = pier_store::queue::rank(t.spec.priority, ready_at);
        if ranked > rank {
            n += 1;
            later.push(Reverse((ranked, n, Deferred(t))));
            return Ok(false);
        }
        taken = visit(t)?;
        Ok(taken)
    })?;
    while !taken && let Some(Reverse((_, _, Deferred(d)))) = later.pop() {
        taken = visit(d)?;
    }
    Ok(())
}

/// A task in [`visit_fitting`]'s heap, ordered only by the key beside it.
struct Deferred(TaskRow);

impl PartialEq for Deferred {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for Deferred {}
impl PartialOrd for Deferred {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Deferred {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

fn ttl(ttl_ms: Option<i64>) -> i64 {
    ttl_ms.unwrap_or(DEFAULT_TTL_MS).clamp(TTL_BOUNDS_MS.0, TTL_BOUNDS_MS.1)
}

/// The results of `row`'s dependencies, by task id, for its prompt.
pub(super) fn dependency_results(s: &dyn TaskStore, row: &TaskRow) -> Result<HashMap<String, String>, StoreError> {
    let mut results = HashMap::new();
    for d in &row.spec.depends_on {
        if let Some(t) = s.task(&row.run_id, d)? {
            results.insert(t.id, t.result.unwrap_or_default());
        }
    }
    Ok(results)
}

impl Tasks {
    /// Leases the first pending task in queue order ([`pier_store::queue`]) that is due, whose
    /// dependencies completed, and that is either a worker task fitting `capabilities` (its
    /// `worker:` capability and what it `requires`) or a task of one of `agents` (which the
    /// worker runs too); `None` if none is.
    pub async fn lease(
        &self,
        worker: &str,
        capabilities: &[String],
        agents: &[String],
        ttl_ms: Option<i64>,
    ) -> Result<Option<Leased>, ActionError> {
        let (worker, capabilities, agents, ttl) =
            (worker.to_owned(), capabilities.to_vec(), agents.to_vec(), ttl(ttl_ms));
        let leased = self
            .blocking(move |s| {
                let mut leased = None;
                visit_fitting(s, &capabilities, &agents, None, &mut |t| {
                    let Some((_, task)) = s.claim(&t.run_id, &t.id, &worker, now_ms() + ttl)? else { return Ok(false) };
                    leased = Some(Leased::of(s, task)?);
                    Ok(true)
                })?;
                Ok(leased)
            })
            .await?;
        if leased.is_some() {
            crate::telemetry::attempt_started();
        }
        Ok(leased.map(|l| self.with_mcp_token(l)))
    }

    /// [`Tasks::lease`], waiting up to `wait` (at most [`super::MAX_WAIT`]) for a task that fits
    /// to become ready, instead of the worker asking again and again. The worker is listed as
    /// seen (`GET /nodes`) whether or not a task came.
    pub async fn lease_waiting(
        &self,
        worker: &str,
        capabilities: &[String],
        agents: &[String],
        ttl_ms: Option<i64>,
        wait: std::time::Duration,
    ) -> Result<Option<Leased>, ActionError> {
        self.seen(worker, capabilities).await?;
        let mut commits = self.store.subscribe();
        let deadline = tokio::time::Instant::now() + wait.min(super::MAX_WAIT);
        loop {
            if let Some(leased) = self.lease(worker, capabilities, agents, ttl_ms).await? {
                return Ok(Some(leased));
            }
            // A retry's `not_before` passes without a commit: look again at least every second.
            let tick = (tokio::time::Instant::now() + std::time::Duration::from_secs(1)).min(deadline);
            match tokio::time::timeout_at(tick, commits.changed()).await {
                Ok(Err(_)) => return Ok(None),
                _ if tokio::time::Instant::now() >= deadline => return Ok(None),
                _ => {}
            }
        }
    }

    /// Lists `worker` as seen (`GET /nodes`), writing it at most every [`SEEN_EVERY`]; a name
    /// that cannot be a worker's is refused.
    async fn seen(&self, worker: &str, capabilities: &[String]) -> Result<(), ActionError> {
        if worker.is_empty() || worker.contains(':') || worker.len() > 200 {
            return Err(ActionError::bad_request(
                "a worker's name is 1 to 200 characters without `:` (host nodes' ids have one)",
            ));
        }
        let due = {
            let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = std::time::Instant::now();
            let fresh = seen.get(worker).is_some_and(|(caps, at)| caps == capabilities && now - *at < SEEN_EVERY);
            if !fresh {
                seen.insert(worker.to_owned(), (capabilities.to_vec(), now));
            }
            !fresh
        };
        if due {
            let (name, caps) = (worker.to_owned(), capabilities.to_vec());
            self.blocking(move |s| Ok(s.seen_worker(&name, &caps)?)).await?;
        }
        Ok(())
    }

    /// The pull workers seen, with the attempts each holds.
    pub async fn workers(&self) -> Result<Vec<pier_store::WorkerRow>, ActionError> {
        self.blocking(|s| Ok(s.workers()?)).await
    }

    /// Renews a worker's lease on its attempt; when it now expires. Refused (`lease_lost`) when
    /// the attempt does not hold its task; renewed but refused (`cancel_requested`) when a
    /// person cancelled the task, so a worker that knows only heartbeats stops its agent (and
    /// has the lease's time to report its ending with its output).
    pub async fn heartbeat(
        &self,
        run: &str,
        task: &str,
        worker: &str,
        attempt: i64,
        ttl_ms: Option<i64>,
    ) -> Result<i64, ActionError> {
        let expires = now_ms() + ttl(ttl_ms);
        let attempt = Attempt { run: run.to_owned(), task: task.to_owned(), n: attempt, owner: worker.to_owned() };
        let (held, cancel) = self
            .blocking(move |s| {
                if !s.heartbeat(&attempt, expires)? {
                    return Ok((false, None));
                }
                Ok((true, s.task(&attempt.run, &attempt.task)?.and_then(|t| t.cancel_requested)))
            })
            .await?;
        if !held {
            return Err(ActionError::Refused {
                code: ErrorCode::LeaseLost,
                message: "the lease is not yours any more; stop working on this task".into(),
            });
        }
        if let Some(reason) = cancel {
            return Err(ActionError::Refused {
                code: ErrorCode::CancelRequested,
                message: format!(
                    "a person cancelled this task ({reason}): stop its agent and report its ending with its output; it ends cancelled"
                ),
            });
        }
        Ok(expires)
    }

    /// Applies a worker's report on its attempt (`body` is the report as sent: a repeat with
    /// the same idempotency key and body gets the first answer). With `next`, the worker's next
    /// task is leased in the ending's commit where one fits and is free; its lease is then
    /// `Some`, or `None` (the worker leases as usual).
    pub async fn report(
        &self,
        run: &str,
        task: &str,
        body: Value,
    ) -> Result<(TaskRow, Option<Option<Leased>>), ActionError> {
        let report = Report::deserialize(&body)
            .map_err(|e| ActionError::bad_request(format!("the report is not valid: {e}")))?;
        let asked = report.next.is_some();
        if let Some(n) = &report.next {
            self.seen(&report.worker, &n.capabilities).await?;
        }
        let (run, task, retry_base) = (run.to_owned(), task.to_owned(), self.config.retry_base);
        let prices = self.config.gateway.as_ref().map(|g| g.prices.clone());
        let reported = self
            .blocking(move |s| {
                // Candidates are looked for before the report's commit, which claims the first
                // still free (the reports of a worker's slots come together).
                let mut next = None;
                if let Some(n) = &report.next {
                    let completing = (report.status == "completed").then_some((run.as_str(), task.as_str()));
                    let mut candidates = Vec::new();
                    visit_fitting(s, &n.capabilities, &n.agents, completing, &mut |t| {
                        candidates.push(Candidate { run: t.run_id, task: t.id, depends_on: t.spec.depends_on });
                        Ok(candidates.len() >= NEXT_CANDIDATES)
                    })?;
                    next =
                        Some(NextClaim { candidates, owner: report.worker.clone(), until: now_ms() + ttl(n.ttl_ms) });
                }
                let cx = person::Reporting { body: &body, retry_base, prices: prices.as_deref() };
                let reported = person::report(s, &run, &task, &report, &cx, next.as_ref())?;
                let claimed = reported.next.map(|t| Leased::of(s, t)).transpose()?;
                Ok((reported.task, claimed, reported.repeat))
            })
            .await?;
        let (row, claimed, repeat) = reported;
        // The reported attempt is over (or was): its token at the MCP endpoint goes with it.
        self.revoke_remote(&row);
        let claimed = claimed.map(|l| self.with_mcp_token(l));
        if !asked {
            return Ok((row, None));
        }
        // A task none of whose candidates was free is the worker's to lease as usual (it
        // waits there for one), not this call's: a repeat answers exactly what the first did.
        if claimed.is_some() && !repeat {
            crate::telemetry::attempt_started();
        }
        Ok((row, Some(claimed)))
    }
}
