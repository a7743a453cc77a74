//! What a person at this command line does to a task: `pier approve`, `pier deny`,
//! `pier answer`, `pier say`. Each is one call of the host's API.

use pier_host::{Answered, Input, Tasks};

use crate::run_cmd::open_tasks;

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
    /// Who answers, for the audit trail [default: the OS user]
    #[arg(long = "as", value_name = "NAME")]
    as_: Option<String>,
}

impl TaskTarget {
    /// The host's API over the store, and the run the task is in.
    async fn open(&self) -> anyhow::Result<(Tasks, String)> {
        let tasks = open_tasks(&self.store)?;
        let run = tasks.locate(&self.task, self.run.as_deref()).await.map_err(|e| match self.run {
            None => anyhow::anyhow!("no run has a task `{}` ({e})", self.task),
            Some(_) => e.into(),
        })?;
        Ok((tasks, run))
    }
}

/// Who a person at this command line is, for the record: `cli:` and the name given with
/// `--as`, else the OS user (`$USER`, else the name of the process's user id).
pub fn person(named: Option<&str>) -> anyhow::Result<String> {
    if let Some(name) = named {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control) {
            anyhow::bail!("--as takes a name of 1 to 64 characters, without control characters");
        }
        return Ok(format!("cli:{name}"));
    }
    let from_env = std::env::var("USER").ok().filter(|u| !u.trim().is_empty());
    let uid = nix::unistd::getuid();
    let name = from_env
        .or_else(|| nix::unistd::User::from_uid(uid).ok().flatten().map(|u| u.name))
        .unwrap_or_else(|| format!("uid {uid}"));
    Ok(format!("cli:{name}"))
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
pub async fn answer_input(args: InputArgs) -> anyhow::Result<()> {
    let (tasks, run) = args.target.open().await?;
    let task = &args.target.task;
    let input = if args.decline {
        Input::Decline
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
        Input::Pairs(pairs)
    };
    let answer = tasks.answer_input(&run, task, None, input, &person(args.target.as_.as_deref())?).await?;
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
pub async fn say(args: SayArgs) -> anyhow::Result<()> {
    let (tasks, run) = args.target.open().await?;
    let task = &args.target.task;
    let n = tasks.say(&run, task, &args.text, args.interrupt, &person(args.target.as_.as_deref())?).await?;
    let when = if args.interrupt { "now, after its current turn is cancelled" } else { "when its current turn ends" };
    println!("message {n} for task `{task}` of run `{run}`: it goes to the agent {when}");
    Ok(())
}

/// `pier approve` (`allow` true) and `pier deny`: answer a task in `awaiting_input`.
#[allow(clippy::print_stdout)]
pub async fn answer(args: AnswerArgs, allow: bool) -> anyhow::Result<()> {
    let (tasks, run) = args.target.open().await?;
    let task = &args.target.task;
    match tasks.answer(&run, task, None, allow, args.option.as_deref(), &person(args.target.as_.as_deref())?).await? {
        Answered::Option(chosen) => println!("answered `{chosen}` for task `{task}` of run `{run}`"),
        Answered::Rerun(row) => println!(
            "task `{task}` of run `{run}` is now {}; resume the run with `pier run --resume {run}`",
            row.state.as_str()
        ),
    }
    Ok(())
}
