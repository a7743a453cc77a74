//! `pier show RUN [TASK]`: a run or a task as the store has it, for a person (or `--format
//! json`): states, results and errors, each attempt with what it showed and its side effects,
//! the question a task waits on with the command that answers it, and what its agent can do.

use std::sync::Arc;

use pier_host::{TaskRow, TaskStore};
use serde_json::{Value, json};

use crate::run_cmd::{EventFormat, open_store, waiting_for};

#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// The run
    run: String,
    /// One of its tasks [default: every task, in short]
    task: Option<String>,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
    /// The store [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long)]
    store: Option<String>,
}

#[allow(clippy::print_stdout)]
pub fn show(args: ShowArgs) -> anyhow::Result<()> {
    let store = open_store(&args.store)?;
    anyhow::ensure!(
        store.run_exists(&args.run)?,
        "there is no run `{}` in the store; `pier runs` lists them",
        args.run
    );
    let tasks = store.tasks(&args.run)?;
    let shown = match &args.task {
        Some(id) => {
            let task = tasks
                .iter()
                .find(|t| &t.id == id)
                .ok_or_else(|| anyhow::anyhow!("run `{}` has no task `{id}`", args.run))?;
            task_json(&store, task)?
        }
        None => json!({
            "run": args.run,
            "tasks": tasks.iter().map(|t| json!({
                "id": t.id, "state": t.state.as_str(), "attempts": t.attempt, "agent": t.spec.agent,
                "result": t.result, "error": t.error,
            })).collect::<Vec<_>>(),
        }),
    };
    match args.format {
        EventFormat::Json => println!("{shown}"),
        EventFormat::Text if args.task.is_some() => print!("{}", task_text(&args.run, &shown)),
        EventFormat::Text => {
            println!("run {}", args.run);
            println!("{:<24} {:<15} {:>8}  result", "task", "state", "attempts");
            for t in &tasks {
                let result = t.result.as_deref().or(t.error.as_deref()).unwrap_or("");
                let first: String = result.lines().next().unwrap_or("").chars().take(60).collect();
                println!("{:<24} {:<15} {:>8}  {first}", t.id, t.state.as_str(), t.attempt);
            }
        }
    }
    Ok(())
}

/// Everything about one task.
fn task_json(store: &Arc<dyn TaskStore>, t: &TaskRow) -> anyhow::Result<Value> {
    let attempts = store.attempts(&t.run_id, &t.id)?;
    let question = store.open_question(&t.run_id, &t.id)?;
    let agent = store.agent(&t.spec.agent)?;
    Ok(json!({
        "task": t,
        "attempts": attempts,
        "question": question.map(|q| json!({"attempt": q.attempt, "n": q.n, "request": q.request})),
        "agent": agent,
    }))
}

fn task_text(run: &str, v: &Value) -> String {
    let t = &v["task"];
    let id = t["id"].as_str().unwrap_or("?");
    let mut out = format!(
        "task {id} of run {run}: {} (attempt {}, {} failed)\n",
        t["state"].as_str().unwrap_or("?"),
        t["attempt"],
        t["failures"]
    );
    let spec = &t["spec"];
    out.push_str(&format!("agent: {}{}\n", spec["agent"].as_str().unwrap_or("?"), agent_line(&v["agent"])));
    if let Some(deps) = spec["depends_on"].as_array().filter(|d| !d.is_empty()) {
        let deps: Vec<&str> = deps.iter().filter_map(Value::as_str).collect();
        out.push_str(&format!("depends on: {}\n", deps.join(", ")));
    }
    if let Some(meta) = spec["metadata"].as_object().filter(|m| !m.is_empty()) {
        let pairs: Vec<String> = meta.iter().map(|(k, v)| format!("{k} = {v}")).collect();
        out.push_str(&format!("metadata: {}\n", pairs.join("; ")));
    }
    if let Some(requires) = spec["requires"].as_array().filter(|r| !r.is_empty()) {
        let words: Vec<&str> = requires.iter().filter_map(Value::as_str).collect();
        out.push_str(&format!("requires: {}\n", words.join(", ")));
    }
    if let Some(q) = v["question"].as_object() {
        out.push_str(&format!("waits: {}\n", waiting_for(id, &q["request"])));
    }
    if let Some(result) = t["result"].as_str() {
        out.push_str(&format!("result:\n{}\n", indent(result)));
    }
    if let Some(error) = t["error"].as_str() {
        out.push_str(&format!("error: {error}\n"));
    }
    for a in v["attempts"].as_array().into_iter().flatten() {
        let effects = a["evidence"].as_array().map_or(0, Vec::len);
        out.push_str(&format!("attempt {}: {effects} side effect(s)\n", a["attempt"]));
        for call in a["output"]["toolCalls"].as_array().into_iter().flatten() {
            let mark = match call["status"].as_str() {
                Some("completed") => "✓",
                Some("failed") => "✗",
                _ => "…",
            };
            out.push_str(&format!("  {mark} {}\n", call["title"].as_str().unwrap_or("?")));
        }
        if let Some(text) = a["output"]["text"].as_str().filter(|t| !t.is_empty()) {
            out.push_str(&format!("  said:\n{}\n", indent(&indent(text))));
        }
    }
    out
}

/// The agent's own name and what it offers, from its last `initialize` answer.
fn agent_line(agent: &Value) -> String {
    let init = &agent["init"];
    if init.is_null() {
        return String::new();
    }
    let info = &init["agentInfo"];
    let mut offers = Vec::new();
    for (word, pointer) in pier_host::caps::REQUIREMENTS {
        if init.pointer(pointer).and_then(Value::as_bool) == Some(true) {
            offers.push(*word);
        }
    }
    format!(
        " ({} {}; offers: {})",
        info["name"].as_str().unwrap_or("?"),
        info["version"].as_str().unwrap_or(""),
        if offers.is_empty() { "none of the requirement words".to_owned() } else { offers.join(", ") }
    )
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
}
