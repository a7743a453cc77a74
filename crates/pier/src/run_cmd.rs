//! `pier run` and `pier events`: the task host in-process, on the embedded store.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pier_host::{Event, TaskStore};
use pier_host::{Host, HostConfig, Scope};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::{self, ProcessEnv};
use crate::waiting::waiting_for;

/// How often, at most, `pier run` reads the log to print what was committed.
const PRINT_EVERY: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EventFormat {
    Text,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The plan file (TOML)
    #[arg(required_unless_present = "resume")]
    plan: Option<PathBuf>,
    /// Continue a run after a crash or Ctrl-C
    #[arg(long, value_name = "RUN", conflicts_with = "plan")]
    resume: Option<String>,
    /// The run's id; an id that exists in the store resumes that run
    #[arg(long)]
    run_id: Option<String>,
    /// Tasks run at once
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Output: text progress lines, or NDJSON events and a summary line
    #[arg(long, value_enum, default_value = "text")]
    format: EventFormat,
    /// The store: `postgres://USER@HOST/DB` (password from PGPASSWORD or the passfile),
    /// `sqlite://PATH` or a path [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long)]
    store: Option<String>,
    /// Base delay of retry backoff, in milliseconds
    #[arg(long, default_value_t = 1000, hide = true)]
    retry_base_ms: u64,
    /// Lease time-to-live in milliseconds; renewed every third of it
    #[arg(long, default_value_t = 15_000, hide = true)]
    lease_ttl_ms: u64,
    /// How long an agent may take to confirm a cancel before it is killed, in milliseconds
    #[arg(long, default_value_t = 5_000)]
    cancel_grace_ms: u64,
}

#[derive(Debug, clap::Args)]
pub struct EventsArgs {
    /// Only this run's events
    #[arg(long)]
    run: Option<String>,
    /// Start after this sequence number
    #[arg(long, default_value_t = 0)]
    after: i64,
    /// Keep printing new events as they are committed
    #[arg(long)]
    follow: bool,
    #[arg(long, value_enum, default_value = "text")]
    format: EventFormat,
    /// The store [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long)]
    store: Option<String>,
    /// Read from a running `pier serve` instead of the local store [env: PIER_SERVER]
    #[arg(long)]
    server: Option<String>,
}

/// Opens the store `--store`, `PIER_STORE` or the config files name (the SQLite file in
/// `$PIER_HOME` by default); a PostgreSQL URL is named without its password.
pub fn open_store(flag: &Option<String>) -> anyhow::Result<Arc<dyn TaskStore>> {
    let files = config::load_files(&ProcessEnv, &std::env::current_dir()?)?;
    let spec = config::store_spec(&ProcessEnv, flag.as_deref(), &files)?;
    pier_host::store::open(&spec)
        .with_context(|| format!("cannot open the store {}", pier_host::store::redacted(&spec)))
}

/// One event as a JSON line: at least `seq`, `run`, `task`, `type`, and the event's fields.
pub fn event_json(e: &Event) -> serde_json::Value {
    let mut v = json!({"seq": e.seq, "run": e.run, "type": e.kind, "at_ms": e.at_ms});
    if let Some(t) = &e.task {
        v["task"] = json!(t);
    }
    if let (Some(obj), Some(data)) = (v.as_object_mut(), e.data.as_object()) {
        for (k, val) in data {
            obj.entry(k.clone()).or_insert(val.clone());
        }
    }
    v
}

fn event_text(e: &Event) -> Option<String> {
    let task = e.task.as_deref().unwrap_or("-");
    match e.kind.as_str() {
        "transition" => {
            let mut line = format!(
                "[{}] {task}: {} -> {} ({})",
                e.seq,
                e.data["from"].as_str().unwrap_or("?"),
                e.data["to"].as_str().unwrap_or("?"),
                e.data["reason"].as_str().unwrap_or("")
            );
            if let Some(err) = e.data["error"].as_str() {
                line.push_str(&format!(" error: {}", err.lines().next().unwrap_or("")));
            }
            // Parked on evidence (not on a question, which has an event of its own).
            if e.data["to"] == "awaiting_input" && e.data.get("evidence").is_some() {
                line.push_str(&format!("; {}", waiting_for(&e.run, task, None)));
            }
            Some(line)
        }
        "run_created" => Some(format!("[{}] run {} created with {} tasks", e.seq, e.run, e.data["tasks"])),
        "question" => Some(format!("[{}] {task}: {}", e.seq, waiting_for(&e.run, task, Some(&e.data["request"])))),
        "message" => Some(format!(
            "[{}] {task}: message {} from {}{}",
            e.seq,
            e.data["n"],
            e.data["by"].as_str().unwrap_or("?"),
            if e.data["interrupt"] == true { ", interrupting" } else { ", for its next prompt" }
        )),
        "permission" => Some(format!(
            "[{}] {task}: permission {} ({})",
            e.seq,
            e.data["outcome"]["optionId"].as_str().or(e.data["outcome"]["outcome"].as_str()).unwrap_or("?"),
            e.data["reason"].as_str().unwrap_or("")
        )),
        _ => None,
    }
}

/// The live view of `pier run` on a terminal: event lines scroll above a block that
/// shows the counts by state and each running task with its current tool.
struct LiveView {
    started: std::time::Instant,
    states: BTreeMap<String, String>,
    running: BTreeMap<String, (std::time::Instant, String)>,
    /// Tasks waiting on a person, with what they wait for.
    waiting: BTreeMap<String, String>,
    height: usize,
}

impl LiveView {
    fn new() -> LiveView {
        LiveView {
            started: std::time::Instant::now(),
            states: BTreeMap::new(),
            running: BTreeMap::new(),
            waiting: BTreeMap::new(),
            height: 0,
        }
    }

    fn see(&mut self, e: &Event, out: &mut String) {
        let task = e.task.clone().unwrap_or_default();
        match e.kind.as_str() {
            "task_created" => {
                self.states.insert(task, "pending".into());
            }
            "transition" => {
                let to = e.data["to"].as_str().unwrap_or("?").to_owned();
                if to == "running" {
                    self.running.insert(task.clone(), (std::time::Instant::now(), String::new()));
                } else {
                    self.running.remove(&task);
                }
                if to != "awaiting_input" {
                    self.waiting.remove(&task);
                } else if e.data.get("evidence").is_some() {
                    self.waiting.insert(task.clone(), waiting_for(&e.run, &task, None));
                }
                self.states.insert(task, to);
                if let Some(line) = event_text(e) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
            "question" => {
                self.waiting.insert(task.clone(), waiting_for(&e.run, &task, Some(&e.data["request"])));
                if let Some(line) = event_text(e) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
            "session_update" => {
                let u = &e.data["update"];
                if let (Some(title), Some(entry)) = (u["title"].as_str(), self.running.get_mut(&task)) {
                    entry.1 = title.to_owned();
                }
            }
            _ => {
                if let Some(line) = event_text(e) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
        }
    }

    /// Clears the old block, writes `lines`, draws the block again.
    fn draw(&mut self, lines: &str) {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for s in self.states.values() {
            *counts.entry(s.as_str()).or_default() += 1;
        }
        let summary: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let mut block = vec![format!("── {:.0}s · {}", self.started.elapsed().as_secs_f64(), summary.join(" · "))];
        for (task, (since, tool)) in self.running.iter().take(12) {
            block.push(format!("  ▸ {task} ({:.1}s) {tool}", since.elapsed().as_secs_f64()));
        }
        for (task, what) in self.waiting.iter().take(6) {
            block.push(format!("  ? {task} {what}"));
        }
        let mut out = String::new();
        if self.height > 0 {
            out.push_str(&format!("\x1b[{}A\x1b[J", self.height));
        }
        out.push_str(lines);
        for l in &block {
            let short: String = l.chars().take(120).collect();
            out.push_str(&short);
            out.push('\n');
        }
        self.height = block.len();
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(out.as_bytes());
        let _ = stdout.flush();
    }
}

fn print_event(e: &Event, format: EventFormat) {
    let mut out = std::io::stdout().lock();
    match format {
        EventFormat::Json => {
            let _ = writeln!(out, "{}", event_json(e));
        }
        EventFormat::Text => {
            if let Some(line) = event_text(e) {
                let _ = writeln!(out, "{line}");
            }
        }
    }
}

/// `pier run`: returns the exit code (0 only if every task completed).
#[allow(clippy::print_stdout)]
pub async fn run(args: RunArgs) -> anyhow::Result<i32> {
    let env = ProcessEnv;
    let here = std::env::current_dir()?;
    let files = config::load_files(&env, &here)?;
    let pier_exe = std::env::current_exe()?;
    if let Some(Err(why)) = args.run_id.as_deref().map(pier_host::plan::check_run_id) {
        anyhow::bail!("--run-id: {why}");
    }
    // A plan is checked before the store is touched: a refused plan leaves nothing behind.
    let checked = match (&args.resume, &args.plan) {
        (None, Some(plan_path)) => {
            let text =
                std::fs::read_to_string(plan_path).with_context(|| format!("cannot read {}", plan_path.display()))?;
            let path = std::env::var("PATH").ok();
            let agents = files.agents.clone();
            let exe = pier_exe.clone();
            let known = move |a: &str| agent_known(a, &agents, &exe, path.as_deref());
            Some(pier_host::plan::parse(&text, &known)?)
        }
        _ => None,
    };
    let store = open_store(&args.store)?;
    // Print what this invocation commits: a new run from its creation, a resumed one from now.
    let start_seq = store.last_seq()?;
    let (run_id, base_dir, new_plan) = match (&args.resume, &args.plan) {
        (Some(run), _) => {
            anyhow::ensure!(store.run_exists(run)?, "there is no run `{run}` in the store");
            (run.clone(), here.clone(), None)
        }
        (None, Some(plan_path)) => {
            let plan = checked.ok_or_else(|| anyhow::anyhow!("the plan was not checked"))?;
            let base = plan_path.canonicalize()?.parent().map(PathBuf::from).unwrap_or(here.clone());
            let run_id = args.run_id.clone().unwrap_or_else(|| format!("run-{}", &uuid_short()));
            // A run id names one plan: the same plan joins the run (a second host driving it);
            // another plan under it is refused, never silently ignored.
            let new = if store.run_exists(&run_id)? {
                let stored: Vec<pier_host::TaskSpec> = store.tasks(&run_id)?.into_iter().map(|t| t.spec).collect();
                anyhow::ensure!(
                    stored == plan.tasks,
                    "run `{run_id}` already exists with another plan; resume it with `pier run --resume {run_id}`, or \
                     give this plan another --run-id"
                );
                None
            } else {
                Some((plan, plan_path.display().to_string()))
            };
            (run_id, base, new)
        }
        (None, None) => anyhow::bail!("give a plan file or --resume RUN"),
    };
    let config = HostConfig {
        pier_exe,
        agents: files.agents.clone(),
        base_dir,
        concurrency: args.concurrency.max(1),
        owner: HostConfig::owner_id(),
        node: HostConfig::node_id(),
        lease_ttl: Duration::from_millis(args.lease_ttl_ms.max(300)),
        retry_base: Duration::from_millis(args.retry_base_ms),
        cancel_grace: Duration::from_millis(args.cancel_grace_ms),
        default_idle_timeout: Duration::from_secs(600),
    };
    if let Some((plan, source)) = new_plan {
        // What the tasks require of their agents, checked before anything is stored.
        pier_host::caps::check(&plan, &store, &config).await?;
        pier_host::host::create_own_run(store.as_ref(), &config, &run_id, &plan, &source)?;
    }
    let stop = CancellationToken::new();
    let signals = {
        let stop = stop.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            eprintln!("pier: stopping; running tasks are being cancelled (resume with `pier run --resume`)");
            stop.cancel();
        })
    };
    // Print this run's events as they are committed, from where the store is now... or from the start of the run.
    let printer = {
        let store = store.clone();
        let run = run_id.clone();
        let format = args.format;
        let done = CancellationToken::new();
        let done2 = done.clone();
        let handle = tokio::spawn(async move {
            let mut rx = store.subscribe();
            let mut live = (format == EventFormat::Text && std::io::IsTerminal::is_terminal(&std::io::stdout()))
                .then(LiveView::new);
            if let Some(view) = live.as_mut() {
                // A resumed run shows its tasks' current states from the start.
                if let Ok(tasks) = store.tasks(&run) {
                    for t in tasks {
                        view.states.insert(t.id, t.state.as_str().to_owned());
                    }
                }
            }
            // Read only what can have come (`LogCursor`): every commit rings the watch.
            let mut cursor = pier_host::LogCursor::new(start_seq);
            let mut last_read = tokio::time::Instant::now();
            loop {
                let seen = *rx.borrow_and_update();
                if cursor.due(seen) {
                    last_read = tokio::time::Instant::now();
                    let batch = {
                        let (s, r, after) = (store.clone(), run.clone(), cursor.after());
                        tokio::task::spawn_blocking(move || s.events_after(Some(&r), after, 1000)).await
                    };
                    let Ok(Ok(events)) = batch else { return };
                    match live.as_mut() {
                        Some(view) => {
                            let mut lines = String::new();
                            for e in &events {
                                view.see(e, &mut lines);
                            }
                            if !events.is_empty() {
                                view.draw(&lines);
                            }
                        }
                        None => {
                            for e in &events {
                                print_event(e, format);
                            }
                        }
                    }
                    cursor.read(&events, 1000, seen);
                    if cursor.due(seen) {
                        continue;
                    }
                }
                if done2.is_cancelled() {
                    return;
                }
                tokio::select! {
                    changed = rx.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        // Commits come every millisecond or two on a busy run: what they wrote is
                        // read and printed together, at most every PRINT_EVERY (the end at once).
                        tokio::select! {
                            _ = tokio::time::sleep_until(last_read + PRINT_EVERY) => {}
                            _ = done2.cancelled() => {}
                        }
                    }
                    _ = done2.cancelled() => {}
                    // Keep the elapsed times moving on a terminal.
                    _ = tokio::time::sleep(Duration::from_secs(1)), if live.is_some() => {
                        if let Some(view) = live.as_mut() {
                            view.draw("");
                        }
                    }
                }
            }
        });
        (handle, done)
    };
    if args.format == EventFormat::Text {
        eprintln!("pier: run {run_id}");
    }
    let summary = Host::new(store.clone(), config).drive(Scope::Run(run_id.clone()), stop.clone()).await?;
    printer.1.cancel();
    let _ = printer.0.await;
    signals.abort();
    let total: usize = summary.values().sum();
    let completed = summary.get("completed").copied().unwrap_or(0);
    match args.format {
        EventFormat::Json => {
            let counts: BTreeMap<&str, usize> = summary.clone();
            let waiting: Vec<_> = waiting_tasks(store.as_ref(), &run_id)?
                .into_iter()
                .map(|(task, asks)| json!({"task": task, "asks": asks}))
                .collect();
            println!("{}", json!({"type": "summary", "run": run_id, "counts": counts, "waiting": waiting}));
        }
        EventFormat::Text => {
            let tasks = store.tasks(&run_id)?;
            println!("\n{:<24} {:<15} {:>8}  result", "task", "state", "attempts");
            for t in &tasks {
                let result = t.result.as_deref().or(t.error.as_deref()).unwrap_or("").replace('\n', " ");
                let short: String = result.chars().take(60).collect();
                println!("{:<24} {:<15} {:>8}  {short}", t.id, t.state.as_str(), t.attempt);
            }
            for (task, asks) in waiting_tasks(store.as_ref(), &run_id)? {
                println!("? {task} {asks}");
            }
            let counts: Vec<String> = summary.iter().map(|(k, v)| format!("{v} {k}")).collect();
            println!("run {run_id}: {}", counts.join(", "));
            if stop.is_cancelled() {
                println!("resume with: pier run --resume {run_id}");
            }
        }
    }
    // Interrupted (Ctrl-C, SIGTERM) exits 130, as `pier exec` does; unfinished or failed work 1.
    Ok(if stop.is_cancelled() {
        130
    } else if completed == total {
        0
    } else {
        1
    })
}

/// The run's tasks waiting on a person, each with what it waits for.
fn waiting_tasks(store: &dyn TaskStore, run: &str) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for t in store.tasks(run)?.into_iter().filter(|t| t.state == pier_host::TaskState::AwaitingInput) {
        let question = store.open_question(run, &t.id)?;
        out.push((t.id.clone(), waiting_for(run, &t.id, question.as_ref().map(|q| &q.request))));
    }
    Ok(out)
}

/// Whether a plan's agent can run: a pull-worker task, or an agent the registry resolves.
pub fn agent_known(
    agent: &str,
    agents: &BTreeMap<String, pier_client::AgentDef>,
    exe: &std::path::Path,
    path: Option<&str>,
) -> Result<(), String> {
    if agent == "worker" || agent.starts_with("worker:") {
        return Ok(());
    }
    pier_client::registry::resolve(agent, agents, exe, path).map(|_| ()).map_err(|e| e.to_string())
}

fn uuid_short() -> String {
    let id = format!("{:x}", fastrand::u64(..));
    id.chars().take(12).collect()
}

/// `pier events`.
pub async fn events(args: EventsArgs) -> anyhow::Result<()> {
    if args.server.is_some() || std::env::var("PIER_SERVER").is_ok_and(|s| !s.is_empty()) {
        return crate::serve_cmd::events(args.server.clone(), args.run.clone(), args.after, args.follow, |e| {
            print_event(e, args.format)
        })
        .await;
    }
    let store = open_store(&args.store)?;
    if let Some(run) = &args.run {
        anyhow::ensure!(store.run_exists(run)?, "there is no run `{run}` in the store; `pier runs` lists them");
    }
    let mut rx = store.subscribe();
    let mut cursor = pier_host::LogCursor::new(args.after);
    loop {
        let seen = *rx.borrow_and_update();
        if cursor.due(seen) {
            let events = store.events_after(args.run.as_deref(), cursor.after(), 1000)?;
            for e in &events {
                print_event(e, args.format);
            }
            cursor.read(&events, 1000, seen);
            if cursor.due(seen) {
                continue;
            }
        }
        if !args.follow {
            return Ok(());
        }
        // The store's watch carries the commits of the process that runs the tasks.
        if rx.changed().await.is_err() {
            return Ok(());
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct AnswerArgs {
    #[command(flatten)]
    target: TaskTarget,
    /// The option to choose, by id or kind: approve allow_once (default) or allow_always, deny
    /// reject_once (default) or reject_always
    option: Option<String>,
}

/// A task named on the command line: in a run (the newest with that task by default) of a store.
#[derive(Debug, clap::Args)]
pub struct TaskTarget {
    /// The task
    task: String,
    /// The run [default: the newest run with that task]
    #[arg(long)]
    run: Option<String>,
    /// The store [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long)]
    store: Option<String>,
}

impl TaskTarget {
    /// The store and the run the task is in.
    fn open(&self) -> anyhow::Result<(std::sync::Arc<dyn TaskStore>, String)> {
        let store = open_store(&self.store)?;
        let run = match &self.run {
            Some(r) => r.clone(),
            None => store
                .runs_with_task(&self.task)?
                .into_iter()
                .next()
                .ok_or_else(|| anyhow::anyhow!("no run has a task `{}`", self.task))?,
        };
        Ok((store, run))
    }
}

/// Who a person at this command line is, for the record.
pub fn person() -> String {
    format!("cli:{}", std::env::var("USER").unwrap_or_else(|_| "unknown".into()))
}

#[derive(Debug, clap::Args)]
pub struct InputArgs {
    #[command(flatten)]
    target: TaskTarget,
    /// The answers, FIELD=VALUE each (a list field takes comma-separated values)
    #[arg(value_name = "FIELD=VALUE")]
    fields: Vec<String>,
    /// Decline to answer
    #[arg(long, conflicts_with = "fields")]
    decline: bool,
}

/// `pier answer`: answer the question a task's agent asked (it waits in awaiting_input).
#[allow(clippy::print_stdout)]
pub fn answer_input(args: InputArgs) -> anyhow::Result<()> {
    let (store, run) = args.target.open()?;
    let task = &args.target.task;
    let input = if args.decline {
        pier_host::person::Input::Decline
    } else {
        let pairs = args
            .fields
            .iter()
            .map(|f| {
                f.split_once('=')
                    .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
                    .ok_or_else(|| anyhow::anyhow!("`{f}` is not FIELD=VALUE"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        pier_host::person::Input::Pairs(pairs)
    };
    let answer = pier_host::person::answer_input(store.as_ref(), &run, task, input, &person())?;
    println!("answered task `{task}` of run `{run}`: {answer}");
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct SayArgs {
    #[command(flatten)]
    target: TaskTarget,
    /// What to tell it: sent as the next prompt on its session
    text: String,
    /// Cancel its current turn (through the cancel handshake) and send this at once
    #[arg(long)]
    interrupt: bool,
}

/// `pier say`: a message to a running task, whichever host runs it on this store.
#[allow(clippy::print_stdout)]
pub fn say(args: SayArgs) -> anyhow::Result<()> {
    let (store, run) = args.target.open()?;
    let task = &args.target.task;
    let n = pier_host::person::say(store.as_ref(), &run, task, &args.text, args.interrupt, &person())?;
    let when = if args.interrupt { "now, after its current turn is cancelled" } else { "when its current turn ends" };
    println!("message {n} for task `{task}` of run `{run}`: it goes to the agent {when}");
    Ok(())
}

/// `pier approve` (`allow` true) and `pier deny`: answer a task in `awaiting_input`.
#[allow(clippy::print_stdout)]
pub fn answer(args: AnswerArgs, allow: bool) -> anyhow::Result<()> {
    let (store, run) = args.target.open()?;
    let task = &args.target.task;
    let task = store
        .tasks(&run)?
        .into_iter()
        .find(|t| &t.id == task)
        .ok_or_else(|| anyhow::anyhow!("run `{run}` has no task `{task}`"))?;
    anyhow::ensure!(
        task.state == pier_host::TaskState::AwaitingInput,
        "task `{}` of run `{run}` is {}, not awaiting_input",
        task.id,
        task.state.as_str()
    );
    let answered = pier_host::person::answer(store.as_ref(), &run, &task.id, allow, args.option.as_deref(), &person())?;
    match answered {
        pier_host::person::Answered::Option(chosen) => {
            println!("answered `{chosen}` for task `{}` of run `{run}`", task.id);
        }
        pier_host::person::Answered::Rerun(row) => println!(
            "task `{}` of run `{run}` is now {}; resume the run with `pier run --resume {run}`",
            task.id,
            row.state.as_str()
        ),
    }
    Ok(())
}
