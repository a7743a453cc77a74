//! The scheduler: hands runnable tasks to ACP agents (through `pier-client`), keeps
//! their leases alive, records everything they report, and decides what each
//! ending means for the task.
//!
//! Outcomes: `end_turn` completes the task with the final assistant message;
//! `refusal` fails it for good; `max_tokens`/`max_turn_requests` fail it unless the
//! plan retries them; a `cancelled` stop reason cancels it. A crash, garbage, an
//! idle timeout or a lost lease fails the *attempt*: it is retried with jittered
//! exponential backoff until `max_attempts`, but only when the attempt reported no
//! side effects (an edit, delete, move or execute tool call, a granted permission,
//! a file written or a command run through the client) or the task is
//! `idempotent`; otherwise the task waits in `awaiting_input` with the evidence.
//! An attempt lost to the host itself (Ctrl-C, a crash found on restart) does not
//! count as a failure.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_client_protocol_schema::v1::StopReason;
use pier_client::policy::ClientPolicy;
use pier_client::run::{LiveAgent, RunOutcome};
use pier_client::{AgentDef, ClientEvent, Ending, RunOptions, SessionTarget, registry};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::plan::{TaskSpec, render};
use crate::pool::AgentPool;
use crate::state::TaskState;
use crate::store::{StoreError, TaskRow, TaskStore, Transition, now_ms};

/// How the host runs tasks.
#[derive(Debug, Clone)]
pub struct HostConfig {
    pub pier_exe: PathBuf,
    pub agents: BTreeMap<String, AgentDef>,
    /// Relative task `cwd`s are resolved against it (the plan's directory).
    pub base_dir: PathBuf,
    pub concurrency: usize,
    /// This host's identity in leases: `HOST:PID:RANDOM`.
    pub owner: String,
    pub lease_ttl: Duration,
    pub retry_base: Duration,
    pub cancel_grace: Duration,
    pub default_idle_timeout: Duration,
}

impl HostConfig {
    pub fn owner_id() -> String {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}:{}:{}", host.trim(), std::process::id(), uuid::Uuid::new_v4().simple())
    }
}

/// Whether a lease owner is a process of this machine that no longer exists.
fn owner_dead(owner: &str) -> bool {
    let mut parts = owner.split(':');
    let (Some(host), Some(pid)) = (parts.next(), parts.next()) else { return false };
    let here = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    host == here.trim() && pid.parse::<u32>().is_ok_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
}

/// Counts by state at the end of a run.
pub type Summary = BTreeMap<&'static str, usize>;

pub struct Scheduler {
    store: Arc<dyn TaskStore>,
    config: HostConfig,
}

async fn blocking<T: Send + 'static>(
    store: &Arc<dyn TaskStore>,
    f: impl FnOnce(&dyn TaskStore) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || f(store.as_ref()))
        .await
        .map_err(|e| StoreError::Db(format!("store worker: {e}")))?
}

/// Tasks with agent `worker` or `worker:CAPABILITY` are claimed by pull workers over HTTP.
pub fn is_worker_task(t: &TaskRow) -> bool {
    t.spec.agent == "worker" || t.spec.agent.starts_with("worker:")
}

/// Tool kinds whose activity counts as a side effect.
fn effectful(kind: &str) -> bool {
    matches!(kind, "edit" | "delete" | "move" | "execute")
}

impl Scheduler {
    pub fn new(store: Arc<dyn TaskStore>, config: HostConfig) -> Scheduler {
        Scheduler { store, config }
    }

    /// Runs `run` until no task can make progress, or `stop` fires (then running
    /// tasks are cancelled through the ACP handshake and returned to the queue).
    pub async fn run(&self, run: &str, stop: CancellationToken) -> Result<Summary, StoreError> {
        let mut view = View::load(&self.store, run).await?;
        let pool = Arc::new(AgentPool::new(self.config.concurrency.max(1)));
        let summary = self.schedule(&stop, &mut view, &pool).await;
        // Whatever the ending, no agent outlives the run.
        pool.drain().await;
        summary
    }

    async fn schedule(
        &self,
        stop: &CancellationToken,
        view: &mut View,
        pool: &Arc<AgentPool>,
    ) -> Result<Summary, StoreError> {
        let mut workers: JoinSet<(String, Option<StoreError>)> = JoinSet::new();
        // A store error a worker hit that no task can get past (a full disk, a corrupt
        // row) ends the run at once, named, instead of waiting for leases to expire.
        let mut fatal: Option<StoreError> = None;
        let mut active: HashMap<String, CancellationToken> = HashMap::new();
        loop {
            view.refresh(&self.store).await?;
            let now = now_ms();

            // Attempts lost by another (dead or silent) host go back through the safe re-run check.
            let held = |t: &&TaskRow| {
                (t.state == TaskState::Running || (t.state == TaskState::AwaitingInput && t.lease_owner.is_some()))
                    && !active.contains_key(&t.id)
            };
            let lost_by = |t: &TaskRow| {
                let dead = t.lease_owner.as_deref().is_some_and(owner_dead);
                let expired = t.lease_expires_at_ms.is_some_and(|e| e < now);
                (expired || dead).then_some(if dead { "its host died" } else { "its lease expired" })
            };
            let mut changed = false;
            for t in view.rows.iter().filter(held) {
                if lost_by(t).is_none() {
                    continue;
                }
                // Heartbeats write no event, so the view's lease may be stale: look again.
                let (r, id) = (t.run_id.clone(), t.id.clone());
                let Some(fresh) = blocking(&self.store, move |s| s.task(&r, &id)).await? else { continue };
                if let Some(why) = lost_by(&fresh).filter(|_| held(&&fresh)) {
                    changed |= self.lost(&fresh, &format!("the attempt was lost: {why}")).await?;
                }
            }
            // A failed or cancelled dependency cancels its pending dependents, and theirs, in one pass.
            for (i, reason) in view.doomed() {
                let t = view.rows[i].clone();
                changed |=
                    self.transition(&t, TaskState::Cancelled, "cancel:dependency", &reason, |_| {}).await?.is_some();
            }
            if stop.is_cancelled() || fatal.is_some() {
                for token in active.values() {
                    token.cancel();
                }
                while let Some(done) = workers.join_next().await {
                    if let Ok((id, _)) = done {
                        active.remove(&id);
                    }
                }
                if let Some(e) = fatal {
                    return Err(e);
                }
                break;
            }
            // A change above (which may cascade) is read afresh first.
            if changed {
                continue;
            }
            let mut next_wake: Option<i64> = None;
            for t in &view.rows {
                if active.len() >= self.config.concurrency.max(1) {
                    break;
                }
                if t.state != TaskState::Pending || active.contains_key(&t.id) || is_worker_task(t) {
                    continue;
                }
                let ready =
                    t.spec.depends_on.iter().all(|d| view.get(d).is_some_and(|d| d.state == TaskState::Completed));
                if !ready {
                    continue;
                }
                if t.not_before_ms > now {
                    next_wake = Some(next_wake.map_or(t.not_before_ms, |w| w.min(t.not_before_ms)));
                    continue;
                }
                let token = stop.child_token();
                active.insert(t.id.clone(), token.clone());
                let results = t
                    .spec
                    .depends_on
                    .iter()
                    .filter_map(|d| view.get(d))
                    .map(|d| (d.id.clone(), d.result.clone().unwrap_or_default()))
                    .collect();
                let worker = Worker {
                    store: self.store.clone(),
                    pool: pool.clone(),
                    config: self.config.clone(),
                    row: t.clone(),
                    results,
                };
                workers.spawn(async move {
                    let id = worker.row.id.clone();
                    match worker.run(token).await {
                        Err(e @ (StoreError::Full { .. } | StoreError::Corrupt { .. })) => (id, Some(e)),
                        Err(e) => {
                            tracing::error!(task = %id, error = %e, "a task worker failed");
                            (id, None)
                        }
                        Ok(()) => (id, None),
                    }
                });
            }
            for t in view.rows.iter().filter(|t| t.state == TaskState::Running && !active.contains_key(&t.id)) {
                if let Some(e) = t.lease_expires_at_ms {
                    next_wake = Some(next_wake.map_or(e, |w| w.min(e)));
                }
            }
            if active.is_empty() && next_wake.is_none() {
                let waiting_on_others = view.rows.iter().any(|t| t.state == TaskState::Running);
                if !waiting_on_others {
                    break;
                }
            }
            let sleep_ms = next_wake.map_or(3_600_000, |w| (w - now_ms()).clamp(1, 3_600_000)) as u64;
            tokio::select! {
                done = workers.join_next(), if !workers.is_empty() => {
                    if let Some(Ok((id, e))) = done {
                        active.remove(&id);
                        fatal = fatal.or(e);
                    }
                    // Every worker that has ended by now is taken in this one pass.
                    while let Some(done) = workers.try_join_next() {
                        if let Ok((id, e)) = done {
                            active.remove(&id);
                            fatal = fatal.or(e);
                        }
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(sleep_ms)) => {}
                _ = stop.cancelled() => {}
            }
        }
        view.refresh(&self.store).await?;
        let mut summary = Summary::new();
        for t in &view.rows {
            *summary.entry(t.state.as_str()).or_default() += 1;
        }
        Ok(summary)
    }

    async fn transition(
        &self,
        t: &TaskRow,
        to: TaskState,
        key: &str,
        reason: &str,
        edit: impl FnOnce(&mut Transition),
    ) -> Result<Option<TaskRow>, StoreError> {
        let mut tr = Transition {
            run: t.run_id.clone(),
            task: t.id.clone(),
            expected_version: t.version,
            to: Some(to),
            key: format!("{key}:{}:{}", t.attempt, t.version),
            reason: reason.to_owned(),
            ..Transition::default()
        };
        edit(&mut tr);
        match blocking(&self.store, move |s| s.transition(&tr)).await {
            Ok(row) => Ok(Some(row)),
            // Someone else moved the task first; the next pass sees the new state.
            Err(StoreError::Conflict { .. } | StoreError::IllegalTransition { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The safe re-run decision for an attempt that was lost mid-turn; true if the task moved.
    async fn lost(&self, t: &TaskRow, reason: &str) -> Result<bool, StoreError> {
        let (run, id, attempt) = (t.run_id.clone(), t.id.clone(), t.attempt);
        let evidence = blocking(&self.store, move |s| s.evidence(&run, &id, attempt)).await?;
        let (to, why) = rerun_decision(t, &evidence, reason);
        let moved = self
            .transition(t, to, "lost", &why, |tr| {
                tr.data = Some(json!({"evidence": evidence}));
                tr.release_lease = true;
                // Already waiting for a person: it stays so, now for the re-run decision.
                if t.state == to {
                    tr.to = None;
                }
            })
            .await?;
        Ok(moved.is_some())
    }
}

/// Pending (run again) or awaiting_input (a person decides), with the reason.
fn rerun_decision(t: &TaskRow, evidence: &[Value], reason: &str) -> (TaskState, String) {
    if evidence.is_empty() {
        (TaskState::Pending, format!("{reason}; no side effects were reported, so it runs again"))
    } else if t.spec.idempotent {
        (TaskState::Pending, format!("{reason}; it reported side effects but the task is idempotent, so it runs again"))
    } else {
        (
            TaskState::AwaitingInput,
            format!("{reason}; it reported side effects, so a person must decide whether to run it again"),
        )
    }
}

/// The scheduler's picture of a run: every task in plan order, kept current by
/// re-reading only the tasks an event touched since the last look. A pass over a
/// large run costs one indexed query when nothing moved, not a read of every task.
struct View {
    run: String,
    rows: Vec<TaskRow>,
    index: HashMap<String, usize>,
    /// The event sequence the rows are current to.
    seq: i64,
}

impl View {
    async fn load(store: &Arc<dyn TaskStore>, run: &str) -> Result<View, StoreError> {
        let r = run.to_owned();
        // The sequence is read before the tasks: whatever lands in between is read twice, never missed.
        let (rows, seq) = blocking(store, move |s| {
            let seq = s.last_seq()?;
            Ok((s.tasks(&r)?, seq))
        })
        .await?;
        let index = rows.iter().enumerate().map(|(i, t)| (t.id.clone(), i)).collect();
        Ok(View { run: run.to_owned(), rows, index, seq })
    }

    async fn refresh(&mut self, store: &Arc<dyn TaskStore>) -> Result<(), StoreError> {
        let (r, after) = (self.run.clone(), self.seq);
        let (changed, seq) = blocking(store, move |s| s.tasks_changed(&r, after)).await?;
        for row in changed {
            match self.index.get(&row.id) {
                Some(&i) => self.rows[i] = row,
                None => {
                    self.index.insert(row.id.clone(), self.rows.len());
                    self.rows.push(row);
                }
            }
        }
        self.seq = seq;
        Ok(())
    }

    fn get(&self, id: &str) -> Option<&TaskRow> {
        self.index.get(id).and_then(|&i| self.rows.get(i))
    }

    /// The pending tasks a failed or cancelled dependency dooms, directly or through
    /// other doomed tasks, each with the reason naming its own dependency; found
    /// breadth-first with a queue (no recursion), so a chain of any length is one pass.
    fn doomed(&self) -> Vec<(usize, String)> {
        let mut dependents: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, t) in self.rows.iter().enumerate().filter(|(_, t)| t.state == TaskState::Pending) {
            for d in &t.spec.depends_on {
                dependents.entry(d.as_str()).or_default().push(i);
            }
        }
        if dependents.is_empty() {
            return Vec::new();
        }
        let mut queue: std::collections::VecDeque<(usize, &'static str)> = self
            .rows
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(t.state, TaskState::Failed | TaskState::Cancelled))
            .map(|(i, t)| (i, t.state.as_str()))
            .collect();
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        while let Some((i, ended)) = queue.pop_front() {
            let id = self.rows[i].id.as_str();
            for &j in dependents.get(id).map(Vec::as_slice).unwrap_or(&[]) {
                if seen.insert(j) {
                    out.push((j, format!("dependency `{id}` ended {ended}")));
                    queue.push_back((j, TaskState::Cancelled.as_str()));
                }
            }
        }
        out
    }
}

struct Worker {
    store: Arc<dyn TaskStore>,
    pool: Arc<AgentPool>,
    config: HostConfig,
    row: TaskRow,
    results: HashMap<String, String>,
}

impl Worker {
    async fn run(self, stop: CancellationToken) -> Result<(), StoreError> {
        let spec = self.row.spec.clone();
        let owner = self.config.owner.clone();
        let ttl = self.config.lease_ttl.as_millis() as i64;
        let attempt = self.row.attempt + 1;
        let claim = Transition {
            run: self.row.run_id.clone(),
            task: self.row.id.clone(),
            expected_version: self.row.version,
            to: Some(TaskState::Running),
            key: format!("claim:{attempt}"),
            reason: format!("attempt {attempt} started"),
            start_attempt: true,
            lease: Some((owner.clone(), now_ms() + ttl)),
            ..Transition::default()
        };
        let claimed = match blocking(&self.store, move |s| s.transition(&claim)).await {
            Ok(row) if row.attempt == attempt && row.state == TaskState::Running => row,
            Ok(_) | Err(StoreError::Conflict { .. } | StoreError::IllegalTransition { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };

        // The lease lives while the agent does; losing it stops the attempt.
        let lease_lost = CancellationToken::new();
        let heartbeat = {
            let (store, run, task, owner, lost) =
                (self.store.clone(), claimed.run_id.clone(), claimed.id.clone(), owner.clone(), lease_lost.clone());
            let every = self.config.lease_ttl / 3;
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let (r, t, o) = (run.clone(), task.clone(), owner.clone());
                    match blocking(&store, move |s| s.heartbeat(&r, &t, attempt, &o, now_ms() + ttl)).await {
                        Ok(true) => {}
                        Ok(false) | Err(_) => {
                            lost.cancel();
                            return;
                        }
                    }
                }
            })
        };

        // Numbers no attempt can run with (from a store an older pier wrote) fail the task at once.
        let unusable = attempt_limits(&spec, self.config.default_idle_timeout).err();
        let prepared = self.options();
        let (events_tx, events_rx) = mpsc::channel(pier_client::run::EVENT_QUEUE);
        let (int_tx, int_rx) = mpsc::unbounded_channel();
        let recorder = tokio::spawn(record(self.store.clone(), claimed.clone(), events_rx));
        let outcome = match prepared {
            Ok(opts) => {
                let prompt = render(&spec.prompt, &self.results);
                let blocks = vec![agent_client_protocol_schema::v1::ContentBlock::Text(
                    agent_client_protocol_schema::v1::TextContent::new(prompt),
                )];
                let run = self.turn(opts, blocks, events_tx, int_rx);
                tokio::pin!(run);
                let mut interrupted = false;
                loop {
                    tokio::select! {
                        outcome = &mut run => break Ok(outcome),
                        _ = stop.cancelled(), if !interrupted => { interrupted = true; let _ = int_tx.send(()); }
                        _ = lease_lost.cancelled(), if !interrupted => { interrupted = true; let _ = int_tx.send(()); }
                    }
                }
            }
            Err(e) => {
                drop(events_tx);
                Err(e)
            }
        };
        heartbeat.abort();
        let _ = recorder.await;
        if lease_lost.is_cancelled() {
            // Another host owns the task now; whatever we decide would be refused anyway.
            return Ok(());
        }
        let (run, id) = (claimed.run_id.clone(), claimed.id.clone());
        let evidence = blocking(&self.store, move |s| s.evidence(&run, &id, attempt)).await?;
        // Questions asked during the attempt moved the task (and its version) since the claim.
        let (run, id) = (claimed.run_id.clone(), claimed.id.clone());
        let current = blocking(&self.store, move |s| s.task(&run, &id)).await?;
        let Some(current) = current
            .filter(|c| c.attempt == attempt && matches!(c.state, TaskState::Running | TaskState::AwaitingInput))
        else {
            return Ok(());
        };
        let mut tr = Transition {
            run: claimed.run_id.clone(),
            task: claimed.id.clone(),
            expected_version: current.version,
            key: format!("end:{attempt}"),
            ..Transition::default()
        };
        let failed_attempt = |tr: &mut Transition, why: String| {
            if !evidence.is_empty() && !spec.idempotent {
                let (to, reason) = rerun_decision(&claimed, &evidence, &why);
                tr.to = Some(to);
                tr.reason = reason;
                tr.count_failure = true;
                tr.error = Some(why);
                tr.data = Some(json!({"evidence": evidence}));
            } else if claimed.failures + 1 < i64::from(spec.max_attempts) {
                let delay = backoff(self.config.retry_base, claimed.failures as u32);
                tr.to = Some(TaskState::Pending);
                tr.count_failure = true;
                tr.not_before_ms = Some(now_ms() + delay.as_millis() as i64);
                tr.reason = format!("attempt {attempt} failed; retrying in {} ms", delay.as_millis());
                tr.error = Some(why);
            } else {
                tr.to = Some(TaskState::Failed);
                tr.count_failure = true;
                tr.reason = format!("attempt {attempt} failed and no attempts are left");
                tr.error = Some(why);
            }
        };
        match outcome {
            Err(e) if unusable.is_some() => {
                tr.to = Some(TaskState::Failed);
                tr.count_failure = true;
                tr.reason = "the task cannot start; it is not retried".into();
                tr.error = Some(format!("task `{}` cannot start: {e}", claimed.id));
            }
            Err(e) => failed_attempt(&mut tr, e),
            Ok(o) => {
                let error = o.error.as_ref().map(ToString::to_string);
                match (o.ending, o.stop_reason) {
                    (Ending::Answered, Some(StopReason::EndTurn)) => {
                        tr.to = Some(TaskState::Completed);
                        tr.result = Some(o.text.clone());
                        tr.usage = o.usage.clone();
                        tr.reason = "end_turn".into();
                    }
                    (Ending::Answered, Some(StopReason::Refusal)) => {
                        tr.to = Some(TaskState::Failed);
                        tr.reason = "the agent refused; refusals are not retried".into();
                        tr.error = Some("refusal".into());
                    }
                    (Ending::Answered, Some(reason @ (StopReason::MaxTokens | StopReason::MaxTurnRequests))) => {
                        let name = serde_json::to_value(reason)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_owned))
                            .unwrap_or_default();
                        if spec.retry_on.contains(&name) {
                            failed_attempt(&mut tr, name);
                        } else {
                            tr.to = Some(TaskState::Failed);
                            tr.reason = format!("stop reason {name}; the plan does not retry it");
                            tr.error = Some(name);
                        }
                    }
                    (Ending::Answered, Some(StopReason::Cancelled)) => {
                        tr.to = Some(TaskState::Cancelled);
                        tr.reason = "the agent ended the turn cancelled".into();
                    }
                    (Ending::Interrupted { .. }, _) => {
                        let (to, reason) = rerun_decision(&claimed, &evidence, "the host stopped the attempt");
                        tr.to = Some(to);
                        tr.reason = reason;
                        tr.data = Some(json!({"evidence": evidence}));
                    }
                    (Ending::PermissionRequired, _) => {
                        tr.to = Some(TaskState::AwaitingInput);
                        tr.reason = "a permission request needs a person's answer".into();
                    }
                    (Ending::TimedOut { .. }, _) => {
                        failed_attempt(&mut tr, error.unwrap_or_else(|| "the attempt timed out".into()))
                    }
                    _ => failed_attempt(&mut tr, error.unwrap_or_else(|| "the agent failed".into())),
                }
            }
        }
        match blocking(&self.store, move |s| s.transition(&tr)).await {
            Ok(_) | Err(StoreError::Conflict { .. } | StoreError::IllegalTransition { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// One turn on a warm agent from the pool, or on a new one; the agent goes back
    /// to the pool only if the turn ended cleanly.
    async fn turn(
        &self,
        opts: RunOptions,
        prompt: Vec<agent_client_protocol_schema::v1::ContentBlock>,
        events: mpsc::Sender<ClientEvent>,
        mut interrupts: mpsc::UnboundedReceiver<()>,
    ) -> RunOutcome {
        let started = std::time::Instant::now();
        let key = AgentPool::key(&opts);
        let fresh = self.row.spec.fresh_agent;
        let warm = if fresh { None } else { self.pool.take(&key).await };
        let agent = match warm {
            Some(agent) => Ok(agent),
            None => LiveAgent::start(&opts, &events).await,
        };
        let mut outcome = match agent {
            Ok(mut agent) => {
                let outcome = agent.turn(&opts, SessionTarget::New, prompt, &events, &mut interrupts).await;
                if fresh {
                    agent.shutdown(&events).await;
                } else {
                    self.pool.give_back(key, agent).await;
                }
                outcome
            }
            Err(e) => RunOutcome::failed(Some(e)),
        };
        outcome.duration = started.elapsed();
        outcome
    }

    fn options(&self) -> Result<RunOptions, String> {
        let mut opts = attempt_options(&self.row.spec, &self.config)?;
        opts.asker = Some(Arc::new(HostAsker {
            store: self.store.clone(),
            run: self.row.run_id.clone(),
            task: self.row.id.clone(),
            attempt: self.row.attempt + 1,
        }));
        Ok(opts)
    }
}

/// The limits of an attempt of `spec`, checked: a store written by an older pier may
/// hold numbers the plan check now refuses, and none of them may reach a panic
/// (`Duration::from_secs_f64` panics on a negative, NaN or huge number).
pub fn attempt_limits(spec: &TaskSpec, default_idle: Duration) -> Result<(Duration, Option<Duration>), String> {
    let seconds = |field: &str, value: f64| {
        crate::plan::check_seconds(field, value)?;
        Duration::try_from_secs_f64(value).map_err(|e| format!("{field} = {value}: {e}"))
    };
    let idle = spec.timeout.map(|t| seconds("timeout", t)).transpose()?.unwrap_or(default_idle);
    let max_time = spec.max_time.map(|t| seconds("max_time", t)).transpose()?;
    crate::plan::check_attempts(spec.max_attempts)?;
    Ok((idle, max_time))
}

/// What an attempt of `spec` runs with (without the asker, which needs the attempt):
/// the function between a stored task and a running attempt. Never panics.
pub fn attempt_options(spec: &TaskSpec, config: &HostConfig) -> Result<RunOptions, String> {
    let (idle_timeout, max_time) = attempt_limits(spec, config.default_idle_timeout)?;
    let path = std::env::var("PATH").ok();
    let agent =
        registry::resolve(&spec.agent, &config.agents, &config.pier_exe, path.as_deref()).map_err(|e| e.to_string())?;
    let cwd = match &spec.cwd {
        Some(c) if c.is_absolute() => c.clone(),
        Some(c) => config.base_dir.join(c),
        None => config.base_dir.clone(),
    };
    let roots = spec.roots.iter().map(|r| if r.is_absolute() { r.clone() } else { config.base_dir.join(r) }).collect();
    let mut policy = ClientPolicy::default();
    for (kind, rule) in &spec.permissions {
        if let (Ok(k), Ok(r)) = (kind.parse(), rule.parse()) {
            policy.set(k, r);
        }
    }
    policy.non_interactive = pier_client::NonInteractive::Fail;
    Ok(RunOptions {
        agent,
        cwd,
        allow_dirs: roots,
        fs: true,
        terminal: true,
        policy,
        interactive: false,
        echo_stderr: false,
        idle_timeout: Some(idle_timeout),
        max_time,
        cancel_grace: config.cancel_grace,
        setup_timeout: Duration::from_secs(60),
        writable: spec
            .writable
            .as_ref()
            .map(|w| w.iter().map(|p| if p.is_absolute() { p.clone() } else { config.base_dir.join(p) }).collect()),
        asker: None,
    })
}

/// Puts a permission request the policy leaves to a person on the task
/// (`running → awaiting_input`), waits for `pier approve`/`pier deny` (or the
/// HTTP API) to answer it, and resumes (`awaiting_input → running`).
struct HostAsker {
    store: Arc<dyn TaskStore>,
    run: String,
    task: String,
    attempt: i64,
}

/// How often a waiting question looks for its answer, which another process may write.
const ANSWER_POLL: Duration = Duration::from_millis(200);

impl pier_client::handler::Asker for HostAsker {
    fn ask(
        &self,
        request: &agent_client_protocol_schema::v1::RequestPermissionRequest,
    ) -> futures::future::BoxFuture<'static, pier_client::handler::AskAnswer> {
        use pier_client::handler::AskAnswer;
        let (store, run, task, attempt) = (self.store.clone(), self.run.clone(), self.task.clone(), self.attempt);
        let request = serde_json::to_value(request).unwrap_or(Value::Null);
        Box::pin(async move {
            let moved =
                move_task(&store, &run, &task, TaskState::AwaitingInput, "a permission request waits for a person")
                    .await;
            if moved.is_err() {
                return AskAnswer::Nobody;
            }
            let (r, t, q) = (run.clone(), task.clone(), request.clone());
            let Ok(n) = blocking(&store, move |s| s.ask(&r, &t, attempt, &q)).await else { return AskAnswer::Nobody };
            let answer = loop {
                let (r, t) = (run.clone(), task.clone());
                match blocking(&store, move |s| s.answer_of(&r, &t, attempt, n)).await {
                    Ok(Some(option)) => break option,
                    Ok(None) => tokio::time::sleep(ANSWER_POLL).await,
                    Err(_) => return AskAnswer::Nobody,
                }
            };
            let _ =
                move_task(&store, &run, &task, TaskState::Running, "a person answered the permission request").await;
            AskAnswer::Option(answer)
        })
    }
}

async fn move_task(
    store: &Arc<dyn TaskStore>,
    run: &str,
    task: &str,
    to: TaskState,
    reason: &str,
) -> Result<TaskRow, StoreError> {
    let (r, t, reason) = (run.to_owned(), task.to_owned(), reason.to_owned());
    blocking(store, move |s| {
        let row = s.task(&r, &t)?.ok_or_else(|| StoreError::UnknownTask(t.clone()))?;
        s.transition(&Transition {
            run: r.clone(),
            task: t.clone(),
            expected_version: row.version,
            to: Some(to),
            key: format!("{}:{}:{}", to.as_str(), row.attempt, row.version),
            reason,
            ..Transition::default()
        })
    })
    .await
}

/// Jittered exponential backoff: base × 2^failures, ±50 %, at most a minute.
pub fn backoff(base: Duration, failures: u32) -> Duration {
    let exp = base.saturating_mul(1u32 << failures.min(16)).min(Duration::from_secs(60));
    exp.mul_f64(0.5 + fastrand::f64())
}

/// Writes a task's events to the log in batches and its side effects as evidence.
async fn record(store: Arc<dyn TaskStore>, row: TaskRow, mut rx: mpsc::Receiver<ClientEvent>) {
    let mut kinds: HashMap<String, String> = HashMap::new();
    let mut effects_seen: HashSet<String> = HashSet::new();
    // After the store refused a batch (a full disk), the rest is drained unwritten so
    // the turn never blocks on a full queue; the attempt's ending reports the error.
    let mut failed = false;
    while let Some(first) = rx.recv().await {
        if failed {
            continue;
        }
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
            if batch.len() >= 256 {
                break;
            }
        }
        let mut rows = Vec::new();
        let mut evidence = Vec::new();
        for event in batch {
            let (kind, data) = match event {
                ClientEvent::Update(params) => {
                    let u = &params["update"];
                    if let (Some(id), Some(k)) = (u["toolCallId"].as_str(), u["kind"].as_str()) {
                        kinds.insert(id.to_owned(), k.to_owned());
                    }
                    if let Some(id) = u["toolCallId"].as_str() {
                        let kind = kinds.get(id).cloned().unwrap_or_default();
                        let status = u["status"].as_str().unwrap_or("");
                        if effectful(&kind)
                            && matches!(status, "in_progress" | "completed")
                            && effects_seen.insert(id.to_owned())
                        {
                            evidence
                                .push(json!({"toolCallId": id, "kind": kind, "status": status, "title": u["title"]}));
                        }
                    }
                    ("session_update", params)
                }
                ClientEvent::Permission { request, outcome, rule, reason } => {
                    if outcome["outcome"] == "selected" {
                        let chosen = outcome["optionId"].clone();
                        let granted = request["options"]
                            .as_array()
                            .and_then(|o| o.iter().find(|o| o["optionId"] == chosen))
                            .is_some_and(|o| o["kind"].as_str().is_some_and(|k| k.starts_with("allow")));
                        if granted {
                            evidence.push(
                                json!({"permission": "granted", "toolCall": request["toolCall"], "option": chosen}),
                            );
                        }
                    }
                    ("permission", json!({"request": request, "outcome": outcome, "rule": rule, "reason": reason}))
                }
                ClientEvent::ClientCall { method, target, error } => {
                    if error.is_none() && matches!(method.as_str(), "fs/write_text_file" | "terminal/create") {
                        evidence.push(json!({"clientCall": method, "target": target}));
                    }
                    ("client_call", json!({"method": method, "target": target, "ok": error.is_none(), "error": error}))
                }
                ClientEvent::ProtocolError(message) => ("protocol_error", json!({"message": message})),
            };
            let mut data = data;
            data["attempt"] = json!(row.attempt);
            rows.push((row.run_id.clone(), Some(row.id.clone()), kind.to_owned(), data));
        }
        let (run, id, attempt) = (row.run_id.clone(), row.id.clone(), row.attempt);
        let result = blocking(&store, move |s| {
            for e in &evidence {
                s.add_evidence(&run, &id, attempt, e)?;
            }
            s.append_events(&rows)
        })
        .await;
        if let Err(e) = result {
            tracing::error!(error = %e, task = %row.id, "recording task events failed; the attempt's later events are not recorded");
            failed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_a_cap() {
        let base = Duration::from_millis(100);
        for f in 0..5 {
            let d = backoff(base, f);
            let nominal = base * (1 << f);
            assert!(d >= nominal / 2 && d <= nominal * 3 / 2, "{f}: {d:?}");
        }
        assert!(backoff(base, 30) <= Duration::from_secs(90));
    }

    #[test]
    fn dead_owners_are_recognised() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        assert!(!owner_dead(&format!("{}:{}:x", host.trim(), std::process::id())));
        assert!(owner_dead(&format!("{}:{}:x", host.trim(), u32::MAX - 7)));
        assert!(!owner_dead("other-host:1:x"));
    }
}
