//! `pier schedules`: the schedules of a running `pier serve`, listed with their next and last
//! occurrences; `add`, `pause`, `resume`, `delete`.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::Value;

use crate::run_cmd::EventFormat;
use crate::serve_cmd::{ServerArgs, request, segment};

#[derive(Debug, clap::Args)]
pub struct SchedulesArgs {
    #[command(subcommand)]
    action: Option<Action>,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text, global = true)]
    format: EventFormat,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Every schedule, with its next and last occurrences (the default)
    List,
    /// Declare the `[[schedules]]` of a TOML file (pier.toml's form; `plan` paths relative to it)
    Add { file: PathBuf },
    /// Stop a schedule's occurrences until it is resumed
    Pause { id: String },
    /// Start a paused schedule again from its next occurrence (what came due meanwhile does not run)
    Resume { id: String },
    /// Delete a schedule (its runs stay)
    Delete { id: String },
}

#[derive(serde::Deserialize)]
struct File {
    #[serde(default)]
    schedules: Vec<toml::Table>,
}

#[allow(clippy::print_stdout)]
pub async fn run(args: SchedulesArgs) -> anyhow::Result<()> {
    let server = args.server.url().ok();
    let post = reqwest::Method::POST;
    let shown = match args.action.unwrap_or(Action::List) {
        Action::List => {
            let v = request(server, reqwest::Method::GET, "/schedules", None).await?;
            if args.format == EventFormat::Json {
                println!("{v}");
            } else {
                print!("{}", table(v["schedules"].as_array().map_or(&[][..], Vec::as_slice)));
            }
            return Ok(());
        }
        Action::Add { file } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
            let parsed: File = toml::from_str(&text).with_context(|| format!("{} is not TOML", file.display()))?;
            anyhow::ensure!(!parsed.schedules.is_empty(), "{} declares no `[[schedules]]`", file.display());
            let base = file.parent().map(PathBuf::from).unwrap_or_default();
            let mut added = Vec::new();
            for spec in crate::config::schedules(&parsed.schedules, &base)? {
                let body = serde_json::to_value(&spec)?;
                added.push(request(server.clone(), post.clone(), "/schedules", Some(body)).await?["schedule"].clone());
            }
            added
        }
        Action::Pause { id } => vec![one(server, post, &id, "/pause").await?],
        Action::Resume { id } => vec![one(server, post, &id, "/resume").await?],
        Action::Delete { id } => {
            request(server, reqwest::Method::DELETE, &format!("/schedules/{}", segment(&id)), None).await?;
            println!("schedule {id} deleted (its runs stay)");
            return Ok(());
        }
    };
    if args.format == EventFormat::Json {
        println!("{}", Value::Array(shown));
    } else {
        print!("{}", table(&shown));
    }
    Ok(())
}

async fn one(server: Option<String>, method: reqwest::Method, id: &str, action: &str) -> anyhow::Result<Value> {
    let path = format!("/schedules/{}{action}", segment(id));
    Ok(request(server, method, &path, Some(serde_json::json!({}))).await?["schedule"].clone())
}

/// One line per schedule (and its last note under it), under a header.
fn table(schedules: &[Value]) -> String {
    if schedules.is_empty() {
        return "no schedules; declare one in pier.toml's [[schedules]] or with `pier schedules add FILE`\n".into();
    }
    let rows: Vec<[String; 6]> = schedules
        .iter()
        .map(|s| {
            let spec = &s["spec"];
            let when = match (spec["cron"].as_str(), spec["every"].as_str()) {
                (Some(c), _) => format!("cron {c} ({})", spec["timezone"].as_str().unwrap_or("UTC")),
                (_, Some(e)) => format!("every {e}"),
                _ => "?".into(),
            };
            let what = match (spec["type"].as_str(), spec["plan_file"].as_str()) {
                (Some(t), _) => format!("type {t}"),
                (_, Some(f)) => format!("plan {f}"),
                _ => "plan".into(),
            };
            let state = match s["paused_by"].as_str() {
                Some(by) => format!("paused by {by}"),
                None => "on".into(),
            };
            let text = |k: &str| s[k].as_str().unwrap_or("-").to_owned();
            let last = match s["last_run"].as_str() {
                Some(run) if s["last_open"] == true => format!("{run} (running)"),
                Some(run) => run.to_owned(),
                None => "-".into(),
            };
            [text("id"), when, what, state, text("next_at"), last]
        })
        .collect();
    let header = ["ID", "WHEN", "WHAT", "STATE", "NEXT", "LAST RUN"].map(String::from);
    let widths: Vec<usize> =
        (0..6).map(|i| rows.iter().chain([&header]).map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    let line = |r: &[String; 6]| {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        format!("{}\n", cells.join("  ").trim_end())
    };
    let mut out = line(&header);
    for (row, s) in rows.iter().zip(schedules) {
        out.push_str(&line(row));
        if let Some(note) = s["last_note"].as_str() {
            out.push_str(&format!("    {note}\n"));
        }
    }
    out
}
