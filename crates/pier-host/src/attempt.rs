//! One attempt of one task: the agent's turn (on a warm agent from the pool or a new
//! one), its lease kept alive, its events and side effects recorded, its questions put
//! to a person, and its ending decided by [`crate::decide::decide`] and applied with
//! [`TaskStore::finish`], fenced on the attempt's token.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_client_protocol_schema::v1::StopReason;
use pier_client::policy::ClientPolicy;
use pier_client::run::{LiveAgent, RunOutcome};
use pier_client::{ClientEvent, Ending as ClientEnding, Partial, RunOptions, SideEffects, registry};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{HostConfig, blocking};
use crate::converse::{Channel, converse};
use crate::decide::{Context, Outcome, decide};
use crate::gateway::{Lease, Settler};
use crate::pool::AgentPool;
use pier_store::plan::{TaskSpec, render};
use pier_store::{Attempt, ErrorClass, Last, QuestionRequest, StoreError, TaskRow, TaskStore, now_ms};
use pier_tools::Rule;

/// How often, at most, a running turn looks in the store for an interrupting message.
const CHECK_EVERY: Duration = Duration::from_millis(50);
/// How long an ending waits for its agent's model requests to reach the log.
const SETTLE: Duration = Duration::from_secs(2);
/// Events written together at most.
const RECORD_BATCH: usize = 256;

/// A claimed attempt, ready to run.
pub(crate) struct Run {
    pub store: Arc<dyn TaskStore>,
    pub pool: Arc<AgentPool>,
    pub config: HostConfig,
    pub attempt: Attempt,
    pub row: TaskRow,
    /// The results of the task's dependencies, for its prompt.
    pub results: HashMap<String, String>,
    /// The gateway account of the agent process the attempt runs on: its ending waits for
    /// the model requests still being recorded.
    pub billing: std::sync::Mutex<Option<Settler>>,
    /// Cancelled when a provider's rate limit stops the attempt (its task waits for the reset).
    pub parked: CancellationToken,
    /// A person's denial that stops the attempt (`on_deny = "fail"`).
    pub denial: Denial,
}

/// A person's denial of a tool call, in a task whose `on_deny` is `fail`: what was denied (set
/// by the asker as it passes the denial on to the agent), and the stop it fires: the attempt
/// cancels the turn, and its ending is the denial's.
#[derive(Clone, Default)]
pub(crate) struct Denial {
    why: Arc<std::sync::Mutex<Option<String>>>,
    stop: CancellationToken,
}

impl Denial {
    pub(crate) fn deny(&self, why: String) {
        self.why.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(why);
        self.stop.cancel();
    }

    /// The ending a denial gives an attempt whose turn ended as `outcome`, if there was one:
    /// the denial's, however the turn ended (but a task that could not start).
    pub(crate) fn outcome(&self, outcome: &Outcome) -> Option<Outcome> {
        let why = self.why.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()?;
        (!matches!(outcome, Outcome::Unusable { .. })).then_some(Outcome::Denied { why })
    }

    pub(crate) fn stopped(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.stop.cancelled()
    }
}

/// Stops the attempt at `denial` when the option `chosen` of `request` denies the tool call.
pub(crate) fn note_denial(
    denial: &Denial,
    request: &agent_client_protocol_schema::v1::RequestPermissionRequest,
    chosen: &str,
) {
    if denies(request, chosen) {
        let call = &request.tool_call;
        let what = call.fields.title.clone().unwrap_or_else(|| call.tool_call_id.0.to_string());
        denial.deny(format!("a person denied the tool call `{what}` ({chosen}); on_deny = \"fail\""));
    }
}

/// Whether the option `chosen` of a permission request denies the tool call.
fn denies(request: &agent_client_protocol_schema::v1::RequestPermissionRequest, chosen: &str) -> bool {
    use agent_client_protocol_schema::v1::PermissionOptionKind;
    request.options.iter().any(|o| {
        *o.option_id.0 == *chosen
            && matches!(o.kind, PermissionOptionKind::RejectOnce | PermissionOptionKind::RejectAlways)
    })
}

impl Run {
    pub(crate) async fn run(self, stop: CancellationToken) -> Result<(), StoreError> {
        let spec = self.row.spec.clone();
        let attempt = self.attempt.clone();
        let ttl = self.config.lease_ttl.as_millis() as i64;

        // The lease lives while the agent does; losing it stops the attempt.
        let lease_lost = CancellationToken::new();
        let heartbeat = {
            let (store, a, lost) = (self.store.clone(), attempt.clone(), lease_lost.clone());
            let every = self.config.lease_ttl / 3;
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let a2 = a.clone();
                    match blocking(&store, move |s| s.heartbeat(&a2, now_ms() + ttl)).await {
                        Ok(true) => {}
                        Ok(false) | Err(_) => {
                            crate::telemetry::lease_lost();
                            lost.cancel();
                            return;
                        }
                    }
                }
            })
        };

        // Numbers no attempt can run with (from a store an older pier wrote) fail the task at once.
        // The attempt's token at the host's MCP endpoint lives as long as this call.
        let grant = self.config.mcp.as_ref().map(|m| m.grant(&attempt));
        let prepared = self.options(grant.as_ref());
        let recorder = Recorder::start(self.store.clone(), attempt.clone());
        let (int_tx, int_rx) = mpsc::unbounded_channel();
        let (outcome, ended) = match prepared {
            Ok(opts) => {
                let prompt = render(&spec.prompt, &self.results);
                let blocks = vec![agent_client_protocol_schema::v1::ContentBlock::Text(
                    agent_client_protocol_schema::v1::TextContent::new(prompt),
                )];
                let run = self.turn(opts, blocks, &recorder, int_rx, &lease_lost, grant.as_ref());
                tokio::pin!(run);
                let mut interrupted = false;
                let (outcome, ended) = loop {
                    tokio::select! {
                        outcome = &mut run => break outcome,
                        _ = stop.cancelled(), if !interrupted => { interrupted = true; let _ = int_tx.send(()); }
                        _ = lease_lost.cancelled(), if !interrupted => { interrupted = true; let _ = int_tx.send(()); }
                        _ = self.parked.cancelled(), if !interrupted => { interrupted = true; let _ = int_tx.send(()); }
                        _ = self.denial.stopped(), if !interrupted => { interrupted = true; let _ = int_tx.send(()); }
                    }
                };
                (outcome_of(&outcome), ended)
            }
            Err(error) => {
                let error = format!("task `{}` cannot start: {error}", attempt.task);
                (Outcome::Unusable { error }, None)
            }
        };
        heartbeat.abort();
        let result = match ended {
            Some(result) => result,
            None => self.end(&outcome, &recorder, false, &lease_lost).await.unwrap_or(Ok(())),
        };
        // What came after the ending (an agent's last words as it was shut down) is recorded too.
        recorder.finish().await;
        drop(grant);
        result
    }

    /// Ends the attempt as [`decide`] says, in one write with what the recorder has not
    /// written yet and what the attempt showed (kept however it ends: a cancelled task keeps
    /// its partial output). With `unless_messages` (the agent can still be told more), `None`
    /// when a message waits for the task: nothing is ended, and the caller sends it.
    async fn end(
        &self,
        outcome: &Outcome,
        recorder: &Recorder,
        unless_messages: bool,
        lease_lost: &CancellationToken,
    ) -> Option<Result<(), StoreError>> {
        let settler = self.billing.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let (mut over_budget, mut limited) = (None, None);
        if let Some(s) = settler {
            s.settle(SETTLE).await;
            over_budget = s.exhausted();
            limited = s.rate_limited();
        }
        // A person's denial stopped the attempt (`on_deny = "fail"`).
        let denied = self.denial.outcome(outcome);
        let outcome = denied.as_ref().unwrap_or(outcome);
        // A budget stopped the agent's requests: however the agent ended its turn after that
        // (an answer about the error, a failure), the task waits for a person.
        let budget_outcome;
        let outcome = match over_budget {
            Some(why) if !matches!(outcome, Outcome::Interrupted { .. } | Outcome::Unusable { .. }) => {
                budget_outcome = Outcome::OverBudget { why };
                &budget_outcome
            }
            // A rate limit stopped the attempt (or the agent gave up on it): unless the agent
            // finished anyway, the task waits for the reset.
            _ => match limited {
                Some((why, until_ms))
                    if !matches!(
                        outcome,
                        Outcome::Unusable { .. } | Outcome::Answered { stop_reason: StopReason::EndTurn, .. }
                    ) =>
                {
                    budget_outcome = Outcome::RateLimited { why, until_ms };
                    &budget_outcome
                }
                _ => outcome,
            },
        };
        let tail = recorder.tail().await;
        let attempt = self.attempt.clone();
        let last = Last { events: tail.events, evidence: tail.evidence, output: tail.output, unless_messages };
        if lease_lost.is_cancelled() {
            // Someone else owns the task now (or it was cancelled): no ending, but what the
            // attempt did and showed is kept.
            let kept = blocking(&self.store, move |s| {
                s.record(&attempt, &last.events, &last.evidence)?;
                s.keep_output(&attempt, &last.output)
            })
            .await;
            if let Err(e) = kept {
                tracing::warn!(error = %e, task = %self.attempt.task, "could not keep the attempt's output");
            }
            return Some(Ok(()));
        }
        let cx = Context {
            spec: &self.row.spec,
            attempt: attempt.n,
            failures: self.row.failures,
            evidence: &tail.seen,
            retry_delay: backoff(self.config.retry_base, self.row.failures as u32),
            now_ms: now_ms(),
        };
        let ending = decide(outcome, &cx);
        let applied = ending.clone();
        let finished = blocking(&self.store, move |s| Ok((s.finish_keeping(&attempt, &last, &ending), last))).await;
        let (finished, last) = match finished {
            Ok(done) => done,
            Err(e) => return Some(Err(e)),
        };
        match finished {
            Ok(_) => {
                crate::telemetry::attempt_ended(outcome, &applied);
                Some(Ok(()))
            }
            Err(StoreError::MessagesWaiting { .. }) => {
                // Nothing of the ending was written: the events go to the log before the message.
                let a = self.attempt.clone();
                let kept = blocking(&self.store, move |s| s.record(&a, &last.events, &last.evidence)).await;
                match kept {
                    Ok(_) => None,
                    Err(e) => Some(Err(e)),
                }
            }
            Err(e) if e.is_race() => {
                if matches!(e, StoreError::LeaseLost { .. }) {
                    crate::telemetry::lease_lost();
                }
                Some(Ok(()))
            }
            Err(e) => Some(Err(e)),
        }
    }

    /// One turn on a warm agent from the pool, or on a new one; the agent goes back
    /// to the pool only if the turn ended cleanly. With the attempt's ending, when the
    /// conversation applied it (see [`crate::converse`]).
    async fn turn(
        &self,
        opts: RunOptions,
        prompt: Vec<agent_client_protocol_schema::v1::ContentBlock>,
        recorder: &Recorder,
        mut interrupts: mpsc::UnboundedReceiver<()>,
        lease_lost: &CancellationToken,
        grant: Option<&crate::host_mcp::Grant>,
    ) -> (RunOutcome, Option<Result<(), StoreError>>) {
        let started = std::time::Instant::now();
        let events = &recorder.events;
        let key = AgentPool::key(&opts);
        let fresh = self.row.spec.fresh_agent;
        let warm = if fresh { None } else { self.pool.take(&key).await };
        let (warm, mut lease) = match warm {
            Some((agent, lease)) => (Some(agent), lease),
            None => (None, None),
        };
        // A stop during the handshake kills the agent at once, as one during the turn cancels it.
        let agent = match warm {
            Some(agent) => Ok(agent),
            None => {
                // A new process gets its own account at the gateway, in its environment.
                let mut started_with = opts.clone();
                lease = self.config.gateway.as_ref().map(|g| g.lease(&opts.agent, &self.config.node));
                if let Some(l) = &lease {
                    l.apply(&mut started_with.agent);
                }
                let started = LiveAgent::start_or_stop(&started_with, events, &mut interrupts).await;
                if let Ok(agent) = &started {
                    // What this agent spec can do, as its newest process says.
                    let (spec, init) = (self.row.spec.agent.clone(), agent.init().clone());
                    if let Err(e) = blocking(&self.store, move |s| s.record_agent(&spec, &init)).await {
                        tracing::warn!(error = %e, "could not record the agent's capabilities");
                    }
                }
                started
            }
        };
        if let Some(l) = &lease {
            l.bill_to(self.store.clone(), self.attempt.clone(), &self.row.spec, self.parked.clone()).await;
        }
        *self.billing.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = lease.as_ref().map(Lease::settler);
        let (mut outcome, ended) = match agent {
            Ok(mut agent) => {
                if let Some(g) = grant {
                    g.runs_on(agent.asking());
                }
                let mut channel = Local::new(self, recorder, lease_lost);
                let (outcome, ended) = converse(&mut agent, &opts, prompt, events, &mut interrupts, &mut channel).await;
                if let Some(l) = &lease {
                    l.unbill();
                }
                if fresh {
                    agent.shutdown(events).await;
                } else {
                    // A task's session is never continued: a warm agent must not keep it.
                    if let Some(id) = &outcome.session_id {
                        agent.close_session(id).await;
                    }
                    self.pool.give_back(key, agent, lease).await;
                }
                (outcome, ended)
            }
            Err(outcome) => (outcome, None),
        };
        outcome.duration = started.elapsed();
        (outcome, ended)
    }

    fn options(&self, grant: Option<&crate::host_mcp::Grant>) -> Result<RunOptions, String> {
        let mut opts = attempt_options(&self.row.spec, &self.config)?;
        if let (Some(mcp), Some(grant)) = (&self.config.mcp, grant) {
            opts.host_mcp_servers.push(crate::host_mcp::server_entry(mcp.url.clone(), grant.token()));
        }
        let denial = (self.row.spec.on_deny == pier_store::plan::OnDeny::Fail).then(|| self.denial.clone());
        let own_tools = grant.is_some();
        opts.asker =
            Some(Arc::new(HostAsker { store: self.store.clone(), attempt: self.attempt.clone(), denial, own_tools }));
        opts.meta = Some(task_meta(&self.attempt.run, &self.attempt.task, self.attempt.n, &self.row.spec));
        Ok(opts)
    }
}

/// A local attempt's [`Channel`]: its task's messages and ending, on the store.
struct Local<'a> {
    run: &'a Run,
    recorder: &'a Recorder,
    lease_lost: &'a CancellationToken,
    commits: tokio::sync::watch::Receiver<i64>,
    /// A commit rang: the next look for an interrupting message is due at `due`.
    due: Option<tokio::time::Instant>,
    last_look: tokio::time::Instant,
}

impl<'a> Local<'a> {
    fn new(run: &'a Run, recorder: &'a Recorder, lease_lost: &'a CancellationToken) -> Local<'a> {
        let commits = run.store.subscribe();
        Local { run, recorder, lease_lost, commits, due: None, last_look: tokio::time::Instant::now() }
    }
}

impl Channel for Local<'_> {
    type Ended = Result<(), StoreError>;

    /// Every commit of the store rings (this attempt's own events too), so the look for an
    /// interrupting message is taken at most every CHECK_EVERY, the first CHECK_EVERY into
    /// the turn: a short turn (most) needs no read. Cancel-safe: what it waits for is kept
    /// in `self` between calls.
    async fn interrupt(&mut self) {
        loop {
            let due = match self.due {
                Some(due) => due,
                None => {
                    if self.commits.changed().await.is_err() {
                        return std::future::pending().await;
                    }
                    let due = self.last_look + CHECK_EVERY;
                    self.due = Some(due);
                    due
                }
            };
            tokio::time::sleep_until(due).await;
            let (run, task) = (self.run.attempt.run.clone(), self.run.attempt.task.clone());
            let waiting = blocking(&self.run.store, move |s| s.waiting(&run, &task)).await;
            // Only now: a look dropped halfway is taken again at the next call.
            self.due = None;
            self.last_look = tokio::time::Instant::now();
            if waiting.is_ok_and(|w| w.interrupt) {
                return;
            }
        }
    }

    async fn end(&mut self, outcome: &RunOutcome) -> Option<Result<(), StoreError>> {
        self.run.end(&outcome_of(outcome), self.recorder, true, self.lease_lost).await
    }

    async fn take_messages(&mut self) -> Vec<String> {
        let a = self.run.attempt.clone();
        let taken = blocking(&self.run.store, move |s| s.take_messages(&a)).await;
        taken.map(|m| m.into_iter().map(|(_, text)| text).collect()).unwrap_or_default()
    }
}

/// The task's identity and metadata, for the agent, and the ask for `ask_user` (the host
/// parks a question until a person answers it). The idempotency key is the same for every
/// attempt of the task, so an agent can recognise work a lost attempt already did.
pub fn task_meta(run: &str, task: &str, attempt: i64, spec: &TaskSpec) -> agent_client_protocol_schema::v1::Meta {
    let mut meta = agent_client_protocol_schema::v1::Meta::new();
    meta.insert(
        pier_acp::TASK_META_KEY.to_owned(),
        serde_json::json!({
            "run": run,
            "task": task,
            "attempt": attempt,
            "idempotencyKey": format!("pier:{run}:{task}"),
            "dependsOn": spec.depends_on,
            "metadata": spec.metadata,
        }),
    );
    meta.insert(pier_acp::ASK_META_KEY.to_owned(), serde_json::Value::Bool(true));
    meta
}

/// What the client's run outcome means, before the decision.
pub(crate) fn outcome_of(o: &RunOutcome) -> Outcome {
    let error = o.error.as_ref().map(ToString::to_string);
    let class = match &o.error {
        Some(e) if !e.is_retryable() => ErrorClass::Protocol,
        _ => ErrorClass::Business,
    };
    // Counted where it was seen (pier-jail's `pier_limit_breaches_total`).
    if let Some(breach) = &o.breach {
        return Outcome::Failed { error: breach.message.clone(), class: ErrorClass::Resource };
    }
    match (o.ending, o.stop_reason) {
        (ClientEnding::Answered, Some(stop_reason)) => {
            Outcome::Answered { stop_reason, text: o.text.clone(), usage: o.usage.clone() }
        }
        (ClientEnding::Interrupted { .. }, _) => Outcome::Interrupted { why: "the host stopped the attempt".into() },
        (ClientEnding::PermissionRequired, _) => Outcome::Failed {
            error: error.unwrap_or_else(|| "a permission request needed a person and none could be asked".into()),
            class: ErrorClass::Business,
        },
        (ClientEnding::TimedOut { limit, .. }, _) => Outcome::Failed {
            error: error.unwrap_or_else(|| format!("the attempt {limit} (the task's timeout / max_time)")),
            class: ErrorClass::Business,
        },
        _ => Outcome::Failed { error: error.unwrap_or_else(|| "the agent failed".into()), class },
    }
}

/// The limits of an attempt of `spec`, checked: a store written by an older pier may
/// hold numbers the plan check now refuses, and none of them may reach a panic
/// (`Duration::from_secs_f64` panics on a negative, NaN or huge number).
pub fn attempt_limits(spec: &TaskSpec, default_idle: Duration) -> Result<(Duration, Option<Duration>), String> {
    let seconds = |field: &str, value: f64| {
        pier_store::plan::check_seconds(field, value)?;
        Duration::try_from_secs_f64(value).map_err(|e| format!("{field} = {value}: {e}"))
    };
    let idle = spec.timeout.map(|t| seconds("timeout", t)).transpose()?.unwrap_or(default_idle);
    let max_time = spec.max_time.map(|t| seconds("max_time", t)).transpose()?;
    pier_store::plan::check_attempts(spec.max_attempts)?;
    Ok((idle, max_time))
}

/// What an attempt of `spec` runs with (without the asker, which needs the attempt):
/// the function between a stored task and a running attempt. Never panics.
pub fn attempt_options(spec: &TaskSpec, config: &HostConfig) -> Result<RunOptions, String> {
    let (idle_timeout, max_time) = attempt_limits(spec, config.default_idle_timeout)?;
    // A store written by an older pier (or by hand) may hold what the plan check now refuses.
    spec.limits.check()?;
    pier_jail::check_network(&spec.network)?;
    let path = std::env::var("PATH").ok();
    let mut agent =
        registry::resolve(&spec.agent, &config.agents, &config.pier_exe, path.as_deref()).map_err(|e| e.to_string())?;
    let writable: Option<Vec<PathBuf>> = spec
        .writable
        .as_ref()
        .map(|w| w.iter().map(|p| if p.is_absolute() { p.clone() } else { config.base_dir.join(p) }).collect());
    if agent.program == config.pier_exe && agent.args.first().is_some_and(|a| a == "agent") {
        agent.args.extend(own_agent_policy(spec));
        for dir in writable.iter().flatten() {
            agent.args.push("--writable".into());
            agent.args.push(dir.display().to_string());
        }
    }
    let cwd = match &spec.cwd {
        Some(c) if c.is_absolute() => c.clone(),
        Some(c) => config.base_dir.join(c),
        None => config.base_dir.clone(),
    };
    let roots: Vec<PathBuf> =
        spec.roots.iter().map(|r| if r.is_absolute() { r.clone() } else { config.base_dir.join(r) }).collect();
    let jail = jail_for(spec, config, &cwd, &roots, writable.as_ref());
    let mut policy = ClientPolicy::default();
    for (kind, rule) in &spec.permissions {
        policy.set(*kind, *rule);
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
        writable,
        asker: None,
        confinement: pier_tools::Confinement::default(),
        jail,
        session_ids: None,
        meta: None,
        mcp_servers: mcp_servers(spec)?,
        host_mcp_servers: Vec::new(),
    })
}

/// The task's MCP servers as `session/new` carries them; an HTTP server's headers read from
/// the host's environment now (a variable that is not set fails the attempt, naming it).
fn mcp_servers(spec: &TaskSpec) -> Result<Vec<agent_client_protocol_schema::v1::McpServer>, String> {
    use agent_client_protocol_schema::v1::{EnvVariable, HttpHeader, McpServer, McpServerHttp, McpServerStdio};
    let mut out = Vec::with_capacity(spec.mcp_servers.len());
    for s in &spec.mcp_servers {
        let server = match (&s.command, &s.url) {
            (Some(command), None) => McpServer::Stdio(
                McpServerStdio::new(s.name.clone(), command.clone())
                    .args(s.args.clone())
                    .env(s.env.iter().map(|(k, v)| EnvVariable::new(k.clone(), v.clone())).collect()),
            ),
            (None, Some(url)) => {
                let mut headers = Vec::with_capacity(s.headers_env.len());
                for (header, var) in &s.headers_env {
                    let value = std::env::var(var).map_err(|_| {
                        format!("MCP server `{}`: header `{header}` is read from ${var}, which is not set here", s.name)
                    })?;
                    headers.push(HttpHeader::new(header.clone(), value));
                }
                McpServer::Http(McpServerHttp::new(s.name.clone(), url.clone()).headers(headers))
            }
            _ => return Err(format!("MCP server `{}` needs exactly one of `command` and `url`", s.name)),
        };
        out.push(server);
    }
    Ok(out)
}

/// The jail of an attempt of `spec`: its level, paths, hosts and limits over the host's.
/// `off` runs the agent open, said in the log every time.
fn jail_for(
    spec: &TaskSpec,
    config: &HostConfig,
    cwd: &std::path::Path,
    roots: &[PathBuf],
    writable: Option<&Vec<PathBuf>>,
) -> Option<pier_client::process::JailSetup> {
    let (level, mut network, limits) = config.sandbox.for_task(spec);
    // The host's MCP endpoint, through the proxy like any host (the same for every task, so
    // warm agents are shared as before).
    network.extend(config.mcp.as_ref().map(|m| m.authority.clone()));
    if level == pier_jail::Level::Off {
        tracing::warn!(task = %spec.id, "sandbox = \"off\": the agent runs unconfined");
        return None;
    }
    let request = pier_jail::Request {
        level,
        cwd: cwd.to_owned(),
        roots: roots.to_vec(),
        writable: writable.cloned(),
        network,
        limits,
        hide: config.sandbox.hide.clone(),
        through_gateway: config.gateway.is_some(),
    };
    Some(pier_client::process::JailSetup { jailer: config.sandbox.jailer.clone(), request })
}

/// The plan's permission layer as flags of pier's own agent, which runs its tools itself:
/// the host's client-side policy sees only the permission requests an agent chooses to send,
/// so a `deny` must reach the agent's own policy to hold, and an `ask` must make it ask.
fn own_agent_policy(spec: &TaskSpec) -> Vec<String> {
    let mut flags = Vec::new();
    for (kind, rule) in &spec.permissions {
        let flag = match rule {
            Rule::Deny | Rule::DenyAlways => "--deny",
            Rule::Allow | Rule::AllowAlways => "--allow",
            Rule::Ask => "--ask",
        };
        flags.push(flag.to_owned());
        flags.push(kind.as_str().to_owned());
    }
    flags
}

/// Puts a permission request the policy leaves to a person on the task
/// (`running → awaiting_input`), waits for `pier approve`/`pier deny` (or the HTTP
/// API) to answer it, and resumes (`awaiting_input → running`). It waits on the store's
/// commit watch, which also carries other processes' commits.
#[derive(Clone)]
struct HostAsker {
    store: Arc<dyn TaskStore>,
    attempt: Attempt,
    /// Set when the task's `on_deny` is `fail`: a denial stops the attempt.
    denial: Option<Denial>,
    /// The attempt was given the host's MCP endpoint: its tools are allowed without a person.
    own_tools: bool,
}

impl pier_client::handler::Asker for HostAsker {
    fn ask(
        &self,
        request: &agent_client_protocol_schema::v1::RequestPermissionRequest,
    ) -> futures::future::BoxFuture<'static, pier_client::handler::AskAnswer> {
        use pier_client::handler::AskAnswer;
        if let Some(answer) = crate::host_mcp::own_tool_answer(request).filter(|_| self.own_tools) {
            return Box::pin(async move { answer });
        }
        let asker = self.clone();
        let asked = request.clone();
        let request = QuestionRequest::Permission(Box::new(request.clone()));
        Box::pin(async move {
            match asker.put(request).await {
                Some(option) => {
                    if let Some(denial) = &asker.denial {
                        note_denial(denial, &asked, &option);
                    }
                    // The agent hears the answer either way; the attempt then cancels its turn.
                    AskAnswer::Option(option)
                }
                // Voided (the task was cancelled or the attempt ended), or the store failed.
                None => AskAnswer::Withdrawn,
            }
        })
    }

    fn answers_questions(&self) -> bool {
        true
    }

    /// A question for the person: the task waits in `awaiting_input` with the message and
    /// the fields asked for, until `pier answer`, the HTTP route or a cancel.
    fn elicit(
        &self,
        request: &agent_client_protocol_schema::v1::CreateElicitationRequest,
    ) -> futures::future::BoxFuture<'static, pier_client::elicit::ElicitAnswer> {
        use pier_client::elicit::ElicitAnswer;
        let asker = self.clone();
        let request = QuestionRequest::Elicitation(Box::new(request.clone()));
        Box::pin(async move {
            let Some(answer) = asker.put(request).await else { return ElicitAnswer::Cancel };
            let answer: Value = serde_json::from_str(&answer).unwrap_or(Value::Null);
            match answer["action"].as_str() {
                Some("accept") => {
                    let content = serde_json::from_value(answer["content"].clone()).unwrap_or_default();
                    ElicitAnswer::Accept(content)
                }
                Some("decline") => ElicitAnswer::Decline,
                _ => ElicitAnswer::Cancel,
            }
        })
    }
}

impl HostAsker {
    /// Parks the task on `request` (a question event), waits for the answer a person gives
    /// through the store, and resumes the task. `None` when the question was voided (the
    /// task was cancelled or the attempt ended while it waited) or the store failed.
    async fn put(&self, request: QuestionRequest) -> Option<String> {
        let (store, attempt) = (self.store.clone(), self.attempt.clone());
        let mut commits = store.subscribe();
        let a = attempt.clone();
        let n = blocking(&store, move |s| s.park(&a, &request)).await.ok()?;
        // Dropped before an answer (the agent withdrew the question, the turn is being
        // cancelled): the question is withdrawn, so it is neither left open nor answered late.
        let mut open = OpenQuestion { store: store.clone(), attempt: attempt.clone(), n: Some(n) };
        let answer = loop {
            let a = attempt.clone();
            match blocking(&store, move |s| s.answer_of(&a, n)).await {
                Ok(Some(answer)) if !answer.is_empty() => break answer,
                Ok(Some(_)) | Err(_) => return None,
                Ok(None) => commits.changed().await.ok()?,
            }
        };
        open.n = None;
        let a = attempt.clone();
        let _ = blocking(&store, move |s| s.resume(&a)).await;
        Some(answer)
    }
}

/// A question the host put to a person and still waits on; withdrawn if dropped so (the
/// asker stopped waiting: its turn cancelled, its MCP call dropped). `n` is taken once answered.
pub(crate) struct OpenQuestion {
    pub(crate) store: Arc<dyn TaskStore>,
    pub(crate) attempt: Attempt,
    pub(crate) n: Option<i64>,
}

impl Drop for OpenQuestion {
    fn drop(&mut self) {
        let Some(n) = self.n.take() else { return };
        let (store, attempt) = (self.store.clone(), self.attempt.clone());
        let withdraw = move || {
            if let Err(e) = store.withdraw(&attempt, n) {
                tracing::warn!(error = %e, task = %attempt.task, "could not withdraw a question");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(withdraw)),
            Err(_) => withdraw(),
        }
    }
}

/// Jittered exponential backoff: base × 2^failures, ±50 %, at most a minute.
pub fn backoff(base: Duration, failures: u32) -> Duration {
    let exp = base.saturating_mul(1u32 << failures.min(16)).min(Duration::from_secs(60));
    exp.mul_f64(0.5 + fastrand::f64())
}

/// What the recorder has not written when the attempt ends, for the ending's own write;
/// every side effect of the attempt (for the decision), and what it showed.
struct Tail {
    events: Vec<(String, Value)>,
    evidence: Vec<Value>,
    seen: Vec<Value>,
    output: Value,
}

/// The attempt's events on their way to the log: written in batches as they come, except
/// the last ones, which the ending takes ([`Recorder::tail`]) and writes with itself.
struct Recorder {
    events: mpsc::Sender<ClientEvent>,
    tails: mpsc::UnboundedSender<tokio::sync::oneshot::Sender<Tail>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    fn start(store: Arc<dyn TaskStore>, attempt: Attempt) -> Recorder {
        let (events, rx) = mpsc::channel(pier_client::run::EVENT_QUEUE);
        let (tails, asks) = mpsc::unbounded_channel();
        Recorder { events, tails, task: tokio::spawn(record(store, attempt, rx, asks)) }
    }

    /// Everything sent so far that is not written yet, taken out of the log's way.
    async fn tail(&self) -> Tail {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = self.tails.send(tx);
        let empty = || Tail { events: Vec::new(), evidence: Vec::new(), seen: Vec::new(), output: Value::Null };
        rx.await.unwrap_or_else(|_| empty())
    }

    /// Writes what is still to come (events after the ending) and stops.
    async fn finish(self) {
        drop(self.events);
        drop(self.tails);
        let _ = self.task.await;
    }
}

/// Most stderr lines one logged event holds.
const STDERR_ROW_LINES: usize = 256;

/// What the attempt showed so far: its text and tool calls, and its side effects. Local
/// attempts and a worker's ([`crate::worker`]) see their agent's events through it alike.
#[derive(Default)]
pub(crate) struct Seen {
    pub(crate) partial: Partial,
    side_effects: SideEffects,
    pub(crate) effects: Vec<Value>,
}

impl Seen {
    /// Takes in one event: its row for the log, and its side effect, if any, for the evidence.
    pub(crate) fn take(&mut self, event: ClientEvent, rows: &mut Vec<(String, Value)>, evidence: &mut Vec<Value>) {
        self.partial.see(&event);
        if let Some(effect) = self.side_effects.see(&event) {
            let effect = serde_json::to_value(&effect).unwrap_or(Value::Null);
            self.effects.push(effect.clone());
            evidence.push(effect);
        }
        // Stderr read faster than the log is written joins the batch of lines before it.
        if let (ClientEvent::Stderr { lines, dropped }, Some((kind, last))) = (&event, rows.last_mut())
            && kind == "agent_stderr"
            && last["lines"].as_array().is_some_and(|l| l.len() + lines.len() <= STDERR_ROW_LINES)
        {
            if let Some(kept) = last["lines"].as_array_mut() {
                kept.extend(lines.iter().cloned().map(Value::String));
            }
            last["dropped"] = Value::from(last["dropped"].as_u64().unwrap_or(0) + dropped);
            return;
        }
        // The event as `pier exec --format json` prints it, without its `type` (the log's own).
        let mut data = serde_json::to_value(&event).unwrap_or(Value::Null);
        if let Some(obj) = data.as_object_mut() {
            obj.remove("type");
        }
        rows.push((event.kind().to_owned(), data));
    }
}

/// Writes a task's events to the log in batches and its side effects as evidence, and
/// answers [`Recorder::tail`] with what it has not written.
async fn record(
    store: Arc<dyn TaskStore>,
    attempt: Attempt,
    mut rx: mpsc::Receiver<ClientEvent>,
    mut asks: mpsc::UnboundedReceiver<tokio::sync::oneshot::Sender<Tail>>,
) {
    let mut seen = Seen::default();
    let (mut rows, mut evidence) = (Vec::new(), Vec::new());
    // After the store refused a batch (a full disk), the rest is drained unwritten so
    // the turn never blocks on a full queue; the attempt's ending reports the error.
    let mut failed = false;
    loop {
        let write = tokio::select! {
            // First: an event sent before the ask is in the queue by then, and goes with the tail.
            biased;
            Some(reply) = asks.recv() => {
                while let Ok(event) = rx.try_recv() {
                    seen.take(event, &mut rows, &mut evidence);
                }
                let (events, evidence) = (std::mem::take(&mut rows), std::mem::take(&mut evidence));
                let (events, evidence) = if failed { (Vec::new(), Vec::new()) } else { (events, evidence) };
                let output = serde_json::to_value(&seen.partial).unwrap_or(Value::Null);
                let _ = reply.send(Tail { events, evidence, seen: seen.effects.clone(), output });
                false
            }
            event = rx.recv() => match event {
                Some(event) => {
                    seen.take(event, &mut rows, &mut evidence);
                    while rows.len() < RECORD_BATCH {
                        let Ok(more) = rx.try_recv() else { break };
                        seen.take(more, &mut rows, &mut evidence);
                    }
                    // Written as they come, not held back to batch more: people watching see them
                    // at once, ahead of what the attempt does next (a question it parks).
                    true
                }
                None => return,
            },
        };
        if !write {
            continue;
        }
        let (batch, effects) = (std::mem::take(&mut rows), std::mem::take(&mut evidence));
        if failed || batch.is_empty() {
            continue;
        }
        let a = attempt.clone();
        let result = blocking(&store, move |s| s.record(&a, &batch, &effects)).await;
        if let Err(e) = result {
            tracing::error!(error = %e, task = %attempt.task, "recording task events failed; the attempt's later events are not recorded");
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
}
