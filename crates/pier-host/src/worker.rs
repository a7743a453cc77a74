//! `pier worker`: agents on another machine, driven through the host's worker API (`/v1`).
//! Each of `concurrency` slots leases a task (waiting for one), starts the worker's agent for it
//! under the same confinement and options a local attempt gets ([`attempt_options`]), and drives
//! the session with pier's client while four things run beside the turn: the lease's heartbeat,
//! the progress pump (the agent's events, batched and numbered, into the task's log), the
//! notice long-poll (a cancel or a lost lease stops the agent at once; a person's message is
//! sent next, or at once after cancelling the turn when it interrupts), and the asker (a
//! permission request or a question parks the task for a person on the host). The ending goes
//! back with the attempt's output and side effects, decided on the host by the same rule as a
//! local attempt's.

use std::sync::Arc;
use std::time::Duration;

use agent_client_protocol_schema::v1::{ContentBlock, StopReason, TextContent};
use pier_client::run::{LiveAgent, RunOutcome};
use pier_client::{ClientEvent, Partial};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::attempt::{Seen, attempt_options, outcome_of};
use crate::config::HostConfig;
use crate::converse::{Channel, converse};
use crate::decide::Outcome;
use crate::pool::AgentPool;

/// How long a lease request waits for work before asking again.
const LEASE_WAIT_MS: u64 = 25_000;
/// How long one notice long-poll waits.
const NOTICE_WAIT_MS: u64 = 25_000;
/// How far into an attempt the notice long-poll starts: a cancel or a message still reaches
/// the agent well within a second, and the many attempts that end sooner cost the host no
/// long-poll at all.
const NOTICE_AFTER: Duration = Duration::from_millis(150);
/// How long events wait for more to go in the same progress batch.
const COALESCE: Duration = Duration::from_millis(5);
/// Events sent together at most.
const BATCH: usize = 256;
/// How long a question waits for the agent's events before it to reach the pump.
const FLUSH_GRACE: Duration = Duration::from_millis(50);
/// How long a failed call to the host waits before the next try.
const RETRY: Duration = Duration::from_secs(1);

/// What a worker is: where its host is, who it is, what it takes and what it runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The host's base URL (`http://host:7070`).
    pub server: String,
    pub token: String,
    pub name: String,
    pub capabilities: Vec<String>,
    /// The agent spec its tasks run on (`pier`, a `[agents.X]` name, a command).
    pub agent: String,
    /// Whether it also takes tasks that name `agent` (not only `worker:` tasks).
    pub takes_agent_tasks: bool,
    pub concurrency: usize,
    pub lease_ttl: Duration,
    /// The options of its attempts: confinement, agents, working directory.
    pub host: HostConfig,
}

/// Why the worker stopped before being asked to.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("the host refused the worker's token (401); give the token `pier serve` prints with --token or PIER_TOKEN")]
    Token,
    #[error("{0}")]
    Host(String),
    /// The host leased a task this worker cannot read (another version of pier): it stops
    /// rather than lease more it would only drop.
    #[error("{0}")]
    Unreadable(String),
}

/// One attempt's calls to the host.
#[derive(Clone)]
struct Link {
    http: reqwest::Client,
    base: String,
    token: String,
    worker: String,
}

impl Link {
    /// Posts `body` (with the worker's name) to `path`: the status and the JSON answer.
    async fn post(&self, path: &str, mut body: Value) -> Result<(u16, Value), WorkerError> {
        if let Some(o) = body.as_object_mut() {
            o.insert("worker".into(), Value::String(self.worker.clone()));
        }
        let sent = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| WorkerError::Host(format!("the host at {} did not answer: {e}", self.base)))?;
        let status = sent.status().as_u16();
        if status == 401 {
            return Err(WorkerError::Token);
        }
        let text = sent.text().await.unwrap_or_default();
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }
}

/// The attempt's address on the host.
fn at(run: &str, task: &str, n: i64, rest: &str) -> String {
    format!("/v1/runs/{run}/tasks/{task}/attempts/{n}/{rest}")
}

/// Runs the worker until `stop`: its slots lease and run tasks; a stop cancels the running
/// turns and reports them interrupted (the host runs them again).
pub async fn run(config: WorkerConfig, stop: CancellationToken) -> Result<(), WorkerError> {
    let link = Link {
        http: reqwest::Client::new(),
        base: config.server.trim_end_matches('/').to_owned(),
        token: config.token.clone(),
        worker: config.name.clone(),
    };
    let config = Arc::new(config);
    let pool = Arc::new(AgentPool::new(config.concurrency.max(1)));
    let mut slots = tokio::task::JoinSet::new();
    for _ in 0..config.concurrency.max(1) {
        slots.spawn(slot(config.clone(), link.clone(), pool.clone(), stop.clone()));
    }
    let mut result = Ok(());
    while let Some(done) = slots.join_next().await {
        if let Ok(Err(e)) = done {
            stop.cancel();
            result = Err(e);
        }
    }
    pool.drain().await;
    result
}

async fn slot(
    config: Arc<WorkerConfig>,
    link: Link,
    pool: Arc<AgentPool>,
    stop: CancellationToken,
) -> Result<(), WorkerError> {
    let agents: Vec<&str> = if config.takes_agent_tasks { vec![config.agent.as_str()] } else { Vec::new() };
    let ttl_ms = config.lease_ttl.as_millis() as u64;
    let ask =
        json!({"capabilities": config.capabilities, "agents": agents, "ttl_ms": ttl_ms, "wait_ms": LEASE_WAIT_MS});
    // What an attempt's ending asks for: the next task, leased in the ending's commit.
    let ask_next = json!({"capabilities": config.capabilities, "agents": agents, "ttl_ms": ttl_ms});
    // The next task, leased with the ending of the attempt before it.
    let mut next: Option<Box<Granted>> = None;
    while !stop.is_cancelled() {
        let leased = match next.take() {
            Some(granted) => Ok(Lease::Granted(granted)),
            None => tokio::select! {
                () = stop.cancelled() => return Ok(()),
                leased = lease(link.clone(), ask.clone(), config.lease_ttl) => leased,
            },
        };
        match leased {
            Ok(Lease::Granted(granted)) => {
                let (leased_tx, mut leased_rx) = mpsc::unbounded_channel();
                let asks = Next { ask: ask_next.clone(), leased: leased_tx };
                let ran = attempt(&config, &link, &pool, *granted, &stop, asks).await;
                next = leased_rx.try_recv().ok();
                if let Err(e) = ran {
                    if let Some(granted) = next.take() {
                        give_back(&link, *granted).await;
                    }
                    return Err(e);
                }
            }
            Ok(Lease::NoWork) => {}
            Err(e @ (WorkerError::Token | WorkerError::Unreadable(_))) => return Err(e),
            Ok(Lease::Refused(status, answer)) => {
                tracing::warn!(status, %answer, "the host refused a lease");
                tokio::time::sleep(RETRY).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "no lease");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
    if let Some(granted) = next.take() {
        give_back(&link, *granted).await;
    }
    Ok(())
}

/// How an attempt's ending asks for its slot's next task, and where the lease goes.
struct Next {
    /// The `next` of the ending's report.
    ask: Value,
    leased: mpsc::UnboundedSender<Box<Granted>>,
}

/// What asking for a task gave.
enum Lease {
    Granted(Box<Granted>),
    /// None came within the wait.
    NoWork,
    Refused(u16, Value),
}

/// A task leased to this worker, its lease renewed from the moment the host granted it (a
/// task leased ahead may wait for the attempt before it to end).
struct Granted {
    row: crate::TaskRow,
    prompt: String,
    /// The attempt's token at the host's MCP endpoint (`{server}/mcp`), if the host serves one.
    mcp_token: Option<String>,
    /// Cancelled when the lease is lost.
    lost: CancellationToken,
    heartbeat: Renewal,
}

/// The heartbeat of a lease, stopped when dropped.
struct Renewal(tokio::task::JoinHandle<()>);

impl Renewal {
    fn abort(&self) {
        self.0.abort();
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Hands a task leased ahead back to the host unstarted: interrupted, it runs again at once.
async fn give_back(link: &Link, granted: Granted) {
    let Granted { row, heartbeat, .. } = granted;
    heartbeat.abort();
    let report = json!({"status": "interrupted", "idempotency_key": format!("give-back-{:016x}", fastrand::u64(..))});
    if let Ok((status, answer)) = link.post(&at(&row.run_id, &row.id, row.attempt, "end"), report).await
        && status != 200
    {
        tracing::info!(status, %answer, "a task leased ahead was not handed back; its lease will lapse");
    }
}

/// Asks the host for a task, waiting for one.
async fn lease(link: Link, ask: Value, ttl: Duration) -> Result<Lease, WorkerError> {
    match link.post("/v1/lease", ask).await? {
        (200, leased) => granted(link, &leased, ttl).await,
        (204, _) => Ok(Lease::NoWork),
        (status, answer) => Ok(Lease::Refused(status, answer)),
    }
}

/// A task the host leased (`{task, prompt}`), its lease renewed from now on.
async fn granted(link: Link, leased: &Value, ttl: Duration) -> Result<Lease, WorkerError> {
    let row: crate::TaskRow = match serde_json::from_value(leased["task"].clone()) {
        Ok(row) => row,
        Err(e) => {
            // Given back as it came, so it runs elsewhere now rather than when its lease lapses.
            let t = &leased["task"];
            if let (Some(run), Some(task), Some(n)) = (t["run_id"].as_str(), t["id"].as_str(), t["attempt"].as_i64()) {
                let report = json!({"status": "interrupted", "idempotency_key": "unreadable"});
                let _ = link.post(&at(run, task, n, "end"), report).await;
            }
            return Err(WorkerError::Unreadable(format!(
                "the host leased a task this worker cannot read ({e}); run the same pier version as the host"
            )));
        }
    };
    let prompt = leased["prompt"].as_str().unwrap_or_default().to_owned();
    let mcp_token = leased["mcp_token"].as_str().map(str::to_owned);
    let lost = CancellationToken::new();
    let path = at(&row.run_id, &row.id, row.attempt, "heartbeat");
    let heartbeat = Renewal(tokio::spawn(heartbeat(link, path, ttl, lost.clone())));
    Ok(Lease::Granted(Box::new(Granted { row, prompt, mcp_token, lost, heartbeat })))
}

/// Gives the attempt's agent the host's MCP endpoint (`{server}/mcp` with the attempt's token),
/// reached through its jail's proxy like any host the task may reach.
fn host_endpoint(opts: &mut pier_client::run::RunOptions, server: &str, token: &str) {
    let url = format!("{}/mcp", server.trim_end_matches('/'));
    opts.host_mcp_servers.push(crate::host_mcp::server_entry(url, token));
    let authority = server.split("://").nth(1).and_then(|rest| rest.split('/').next()).unwrap_or_default();
    if let Some(jail) = &mut opts.jail
        && !authority.is_empty()
    {
        jail.request.network.push(authority.to_owned());
    }
}

/// A message from a person, for the agent.
struct Said {
    interrupt: bool,
}

/// One leased task, from its agent's start to its ending on the host.
async fn attempt(
    config: &WorkerConfig,
    link: &Link,
    pool: &AgentPool,
    granted: Granted,
    stop: &CancellationToken,
    next: Next,
) -> Result<(), WorkerError> {
    let Granted { row, prompt, mcp_token, lost, heartbeat } = granted;
    let (run, task, n) = (row.run_id.clone(), row.id.clone(), row.attempt);
    tracing::info!(%run, %task, attempt = n, "leased");
    let (said_tx, mut said) = mpsc::unbounded_channel();
    // A person's cancel: the turn stops, and the ending (with the output) ends the task.
    let cancelled = CancellationToken::new();
    let told = Told { lost: lost.clone(), cancelled: cancelled.clone(), said: said_tx };
    let notices = tokio::spawn(notices(link.clone(), at(&run, &task, n, "notice"), told));
    let (events, rx) = mpsc::channel(pier_client::run::EVENT_QUEUE);
    let (to_pump, asks) = mpsc::unbounded_channel();
    let pump = tokio::spawn(progress(link.clone(), at(&run, &task, n, "progress"), rx, asks, lost.clone()));

    let mut spec = row.spec.clone();
    spec.agent = config.agent.clone();
    // The agent's model traffic goes through this worker's own gateway: keys stay here, and
    // what it spent goes back with the ending.
    let closer = Closer {
        link,
        path: at(&run, &task, n, "end"),
        pump: &to_pump,
        lease_ttl: config.lease_ttl,
        key: format!("end-{:016x}", fastrand::u64(..)),
        reports: Default::default(),
        next,
        stop,
        denial: Default::default(),
    };
    let mut spent = Vec::new();
    let mut ended = None;
    let outcome = match attempt_options(&spec, &config.host) {
        Ok(mut opts) => {
            let base = at(&run, &task, n, "questions");
            let denial = (spec.on_deny == pier_store::plan::OnDeny::Fail).then(|| closer.denial.clone());
            let own_tools = mcp_token.is_some();
            opts.asker =
                Some(Arc::new(RemoteAsker { link: link.clone(), base, pump: to_pump.clone(), denial, own_tools }));
            opts.meta = Some(crate::attempt::task_meta(&run, &task, n, &spec));
            if let Some(token) = &mcp_token {
                host_endpoint(&mut opts, &config.server, token);
            }
            let (int_tx, mut interrupts) = mpsc::unbounded_channel();
            let stopping = {
                let (lost, stop, cancelled) = (lost.clone(), stop.clone(), cancelled.clone());
                let denial = closer.denial.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        () = lost.cancelled() => {}
                        () = denial.stopped() => {}
                        () = stop.cancelled() => {}
                        () = cancelled.cancelled() => {}
                    }
                    let _ = int_tx.send(());
                })
            };
            // A warm agent of the same definition serves the next task in a new session, as a
            // host's own do; a new one gets its own account at this worker's gateway.
            let key = AgentPool::key(&opts);
            let fresh = spec.fresh_agent;
            let warm = if fresh { None } else { pool.take(&key).await };
            let (started, mut lease) = match warm {
                Some((agent, lease)) => (Ok(agent), lease),
                None => {
                    let mut started_with = opts.clone();
                    let lease = config.host.gateway.as_ref().map(|g| g.lease(&opts.agent, &link.worker));
                    if let Some(l) = &lease {
                        l.apply(&mut started_with.agent);
                    }
                    (LiveAgent::start_or_stop(&started_with, &events, &mut interrupts).await, lease)
                }
            };
            if let Some(l) = &lease {
                l.collect();
            }
            let blocks = vec![ContentBlock::Text(TextContent::new(prompt))];
            let outcome = match started {
                Ok(mut agent) => {
                    let mut channel = Remote {
                        link,
                        messages: at(&run, &task, n, "messages"),
                        closer: &closer,
                        lease: lease.as_ref(),
                        said: &mut said,
                    };
                    let (o, e) = converse(&mut agent, &opts, blocks, &events, &mut interrupts, &mut channel).await;
                    ended = e;
                    if let Some(l) = &lease {
                        spent = l.collected(Duration::from_secs(2)).await;
                    }
                    if fresh {
                        agent.shutdown(&events).await;
                    } else {
                        // A task's session is never continued: a warm agent must not keep it.
                        if let Some(id) = &o.session_id {
                            agent.close_session(id).await;
                        }
                        pool.give_back(key, agent, lease.take()).await;
                    }
                    o
                }
                Err(outcome) => outcome,
            };
            stopping.abort();
            outcome_of(&outcome)
        }
        Err(error) => {
            Outcome::Unusable { error: format!("task `{task}` cannot start on worker {}: {error}", link.worker) }
        }
    };
    if let Some(ended) = ended {
        drop(events);
        let _ = pump.await;
        notices.abort();
        heartbeat.abort();
        return ended.into_result();
    }
    if lost.is_cancelled() {
        drop(events);
        let (partial, _) = pump.await.unwrap_or_default();
        notices.abort();
        heartbeat.abort();
        tracing::info!(%run, %task, "the attempt does not hold its task any more; its agent was stopped");
        let output = json!({"output": serde_json::to_value(&partial).unwrap_or(Value::Null)});
        if let Ok((status, answer)) = link.post(&at(&run, &task, n, "output"), output).await
            && status != 200
        {
            tracing::info!(status, %answer, "the attempt's output was not kept");
        }
        return Ok(());
    }
    let ended = closer.end(&outcome, &spent, false).await;
    drop(events);
    let _ = pump.await;
    notices.abort();
    heartbeat.abort();
    ended.into_result()
}

/// How an attempt's ending went.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The host took it.
    Taken,
    /// Refused because a person's message waits: the worker takes it and goes on.
    MessagesWaiting,
    /// Refused for good (the attempt is not the task's any more), or the host stayed away.
    Dropped,
    Token,
    /// The host answered with a next task this worker cannot read: it stops, as for a lease.
    Unreadable(String),
}

impl Ended {
    /// What the worker does after this ending: go on, or stop with the error.
    fn into_result(self) -> Result<(), WorkerError> {
        match self {
            Ended::Token => Err(WorkerError::Token),
            Ended::Unreadable(why) => Err(WorkerError::Unreadable(why)),
            Ended::Taken | Ended::MessagesWaiting | Ended::Dropped => Ok(()),
        }
    }
}

/// What ends an attempt on the host: the report of its outcome with what it showed and spent.
struct Closer<'a> {
    link: &'a Link,
    path: String,
    /// Gives what the agent sent and has not been written, and what it showed.
    pump: &'a mpsc::UnboundedSender<ToPump>,
    lease_ttl: Duration,
    /// The attempt's reports' keys: a repeat of one report is applied once.
    key: String,
    reports: std::sync::atomic::AtomicU32,
    /// The next task for the slot, asked for with the ending (unless the worker stops).
    next: Next,
    stop: &'a CancellationToken,
    /// A person's denial that stops the attempt (`on_deny = "fail"`): its ending, however the
    /// turn ended.
    denial: crate::attempt::Denial,
}

impl Closer<'_> {
    async fn end(&self, outcome: &Outcome, spent: &[crate::ModelRequest], unless_messages: bool) -> Ended {
        let denied = self.denial.outcome(outcome);
        let outcome = denied.as_ref().unwrap_or(outcome);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let ((partial, effects), batch) = match self.pump.send(ToPump::Take(tx)) {
            Ok(()) => rx.await.unwrap_or_default(),
            Err(_) => Default::default(),
        };
        let ended = self.report(outcome, spent, unless_messages, partial, effects, batch.clone()).await;
        // Refused with a message waiting, the batch goes on its own, ahead of what follows;
        // otherwise it was written with the ending (or cannot be any more).
        let unsent = if ended == Ended::MessagesWaiting { batch } else { None };
        let _ = self.pump.send(ToPump::Settle(unsent));
        ended
    }

    async fn report(
        &self,
        outcome: &Outcome,
        spent: &[crate::ModelRequest],
        unless_messages: bool,
        partial: Partial,
        effects: Vec<Value>,
        batch: Option<Value>,
    ) -> Ended {
        let mut report = match outcome {
            Outcome::Answered { stop_reason: StopReason::EndTurn, text, .. } => {
                json!({"status": "completed", "result": text})
            }
            Outcome::Answered { stop_reason, text, .. } => {
                json!({"status": "stopped", "stop_reason": pier_client::event::wire_name(stop_reason), "result": text})
            }
            Outcome::Failed { error, class } => json!({"status": "failed", "error": error, "class": class}),
            Outcome::Unusable { error } => json!({"status": "failed", "error": error, "class": "protocol"}),
            Outcome::Denied { why } => json!({"status": "denied", "error": why}),
            Outcome::Interrupted { .. } | Outcome::OverBudget { .. } | Outcome::RateLimited { .. } => {
                json!({"status": "interrupted"})
            }
        };
        let k = self.reports.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        report["idempotency_key"] = json!(format!("{}-{k}", self.key));
        report["output"] = serde_json::to_value(&partial).unwrap_or(Value::Null);
        report["evidence"] = Value::Array(effects);
        report["unless_messages"] = json!(unless_messages);
        if let Some(batch) = batch {
            report["progress"] = batch;
        }
        if !self.stop.is_cancelled() {
            report["next"] = self.next.ask.clone();
        }
        if !spent.is_empty() {
            let usage: Vec<Value> = spent
                .iter()
                .map(|r| {
                    let t = r.tokens.unwrap_or_default();
                    json!({"provider": r.provider, "model": r.model, "input": t.input, "cached_input": t.cached_input,
                           "output": t.output, "reasoning": t.reasoning, "cost": r.cost})
                })
                .collect();
            report["usage"] = Value::Array(usage);
        }
        // Sent again (the host applies one key once) until the host takes it, refuses it, or
        // the lease has surely lapsed.
        let deadline = tokio::time::Instant::now() + self.lease_ttl;
        loop {
            match self.link.post(&self.path, report.clone()).await {
                Ok((200, answer)) => {
                    if answer["next"].is_object() {
                        match granted(self.link.clone(), &answer["next"], self.lease_ttl).await {
                            Ok(Lease::Granted(g)) => {
                                let _ = self.next.leased.send(g);
                            }
                            Ok(_) => {}
                            Err(WorkerError::Unreadable(why)) => return Ended::Unreadable(why),
                            Err(e) => tracing::warn!(error = %e, "the next task's lease is not usable"),
                        }
                    }
                    return Ended::Taken;
                }
                Ok((409, answer)) if answer["error"]["code"] == "messages_waiting" => return Ended::MessagesWaiting,
                // A host older than this worker knows no `next`: the ending goes without it (the
                // slot leases on its own), nothing of it having been written.
                Ok((400, answer))
                    if report.get("next").is_some()
                        && answer["error"]["message"].as_str().is_some_and(|m| m.contains("`next`")) =>
                {
                    if let Some(r) = report.as_object_mut() {
                        r.remove("next");
                    }
                    continue;
                }
                Ok((status, answer)) if (400..500).contains(&status) => {
                    tracing::warn!(status, %answer, "the host refused the attempt's ending");
                    return Ended::Dropped;
                }
                Err(WorkerError::Token) => return Ended::Token,
                other => tracing::warn!(?other, "could not report the ending; trying again"),
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!("the host stayed out of reach past the lease; the attempt's ending is dropped");
                return Ended::Dropped;
            }
            tokio::time::sleep(RETRY).await;
        }
    }
}

/// A worker's [`Channel`]: its task's messages and ending, through the host's `/v1`.
struct Remote<'a> {
    link: &'a Link,
    /// `…/attempts/{n}/messages`.
    messages: String,
    closer: &'a Closer<'a>,
    /// The gateway account of the agent: what it spent goes with the ending.
    lease: Option<&'a crate::gateway::Lease>,
    /// What the notice long-poll told of people's messages.
    said: &'a mut mpsc::UnboundedReceiver<Said>,
}

impl Channel for Remote<'_> {
    type Ended = Ended;

    async fn interrupt(&mut self) {
        loop {
            match self.said.recv().await {
                Some(Said { interrupt: true }) => return,
                Some(_) => {}
                None => return std::future::pending().await,
            }
        }
    }

    async fn end(&mut self, outcome: &RunOutcome) -> Option<Ended> {
        let spent = match self.lease {
            Some(l) => l.collected(Duration::from_secs(2)).await,
            None => Vec::new(),
        };
        match self.closer.end(&outcome_of(outcome), &spent, true).await {
            Ended::MessagesWaiting => None,
            ended => Some(ended),
        }
    }

    async fn take_messages(&mut self) -> Vec<String> {
        match self.link.post(&self.messages, json!({})).await {
            Ok((200, v)) => v["messages"]
                .as_array()
                .map(|m| m.iter().filter_map(|m| m["text"].as_str().map(str::to_owned)).collect())
                .unwrap_or_default(),
            _ => Vec::new(),
        }
    }
}

/// Renews the lease every third of its life. A refusal (the task is not this attempt's any
/// more) cancels `lost`; so does a host out of reach for longer than the lease lasts (it has
/// lapsed, and the task is another's to run): until then the worker goes on, and what it sends
/// is sent again when the host is back. A person's cancel renews the lease (the notice
/// long-poll stops the turn), so the attempt has the time to report its ending.
async fn heartbeat(link: Link, path: String, ttl: Duration, lost: CancellationToken) {
    let body = json!({"ttl_ms": ttl.as_millis() as u64});
    let mut renewed = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(ttl / 3).await;
        match link.post(&path, body.clone()).await {
            Ok((200, _)) => renewed = tokio::time::Instant::now(),
            Ok((409, v)) if v["error"]["code"] == "cancel_requested" => renewed = tokio::time::Instant::now(),
            Ok((409 | 404, _)) => {
                lost.cancel();
                return;
            }
            other => {
                tracing::warn!(?other, "a heartbeat did not reach the host; the lease may lapse");
                if renewed.elapsed() >= ttl {
                    lost.cancel();
                    return;
                }
            }
        }
    }
}

/// Whom the notice long-poll tells what.
struct Told {
    /// The task is not the attempt's any more.
    lost: CancellationToken,
    /// A person cancelled the task.
    cancelled: CancellationToken,
    /// A person's message waits.
    said: mpsc::UnboundedSender<Said>,
}

/// Long-polls the host for what concerns the attempt: a lost task cancels `lost`, a person's
/// cancel `cancelled`, a message is told to the turn.
async fn notices(link: Link, path: String, to: Told) {
    let Told { lost, cancelled, said } = to;
    tokio::time::sleep(NOTICE_AFTER).await;
    let mut told = None;
    loop {
        match link.post(&path, json!({"wait_ms": NOTICE_WAIT_MS})).await {
            Ok((200, n)) if n["held"] == false => {
                lost.cancel();
                return;
            }
            Ok((200, n)) if n["cancel"].is_string() => {
                cancelled.cancel();
                return;
            }
            Ok((200, n)) if n["messages"] == true => {
                // Told once while it waits; it is taken when the turn makes room, so until
                // then the host is asked less often.
                let interrupt = n["interrupt"] == true;
                if told != Some(interrupt) {
                    told = Some(interrupt);
                    let _ = said.send(Said { interrupt });
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok((200, _)) if told.is_some() => told = None,
            Ok((200, _)) => {}
            Ok((409 | 404, _)) => {
                lost.cancel();
                return;
            }
            _ => tokio::time::sleep(RETRY).await,
        }
    }
}

/// What the attempt showed so far (its text and tool calls) and its side effects.
type Shown = (Partial, Vec<Value>);

/// What the attempt asks of its progress pump.
enum ToPump {
    /// Write every event sent so far, then answer with what the attempt showed. The grace is
    /// how long to wait for an event still on its way through the client (before a question).
    Flush(Duration, tokio::sync::oneshot::Sender<Shown>),
    /// Hand over every event not written yet as the next batch, unsent, for the ending to
    /// carry in its own call (one request and one commit less per task); later events are
    /// held back until [`ToPump::Settle`].
    Take(tokio::sync::oneshot::Sender<(Shown, Option<Value>)>),
    /// The ending's call is over: its batch was written with it (`None`), or it must go on
    /// its own (the ending was refused for a waiting message), ahead of what came since.
    Settle(Option<Value>),
}

/// Sends the agent's events into the task's log, in numbered batches, as they come; what
/// the attempt showed when the events end. A flush (before a question is put to a person)
/// writes what is queued first, so the log shows what the agent did before it asked.
async fn progress(
    link: Link,
    path: String,
    mut rx: mpsc::Receiver<ClientEvent>,
    mut asks: mpsc::UnboundedReceiver<ToPump>,
    lost: CancellationToken,
) -> Shown {
    let mut seen = Seen::default();
    let (mut seq, mut held, mut open, mut asking) = (0, false, true, true);
    // Until the events end, and the ending that took the last batch has settled it.
    while open || held {
        let mut batch = Vec::new();
        let (mut reply, mut take) = (None, None);
        tokio::select! {
            biased;
            ask = asks.recv(), if asking => match ask {
                Some(ToPump::Flush(grace, r)) => {
                    // What the agent sent before it asked is on its way through the client's
                    // forwarding: given a moment (bounded) to arrive, then written first.
                    if open && !held && !grace.is_zero() {
                        match tokio::time::timeout(grace, rx.recv()).await {
                            Ok(Some(event)) => batch.push(event),
                            Ok(None) => open = false,
                            Err(_) => {}
                        }
                    }
                    reply = Some(r);
                }
                Some(ToPump::Take(r)) => take = Some(r),
                Some(ToPump::Settle(unsent)) => {
                    held = false;
                    if let Some(body) = unsent {
                        send(&link, &path, &body, &lost).await;
                    }
                    continue;
                }
                None => asking = false,
            },
            event = rx.recv(), if open && !held => match event {
                Some(event) => batch.push(event),
                None => open = false,
            },
            else => break,
        }
        // What follows within COALESCE goes in the same batch (a turn's updates come in
        // bursts), unless someone waits for the log or takes the batch.
        let until = tokio::time::Instant::now() + COALESCE;
        while open && !held && !batch.is_empty() && batch.len() < BATCH && reply.is_none() && take.is_none() {
            tokio::select! {
                biased;
                ask = asks.recv(), if asking => match ask {
                    Some(ToPump::Flush(_, r)) => reply = Some(r),
                    Some(ToPump::Take(r)) => take = Some(r),
                    Some(ToPump::Settle(_)) => {}
                    None => asking = false,
                },
                more = tokio::time::timeout_at(until, rx.recv()) => match more {
                    Ok(Some(more)) => batch.push(more),
                    Ok(None) => open = false,
                    Err(_) => break,
                },
            }
        }
        if (reply.is_some() || take.is_some()) && !held {
            while let Ok(more) = rx.try_recv() {
                batch.push(more);
            }
        }
        // A long drain goes in several batches (the host takes a bounded number at once):
        // all but the last are sent now, in order.
        while batch.len() > BATCH {
            let rest = batch.split_off(BATCH);
            let body = batch_body(&mut seen, &mut seq, std::mem::replace(&mut batch, rest));
            send(&link, &path, &body, &lost).await;
        }
        let body = (!batch.is_empty()).then(|| batch_body(&mut seen, &mut seq, batch));
        if let Some(t) = take {
            held = true;
            let _ = t.send(((seen.partial.clone(), seen.effects.clone()), body));
            continue;
        }
        if let Some(body) = &body {
            send(&link, &path, body, &lost).await;
        }
        if let Some(r) = reply {
            let _ = r.send((seen.partial.clone(), seen.effects.clone()));
        }
    }
    (seen.partial, seen.effects)
}

/// The next numbered progress batch of `events`, seen into what the attempt showed.
fn batch_body(seen: &mut Seen, seq: &mut i64, events: Vec<ClientEvent>) -> Value {
    let (mut rows, mut evidence) = (Vec::with_capacity(events.len()), Vec::new());
    for event in events {
        seen.take(event, &mut rows, &mut evidence);
    }
    let wire: Vec<Value> = rows
        .into_iter()
        .map(|(kind, mut data)| {
            if let Some(o) = data.as_object_mut() {
                o.insert("type".into(), Value::String(kind));
            }
            data
        })
        .collect();
    *seq += 1;
    json!({"seq": *seq, "events": wire, "evidence": evidence})
}

/// Sends a progress batch until the host has it (it writes it once, by its `seq`), refuses
/// it, or the attempt is lost.
async fn send(link: &Link, path: &str, body: &Value, lost: &CancellationToken) {
    loop {
        match link.post(path, body.clone()).await {
            Ok((200, _)) => return,
            Ok((status, answer)) if (400..500).contains(&status) => {
                tracing::warn!(status, %answer, "the host refused a progress batch");
                return;
            }
            Err(WorkerError::Token) => return,
            _ if lost.is_cancelled() => return,
            _ => tokio::time::sleep(RETRY).await,
        }
    }
}

/// Puts the agent's permission requests and questions to a person through the host.
struct RemoteAsker {
    link: Link,
    /// `…/attempts/{n}/questions`.
    base: String,
    pump: mpsc::UnboundedSender<ToPump>,
    /// Set when the task's `on_deny` is `fail`: a denial stops the attempt.
    denial: Option<crate::attempt::Denial>,
    /// The host gave the attempt its MCP endpoint: its tools are allowed without a person.
    own_tools: bool,
}

impl RemoteAsker {
    /// Parks the task on `request` (after what the agent did before it asked is in the log)
    /// and waits for the person's answer; `None` when the question was voided (the task
    /// cancelled, the attempt lost).
    async fn put(link: Link, base: String, pump: mpsc::UnboundedSender<ToPump>, request: Value) -> Option<String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if pump.send(ToPump::Flush(FLUSH_GRACE, tx)).is_ok() {
            let _ = rx.await;
        }
        let (status, asked) = link.post(&base, json!({"request": request})).await.ok()?;
        if status != 201 {
            return None;
        }
        let q = asked["question"].as_i64()?;
        // Dropped before an answer (the turn is being cancelled): the question is withdrawn.
        let mut open = Withdraw { link: link.clone(), path: Some(format!("{base}/{q}/withdraw")) };
        loop {
            match link.post(&format!("{base}/{q}/wait"), json!({"wait_ms": NOTICE_WAIT_MS})).await {
                Ok((200, v)) => {
                    if let Some(answer) = v["answer"].as_str() {
                        open.path = None;
                        return Some(answer.to_owned());
                    }
                }
                Ok(_) => {
                    open.path = None;
                    return None;
                }
                Err(_) => tokio::time::sleep(RETRY).await,
            }
        }
    }
}

impl pier_client::handler::Asker for RemoteAsker {
    fn ask(
        &self,
        request: &agent_client_protocol_schema::v1::RequestPermissionRequest,
    ) -> futures::future::BoxFuture<'static, pier_client::handler::AskAnswer> {
        use pier_client::handler::AskAnswer;
        if let Some(answer) = crate::host_mcp::own_tool_answer(request).filter(|_| self.own_tools) {
            return Box::pin(async move { answer });
        }
        let (link, base, pump) = (self.link.clone(), self.base.clone(), self.pump.clone());
        let (denial, asked) = (self.denial.clone(), request.clone());
        let request = serde_json::to_value(request).unwrap_or(Value::Null);
        Box::pin(async move {
            match RemoteAsker::put(link, base, pump, request).await {
                Some(option) => {
                    if let Some(denial) = &denial {
                        crate::attempt::note_denial(denial, &asked, &option);
                    }
                    AskAnswer::Option(option)
                }
                None => AskAnswer::Withdrawn,
            }
        })
    }

    fn answers_questions(&self) -> bool {
        true
    }

    fn elicit(
        &self,
        request: &agent_client_protocol_schema::v1::CreateElicitationRequest,
    ) -> futures::future::BoxFuture<'static, pier_client::elicit::ElicitAnswer> {
        use pier_client::elicit::ElicitAnswer;
        let (link, base, pump) = (self.link.clone(), self.base.clone(), self.pump.clone());
        let request = json!({ "elicitation": serde_json::to_value(request).unwrap_or(Value::Null) });
        Box::pin(async move {
            let Some(answer) = RemoteAsker::put(link, base, pump, request).await else { return ElicitAnswer::Cancel };
            let answer: Value = serde_json::from_str(&answer).unwrap_or(Value::Null);
            match answer["action"].as_str() {
                Some("accept") => {
                    ElicitAnswer::Accept(serde_json::from_value(answer["content"].clone()).unwrap_or_default())
                }
                Some("decline") => ElicitAnswer::Decline,
                _ => ElicitAnswer::Cancel,
            }
        })
    }
}

/// A question still waited on; withdrawn on the host if dropped so.
struct Withdraw {
    link: Link,
    path: Option<String>,
}

impl Drop for Withdraw {
    fn drop(&mut self) {
        let Some(path) = self.path.take() else { return };
        let link = self.link.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = link.post(&path, json!({})).await;
            });
        }
    }
}
