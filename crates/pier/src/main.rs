//! `pier`: one binary, thin subcommands over the library crates.

mod agent_cmd;
mod agent_jail;
mod budget_cmd;
mod client_cmd;
mod config;
mod config_cmd;
mod demo;
mod events_cmd;
mod logging;
mod logs_cmd;
mod models_cmd;
mod person_cmd;
mod render;
mod retry_cmd;
mod run_cmd;
mod schedules_cmd;
mod serve_cmd;
mod show_cmd;
mod store_cmd;
mod waiting;
mod worker_cmd;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "pier", version, about = "An ACP v1 agent, client and task host")]
struct Cli {
    /// Write logs to this file instead of stderr (level from RUST_LOG, default `warn`)
    #[arg(long, global = true)]
    log_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve ACP v1 on stdin/stdout as an agent
    Agent(agent_cmd::AgentArgs),
    /// Send one prompt to a fresh session of any ACP agent
    Exec(client_cmd::ClientArgs),
    /// Send a prompt to a named session that survives restarts
    Prompt(client_cmd::PromptArgs),
    /// List, show or forget named sessions
    #[command(subcommand)]
    Sessions(client_cmd::SessionsCmd),
    /// Run a plan of tasks on a pool of ACP agents, durably
    Run(run_cmd::RunArgs),
    /// Print the event log
    Events(events_cmd::EventsArgs),
    /// A task's agent as a terminal shows it: what it said, its tool calls, its stderr
    Logs(logs_cmd::LogsArgs),
    /// Answer a task waiting for input: allow its permission request, or run it again
    Approve(person_cmd::AnswerArgs),
    /// Answer a task waiting for input: reject its permission request, or cancel it
    Deny(person_cmd::AnswerArgs),
    /// List the runs of the store, newest first, with their tasks' states
    Runs(show_cmd::RunsArgs),
    /// Show a run, or one task: its result, attempts, what it waits on, what its agent can do
    Show(show_cmd::ShowArgs),
    /// Raise a task's budget, or its run's: the tasks a budget stopped run again
    Budget(budget_cmd::BudgetArgs),
    /// Run a failed or cancelled task again, as a new attempt (and the tasks cancelled below it)
    Retry(retry_cmd::RetryArgs),
    /// Answer the question a task's agent asked: FIELD=VALUE … or --decline
    Answer(person_cmd::InputArgs),
    /// Tell a running task something: queued for its next prompt, or at once with --interrupt
    Say(person_cmd::SayArgs),
    /// Serve the task host over HTTP (bearer token, SSE events, pull workers)
    Serve(serve_cmd::ServeArgs),
    /// Take tasks from a running `pier serve` and run their agents on this machine
    Worker(worker_cmd::WorkerArgs),
    /// Submit a plan to a running `pier serve`
    Submit(serve_cmd::SubmitArgs),
    /// Show the runs of a running `pier serve`, or one run's tasks (`pier runs`/`pier show --server`)
    Status(serve_cmd::StatusArgs),
    /// Cancel a run or a task on a running `pier serve`
    Cancel(serve_cmd::CancelArgs),
    /// The schedules of a running `pier serve`: list (next and last occurrences), add, pause, resume, delete
    Schedules(schedules_cmd::SchedulesArgs),
    /// Install or list embedded models
    #[command(subcommand)]
    Models(models_cmd::ModelsCmd),
    /// The store as a file: `pier store backup PATH`
    #[command(subcommand)]
    Store(store_cmd::StoreCmd),
    /// Run `pier agent` against a scripted local model and show the ACP exchange
    Demo,
    /// Print the effective configuration and where each value came from (flag, env, file, default)
    Config(config_cmd::ConfigArgs),
    /// Print a shell completion script: `pier completions bash > /etc/bash_completion.d/pier`
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Lead a subagent's process group: run PROGRAM, and end the whole group when the parent dies
    #[command(hide = true)]
    SubagentGuard {
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },
    /// Run a shell command confined as run_command's (a client's terminal runs it for pier's agent)
    #[command(hide = true, name = "command-guard")]
    ShellGuard {
        /// The command's PIER_COMMAND_ID (32 hex digits), by which pier's agent ends what is left of it
        #[arg(long)]
        marker: String,
        /// Where the command may write (Landlock); repeat for several
        #[arg(long)]
        writable: Vec<std::path::PathBuf>,
        /// No Landlock (`--sandbox off`)
        #[arg(long)]
        no_landlock: bool,
        /// No cgroup of its own
        #[arg(long)]
        no_cgroups: bool,
        /// The command, given to `sh -c`
        command: String,
    },
    /// Run PROGRAM confined as the spec says (started by pier itself, see pier-jail)
    #[command(hide = true)]
    Jail {
        /// Only check that this machine can build a jail; the reason on stderr if not
        #[arg(long)]
        probe: bool,
        #[arg(long, required_unless_present = "probe")]
        spec: Option<String>,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },
}

/// Sessions, agents, MCP servers and SSE clients each hold descriptors: take the whole
/// allowance the administrator granted (the hard limit), not the conservative default.
fn raise_descriptor_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::debug!(error = %e, soft, hard, "could not raise the descriptor limit");
    }
}

fn main() {
    let cli = Cli::parse();
    // Before any thread starts: the guard waits for signals blocked in its only thread.
    if let Command::SubagentGuard { command } = &cli.command
        && let Some((program, args)) = command.split_first()
    {
        std::process::exit(pier_subagent::guard::run(program, args));
    }
    // The jail helper forks and unshares namespaces: it must run before any thread starts too.
    if let Command::Jail { probe, spec, command } = &cli.command {
        std::process::exit(match (probe, spec, command.split_first()) {
            (true, ..) => pier_jail::helper::probe(),
            (false, Some(spec), Some((program, args))) => pier_jail::helper::run(spec, program, args),
            _ => {
                eprintln!("pier jail: give --spec and a command after --");
                2
            }
        });
    }
    if let Err(e) = logging::init(cli.log_file.as_deref()) {
        eprintln!("pier: {e:#}");
        std::process::exit(2);
    }
    raise_descriptor_limit();
    // The agent is a chain of hand-offs (model stream -> turn -> projector -> writer) with little
    // CPU per step: on one thread each hop is a queue push, not a wake-up of a parked worker
    // (docs/benchmarks.md, B6). Blocking work (files, the local model) has its own threads.
    let mut builder = match cli.command {
        Command::Agent(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pier: could not start the async runtime: {e}");
            std::process::exit(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Agent(args) => agent_cmd::run(args).await,
            Command::Exec(args) => Ok(client_cmd::exec(args).await),
            Command::Prompt(args) => Ok(client_cmd::prompt(args).await),
            Command::Sessions(cmd) => client_cmd::sessions(cmd).map(|()| 0),
            Command::Run(args) => run_cmd::run(args).await,
            Command::Events(args) => events_cmd::events(args).await.map(|()| 0),
            Command::Logs(args) => logs_cmd::logs(args).await.map(|()| 0),
            Command::Approve(args) => person_cmd::answer(args, true).await.map(|()| 0),
            Command::Deny(args) => person_cmd::answer(args, false).await.map(|()| 0),
            Command::Say(args) => person_cmd::say(args).await.map(|()| 0),
            Command::Answer(args) => person_cmd::answer_input(args).await.map(|()| 0),
            Command::Retry(args) => retry_cmd::retry(args).await.map(|()| 0),
            Command::Budget(args) => budget_cmd::budget(args).await.map(|()| 0),
            Command::Show(args) => show_cmd::show(args).await.map(|()| 0),
            Command::Runs(args) => show_cmd::runs(args).await.map(|()| 0),
            Command::Serve(args) => serve_cmd::serve(args).await.map(|()| 0),
            Command::Submit(args) => serve_cmd::submit(args).await.map(|()| 0),
            Command::Worker(args) => worker_cmd::run(args).await.map(|()| 0),
            Command::Status(args) => serve_cmd::status(args).await.map(|()| 0),
            Command::Cancel(args) => serve_cmd::cancel(args).await.map(|()| 0),
            Command::Schedules(args) => schedules_cmd::run(args).await.map(|()| 0),
            Command::Models(cmd) => models_cmd::run(cmd).map(|()| 0),
            Command::Store(cmd) => store_cmd::run(cmd).await.map(|()| 0),
            Command::Demo => demo::run().await.map(|()| 0),
            Command::Config(args) => config_cmd::show(args).map(|()| 0),
            Command::Completions { shell } => {
                use clap::CommandFactory;
                clap_complete::generate(shell, &mut Cli::command(), "pier", &mut std::io::stdout());
                Ok(0)
            }
            Command::ShellGuard { marker, writable, no_landlock, no_cgroups, command } => {
                let confinement = pier_tools::contain::Confinement { landlock: !no_landlock, cgroups: !no_cgroups };
                Ok(pier_tools::guard::run(pier_tools::guard::Guarded { command, confinement, writable, marker }).await)
            }
            Command::SubagentGuard { .. } | Command::Jail { .. } => Ok(0),
        }
    });
    // A blocked stdin read must not hold the process open once we are done.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    // The process ends without every store handle closed: the SQLite files it wrote are
    // made whole on their own (nothing left only in a -wal) before it does.
    pier_host::store::checkpoint_open_stores();
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                std::process::exit(0);
            }
            eprintln!("pier: {e:#}");
            std::process::exit(1);
        }
    }
}
