//! `pier run`: the task host in-process, on the embedded store (or any store `--store` names):
//! the plan submitted as a run of this process, driven to its end, its events printed.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use pier_host::{Follow, Follower, HostConfig, Scope, Submission, Tasks};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::{self, ProcessEnv};
use crate::events_cmd::{LiveView, print_event};
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
    /// 0..=9, every task of the plan's: it wins over what the plan says
    #[arg(long, conflicts_with = "resume")]
    priority: Option<u8>,
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

/// The host's API over the store `--store`, `PIER_STORE` or the config files name (the
/// SQLite file in `$PIER_HOME` by default), for commands that read or act on tasks; a
/// PostgreSQL URL is named without its password.
pub fn open_tasks(flag: &Option<String>) -> anyhow::Result<Tasks> {
    let here = std::env::current_dir()?;
    let files = config::load_files(&ProcessEnv, &here)?;
    let config = HostConfig::new(std::env::current_exe()?, files.agents.clone(), here);
    open_tasks_with(flag, &files, config)
}

/// [`open_tasks`] for a host configured as `config`, with the config files already read.
pub fn open_tasks_with(
    flag: &Option<String>,
    files: &config::FileConfig,
    mut config: HostConfig,
) -> anyhow::Result<Tasks> {
    let spec = config::store_spec(&ProcessEnv, flag.as_deref(), files)?;
    confine(files, &mut config)?;
    if let Some(path) = spec.strip_prefix("sqlite://").or((!spec.contains("://")).then_some(spec.as_str())) {
        for suffix in ["", "-wal", "-shm"] {
            config.sandbox.hide.push(PathBuf::from(format!("{path}{suffix}")));
        }
    }
    tracing::info!("{}", config.sandbox.describe());
    Tasks::open(&spec, config).with_context(|| format!("cannot open the store {}", pier_host::store::redacted(&spec)))
}

/// The confinement of a host's attempts from pier.toml: the level, the hosts, the limits, and
/// pier's own home hidden from them (a store's files are the caller's to add).
pub fn confine(files: &config::FileConfig, config: &mut HostConfig) -> anyhow::Result<()> {
    config.sandbox.level = config::host_level(files)?;
    config.sandbox.network = files.network.clone();
    pier_jail::check_network(&config.sandbox.network).map_err(|why| anyhow::anyhow!("network in pier.toml: {why}"))?;
    config.sandbox.limits = files.limits;
    config.sandbox.limits.check().map_err(|why| anyhow::anyhow!("[limits] in pier.toml: {why}"))?;
    // pier's own state: its home (the token, the default store).
    config.sandbox.hide.push(config::pier_home(&ProcessEnv)?);
    Ok(())
}

/// A plan to submit, and where it came from.
type NewPlan = (pier_host::Plan, String);

/// A plan checked before the store is touched (a refused plan leaves nothing behind), and
/// the host's configuration for it.
fn prepare(args: &RunArgs) -> anyhow::Result<(HostConfig, config::FileConfig, Option<NewPlan>)> {
    let here = std::env::current_dir()?;
    let files = config::load_files(&ProcessEnv, &here)?;
    let pier_exe = std::env::current_exe()?;
    if let Some(Err(why)) = args.run_id.as_deref().map(pier_host::plan::check_run_id) {
        anyhow::bail!("--run-id: {why}");
    }
    // pier.toml's types, every JSON Schema compiled once.
    let shared = config::types(&files)?;
    let (base_dir, plan) = match (&args.resume, &args.plan) {
        (Some(_), _) => (here, None),
        (None, Some(plan_path)) => {
            let text =
                std::fs::read_to_string(plan_path).with_context(|| format!("cannot read {}", plan_path.display()))?;
            let types = pier_host::tasks::plan_types(&shared, config::types_beside(plan_path)?.as_deref())?;
            let mut plan = pier_host::tasks::parse_plan(&text, &files.agents, &pier_exe, &types)?;
            if let Some(p) = args.priority {
                plan = plan.at_priority(p)?;
            }
            let base = plan_path.canonicalize()?.parent().map(PathBuf::from).unwrap_or(here);
            (base, Some((plan, plan_path.display().to_string())))
        }
        (None, None) => anyhow::bail!("give a plan file or --resume RUN"),
    };
    let config = HostConfig {
        concurrency: args.concurrency.max(1),
        lease_ttl: Duration::from_millis(args.lease_ttl_ms.max(300)),
        retry_base: Duration::from_millis(args.retry_base_ms),
        cancel_grace: Duration::from_millis(args.cancel_grace_ms),
        gateway: config::gateway(&files, &ProcessEnv)?,
        types: shared,
        ..HostConfig::new(pier_exe, files.agents.clone(), base_dir)
    };
    Ok((config, files, plan))
}

/// Stops the run on SIGTERM or SIGINT (running tasks are cancelled, the run can be resumed).
fn stop_on_signals() -> (CancellationToken, tokio::task::JoinHandle<()>) {
    stop_on_signals_saying("pier: stopping; running tasks are being cancelled (resume with `pier run --resume`)")
}

/// A token cancelled on SIGTERM or SIGINT, after `said` goes to stderr.
pub fn stop_on_signals_saying(said: &'static str) -> (CancellationToken, tokio::task::JoinHandle<()>) {
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
            eprintln!("{said}");
            stop.cancel();
        })
    };
    (stop, signals)
}

/// Prints a run's events as they are committed, until `done` fires and it has caught up:
/// a line per event, or the live view on a terminal.
async fn print_run(mut follower: Follower, mut live: Option<LiveView>, format: EventFormat, done: CancellationToken) {
    let mut finishing = false;
    loop {
        tokio::select! {
            batch = follower.next_batch() => {
                let Some(Ok(events)) = batch else { return };
                match live.as_mut() {
                    Some(view) => {
                        let mut lines = String::new();
                        for e in &events {
                            view.see(e, &mut lines);
                        }
                        view.draw(&lines);
                    }
                    None => events.iter().for_each(|e| print_event(e, format)),
                }
                // Commits come every millisecond or two on a busy run: what they wrote is
                // printed together, at most every PRINT_EVERY (the end at once).
                if !finishing {
                    tokio::select! {
                        _ = tokio::time::sleep(PRINT_EVERY) => {}
                        _ = done.cancelled() => {}
                    }
                }
            }
            _ = done.cancelled(), if !finishing => {
                finishing = true;
                follower.finish();
            }
            // Keep the elapsed times moving on a terminal.
            _ = tokio::time::sleep(Duration::from_secs(1)), if live.is_some() => {
                if let Some(view) = live.as_mut() {
                    view.draw("");
                }
            }
        }
    }
}

/// `pier run`: returns the exit code (0 only if every task completed).
#[allow(clippy::print_stdout)]
pub async fn run(args: RunArgs) -> anyhow::Result<i32> {
    let (config, files, plan) = prepare(&args)?;
    let tasks = open_tasks_with(&args.store, &files, config)?;
    // Print what this invocation commits: a new run from its creation, a resumed one from now.
    let start_seq = tasks.position().await?;
    let run_id = match (&args.resume, plan) {
        (Some(run), _) => {
            anyhow::ensure!(tasks.run_exists(run).await?, "there is no run `{run}` in the store");
            run.clone()
        }
        (None, Some((plan, source))) => {
            let submission = Submission { plan, run: args.run_id.clone(), source, own: true };
            tasks.submit(submission).await?.run
        }
        (None, None) => anyhow::bail!("give a plan file or --resume RUN"),
    };
    let (stop, signals) = stop_on_signals();
    let live = if args.format == EventFormat::Text && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        // A resumed run shows its tasks' current states from the start.
        let view = tasks.run(&run_id).await.map(|v| v.tasks).unwrap_or_default();
        Some(LiveView::new(view.into_iter().map(|(t, _)| (t.id, t.state))))
    } else {
        None
    };
    let follower =
        tasks.follow(Follow { run: Some(run_id.clone()), after: start_seq, live: true, ..Default::default() });
    let done = CancellationToken::new();
    let printer = tokio::spawn(print_run(follower, live, args.format, done.clone()));
    if args.format == EventFormat::Text {
        eprintln!("pier: run {run_id}");
    }
    let summary = tasks.drive(Scope::Run(run_id.clone()), stop.clone()).await?;
    done.cancel();
    let _ = printer.await;
    signals.abort();
    report(&tasks, &run_id, &summary, args.format, stop.is_cancelled()).await?;
    let completed = summary.get("completed").copied().unwrap_or(0);
    // Interrupted (Ctrl-C, SIGTERM) exits 130, as `pier exec` does; unfinished or failed work 1.
    Ok(if stop.is_cancelled() {
        130
    } else if completed == summary.values().sum::<usize>() {
        0
    } else {
        1
    })
}

/// The run's end: its tasks with their results, what waits on a person, the counts.
#[allow(clippy::print_stdout)]
async fn report(
    tasks: &Tasks,
    run_id: &str,
    summary: &pier_host::Summary,
    format: EventFormat,
    stopped: bool,
) -> anyhow::Result<()> {
    let view = tasks.run(run_id).await?;
    let waiting: Vec<(String, String)> = view
        .waiting()
        .map(|(t, q)| (t.id.clone(), waiting_for(run_id, &t.id, q.as_ref().map(|q| &q.request))))
        .collect();
    match format {
        EventFormat::Json => {
            let waiting: Vec<_> = waiting.into_iter().map(|(task, asks)| json!({"task": task, "asks": asks})).collect();
            println!("{}", json!({"type": "summary", "run": run_id, "counts": summary, "waiting": waiting}));
        }
        EventFormat::Text => {
            println!("\n{:<24} {:<15} {:>8}  result", "task", "state", "attempts");
            for (t, _) in &view.tasks {
                let result = t.result.as_deref().or(t.error.as_deref()).unwrap_or("").replace('\n', " ");
                let short: String = result.chars().take(60).collect();
                println!("{:<24} {:<15} {:>8}  {short}", t.id, t.state.as_str(), t.attempt);
            }
            for (task, asks) in waiting {
                println!("? {task} {asks}");
            }
            let counts: Vec<String> = summary.iter().map(|(k, v)| format!("{v} {k}")).collect();
            println!("run {run_id}: {}", counts.join(", "));
            if stopped {
                println!("resume with: pier run --resume {run_id}");
            }
        }
    }
    Ok(())
}
