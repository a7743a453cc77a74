//! `pier budget RUN [TASK] [--tokens N] [--cost X]`: raise a task's budget (with TASK) or its
//! run's (without), on the local store or through a server; the tasks a budget stopped resume.

use serde_json::{Value, json};

use crate::run_cmd::{EventFormat, open_tasks};
use crate::serve_cmd::segment;

#[derive(Debug, clap::Args)]
pub struct BudgetArgs {
    /// The run
    run: String,
    /// One of its tasks [default: the run's budget, on every task]
    task: Option<String>,
    /// Tokens (input and output) the task, or the run, may use in all
    #[arg(long)]
    tokens: Option<u64>,
    /// What it may cost in all, in the currency of pier.toml's `[prices]`
    #[arg(long)]
    cost: Option<f64>,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
    #[command(flatten)]
    source: crate::show_cmd::Source,
}

#[allow(clippy::print_stdout)]
pub async fn budget(args: BudgetArgs) -> anyhow::Result<()> {
    let budget = pier_host::Budget { tokens: args.tokens, cost: args.cost };
    let rows: Vec<Value> = match args.source.server() {
        Some(server) => {
            let path = match &args.task {
                Some(t) => format!("/runs/{}/tasks/{}/budget", segment(&args.run), segment(t)),
                None => format!("/runs/{}/budget", segment(&args.run)),
            };
            let v = crate::serve_cmd::post(Some(server), &path, json!(budget)).await?;
            v["tasks"].as_array().cloned().unwrap_or_default()
        }
        None => {
            let tasks = open_tasks(&args.source.store)?;
            let by = crate::person_cmd::person(None)?;
            let (own, run) = match &args.task {
                Some(_) => (Some(budget), None),
                None => (None, Some(budget)),
            };
            let rows = tasks.set_budget(&args.run, args.task.as_deref(), own, run, &by).await?;
            rows.iter().map(|r| json!(r)).collect()
        }
    };
    if args.format == EventFormat::Json {
        println!("{}", json!({"run": args.run, "tasks": rows}));
        return Ok(());
    }
    let limit = |b: &Value| match (b["tokens"].as_u64(), b["cost"].as_f64()) {
        (Some(t), Some(c)) => format!("{t} tokens, cost {c}"),
        (Some(t), None) => format!("{t} tokens"),
        (None, Some(c)) => format!("cost {c}"),
        (None, None) => "none".into(),
    };
    for r in &rows {
        let spec = &r["spec"];
        let resumed = if r["state"] == "pending" { "; it runs again" } else { "" };
        println!(
            "task {} of run {}: budget {}, run budget {}{resumed}",
            r["id"].as_str().unwrap_or("?"),
            args.run,
            limit(&spec["budget"]),
            limit(&spec["run_budget"])
        );
    }
    Ok(())
}
