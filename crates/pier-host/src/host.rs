//! The host: one per store and process, an actor that drives tasks to their ends. It
//! owns the agent pool and the global concurrency limit, and wakes on a closed set of
//! [`HostEvent`]s (a commit published by the store, an attempt that ended, a timer for a
//! retry or a lease falling due, a stop), never on a poll.
//!
//! Each pass brings its [`View`] current with the tasks the commits touched, takes back
//! attempts whose holders lost them ([`TaskStore::release_lost`], fenced on the lease it
//! saw), cancels the dependents of failed tasks, and claims runnable tasks up to the
//! limit ([`TaskStore::claim`]: of several hosts racing for a task, exactly one wins).
//! Each claimed attempt runs in [`crate::attempt`] with its token.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::attempt::Run;
use crate::config::{HostConfig, Summary, blocking};
use crate::decide::{Context, Outcome, decide};
use crate::pool::AgentPool;
use pier_store::state::TaskState;
use pier_store::{OwnCommit, StoreError, TaskRow, TaskStore, now_ms, own_following};

/// Whether a lease owner is a process of this machine that no longer exists.
pub(crate) fn owner_dead(owner: &str) -> bool {
    let mut parts = owner.split(':');
    let (Some(host), Some(pid)) = (parts.next(), parts.next()) else { return false };
    host == crate::config::hostname()
        && pid.parse::<u32>().is_ok_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
}

/// Which tasks a host drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// One run, until no task of it can make progress (`pier run`).
    Run(String),
    /// Every run of the store, until stopped (`pier serve`): each run is driven by one node
    /// at a time, the holder of its run lease (`TaskStore::lease_runs`, renewed every third
    /// of the lease time), and handed back when the host stops.
    All,
}

/// What wakes the host.
enum HostEvent {
    /// The store published a commit (this process's or another's).
    Commit,
    /// An attempt ended; a store error no task can get past (a full disk, a corrupt row) is fatal.
    AttemptEnded {
        key: (String, String),
        fatal: Option<StoreError>,
    },
    /// A retry's `not_before` or a lease's expiry is due.
    Due,
    Stop,
}

/// What a pass of the host decided.
enum Step {
    /// Wait for the next [`HostEvent`].
    Wait,
    /// Pass again at once: something changed that may cascade.
    Again,
    /// Nothing is left to do (one run), or the host stopped.
    Done,
    /// The host stopped on an error no task can get past.
    Failed(StoreError),
}

/// The host's state while it drives, which lives as long as one `drive`.
struct Pass {
    view: View,
    /// The attempts running, each ending with its task's key and a fatal store error, if any.
    attempts: JoinSet<(Key, Option<StoreError>)>,
    /// A cancel token per running attempt.
    active: HashMap<Key, CancellationToken>,
    fatal: Option<StoreError>,
    /// Something changed since the last pass looked.
    dirty: bool,
    /// When the next timer falls due, as of the last pass.
    next_wake: Option<i64>,
    next_lease: tokio::time::Instant,
    /// The live nodes at the last lease renewal (`pier serve`).
    live: Option<usize>,
}

impl Pass {
    /// Waits for whatever comes first: a commit, an attempt's end, a timer, a stop.
    async fn wait(&mut self, commits: &mut watch::Receiver<i64>, stop: &CancellationToken) -> HostEvent {
        let sleep = self
            .next_wake
            .map_or(Duration::from_secs(3600), |w| Duration::from_millis((w - now_ms()).clamp(1, 3_600_000) as u64));
        tokio::select! {
            changed = commits.changed() => match changed {
                Ok(()) => {
                    commits.borrow_and_update();
                    HostEvent::Commit
                }
                Err(_) => HostEvent::Stop,
            },
            Some(done) = self.attempts.join_next(), if !self.attempts.is_empty() => match done {
                Ok((key, fatal)) => HostEvent::AttemptEnded { key, fatal },
                Err(e) => HostEvent::AttemptEnded {
                    key: (String::new(), String::new()),
                    fatal: Some(StoreError::Db(format!("an attempt failed: {e}"))),
                },
            },
            _ = tokio::time::sleep(sleep) => HostEvent::Due,
            _ = tokio::time::sleep_until(self.next_lease) => HostEvent::Due,
            _ = stop.cancelled() => HostEvent::Stop,
        }
    }

    fn apply(&mut self, event: HostEvent) {
        match event {
            HostEvent::Commit | HostEvent::Stop => {}
            HostEvent::AttemptEnded { key, fatal } => {
                self.ended(&key, fatal);
                self.dirty = true;
                // Every attempt that has ended by now is taken in this one pass.
                while let Some(done) = self.attempts.try_join_next() {
                    if let Ok((key, fatal)) = done {
                        self.ended(&key, fatal);
                    }
                }
            }
            HostEvent::Due => self.dirty = true,
        }
    }

    fn ended(&mut self, key: &Key, fatal: Option<StoreError>) {
        self.view.set_busy(key, false);
        self.active.remove(key);
        self.fatal = self.fatal.take().or(fatal);
    }
}

pub struct Host {
    store: Arc<dyn TaskStore>,
    config: HostConfig,
    pool: Arc<AgentPool>,
    /// Whether a run submitted to this process is driven by it from its creation.
    pub(crate) share: crate::share::Share,
}

type Key = (String, String);

/// The events that create a run and its tasks.
const RUN_CREATED: &str = "run_created";
const TASK_CREATED: &str = "task_created";

/// Creates run `run` for a host that drives it alone (`pier run`, `Scope::Run`): the run's
/// lease is taken first (a lease needs no run), so no `pier serve` node on the same store,
/// which takes every run it sees without a live lease, can take it between its creation and
/// this host's first lease renewal.
pub fn create_own_run(
    store: &dyn TaskStore,
    config: &HostConfig,
    run: &str,
    plan: &pier_store::plan::Plan,
    source: &str,
) -> Result<(), StoreError> {
    let until = now_ms() + config.lease_ttl.as_millis() as i64;
    if !store.lease_run(&config.node, run, until)? {
        // Another host holds it: another `pier run` of the same id is creating it.
        return Err(StoreError::RunExists(run.to_owned()));
    }
    store.create_run(run, plan, source)
}

impl Host {
    pub fn new(store: Arc<dyn TaskStore>, config: HostConfig) -> Host {
        let pool = Arc::new(AgentPool::new(config.concurrency.max(1)));
        Host { store, config, pool, share: Default::default() }
    }

    /// Drives the tasks in `scope` until `stop` fires (running attempts are then cancelled
    /// through the ACP handshake and go back to the queue) or, for one run, until none of
    /// its tasks can make progress. Returns the counts by state of the run (empty for all).
    pub async fn drive(&self, scope: Scope, stop: CancellationToken) -> Result<Summary, StoreError> {
        let result = self.schedule(&scope, &stop).await;
        self.share.stop().await;
        // Whatever the ending, no agent outlives the host's work, and its run leases go back:
        // a run left waiting on a person is resumed (`pier run --resume`, another node) at
        // once, not when the lease of a host that is gone runs out.
        self.pool.drain().await;
        let node = self.config.node.clone();
        if let Err(e) = blocking(&self.store, move |s| s.release_runs(&node)).await {
            tracing::warn!(error = %e, "could not hand the runs back; they return when their leases expire");
        }
        result
    }

    async fn schedule(&self, scope: &Scope, stop: &CancellationToken) -> Result<Summary, StoreError> {
        let mut commits = self.store.subscribe();
        commits.borrow_and_update();
        // Before the view is loaded: no own commit after the load's sequence is missed.
        let mut own = self.store.own_commits();
        let mut p = Pass {
            view: View::load(&self.store, scope, &self.config.node).await?,
            attempts: JoinSet::new(),
            active: HashMap::new(),
            fatal: None,
            dirty: true,
            next_wake: None,
            next_lease: tokio::time::Instant::now(),
            live: None,
        };
        loop {
            match self.step(scope, stop, &mut p, &commits, &mut own).await {
                Ok(Step::Wait) => {
                    let event = p.wait(&mut commits, stop).await;
                    p.apply(event);
                }
                Ok(Step::Again) => {}
                Ok(Step::Done) => break,
                Ok(Step::Failed(e)) => return Err(e),
                // Only a full disk or a corrupt row, which no retry gets past, stops the host.
                Err(e @ (StoreError::Full { .. } | StoreError::Corrupt { .. })) => return Err(e),
                // Any other store error may pass (a database restarting, a commit whose answer
                // was lost): it costs a pass, not the host, and the pass runs again a second later.
                Err(e) => {
                    tracing::warn!(error = %e, "a store operation failed; the host tries again in a second");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = stop.cancelled() => {}
                    }
                    p.dirty = true;
                }
            }
        }
        let mut summary = Summary::new();
        if let Scope::Run(run) = scope {
            let r = run.clone();
            for t in blocking(&self.store, move |s| s.tasks(&r)).await? {
                *summary.entry(t.state.as_str()).or_default() += 1;
            }
        }
        Ok(summary)
    }

    /// One pass: the view brought current, the leases renewed when due, attempts of ended
    /// tasks stopped, lost attempts taken back, doomed tasks cancelled, runnable ones started.
    async fn step(
        &self,
        scope: &Scope,
        stop: &CancellationToken,
        p: &mut Pass,
        commits: &watch::Receiver<i64>,
        own: &mut broadcast::Receiver<Arc<OwnCommit>>,
    ) -> Result<Step, StoreError> {
        // Only when something committed past what the view has read: an attempt's end or a
        // timer wakes this loop too, and most of those wake-ups have nothing new to read.
        let watched = *commits.borrow();
        if watched > p.view.seq {
            p.dirty |= p.view.refresh(&self.store, own, watched).await?;
        }
        let due = tokio::time::Instant::now() >= p.next_lease;
        if due || p.view.unleased_run_seen {
            self.renew_leases(scope, p, due, commits).await?;
        }
        // An attempt whose task a person cancelled (or that ended under it) stops now, through
        // the cancel handshake, and ends the task with its output.
        for (key, token) in &p.active {
            if p.view.get(&key.0, &key.1).is_some_and(|t| t.state.is_terminal() || t.cancel_requested.is_some()) {
                token.cancel();
            }
        }
        if stop.is_cancelled() || p.fatal.is_some() {
            self.wind_down(p).await;
            return Ok(p.fatal.take().map_or(Step::Done, Step::Failed));
        }
        let now = now_ms();
        if p.dirty || p.next_wake.is_some_and(|w| w <= now) {
            p.dirty = false;
            // A change (which may cascade) is read afresh before anything starts.
            let lost = self.take_back_lost(&mut p.view, now).await?;
            if lost | self.cancel_doomed(&mut p.view).await? {
                p.dirty = true;
                return Ok(Step::Again);
            }
            self.start_runnable(&mut p.view, &mut p.active, &mut p.attempts, stop, now);
            p.next_wake = p.view.next_wake(now);
        }
        if let (Scope::All, Some(live)) = (scope, p.live) {
            self.share.arrived(&p.view.arrived);
            self.share.saw(p.view.runs.len(), p.view.driven().count(), live);
        }
        p.view.arrived.clear();
        // Nothing left that this host can do — unless another holds the run's lease and
        // works on it, which this one waits out (it takes the run over if that one dies).
        if let Scope::Run(run) = scope
            && p.active.is_empty()
            && p.next_wake.is_none()
            && (p.view.holds(run) || !p.view.in_progress(run))
        {
            return Ok(Step::Done);
        }
        Ok(Step::Wait)
    }

    /// Renews this host's run leases when `due` (else a run appeared: only takes free ones
    /// up to its share): `pier serve` takes its fair share of every run; `pier run` only its
    /// own run, so it never schedules a run a server node drives (or another `pier run`).
    async fn renew_leases(
        &self,
        scope: &Scope,
        p: &mut Pass,
        due: bool,
        commits: &watch::Receiver<i64>,
    ) -> Result<(), StoreError> {
        let lease_every = (self.config.lease_ttl / 3).max(Duration::from_millis(100));
        let (node, until) = (self.config.node.clone(), now_ms() + self.config.lease_ttl.as_millis() as i64);
        let held = match scope {
            Scope::All if !due => {
                // The view holds the runs in progress: those it drives are its share in use.
                let driving = p.view.driven().count();
                let taken = blocking(&self.store, move |s| s.take_runs(&node, until, driving)).await?;
                let held = p.view.held.iter().cloned().chain(taken).collect();
                p.dirty |= p.view.set_held(held);
                return Ok(());
            }
            Scope::All => {
                let held = blocking(&self.store, move |s| s.lease_runs(&node, until)).await?;
                // Every commit of this process the renewal saw is announced by now.
                p.view.renewed_upto = *commits.borrow();
                held
            }
            Scope::Run(run) => {
                let r = run.clone();
                let holds = blocking(&self.store, move |s| s.lease_run(&node, &r, until)).await?;
                if holds { vec![run.clone()] } else { Vec::new() }
            }
        };
        p.dirty |= p.view.set_held(held);
        p.next_lease = tokio::time::Instant::now() + lease_every;
        // The providers' rate limits are shared by the live nodes, and so are the runs
        // submitted to a served node (`share`): this one holds its share of each.
        if *scope == Scope::All || self.config.gateway.is_some() {
            match blocking(&self.store, |s| s.nodes()).await {
                Ok(nodes) => {
                    let live = nodes.len().max(1);
                    p.live = (*scope == Scope::All).then_some(live);
                    if let Some(g) = &self.config.gateway {
                        g.gateway.set_nodes(live as u32);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not count the live nodes; shares kept"),
            }
        }
        Ok(())
    }

    /// Stops: the runs go back first, so another node takes them as the attempts cancelled
    /// here put their tasks back (it sees them become pending) without waiting for the
    /// leases to expire; then every attempt is cancelled and awaited.
    async fn wind_down(&self, p: &mut Pass) {
        // Runs submitted from now on are left for the other nodes, and those being created
        // with their lease taken here are among the runs handed back.
        self.share.stop().await;
        let node = self.config.node.clone();
        if let Err(e) = blocking(&self.store, move |s| s.release_runs(&node)).await {
            tracing::warn!(error = %e, "could not hand the runs back; they return when their leases expire");
        }
        for token in p.active.values() {
            token.cancel();
        }
        while let Some(done) = p.attempts.join_next().await {
            if let Ok((key, _)) = done {
                p.active.remove(&key);
            }
        }
    }

    async fn take_back_lost(&self, view: &mut View, now: i64) -> Result<bool, StoreError> {
        let suspects = view.suspects(now);
        let mut moved = false;
        for (r, id) in suspects {
            // Heartbeats write no event, so the view's lease may be stale: look again, and
            // keep what we saw, so the next wake is at the renewed expiry (no spinning).
            let Some(fresh) = blocking(&self.store, move |s| s.task(&r, &id)).await? else { continue };
            view.put(fresh.clone());
            view.forget_if_ended(&fresh.run_id);
            let (Some(why), Some(held)) = (lost_by(&fresh, now), fresh.held()) else { continue };
            let (r, id, n) = (fresh.run_id.clone(), fresh.id.clone(), fresh.attempt);
            let evidence = blocking(&self.store, move |s| s.evidence(&r, &id, n)).await?;
            let cx = Context {
                spec: &fresh.spec,
                attempt: fresh.attempt,
                failures: fresh.failures,
                evidence: &evidence,
                retry_delay: Duration::ZERO,
                now_ms: now,
            };
            let ending = decide(&Outcome::Interrupted { why: format!("the attempt was lost: {why}") }, &cx);
            moved |= blocking(&self.store, move |s| s.release_lost(&held, &ending)).await?.is_some();
        }
        Ok(moved)
    }

    /// A failed or cancelled dependency cancels its pending dependents, and theirs.
    async fn cancel_doomed(&self, view: &mut View) -> Result<bool, StoreError> {
        let mut moved = false;
        for ((run, task), reason) in view.doomed() {
            moved |= blocking(&self.store, move |s| s.cancel(&run, &task, &reason)).await?.is_some();
        }
        Ok(moved)
    }

    /// Starts runnable tasks up to the limit. Each attempt claims its task itself, so the
    /// claims of a pass land in one group commit; a claim another host won ends the attempt
    /// at once.
    fn start_runnable(
        &self,
        view: &mut View,
        active: &mut HashMap<Key, CancellationToken>,
        attempts: &mut JoinSet<(Key, Option<StoreError>)>,
        stop: &CancellationToken,
        now: i64,
    ) {
        let room = self.config.concurrency.max(1).saturating_sub(active.len());
        for key in view.runnable(now, room) {
            let Some(row) = view.get(&key.0, &key.1).cloned() else { continue };
            let results: HashMap<String, String> = row
                .spec
                .depends_on
                .iter()
                .filter_map(|d| view.get(&row.run_id, d))
                .map(|d| (d.id.clone(), d.result.clone().unwrap_or_default()))
                .collect();
            let token = stop.child_token();
            view.set_busy(&key, true);
            active.insert(key.clone(), token.clone());
            let (store, pool, config) = (self.store.clone(), self.pool.clone(), self.config.clone());
            attempts.spawn(async move {
                let (owner, until) = (config.owner.clone(), now_ms() + config.lease_ttl.as_millis() as i64);
                let (r, t) = key.clone();
                let claimed = blocking(&store, move |s| s.claim(&r, &t, &owner, until)).await;
                let (attempt, row) = match claimed {
                    Ok(Some(claimed)) => {
                        crate::telemetry::attempt_started();
                        claimed
                    }
                    Ok(None) => return (key, None),
                    Err(e @ (StoreError::Full { .. } | StoreError::Corrupt { .. })) => return (key, Some(e)),
                    Err(e) => {
                        tracing::error!(task = %key.1, error = %e, "claiming a task failed");
                        return (key, None);
                    }
                };
                let run = Run {
                    store,
                    pool,
                    config,
                    attempt,
                    row,
                    results,
                    billing: Default::default(),
                    parked: Default::default(),
                    denial: Default::default(),
                };
                match run.run(token).await {
                    Err(e @ (StoreError::Full { .. } | StoreError::Corrupt { .. })) => (key, Some(e)),
                    Err(e) => {
                        tracing::error!(task = %key.1, error = %e, "a task attempt failed");
                        (key, None)
                    }
                    Ok(()) => (key, None),
                }
            });
        }
    }
}

/// Why an attempt held by someone else is lost, if it is. Reads the row's fields only (no
/// allocation): it runs for every held row of every pass.
fn lost_by(t: &TaskRow, now: i64) -> Option<&'static str> {
    if !matches!(t.state, TaskState::Running | TaskState::AwaitingInput) {
        return None;
    }
    let (Some(owner), Some(expires)) = (t.lease_owner.as_deref(), t.lease_expires_at_ms) else { return None };
    if expires < now {
        Some("its lease expired")
    } else if owner_dead(owner) {
        Some("its host died")
    } else {
        None
    }
}

/// One run as the host sees it: every task in plan order, and which are being attempted here.
#[derive(Default)]
struct RunView {
    rows: Vec<TaskRow>,
    index: HashMap<String, usize>,
    /// Tasks this host is attempting (claiming or running).
    busy: HashSet<String>,
    /// Rows before this one have all ended: passes start here. An ended task moves again
    /// only by a person's retry, which [`View::put`] meets by moving the cursor back.
    cursor: usize,
    /// The rows a host could start (pending, not a pull worker's), in plan order: a pass
    /// looks at these and at `live` only, so tasks queued for workers cost it nothing.
    startable: std::collections::BTreeSet<usize>,
    /// The rows held by an attempt (running or awaiting input), anyone's.
    live: std::collections::BTreeSet<usize>,
    /// A task has a priority or concurrency keys: passes rank every ready task (`pick`).
    scheduled: bool,
    /// When each task last moved (from the log when the run was read, else when this view
    /// took its change): where a ranked task's wait starts ([`ready_since`]).
    moved_at: HashMap<String, i64>,
}

impl RunView {
    fn get(&self, task: &str) -> Option<&TaskRow> {
        self.index.get(task).and_then(|&i| self.rows.get(i))
    }

    fn advance(&mut self) {
        while self.rows.get(self.cursor).is_some_and(|t| t.state.is_terminal()) {
            self.cursor += 1;
        }
    }

    fn unfinished(&self) -> impl Iterator<Item = &TaskRow> {
        self.rows[self.cursor.min(self.rows.len())..].iter()
    }

    /// Row `i` changed: files it under what a pass looks for.
    fn classify(&mut self, i: usize) {
        self.startable.remove(&i);
        self.live.remove(&i);
        let Some(t) = self.rows.get(i) else { return };
        self.scheduled |= t.spec.priority > 0 || !t.spec.concurrency.is_empty();
        match t.state {
            TaskState::Pending if !t.spec.is_worker() => {
                self.startable.insert(i);
            }
            TaskState::Running | TaskState::AwaitingInput => {
                self.live.insert(i);
            }
            _ => {}
        }
    }

    fn startable(&self) -> impl Iterator<Item = &TaskRow> {
        self.startable.iter().filter_map(|&i| self.rows.get(i))
    }

    fn live(&self) -> impl Iterator<Item = &TaskRow> {
        self.live.iter().filter_map(|&i| self.rows.get(i))
    }

    fn ready(&self, t: &TaskRow) -> bool {
        t.spec.depends_on.iter().all(|d| self.get(d).is_some_and(|d| d.state == TaskState::Completed))
    }
}

/// The host's picture of the runs it drives: every task of each run (dependencies need
/// their done neighbours), kept current by re-reading only the tasks an event touched.
/// A pass looks at the tasks a host could start and the held ones only, without allocating.
struct View {
    scope: Scope,
    /// This node: a run it took the lease of as it created it is held from its creation.
    node: String,
    /// The last commit announced when this node's leases were last renewed: a creation
    /// commit up to it was accounted for by the renewal, which may have handed its run back.
    renewed_upto: i64,
    /// The runs that came into the view since the last pass (for `share`).
    arrived: Vec<String>,
    runs: BTreeMap<String, RunView>,
    /// The runs whose lease this host holds, which it drives; the others are only watched.
    held: HashSet<String>,
    /// A run appeared that this host does not drive, or a task of one went back to the
    /// queue: ask for leases without waiting for the next renewal.
    unleased_run_seen: bool,
    /// The event sequence the rows are current to.
    seq: i64,
    /// Tasks seen failing or being cancelled; dependents are looked for only when this grows.
    bad_endings: usize,
    bad_endings_checked: usize,
    /// When each ready task was first seen ready, for ageing (`pick`).
    waiting_since: HashMap<Key, i64>,
}

impl View {
    async fn load(store: &Arc<dyn TaskStore>, scope: &Scope, node: &str) -> Result<View, StoreError> {
        let s2 = scope.clone();
        // The sequence is read before the tasks: whatever lands in between is read twice, never missed.
        let (runs, seq) = blocking(store, move |s| {
            let seq = s.last_seq()?;
            let runs: Vec<String> = match &s2 {
                Scope::Run(r) => vec![r.clone()],
                Scope::All => {
                    let mut seen = Vec::new();
                    for t in s.unfinished_tasks()? {
                        if !seen.contains(&t.run_id) {
                            seen.push(t.run_id);
                        }
                    }
                    seen
                }
            };
            let mut out = Vec::new();
            for r in runs {
                out.push(s.tasks(&r)?);
            }
            Ok((out, seq))
        })
        .await?;
        let mut view = View {
            scope: scope.clone(),
            node: node.to_owned(),
            renewed_upto: 0,
            arrived: Vec::new(),
            runs: BTreeMap::new(),
            held: HashSet::new(),
            unleased_run_seen: false,
            seq,
            bad_endings: 0,
            bad_endings_checked: usize::MAX,
            waiting_since: HashMap::new(),
        };
        for tasks in runs {
            let run = tasks.first().map(|t| t.run_id.clone());
            for t in tasks {
                view.put(t);
            }
            // Read whole; it may have ended between the two reads.
            if let Some(run) = run {
                view.forget_if_ended(&run);
            }
        }
        Ok(view)
    }

    fn put(&mut self, row: TaskRow) {
        let bad = |t: &TaskRow| matches!(t.state, TaskState::Failed | TaskState::Cancelled);
        let run = self.runs.entry(row.run_id.clone()).or_default();
        let newly_bad = bad(&row) && !run.get(&row.id).is_some_and(bad);
        let i = match run.index.get(&row.id) {
            Some(&i) => {
                if !row.state.is_terminal() {
                    run.cursor = run.cursor.min(i);
                }
                run.rows[i] = row;
                i
            }
            None => {
                run.index.insert(row.id.clone(), run.rows.len());
                run.rows.push(row);
                run.rows.len() - 1
            }
        };
        run.classify(i);
        run.advance();
        self.bad_endings += usize::from(newly_bad);
    }

    /// Drops run `run` (read whole) from the view if every task of it has ended and none is this host's
    /// any more (`pier serve` only: `pier run` watches its one run to the end). A served view
    /// holds the runs still in progress, not every run since the host started; an ended run
    /// moves again only by a person's retry, whose commit brings it back whole (`take`).
    fn forget_if_ended(&mut self, run: &str) {
        if self.scope != Scope::All {
            return;
        }
        let ended = self.runs.get(run).is_some_and(|r| r.cursor >= r.rows.len() && r.busy.is_empty());
        // (`waiting_since` needs nothing here: `pick` keeps only the tasks ready at its pass.)
        if ended {
            self.runs.remove(run);
        }
    }

    fn get(&self, run: &str, task: &str) -> Option<&TaskRow> {
        self.runs.get(run)?.get(task)
    }

    /// The runs this host drives: those whose lease it holds.
    fn driven(&self) -> impl Iterator<Item = (&String, &RunView)> {
        self.runs.iter().filter(|(run, _)| self.held.contains(*run))
    }

    /// Whether this host holds run `run`'s lease.
    fn holds(&self, run: &str) -> bool {
        self.held.contains(run)
    }

    /// Whether run `run` has a task pending or running (anyone's).
    fn in_progress(&self, run: &str) -> bool {
        self.runs
            .get(run)
            .is_some_and(|r| r.unfinished().any(|t| matches!(t.state, TaskState::Pending | TaskState::Running)))
    }

    /// Takes the runs this host now drives; true if that changed.
    fn set_held(&mut self, held: Vec<String>) -> bool {
        self.unleased_run_seen = false;
        let held: HashSet<String> = held.into_iter().collect();
        let changed = self.held != held;
        if changed {
            // A run taken over may have failures whose dependents nobody cancelled yet.
            self.bad_endings_checked = usize::MAX;
        }
        self.held = held;
        changed
    }

    fn set_busy(&mut self, (run, task): &Key, busy: bool) {
        if let Some(r) = self.runs.get_mut(run) {
            if busy {
                r.busy.insert(task.clone());
            } else {
                r.busy.remove(task);
            }
        }
        if !busy {
            self.forget_if_ended(run);
        }
    }

    /// Brings the view current with the commit watch showing `watched`; true if a task moved
    /// (a version changed) or a run appeared. This process's own commits come with the rows
    /// they changed (`own`) and are applied as they are; the store is read only past a gap
    /// (another process's commit, a follower fallen behind) or for what the watch shows beyond.
    async fn refresh(
        &mut self,
        store: &Arc<dyn TaskStore>,
        own: &mut broadcast::Receiver<Arc<OwnCommit>>,
        watched: i64,
    ) -> Result<bool, StoreError> {
        let mut moved = false;
        let mut new_runs = HashSet::new();
        for commit in own_following(own, &mut self.seq) {
            moved |= self.take_own(&commit, &mut new_runs);
        }
        // Past a commit passed over the watch still shows more than the view has.
        if watched > self.seq {
            let after = self.seq;
            let (changed, seq) = blocking(store, move |s| s.tasks_changed(after)).await?;
            self.seq = seq;
            for row in changed {
                moved |= self.take(row, &mut new_runs);
            }
        }
        for run in new_runs {
            let r = run.clone();
            let (tasks, driver) = blocking(store, move |s| Ok((s.tasks(&r)?, s.run_driver(&r)?))).await?;
            for t in tasks {
                self.put(t);
            }
            self.driven_by(&run, driver.as_deref());
            self.arrived.push(run.clone());
            // A run whose tasks are ranked ages them from when they became ready, as the log
            // says, not from when this host first saw them (a restart or takeover keeps it).
            if self.runs.get(&run).is_some_and(|v| v.scheduled) {
                let r = run.clone();
                let moved_at = blocking(store, move |s| s.tasks_moved_at(&r)).await?;
                if let Some(view) = self.runs.get_mut(&run) {
                    view.moved_at.extend(moved_at);
                }
            }
            self.forget_if_ended(&run);
            moved = true;
        }
        Ok(moved)
    }

    /// Run `run`, just read whole, is driven by `driver` (the node of its live lease): this
    /// node holds it if it is this node (it took the lease as it created the run, and the
    /// commit's announcement was passed over by a read of the log); leases are asked for if
    /// nobody drives it and it has work left.
    fn driven_by(&mut self, run: &str, driver: Option<&str>) {
        if driver == Some(self.node.as_str()) {
            self.held.insert(run.to_owned());
        } else if driver.is_none() && self.runs.get(run).is_some_and(|r| r.unfinished().next().is_some()) {
            self.unleased_run_seen = true;
        }
    }

    /// Takes in commit `c` of this process: the rows it changed, and the runs it created
    /// whole; true if it moved a task or brought a run.
    fn take_own(&mut self, c: &OwnCommit, new_runs: &mut HashSet<String>) -> bool {
        let created = self.created(c);
        let mut moved = !created.is_empty();
        for row in &c.tasks {
            moved |= self.take(row.clone(), new_runs);
        }
        self.created_at(c, &created);
        moved
    }

    /// The runs commit `c` of this process created (`pier serve`), which come whole with it
    /// (a run's tasks are created in its commit, each with an event, so the commit carries
    /// every row): they enter the view without a read, held from the start when this node
    /// took the lease in that commit (`driven_by`).
    /// A commit the last renewal accounted for is not trusted with its lease (the renewal
    /// may have handed the run back since): its runs are read whole, with their driver, as a
    /// run found in the log is.
    fn created(&mut self, c: &OwnCommit) -> Vec<String> {
        if self.scope != Scope::All || c.upto <= self.renewed_upto {
            return Vec::new();
        }
        let mut created = Vec::new();
        for e in c.events.iter().filter(|e| e.kind == RUN_CREATED) {
            if self.runs.contains_key(&e.run) {
                continue;
            }
            if let pier_store::Entry::Host(pier_store::LogEvent::RunCreated { driven_by: Some(node), .. }) =
                e.clone().into_event().entry()
                && node == self.node
            {
                self.held.insert(e.run.clone());
            }
            self.runs.entry(e.run.clone()).or_default();
            self.arrived.push(e.run.clone());
            created.push(e.run.clone());
        }
        created
    }

    /// A ranked run created by commit `c` ages its tasks from their creation, as a read of
    /// the log would (`tasks_moved_at`).
    fn created_at(&mut self, c: &OwnCommit, created: &[String]) {
        for run in created {
            if let Some(view) = self.runs.get_mut(run).filter(|v| v.scheduled) {
                for e in c.events.iter().filter(|e| e.run == *run && e.kind == TASK_CREATED) {
                    if let Some(task) = &e.task {
                        view.moved_at.insert(task.clone(), e.at_ms);
                    }
                }
            }
            self.forget_if_ended(run);
        }
    }

    /// Takes in a changed row; true if it moved a task. A run not in the view yet is noted
    /// in `new_runs` (read whole afterwards). A row older than the view's (a commit's
    /// rows can be, see `OwnCommit`) is passed over: versions only grow.
    fn take(&mut self, row: TaskRow, new_runs: &mut HashSet<String>) -> bool {
        let in_scope = match &self.scope {
            Scope::Run(r) => *r == row.run_id,
            Scope::All => true,
        };
        if !in_scope || new_runs.contains(&row.run_id) {
            return false;
        }
        if !self.runs.contains_key(&row.run_id) {
            // Read whole afterwards, with who drives it (`driven_by`).
            new_runs.insert(row.run_id.clone());
            return false;
        }
        if self.get(&row.run_id, &row.id).is_some_and(|old| old.version >= row.version) {
            return false;
        }
        // A task of a run another node drives went back to the queue: that node may have
        // handed the run back; ask for leases now rather than at the next renewal.
        if row.state == TaskState::Pending && !self.held.contains(&row.run_id) {
            self.unleased_run_seen = true;
        }
        let run = row.run_id.clone();
        // Only a ranked run keeps when its tasks moved (a plain one costs nothing more here).
        let ranked = self.runs.get(&run).is_some_and(|v| v.scheduled).then(|| row.id.clone());
        self.put(row);
        if let (Some(id), Some(view)) = (ranked, self.runs.get_mut(&run)) {
            view.moved_at.insert(id, now_ms());
        }
        self.forget_if_ended(&run);
        true
    }

    /// Up to `room` tasks ready to claim now, in run and plan order.
    fn runnable(&mut self, now: i64, room: usize) -> Vec<Key> {
        let mut out = Vec::new();
        if room == 0 {
            return out;
        }
        if self.runs.values().any(|r| r.scheduled) {
            return self.picked(now, room);
        }
        for (run, r) in self.driven() {
            for t in r.startable() {
                if t.not_before_ms <= now && !r.busy.contains(&t.id) && r.ready(t) {
                    out.push((run.clone(), t.id.clone()));
                    if out.len() == room {
                        return out;
                    }
                }
            }
        }
        out
    }

    /// [`View::runnable`] when a task has a priority or concurrency keys: every ready task in
    /// view ranked by `pick` (those of runs other nodes drive keep their keys' places), with
    /// the live attempts of every run in view counted against their keys (other nodes' and
    /// workers' too).
    fn picked(&mut self, now: i64, room: usize) -> Vec<Key> {
        let held = crate::pick::held(self.runs.values().flat_map(RunView::live));
        let mut ready = Vec::new();
        for (run, r) in &self.runs {
            let mine = self.held.contains(run);
            for t in r.startable() {
                if t.not_before_ms <= now && !r.busy.contains(&t.id) && r.ready(t) {
                    let key = (run.clone(), t.id.clone());
                    // A task this host has not seen waiting yet waited since it became ready.
                    if !self.waiting_since.contains_key(&key)
                        && let Some(since) = ready_since(&r.moved_at, t)
                    {
                        self.waiting_since.insert(key.clone(), since.min(now));
                    }
                    ready.push(crate::pick::Ready { key, row: t, mine });
                }
            }
        }
        crate::pick::pick(ready, room, held, &mut self.waiting_since, now)
    }

    /// Attempts held by someone else that look lost in the view.
    fn suspects(&self, now: i64) -> Vec<Key> {
        let mut out = Vec::new();
        for (run, r) in self.driven() {
            for t in r.live() {
                // This host's own attempts first, before `lost_by` looks for their owner.
                if !r.busy.contains(&t.id) && lost_by(t, now).is_some() {
                    out.push((run.clone(), t.id.clone()));
                }
            }
        }
        out
    }

    /// The next time something is due: a ready task's `not_before`, or the expiry of a
    /// lease held elsewhere.
    fn next_wake(&self, now: i64) -> Option<i64> {
        let mut next: Option<i64> = None;
        for (_, r) in self.driven() {
            for t in r.startable().chain(r.live()) {
                let due = match t.state {
                    TaskState::Pending if t.not_before_ms > now && !t.spec.is_worker() && r.ready(t) => {
                        Some(t.not_before_ms)
                    }
                    TaskState::Running | TaskState::AwaitingInput if !r.busy.contains(&t.id) => t.lease_expires_at_ms,
                    _ => None,
                };
                if let Some(d) = due {
                    next = Some(next.map_or(d, |n| n.min(d)));
                }
            }
        }
        next
    }

    /// The pending tasks a failed or cancelled dependency dooms, directly or through
    /// other doomed tasks, each with the reason naming its own dependency; found
    /// breadth-first with a queue (no recursion), so a chain of any length is one pass.
    /// Looked for only when a task failed or was cancelled since the last look.
    fn doomed(&mut self) -> Vec<(Key, String)> {
        if self.bad_endings == self.bad_endings_checked {
            return Vec::new();
        }
        self.bad_endings_checked = self.bad_endings;
        let mut out = Vec::new();
        for (run, r) in self.driven() {
            let mut dependents: HashMap<&str, Vec<&str>> = HashMap::new();
            for t in r.unfinished().filter(|t| t.state == TaskState::Pending) {
                for d in &t.spec.depends_on {
                    dependents.entry(d.as_str()).or_default().push(t.id.as_str());
                }
            }
            if dependents.is_empty() {
                continue;
            }
            let mut queue: std::collections::VecDeque<(&str, &'static str)> = r
                .rows
                .iter()
                .filter(|t| matches!(t.state, TaskState::Failed | TaskState::Cancelled))
                .map(|t| (t.id.as_str(), t.state.as_str()))
                .collect();
            let mut seen = HashSet::new();
            while let Some((id, ended)) = queue.pop_front() {
                for &j in dependents.get(id).map(Vec::as_slice).unwrap_or(&[]) {
                    if seen.insert(j) {
                        out.push(((run.clone(), j.to_owned()), format!("dependency `{id}` ended {ended}")));
                        queue.push_back((j, TaskState::Cancelled.as_str()));
                    }
                }
            }
        }
        out
    }
}

/// When `task` (ready now) became ready: the later of its own last move (created, retried,
/// back from an attempt) and its dependencies' (their completion), if the view knows them all.
fn ready_since(moved_at: &HashMap<String, i64>, task: &TaskRow) -> Option<i64> {
    let mut since = *moved_at.get(&task.id)?;
    for dep in &task.spec.depends_on {
        since = since.max(*moved_at.get(dep)?);
    }
    Some(since.max(task.not_before_ms))
}

#[cfg(test)]
mod tests {
    /// Issue #32: ageing is counted from when a task became ready (its own last move and its
    /// dependencies' completion, from the log), not from when a host first saw it.
    #[test]
    fn a_ready_task_waited_since_the_later_of_its_move_and_its_dependencies() {
        use std::collections::HashMap;
        let mut t = row("r", "c", TaskState::Pending, 1, &["a", "b"]);
        let moved: HashMap<String, i64> = [("a", 500), ("b", 900), ("c", 100)].map(|(k, v)| (k.to_owned(), v)).into();
        assert_eq!(super::ready_since(&moved, &t), Some(900), "ready when its last dependency completed");
        t.not_before_ms = 1_200;
        assert_eq!(super::ready_since(&moved, &t), Some(1_200), "a retry waits from its backoff's end");
        t.spec.depends_on.push("unknown".into());
        assert_eq!(super::ready_since(&moved, &t), None, "unknown: counted from when the host sees it");
    }

    use super::*;
    use pier_store::{RawEvent, TaskSpec};
    use serde_json::json;

    #[test]
    fn dead_owners_are_recognised() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        assert!(!owner_dead(&format!("{}:{}:x", host.trim(), std::process::id())));
        assert!(owner_dead(&format!("{}:{}:x", host.trim(), u32::MAX - 7)));
        assert!(!owner_dead("other-host:1:x"));
    }

    fn row(run: &str, id: &str, state: TaskState, version: i64, depends_on: &[&str]) -> TaskRow {
        let spec = TaskSpec {
            id: id.into(),
            depends_on: depends_on.iter().map(|d| d.to_string()).collect(),
            ..TaskSpec::default()
        };
        TaskRow {
            run_id: run.into(),
            id: id.into(),
            state,
            version,
            attempt: 0,
            failures: 0,
            lease_owner: None,
            lease_expires_at_ms: None,
            not_before_ms: 0,
            result: None,
            usage: None,
            error: None,
            spec,
            cancel_requested: None,
        }
    }

    fn view(scope: Scope) -> View {
        View {
            scope,
            node: "n".into(),
            renewed_upto: 0,
            arrived: Vec::new(),
            runs: BTreeMap::new(),
            held: HashSet::new(),
            unleased_run_seen: false,
            seq: 0,
            bad_endings: 0,
            bad_endings_checked: 0,
            waiting_since: HashMap::new(),
        }
    }

    fn event(seq: i64, run: &str, task: Option<&str>, kind: &str, at_ms: i64, data: serde_json::Value) -> RawEvent {
        let (run, task, kind, data) = (run.into(), task.map(str::to_owned), kind.into(), data.to_string());
        RawEvent { seq, run, task, kind, at_ms, data }
    }

    /// A run this process created comes whole with its commit (no read of the store), held
    /// from the start when this node took its lease there; one left free is asked for.
    #[test]
    fn a_run_created_here_enters_the_view_whole_and_held_when_this_node_took_it() {
        let mut v = view(Scope::All);
        let mut new_runs = HashSet::new();
        let mut ranked = row("mine", "a", TaskState::Pending, 1, &[]);
        ranked.spec.priority = 5;
        let commit = OwnCommit {
            after: 0,
            upto: 4,
            tasks: vec![ranked, row("free", "a", TaskState::Pending, 1, &[])],
            events: vec![
                event(1, "mine", None, RUN_CREATED, 10, json!({"tasks": 1, "source": "http", "driven_by": "n"})),
                event(2, "mine", Some("a"), TASK_CREATED, 10, json!({})),
                event(3, "free", None, RUN_CREATED, 20, json!({"tasks": 1, "source": "http"})),
                event(4, "free", Some("a"), TASK_CREATED, 20, json!({})),
            ],
        };
        assert!(v.take_own(&commit, &mut new_runs));
        assert!(new_runs.is_empty(), "nothing left to read: {new_runs:?}");
        assert!(v.get("mine", "a").is_some() && v.get("free", "a").is_some());
        assert!(v.holds("mine") && !v.holds("free"));
        assert!(v.unleased_run_seen, "the free run is asked for");
        assert_eq!(v.runs.get("mine").and_then(|r| r.moved_at.get("a")), Some(&10), "ranked from its creation");
        // Another node's creation (or one this view had) is not this view's to take whole.
        let other = OwnCommit {
            after: 4,
            upto: 5,
            tasks: vec![],
            events: vec![event(5, "x", None, RUN_CREATED, 30, json!({"driven_by": "m"}))],
        };
        assert!(v.take_own(&other, &mut new_runs));
        assert!(!v.holds("x"), "driven by another node");
    }

    /// A run read whole from the log (its commit's announcement passed over) is this node's
    /// when its live lease is (taken as the run was created here), another's when another
    /// node's is: only a run nobody drives makes the host ask for leases.
    #[test]
    fn a_run_read_from_the_log_is_held_as_its_lease_says() {
        let mut v = view(Scope::All);
        for run in ["mine", "theirs", "free", "ended"] {
            let state = if run == "ended" { TaskState::Completed } else { TaskState::Pending };
            v.put(row(run, "a", state, 1, &[]));
        }
        v.driven_by("theirs", Some("m"));
        v.driven_by("ended", None);
        assert!(!v.unleased_run_seen && !v.holds("theirs"), "another node's run, or one with nothing left");
        v.driven_by("mine", Some("n"));
        assert!(v.holds("mine") && !v.unleased_run_seen);
        v.driven_by("free", None);
        assert!(v.unleased_run_seen && !v.holds("free"));
    }

    /// A served view holds the runs in progress, not every run since the host started: at
    /// 1,000 one-task runs a second every pass walked them all (B11's p50 was 254 ms).
    #[test]
    fn a_served_view_forgets_a_run_once_it_has_ended_and_a_retry_brings_it_back() {
        let mut v = view(Scope::All);
        let mut new_runs = HashSet::new();
        // Read whole: the ended first task does not drop the run its second needs.
        v.put(row("r", "a", TaskState::Completed, 3, &[]));
        v.put(row("r", "b", TaskState::Pending, 1, &["a"]));
        v.forget_if_ended("r");
        assert!(v.runs.get("r").is_some_and(|r| r.ready(&row("r", "b", TaskState::Pending, 1, &["a"]))));
        v.set_busy(&("r".into(), "b".into()), true);
        assert!(v.take(row("r", "b", TaskState::Completed, 3, &["a"]), &mut new_runs));
        assert!(v.runs.contains_key("r"), "kept while this host's attempt of it is alive");
        v.set_busy(&("r".into(), "b".into()), false);
        assert!(v.runs.is_empty(), "an ended run is forgotten");
        // A person's retry: the row of a run not in view brings it back, read whole.
        assert!(!v.take(row("r", "b", TaskState::Pending, 4, &["a"]), &mut new_runs));
        assert!(new_runs.contains("r"));
        v.put(row("r", "a", TaskState::Completed, 3, &[]));
        v.put(row("r", "b", TaskState::Pending, 4, &["a"]));
        v.driven_by("r", None);
        assert!(v.unleased_run_seen && !v.holds("r"), "nobody drives it: leases are asked for");
        // `pier run` keeps its one run to the end.
        let mut own = view(Scope::Run("r".into()));
        own.put(row("r", "a", TaskState::Completed, 3, &[]));
        own.forget_if_ended("r");
        assert!(own.runs.contains_key("r"));
    }
}
