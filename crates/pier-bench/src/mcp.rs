//! B12: an MCP tool call's round trip through an agent, against the same call made directly.
//!
//! `pier-bench mcp --pier PATH --server SCRIPT [--codex PATH] [--n 50]`: one fake model on
//! loopback answers every request with one call of the stdio MCP server's `echo` tool until
//! the conversation holds N results. Side by side:
//! - *direct*: this process speaks MCP to the server itself (initialize, then N `tools/call`
//!   on one pipe), each call timed: the server's own round trip, the floor;
//! - *pier*: `pier agent --profile editor` given the server in `session/new`;
//! - *codex*: codex-acp given the same server (Responses API to the fake).
//!
//! For an agent, two spans: the loop, from the fake model receiving one request to the next (the
//! agent reading the model's tool call, calling the server, sending the result back), and the
//! call as the ACP client sees it, from its first `tool_call` update to its `completed`. The
//! call less the direct round trip is what the agent adds to the MCP call.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_client_protocol_schema::v1::Error;
use futures::future::BoxFuture;
use pier_acp::{Connection, ConnectionConfig, Handler, RequestCx};
use pier_fake_model::body::{tool_names, tool_results};
use pier_fake_model::{FakeModel, Reply};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

/// Answers a permission request with its first allowing option (refuses other requests), and
/// keeps when each tool call was first shown and when it completed.
#[derive(Default)]
struct Allow {
    calls: std::sync::Mutex<std::collections::HashMap<String, (Instant, Option<Instant>)>>,
}

impl Allow {
    /// Each call's span from first shown to completed, in the order they completed.
    fn spans(&self) -> Vec<Duration> {
        let calls = self.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut done: Vec<(Instant, Duration)> =
            calls.values().filter_map(|(start, end)| end.map(|e| (e, e.duration_since(*start)))).collect();
        done.sort();
        done.into_iter().map(|(_, d)| d).collect()
    }
}

impl Handler for Allow {
    fn request(&self, _cx: RequestCx, method: String, params: Value) -> BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async move {
            if method != "session/request_permission" {
                return Err(Error::method_not_found());
            }
            let options = params["options"].as_array().cloned().unwrap_or_default();
            let allow = options.iter().find(|o| o["kind"].as_str().is_some_and(|k| k.starts_with("allow")));
            Ok(json!({"outcome": {"outcome": "selected", "optionId": allow.map(|o| o["optionId"].clone())}}))
        })
    }
    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        let at = Instant::now();
        let update = &params["update"];
        let Some(id) = update["toolCallId"].as_str().filter(|_| method == "session/update") else { return };
        let mut calls = self.calls.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let call = calls.entry(id.to_owned()).or_insert((at, None));
        if update["status"] == "completed" {
            call.1 = Some(at);
        }
    }
}

fn median_ms(v: &mut [Duration]) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// The server's own round trip: N `tools/call` of `echo` on one stdio connection.
async fn direct(server: &Path, n: usize) -> Vec<Duration> {
    let mut child = tokio::process::Command::new("python3")
        .arg(server)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn the MCP server: {e}"));
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else { panic!("pipes") };
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut send = async |v: Value| {
        let line = format!("{v}\n");
        stdin.write_all(line.as_bytes()).await.unwrap_or_else(|e| panic!("write: {e}"));
    };
    let init =
        json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}});
    send(json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init})).await;
    let _ = lines.next_line().await;
    send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
    let mut out = Vec::with_capacity(n);
    for i in 1..=n {
        let started = Instant::now();
        let params = json!({"name": "echo", "arguments": {"text": "from the plan's server"}});
        send(json!({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": params})).await;
        let line = lines.next_line().await.ok().flatten().unwrap_or_else(|| panic!("the server ended"));
        out.push(started.elapsed());
        assert!(line.contains("from the plan's server"), "{line}");
    }
    out
}

/// One agent's turn of N calls: the gaps between the fake model's requests.
/// `env` makes the agent's environment from the fake model's base URL.
async fn through(
    program: &Path,
    args: &[&str],
    env: &dyn Fn(&str) -> Vec<(String, String)>,
    cwd: &Path,
    server: &Path,
    n: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let fake = FakeModel::start().await.unwrap_or_else(|e| panic!("fake model: {e}"));
    fake.set_fallback(move |body| {
        let Some(echo) = tool_names(body).into_iter().find(|t| t.ends_with("echo")) else {
            return Reply::text("no echo tool");
        };
        let done = tool_results(body).len();
        if done < n {
            Reply::tool_call(&format!("c{done}"), &echo, r#"{"text": "from the plan's server"}"#)
        } else {
            Reply::text("done")
        }
    });
    let env = env(&fake.base_url());
    let mut child = super::delegate::command(program, args, &env, cwd)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else { panic!("pipes") };
    let seen = Arc::new(Allow::default());
    let conn = Connection::spawn(stdout, stdin, seen.clone(), ConnectionConfig::default());
    let call = async |method: &str, params: Value| match tokio::time::timeout(
        Duration::from_secs(120),
        conn.request_value(method, &params),
    )
    .await
    {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{method}: {e}"),
        Err(_) => panic!("{method}: no answer within 120 s"),
    };
    call("initialize", json!({"protocolVersion": 1, "clientCapabilities": {}})).await;
    let server = json!({"name": "notes", "command": "python3", "args": [server], "env": []});
    let new = call("session/new", json!({"cwd": cwd, "mcpServers": [server]})).await;
    let sid = new["sessionId"].as_str().unwrap_or_default().to_owned();
    let answer = call("session/prompt", json!({"sessionId": sid, "prompt": [{"type": "text", "text": "go"}]})).await;
    assert_eq!(answer["stopReason"], "end_turn", "{answer}");
    conn.close().await;
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let _ = child.kill().await;
    let times: Vec<Instant> = fake.requests().iter().map(|r| r.at).collect();
    // The first gap (and call) carries the server's start and the first call's warm-up: left out.
    let gaps = times.windows(2).skip(1).map(|w| w[1].duration_since(w[0])).collect();
    (gaps, seen.spans().into_iter().skip(1).collect())
}

fn path_arg(args: &[String], flag: &str) -> Option<PathBuf> {
    let p = args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1))?;
    Some(std::fs::canonicalize(p).unwrap_or_else(|e| panic!("{flag} {p}: {e}")))
}

pub async fn run(args: &[String]) {
    let n = super::arg(args, "--n", 50) as usize;
    let pier = path_arg(args, "--pier").unwrap_or_else(|| panic!("give the pier binary with --pier PATH"));
    let server = path_arg(args, "--server").unwrap_or_else(|| panic!("give the MCP server script with --server PATH"));
    let home = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let cwd = home.path().join("work");
    std::fs::create_dir_all(&cwd).unwrap_or_else(|e| panic!("work dir: {e}"));
    let mut direct_calls = direct(&server, n).await;
    let data = home.path().join("data").display().to_string();
    let at = home.path().display().to_string();
    let pier_env = |base: &str| {
        vec![
            ("PIER_HOME".to_owned(), data.clone()),
            ("PIER_BASE_URL".to_owned(), base.to_owned()),
            ("PIER_MODEL".to_owned(), "fake-model".to_owned()),
            ("PIER_API_KEY".to_owned(), "bench".to_owned()),
            ("RUST_LOG".to_owned(), "error".to_owned()),
            ("HOME".to_owned(), at.clone()),
        ]
    };
    let (mut pier_gaps, mut pier_spans) =
        through(&pier, &["agent", "--profile", "editor"], &pier_env, &cwd, &server, n).await;
    let direct_ms = median_ms(&mut direct_calls);
    let pier_ms = median_ms(&mut pier_gaps);
    let pier_call_ms = median_ms(&mut pier_spans);
    // `*_ms`: model request to model request (the whole loop around one call); `*_call_ms`: the
    // call as the client sees it, first shown to completed; `*_overhead_ms`: that, less the
    // server's own round trip.
    let mut out = json!({
        "calls": n,
        "direct_ms": direct_ms,
        "pier_ms": pier_ms,
        "pier_call_ms": pier_call_ms,
        "pier_overhead_ms": pier_call_ms - direct_ms,
    });
    if let Some(codex) = path_arg(args, "--codex") {
        let scratch = home.path().join("codex");
        let env =
            |base: &str| pier_fake_model::peers::env("codex", &scratch, base).unwrap_or_else(|e| panic!("codex: {e}"));
        let (mut codex_gaps, mut codex_spans) = through(&codex, &[], &env, &cwd, &server, n).await;
        let codex_call_ms = median_ms(&mut codex_spans);
        out["codex_ms"] = json!(median_ms(&mut codex_gaps));
        out["codex_call_ms"] = json!(codex_call_ms);
        out["codex_overhead_ms"] = json!(codex_call_ms - direct_ms);
    }
    println!("{out}");
}
