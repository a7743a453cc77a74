//! `pier runs`, `pier show RUN [TASK]` and `pier status`: runs and tasks as the store has
//! them, read from the local store or, with `--server`, from a running `pier serve` (the
//! same views either way), for a person (or `--format json`): states, results and errors,
//! each attempt with what it showed and its side effects, the question a task waits on with
//! the command that answers it, and what its agent can do.

use serde_json::{Value, json};

use crate::run_cmd::{EventFormat, open_tasks};
use crate::waiting::waiting_for;

/// Where the runs are read: the local store, or a server.
#[derive(Debug, Clone, clap::Args)]
pub struct Source {
    /// The store [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long, conflicts_with = "server")]
    pub store: Option<String>,
    /// Read from a running `pier serve` instead of the local store (token from PIER_TOKEN)
    /// [env: PIER_SERVER]
    #[arg(long)]
    server: Option<String>,
}

impl Source {
    /// The server to read from, if any: `--server`, else `PIER_SERVER` unless `--store` is given.
    pub fn server(&self) -> Option<String> {
        self.server.clone().or_else(|| {
            if self.store.is_some() {
                return None;
            }
            std::env::var("PIER_SERVER").ok().filter(|s| !s.is_empty())
        })
    }

    pub fn remote(server: Option<String>) -> Source {
        Source { store: None, server }
    }
}

#[derive(Debug, clap::Args)]
pub struct RunsArgs {
    /// Only runs in this state: running, waiting (on a person), completed or failed
    #[arg(long)]
    state: Option<String>,
    /// The newest N runs (0: all)
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
    #[command(flatten)]
    source: Source,
}

impl RunsArgs {
    pub fn new(format: EventFormat, source: Source) -> RunsArgs {
        RunsArgs { state: None, limit: 50, format, source }
    }
}

/// `pier runs`: the runs, newest first (the order of `GET /runs`), with their state, times
/// and tasks' states, under a header.
#[allow(clippy::print_stdout)]
pub async fn runs(args: RunsArgs) -> anyhow::Result<()> {
    let limit = (args.limit > 0).then_some(args.limit);
    // Each as `GET /runs` shows it.
    let (runs, more): (Vec<Value>, u64) = match args.source.server() {
        Some(server) => {
            let mut path = String::from("/runs?");
            if let Some(state) = &args.state {
                path.push_str(&format!("state={}&", crate::serve_cmd::segment(state)));
            }
            if let Some(l) = limit {
                path.push_str(&format!("limit={l}"));
            }
            let v = crate::serve_cmd::get(Some(server), &path).await?;
            (v["runs"].as_array().cloned().unwrap_or_default(), v["more"].as_u64().unwrap_or(0))
        }
        None => {
            let filter = pier_host::tasks::RunFilter { state: args.state.clone(), limit, ..Default::default() };
            let list = open_tasks(&args.source.store)?.list_runs(&filter).await?;
            let runs = list.runs.iter().map(|r| {
                json!({"run": r.run, "counts": r.counts, "state": r.state(), "created_at_ms": r.created_at_ms,
                       "updated_at_ms": r.updated_at_ms, "attempts": r.attempts, "spend": r.spend.to_json()})
            });
            (runs.collect(), list.more as u64)
        }
    };
    if args.format == EventFormat::Json {
        for r in &runs {
            let counts = r["counts"].as_object().cloned().unwrap_or_default();
            let total: u64 = counts.values().filter_map(Value::as_u64).sum();
            let mut line = r.clone();
            line["tasks"] = total.into();
            println!("{line}");
        }
        return Ok(());
    }
    if runs.is_empty() {
        match &args.state {
            Some(state) => eprintln!("pier: no {state} runs"),
            None => eprintln!("pier: no runs yet; `pier run PLAN` starts one"),
        }
        return Ok(());
    }
    let now = pier_host::store::now_ms();
    let rows: Vec<[String; 5]> = runs
        .iter()
        .map(|r| {
            let counts = r["counts"].as_object().cloned().unwrap_or_default();
            let total: u64 = counts.values().filter_map(Value::as_u64).sum();
            let said: Vec<String> = counts.iter().map(|(k, v)| format!("{v} {k}")).collect();
            let state = r["state"].as_str().unwrap_or("?").to_owned();
            let created = r["created_at_ms"].as_i64().unwrap_or(0);
            // A run in progress has taken until now so far; an ended one until its last event.
            let until = if state == "running" { now } else { r["updated_at_ms"].as_i64().unwrap_or(created) };
            [
                r["run"].as_str().unwrap_or("?").to_owned(),
                state,
                pier_host::schedule::rfc3339(created).replace('T', " ").replace('Z', ""),
                took(until - created),
                format!("{total} tasks  {}  [{}]", said.join(", "), short_spend(&r["spend"])),
            ]
        })
        .collect();
    let header = ["RUN", "STATE", "CREATED (UTC)", "TOOK", "TASKS"].map(String::from);
    let widths: Vec<usize> =
        (0..4).map(|i| rows.iter().chain([&header]).map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    for row in [&header].into_iter().chain(&rows) {
        let cells: Vec<String> = row[..4].iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}  {}", cells.join("  "), row[4]);
    }
    if more > 0 {
        eprintln!("pier: {more} older run(s) not shown (--limit 0 shows all)");
    }
    Ok(())
}

/// A duration for a person: `0.4s`, `12s`, `3m 4s`, `2h 5m`.
fn took(ms: i64) -> String {
    let ms = ms.max(0);
    match ms / 1000 {
        0..10 => format!("{:.1}s", ms as f64 / 1000.0),
        s @ 10..60 => format!("{s}s"),
        s @ 60..3600 => format!("{}m {}s", s / 60, s % 60),
        s => format!("{}h {}m", s / 3600, (s % 3600) / 60),
    }
}

#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// The run
    run: String,
    /// One of its tasks [default: every task, in short]
    task: Option<String>,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
    #[command(flatten)]
    source: Source,
    /// Show it again at every change until the task (or every task of the run) has ended
    #[arg(long)]
    watch: bool,
}

impl ShowArgs {
    pub fn new(run: String, format: EventFormat, source: Source) -> ShowArgs {
        ShowArgs { run, task: None, format, source, watch: false }
    }
}

/// How often `--watch` asks a `pier serve` again (a local store wakes it at each commit).
const SERVER_WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

#[allow(clippy::print_stdout)]
pub async fn show(args: ShowArgs) -> anyhow::Result<()> {
    let server = args.source.server();
    let tasks = match &server {
        Some(_) => None,
        None => Some(open_tasks(&args.source.store)?),
    };
    // Subscribed before the first read: a change between the read and the wait is not missed.
    let mut changes = match (&tasks, args.watch) {
        (Some(t), true) => {
            let after = t.position().await?;
            Some(t.follow(pier_host::Follow { run: Some(args.run.clone()), after, live: true, ..Default::default() }))
        }
        _ => None,
    };
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    loop {
        let shown = match (&server, &tasks) {
            (Some(server), _) => remote(server.clone(), &args.run, args.task.as_deref()).await?,
            (None, Some(tasks)) => local(tasks, &args.run, args.task.as_deref()).await?,
            (None, None) => anyhow::bail!("neither a store nor a server to read from"),
        };
        if args.watch && tty && args.format == EventFormat::Text {
            // The screen shows the task as it is now, not a scroll of how it was.
            print!("\x1b[H\x1b[2J");
        }
        match args.format {
            EventFormat::Json => println!("{shown}"),
            EventFormat::Text if args.task.is_some() => print!("{}", task_text(&args.run, &shown)),
            EventFormat::Text => print!("{}", run_text(&args.run, &shown)),
        }
        if !args.watch || ended(&shown, args.task.is_some()) {
            return Ok(());
        }
        if args.format == EventFormat::Text && !tty {
            println!();
        }
        std::io::Write::flush(&mut std::io::stdout())?;
        match &mut changes {
            Some(follower) => match follower.next_batch().await {
                Some(batch) => drop(batch?),
                None => return Ok(()),
            },
            None => tokio::time::sleep(SERVER_WATCH_EVERY).await,
        }
    }
}

/// Whether what `show` read has ended: the task, or every task of the run.
fn ended(shown: &Value, one_task: bool) -> bool {
    let over = |state: &Value| {
        state.as_str().and_then(pier_host::TaskState::parse).is_some_and(pier_host::TaskState::is_terminal)
    };
    if one_task {
        return over(&shown["task"]["state"]);
    }
    shown["tasks"].as_array().is_some_and(|tasks| tasks.iter().all(|t| over(&t["state"])))
}

/// A run (`{run, tasks: [{id, state, attempts, agent, result, error, asks?}]}`) or one task
/// whole (as `GET …/tasks/{task}` has it), from the local store.
async fn local(tasks: &pier_host::Tasks, run: &str, task: Option<&str>) -> anyhow::Result<Value> {
    if let Some(id) = task {
        let mut v = pier_server::task_json(&tasks.task(run, id).await?);
        v["turns"] = json!(pier_host::tasks::turns(&tasks.transcript(run, id).await?));
        return Ok(v);
    }
    let view = tasks.run(run).await?;
    let rows = view.tasks.iter().map(|(t, q)| {
        let mut row = json!({
            "id": t.id, "state": t.state.as_str(), "attempts": t.attempt, "agent": t.spec.agent,
            "result": t.result, "error": t.error,
            "spend": view.task_spend.get(&t.id).map_or(Value::Null, pier_host::Spend::to_json),
        });
        if t.state == pier_host::TaskState::AwaitingInput {
            row["asks"] = json!(waiting_for(run, &t.id, q.as_ref().map(|q| &q.request)));
        }
        row
    });
    Ok(json!({"run": run, "tasks": rows.collect::<Vec<_>>(), "spend": view.spend.to_json()}))
}

/// A question's request as the API shows it, typed again.
fn request_of(question: &Value) -> Option<pier_host::QuestionRequest> {
    serde_json::from_value(question.get("request")?.clone()).ok()
}

/// The same views from a server's `GET /runs/{run}` and `GET /runs/{run}/tasks/{task}`.
async fn remote(server: String, run: &str, task: Option<&str>) -> anyhow::Result<Value> {
    use crate::serve_cmd::{get, segment};
    if let Some(id) = task {
        // The task whole, its turns among it.
        return get(Some(server), &format!("/runs/{}/tasks/{}?turns=true", segment(run), segment(id))).await;
    }
    let v = get(Some(server), &format!("/runs/{}", segment(run))).await?;
    let rows: Vec<Value> = v["tasks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let mut row = json!({
                "id": t["id"], "state": t["state"], "attempts": t["attempt"], "agent": t["spec"]["agent"],
                "result": t["result"], "error": t["error"], "spend": t["spend"],
            });
            if t["state"] == "awaiting_input" {
                let id = t["id"].as_str().unwrap_or("?");
                row["asks"] = json!(waiting_for(run, id, request_of(&t["question"]).as_ref()));
            }
            row
        })
        .collect();
    Ok(json!({"run": run, "tasks": rows, "spend": v["spend"]}))
}

/// A spend as `--format json` has it (`null`: unknown), in a few words.
fn short_spend(spend: &Value) -> String {
    if spend.is_null() {
        return "spend unknown".into();
    }
    let tokens = spend["tokens"]["input"].as_u64().unwrap_or(0) + spend["tokens"]["output"].as_u64().unwrap_or(0);
    match (spend["cost"].as_f64(), spend["unpriced"].as_u64().unwrap_or(0)) {
        (Some(c), 0) => format!("{tokens} tokens, cost {c:.4}"),
        (Some(c), _) => format!("{tokens} tokens, cost {c:.4} + unpriced"),
        (None, _) => format!("{tokens} tokens, cost unknown"),
    }
}

/// A spend's full line and its breakdown by model.
fn spend_lines(spend: &Value) -> String {
    let Some(text) = spend["text"].as_str() else {
        return "spend: unknown (no model traffic passed pier's gateway)\n".into();
    };
    let mut out = format!("spend: {text}\n");
    for (model, m) in spend["by_model"].as_object().into_iter().flatten() {
        out.push_str(&format!("  {model}: {}\n", short_spend(m)));
    }
    out
}

fn run_text(run: &str, v: &Value) -> String {
    let mut out = format!("run {run}\n{:<24} {:<15} {:>8}  result\n", "task", "state", "attempts");
    let tasks = v["tasks"].as_array().cloned().unwrap_or_default();
    for t in &tasks {
        let result = t["result"].as_str().or(t["error"].as_str()).unwrap_or("");
        let first: String = result.lines().next().unwrap_or("").chars().take(60).collect();
        out.push_str(&format!(
            "{:<24} {:<15} {:>8}  {first}\n",
            t["id"].as_str().unwrap_or("?"),
            t["state"].as_str().unwrap_or("?"),
            t["attempts"]
        ));
    }
    for t in &tasks {
        if let Some(asks) = t["asks"].as_str() {
            out.push_str(&format!("? {} {asks}\n", t["id"].as_str().unwrap_or("?")));
        }
    }
    out.push_str(&spend_lines(&v["spend"]));
    out
}

/// A task's type and input, priority, concurrency keys (and, while it is pending, the full
/// ones it waits for) and prompt as its agent gets it.
fn typed_lines(spec: &Value, v: &Value) -> String {
    let mut out = String::new();
    if let Some(ty) = spec["type"].as_str() {
        out.push_str(&format!("type: {ty}, input {}\n", spec["input"]));
    }
    if let Some(p) = spec["priority"].as_u64().filter(|p| *p > 0) {
        out.push_str(&format!("priority: {p}\n"));
    }
    if let Some(keys) = spec["concurrency"].as_array().filter(|k| !k.is_empty()) {
        let keys: Vec<String> =
            keys.iter().map(|k| format!("{} (limit {})", k["key"].as_str().unwrap_or("?"), k["limit"])).collect();
        out.push_str(&format!("concurrency: {}\n", keys.join(", ")));
    }
    if v["task"]["state"] == "pending" {
        for k in v["keys"].as_array().into_iter().flatten() {
            let (running, limit) = (k["running"].as_i64().unwrap_or(0), k["limit"].as_i64().unwrap_or(0));
            if running >= limit {
                let key = k["key"].as_str().unwrap_or("?");
                out.push_str(&format!("waiting for concurrency key {key}: {running} of {limit} running\n"));
            }
        }
    }
    if let Some(prompt) = v["prompt"].as_str().or(spec["prompt"].as_str()) {
        out.push_str(&format!("prompt:\n{}\n", indent(prompt)));
    }
    out
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
    if let Some(why) = t["cancel_requested"].as_str() {
        out.push_str(&format!("stopping: a person cancelled it ({why}); its attempt ends it with its output\n"));
    }
    let spec = &t["spec"];
    out.push_str(&format!("agent: {}{}\n", spec["agent"].as_str().unwrap_or("?"), agent_line(&v["agent"])));
    if let Some(sandbox) = v["sandbox"].as_str() {
        out.push_str(&format!("sandbox: {sandbox}\n"));
    }
    out.push_str(&spend_lines(&v["spend"]));
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
    out.push_str(&typed_lines(spec, v));
    if let Some(request) = request_of(&v["question"]) {
        out.push_str(&format!("waits: {}\n", waiting_for(run, id, Some(&request))));
    } else if t["state"] == "awaiting_input" {
        out.push_str(&format!("waits: {}\n", waiting_for(run, id, None)));
    }
    if let Some(result) = t["result"].as_str() {
        out.push_str(&format!("result:\n{}\n", indent(result)));
    }
    if let Some(error) = t["error"].as_str() {
        out.push_str(&format!("error: {error}\n"));
    }
    for a in v["attempts"].as_array().into_iter().flatten() {
        let effects = a["evidence"].as_array().map_or(0, Vec::len);
        let times = v["times"].as_array().into_iter().flatten().find(|t| t["attempt"] == a["attempt"]);
        let when = times.map(attempt_when).unwrap_or_default();
        out.push_str(&format!("attempt {}: {when}{effects} side effect(s)\n", a["attempt"]));
        let turns: Vec<&Value> =
            v["turns"].as_array().into_iter().flatten().filter(|t| t["attempt"] == a["attempt"]).collect();
        if !turns.is_empty() {
            out.push_str(&turn_blocks(&turns, t["result"].as_str()));
            continue;
        }
        for call in a["output"]["toolCalls"].as_array().into_iter().flatten() {
            let mark = match call["status"].as_str() {
                Some("completed") => "✓",
                Some("failed") => "✗",
                _ => "…",
            };
            out.push_str(&format!("  {mark} {}\n", call["title"].as_str().unwrap_or("?")));
        }
        match a["output"]["text"].as_str().filter(|t| !t.is_empty()) {
            // The answer that became the result is shown once, as the result.
            Some(text) if t["result"].as_str() == Some(text) => out.push_str("  said: the result above\n"),
            Some(text) => out.push_str(&format!("  said:\n{}\n", indent(&indent(text)))),
            None => {}
        }
    }
    out
}

/// An attempt's turns, a block each: what opened it, its tool calls, what the agent said (the
/// answer that became the result said once, above).
fn turn_blocks(turns: &[&Value], result: Option<&str>) -> String {
    let mut out = String::new();
    for t in turns {
        let opened = &t["opened"];
        let head = match opened["kind"].as_str() {
            Some("message") => format!(
                "message {} from {}: {}",
                opened["n"],
                opened["by"].as_str().unwrap_or("?"),
                opened["text"].as_str().unwrap_or("").lines().next().unwrap_or("")
            ),
            _ => "the task's prompt".to_owned(),
        };
        out.push_str(&format!("  turn {}, {head}\n", t["turn"]));
        for call in t["tool_calls"].as_array().into_iter().flatten() {
            let mark = match call["status"].as_str() {
                Some("completed") => "✓",
                Some("failed") => "✗",
                _ => "…",
            };
            let took = match (call["started_at_ms"].as_i64(), call["ended_at_ms"].as_i64()) {
                (Some(from), Some(to)) => format!(" ({:.1} s)", (to - from).max(0) as f64 / 1000.0),
                _ => String::new(),
            };
            out.push_str(&format!("    {mark} {}{took}\n", call["title"].as_str().unwrap_or("?")));
        }
        match t["said"].as_str().filter(|s| !s.is_empty()) {
            Some(said) if result == Some(said) => out.push_str("    said: the result above\n"),
            Some(said) => out.push_str(&format!("    said:\n{}\n", indent(&indent(&indent(said))))),
            None => {}
        }
    }
    out
}

/// When an attempt ran: `started 2026-12-07 08:36:27 UTC, took 3.2 s, completed; ` (or `running
/// for 3.2 s; ` while it runs).
fn attempt_when(t: &Value) -> String {
    let Some(started) = t["started_at_ms"].as_i64() else { return String::new() };
    let at = pier_host::schedule::human(started);
    match (t["ended_at_ms"].as_i64(), t["ended"].as_str()) {
        (Some(ended), Some(how)) => format!("started {at}, took {:.1} s, {how}; ", (ended - started) as f64 / 1000.0),
        _ => {
            let on = (pier_host::store::now_ms() - started).max(0) as f64 / 1000.0;
            format!("started {at}, running for {on:.1} s; ")
        }
    }
}

/// The agent's own name and what it offers, from its last `initialize` answer.
fn agent_line(agent: &Value) -> String {
    let init = &agent["init"];
    if init.is_null() {
        return String::new();
    }
    let info = &init["agentInfo"];
    let mut offers = Vec::new();
    for (word, pointer) in pier_host::requires::REQUIREMENTS {
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
