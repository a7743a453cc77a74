//! `pier retry RUN TASK [--with-dependents]`: a failed or cancelled task runs again, as a
//! new attempt, on the local store or through a server's `POST …/retry`.

use serde_json::{Value, json};

use crate::run_cmd::{EventFormat, open_tasks};
use crate::serve_cmd::segment;

#[derive(Debug, clap::Args)]
pub struct RetryArgs {
    /// The run
    run: String,
    /// Its failed or cancelled task
    task: String,
    /// Also the tasks below it that were cancelled (because it failed), transitively
    #[arg(long)]
    with_dependents: bool,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
    #[command(flatten)]
    source: crate::show_cmd::Source,
}

#[allow(clippy::print_stdout)]
pub async fn retry(args: RetryArgs) -> anyhow::Result<()> {
    let server = args.source.server();
    let local = server.is_none();
    let rows: Vec<Value> = match server {
        Some(server) => {
            let path = format!("/runs/{}/tasks/{}/retry", segment(&args.run), segment(&args.task));
            let v =
                crate::serve_cmd::post(Some(server), &path, json!({"with_dependents": args.with_dependents})).await?;
            v["tasks"].as_array().cloned().unwrap_or_default()
        }
        None => {
            let tasks = open_tasks(&args.source.store)?;
            let by = crate::person_cmd::person(None)?;
            let rows = tasks.retry(&args.run, &args.task, args.with_dependents, &by).await?;
            rows.iter().map(|r| json!(r)).collect()
        }
    };
    if args.format == EventFormat::Json {
        println!("{}", json!({"run": args.run, "tasks": rows}));
        return Ok(());
    }
    for r in &rows {
        println!(
            "task {} of run {}: pending again (attempt {} next)",
            r["id"].as_str().unwrap_or("?"),
            args.run,
            r["attempt"].as_i64().unwrap_or(0) + 1
        );
    }
    if local {
        println!("a `pier serve` on this store runs it now; otherwise: pier run --resume {}", args.run);
    }
    Ok(())
}
