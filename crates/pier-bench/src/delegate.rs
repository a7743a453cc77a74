//! B7: what a delegation adds over running its child directly.
//!
//! `pier-bench delegate --pier PATH [--n 20]`: one fake model on loopback plays every
//! model. Each round runs, side by side:
//! - *direct*: the child command (pier's own agent, automation profile, as `delegate`
//!   starts it) driven by this process: spawn → `initialize` → `session/new` →
//!   `session/prompt` answered → stdin closed → exit reaped;
//! - *delegated*: a warm parent `pier agent --profile editor` given a prompt whose model
//!   calls `delegate` with the same child prompt; the time from the call's `in_progress`
//!   to its `completed` as this client reads them off the parent's stdout.
//!
//! The difference of the medians is the overhead of delegating (the guard process, the
//! tool and its channels, the parent's projection), next to the child's own start-up.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_client_protocol_schema::v1::Error;
use futures::future::BoxFuture;
use pier_acp::{Connection, ConnectionConfig, Handler, RequestCx};
use pier_fake_model::body::first_user;
use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::{Value, json};

/// When the parent showed each tool call's statuses.
#[derive(Default)]
struct Seen {
    statuses: Mutex<Vec<(String, String, Instant)>>,
}

impl Handler for Seen {
    fn request(&self, _cx: RequestCx, _m: String, _p: Value) -> BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async { Err(Error::method_not_found()) })
    }
    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        let at = Instant::now();
        let update = &params["update"];
        if method == "session/update"
            && let (Some(id), Some(status)) = (update["toolCallId"].as_str(), update["status"].as_str())
        {
            let mut seen = self.statuses.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            seen.push((id.to_owned(), status.to_owned(), at));
        }
    }
}

impl Seen {
    fn span(&self, id: &str) -> Option<Duration> {
        let seen = self.statuses.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = |s: &str| seen.iter().find(|(i, st, _)| i == id && st == s).map(|(.., t)| *t);
        Some(at("completed")?.duration_since(at("in_progress")?))
    }
}

/// `program ARGS` with exactly `env` added, in `cwd`, its stdio piped (stderr dropped), in a
/// process group of its own, killed when dropped.
pub(crate) fn command(pier: &Path, args: &[&str], env: &[(String, String)], cwd: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(pier);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    cmd
}

async fn call(conn: &Connection, method: &str, params: Value) -> Value {
    match tokio::time::timeout(Duration::from_secs(60), conn.request_value(method, &params)).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{method}: {e}"),
        Err(_) => panic!("{method}: no answer within 60 s"),
    }
}

/// The child, run directly: spawn → answer → exit.
async fn direct(pier: &Path, env: &[(String, String)], cwd: &Path) -> Duration {
    let started = Instant::now();
    let mut child = match command(pier, CHILD_ARGS, env, cwd).spawn() {
        Ok(c) => c,
        Err(e) => panic!("spawn {}: {e}", pier.display()),
    };
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else { panic!("pipes") };
    let conn = Connection::spawn(stdout, stdin, Arc::new(Seen::default()), ConnectionConfig::default());
    call(&conn, "initialize", json!({"protocolVersion": 1})).await;
    let new = call(&conn, "session/new", json!({"cwd": cwd, "mcpServers": []})).await;
    let sid = new["sessionId"].as_str().unwrap_or_default().to_owned();
    let prompt = json!({"sessionId": sid, "prompt": [{"type": "text", "text": "child: answer"}]});
    let answer = call(&conn, "session/prompt", prompt).await;
    assert_eq!(answer["stopReason"], "end_turn", "{answer}");
    conn.close().await;
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    started.elapsed()
}

/// The flags `delegate` gives pier's own child at depth 1 (see `pier agent --help`).
const CHILD_ARGS: &[&str] =
    &["agent", "--profile", "automation", "--subagents", "--subagent-depth", "1", "--ask", "execute"];

/// The model's side: a parent delegates once, then answers; anything else answers "ok".
fn script(body: &Value) -> Reply {
    let user = first_user(body);
    let answered = body["messages"].as_array().is_some_and(|m| m.iter().any(|m| m["role"] == "tool"));
    match (user.strip_prefix("parent "), answered) {
        (Some(n), false) => Reply::Stream(vec![
            Step::ToolCallStart { index: 0, id: format!("d{n}"), name: "delegate".into() },
            Step::ToolCallArgs { index: 0, fragment: json!({"prompt": "child: answer"}).to_string() },
            Step::Finish("tool_calls".into()),
            Step::Done,
        ]),
        (Some(_), true) => Reply::text("done"),
        (None, _) => Reply::text("ok"),
    }
}

pub async fn run(args: &[String]) {
    let n = super::arg(args, "--n", 20) as usize;
    let pier: PathBuf = args
        .iter()
        .position(|a| a == "--pier")
        .and_then(|i| args.get(i + 1))
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|e| panic!("--pier {p}: {e}")))
        .unwrap_or_else(|| panic!("give the pier binary with --pier PATH"));
    let fake = match FakeModel::start().await {
        Ok(f) => f,
        Err(e) => panic!("fake model: {e}"),
    };
    fake.set_fallback(script);
    let home = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("temp dir: {e}"),
    };
    let cwd = home.path().join("work");
    if let Err(e) = std::fs::create_dir_all(&cwd) {
        panic!("work dir: {e}");
    }
    let env = vec![
        ("PIER_HOME".to_owned(), home.path().join("data").display().to_string()),
        ("PIER_BASE_URL".to_owned(), fake.base_url()),
        ("PIER_MODEL".to_owned(), "fake-model".to_owned()),
        ("PIER_API_KEY".to_owned(), "bench".to_owned()),
        ("RUST_LOG".to_owned(), "error".to_owned()),
    ];
    let mut parent = match command(&pier, &["agent", "--profile", "editor", "--allow", "other"], &env, &cwd).spawn() {
        Ok(c) => c,
        Err(e) => panic!("spawn the parent: {e}"),
    };
    let (Some(stdin), Some(stdout)) = (parent.stdin.take(), parent.stdout.take()) else { panic!("pipes") };
    let seen = Arc::new(Seen::default());
    let conn = Connection::spawn(stdout, stdin, seen.clone(), ConnectionConfig::default());
    call(&conn, "initialize", json!({"protocolVersion": 1, "clientCapabilities": {}})).await;

    let (mut direct_runs, mut delegated) = (Vec::with_capacity(n), Vec::with_capacity(n));
    // One warm-up of each, not counted (page cache, the fake's first connections).
    for round in 0..=n {
        let d = direct(&pier, &env, &cwd).await;
        // A session per round: the model script keys on each conversation's first message.
        let new = call(&conn, "session/new", json!({"cwd": cwd, "mcpServers": []})).await;
        let sid = new["sessionId"].as_str().unwrap_or_default().to_owned();
        let prompt = json!({"sessionId": sid, "prompt": [{"type": "text", "text": format!("parent {round}")}]});
        let answer = call(&conn, "session/prompt", prompt).await;
        assert_eq!(answer["stopReason"], "end_turn", "{answer}");
        let span = seen.span(&format!("d{round}")).unwrap_or_else(|| panic!("the delegate call d{round} was not seen"));
        if round > 0 {
            direct_runs.push(d);
            delegated.push(span);
        }
    }
    conn.close().await;
    let _ = parent.kill().await;
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    let (direct_ms, delegated_ms) = (median(&mut direct_runs), median(&mut delegated));
    println!(
        "{}",
        json!({
            "rounds": n,
            "direct_ms": direct_ms,
            "delegated_ms": delegated_ms,
            "overhead_ms": delegated_ms - direct_ms,
        })
    );
}
