//! `pier-bench`: the pier side of the benchmark suite (see `bench/run.sh`).
//!
//! - `agent`: an ACP agent on pier's core that answers a prompt with N
//!   `agent_message_chunk` notifications of about 100 bytes, then `end_turn`,
//!   and answers the no-op extension request `_bench/ping`.
//! - `client CMD…`: drives any agent over stdio: B1 (updates/s), B2 (ping or
//!   `session/new` round trips), and prints one JSON line of results.
//! - `limit`: the same bytes through a pipe, parsed with serde_json alone.
//! - `floor`: B2's floor, a line echoed by a blocking child with no protocol at all.
//! - `log -- DB`: B5's durable event appends/s from concurrent writers, then a fill
//!   of the log for the replay.
//! - `replay -- URL`: B5's SSE replay of every stored event from `pier serve`.
//! - `host -- PIER`: B5 end to end, `pier run` of N trivial tasks against the bench agent.
//! - `startup CMD…`: spawn → `initialize` answered → `session/new` answered.
//! - `sessions CMD…`: opens sessions and reports the agent's RSS.

#![allow(clippy::print_stdout)]

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agent_client_protocol_schema::ProtocolVersion;
use agent_client_protocol_schema::v1::{
    ContentBlock, ContentChunk, Error, InitializeResponse, NewSessionResponse, PromptResponse, SessionNotification,
    SessionUpdate, StopReason, TextContent,
};
use futures::future::BoxFuture;
use pier_acp::{Connection, ConnectionConfig, Handler, RequestCx};
use serde_json::{Value, json};

const CHUNK: &str = "The quick brown fox jumps over the lazy dog while the benchmark counts every single message. ok";

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct BenchAgent {
    sessions: AtomicU64,
}

impl Handler for BenchAgent {
    fn request(&self, cx: RequestCx, method: String, params: Value) -> BoxFuture<'static, Result<Value, Error>> {
        let n = self.sessions.fetch_add(u64::from(method == "session/new"), Ordering::Relaxed);
        Box::pin(async move {
            match method.as_str() {
                "initialize" => Ok(json!(InitializeResponse::new(ProtocolVersion::V1))),
                "session/new" => Ok(json!(NewSessionResponse::new(format!("s{n}")))),
                "_bench/ping" => Ok(json!({})),
                "session/prompt" => {
                    let sid = params["sessionId"].as_str().unwrap_or("s").to_owned();
                    let count: u64 =
                        params["prompt"][0]["text"].as_str().and_then(|t| t.trim().parse().ok()).unwrap_or(1);
                    for _ in 0..count {
                        let note = SessionNotification::new(
                            sid.clone(),
                            SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(
                                CHUNK,
                            )))),
                        );
                        if cx.conn.notify("session/update", &note).await.is_err() {
                            break;
                        }
                    }
                    Ok(json!(PromptResponse::new(StopReason::EndTurn)))
                }
                _ => Err(Error::method_not_found()),
            }
        })
    }

    fn notification(&self, _conn: &Connection, _method: &str, _params: Value) {}
}

struct Counter {
    updates: Arc<AtomicU64>,
}

impl Handler for Counter {
    fn request(&self, _cx: RequestCx, _m: String, _p: Value) -> BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async { Err(Error::method_not_found()) })
    }
    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        // A real client reads each update into the schema type; so does the bench.
        if method == "session/update" && serde_json::from_value::<SessionNotification>(params).is_ok() {
            self.updates.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn agent() {
    let (reader, writer) = pier_acp::stdio::streams();
    let conn = Connection::spawn(
        reader,
        writer,
        Arc::new(BenchAgent { sessions: AtomicU64::new(0) }),
        ConnectionConfig::default(),
    );
    conn.closed().await;
}

fn spawn(cmd: &[String]) -> tokio::process::Child {
    let Some((program, rest)) = cmd.split_first() else { panic!("give the agent command after --") };
    match tokio::process::Command::new(program)
        .args(rest)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => panic!("spawn {program}: {e}"),
    }
}

/// Ends the agent and everything it started (Node agents start helpers of their own).
async fn end(mut child: tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
    }
    let _ = child.wait().await;
}

fn connect(child: &mut tokio::process::Child, updates: Arc<AtomicU64>) -> Connection {
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else { panic!("pipes") };
    Connection::spawn(stdout, stdin, Arc::new(Counter { updates }), ConnectionConfig::default())
}

async fn call(conn: &Connection, method: &str, params: Value) -> Value {
    match conn.request_value(method, &params).await {
        Ok(v) => v,
        Err(e) => panic!("{method}: {e}"),
    }
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    field("VmHWM:").max(field("VmRSS:"))
}

async fn client(args: &[String], cmd: &[String]) {
    let updates_wanted = arg(args, "--updates", 100_000);
    let rtts = arg(args, "--rtt", 20_000);
    let rtt_method = if args.iter().any(|a| a == "--rtt-session-new") { "session/new" } else { "_bench/ping" };
    let updates = Arc::new(AtomicU64::new(0));
    let mut child = spawn(cmd);
    let pid = child.id().unwrap_or(0);
    let conn = connect(&mut child, updates.clone());
    call(&conn, "initialize", json!({"protocolVersion": 1})).await;
    let cwd = std::env::current_dir().map(|p| p.display().to_string()).unwrap_or_else(|_| "/".into());
    let session = call(&conn, "session/new", json!({"cwd": cwd, "mcpServers": []})).await;
    let sid = session["sessionId"].as_str().unwrap_or("").to_owned();
    // B1.
    let started = Instant::now();
    let prompt = json!({"sessionId": sid, "prompt": [{"type": "text", "text": updates_wanted.to_string()}]});
    call(&conn, "session/prompt", prompt).await;
    let b1 = started.elapsed();
    let got = updates.load(Ordering::Relaxed);
    let agent_rss_kb = rss_kb(pid);
    let own_rss_kb = rss_kb(std::process::id());
    // B2.
    let mut lat = Vec::with_capacity(rtts as usize);
    for _ in 0..rtts {
        let t = Instant::now();
        let params = if rtt_method == "session/new" { json!({"cwd": cwd, "mcpServers": []}) } else { json!({}) };
        call(&conn, rtt_method, params).await;
        lat.push(t.elapsed());
    }
    lat.sort();
    let pct = |p: f64| lat.get(((lat.len() as f64 - 1.0) * p) as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6);
    let bytes = serde_json::to_vec(&json!({"jsonrpc":"2.0","method":"session/update","params": SessionNotification::new(sid.clone(), SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(CHUNK)))))})).map_or(0, |v| v.len() + 1);
    println!(
        "{}",
        json!({
            "updates": got, "seconds": b1.as_secs_f64(),
            "msgs_per_s": got as f64 / b1.as_secs_f64(),
            "mb_per_s": (got as f64 * bytes as f64) / b1.as_secs_f64() / 1e6,
            "frame_bytes": bytes,
            "rtt_method": rtt_method, "rtt_p50_us": pct(0.5), "rtt_p99_us": pct(0.99),
            "agent_peak_rss_kb": agent_rss_kb, "client_peak_rss_kb": own_rss_kb,
        })
    );
    drop(conn);
    end(child).await;
}

/// The serde-only limit: the same frames through a pipe, parsed into schema types.
fn limit(args: &[String]) {
    use std::io::{BufRead, Write};
    let n = arg(args, "--updates", 100_000);
    let note = json!({"jsonrpc":"2.0","method":"session/update","params": SessionNotification::new("s", SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(CHUNK)))))});
    let mut frame = serde_json::to_vec(&note).unwrap_or_default();
    frame.push(b'\n');
    let (reader, mut writer) = match std::io::pipe() {
        Ok(p) => p,
        Err(e) => panic!("pipe: {e}"),
    };
    let started = Instant::now();
    let w = std::thread::spawn(move || {
        let mut out = std::io::BufWriter::with_capacity(1 << 16, &mut writer);
        for _ in 0..n {
            let _ = out.write_all(&frame);
        }
        let _ = out.flush();
    });
    let mut count = 0u64;
    let mut lines = std::io::BufReader::with_capacity(1 << 16, reader);
    let mut line = Vec::new();
    #[derive(serde::Deserialize)]
    struct Frame {
        #[allow(dead_code)]
        jsonrpc: String,
        #[allow(dead_code)]
        method: String,
        params: SessionNotification,
    }
    while lines.read_until(b'\n', &mut line).map_or(0, |n| n) > 0 {
        if let Ok(frame) = serde_json::from_slice::<Frame>(&line) {
            std::hint::black_box(frame.params);
            count += 1;
        }
        line.clear();
        if count == n {
            break;
        }
    }
    let _ = w.join();
    let s = started.elapsed().as_secs_f64();
    println!("{}", json!({"updates": count, "seconds": s, "msgs_per_s": count as f64 / s}));
}

/// The floor of B2: a request-sized line echoed by a blocking child (std only, no
/// runtime, no parsing), timed the same way. What any implementation pays for two
/// pipe writes and two wake-ups on this machine.
fn floor(args: &[String]) {
    use std::io::{BufRead, Write};
    let rtts = arg(args, "--rtt", 20_000);
    let exe = std::env::current_exe().unwrap_or_else(|_| "pier-bench".into());
    let mut child =
        match std::process::Command::new(exe).arg("echo").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn() {
            Ok(c) => c,
            Err(e) => panic!("spawn the echo child: {e}"),
        };
    let (Some(mut to), Some(from)) = (child.stdin.take(), child.stdout.take()) else { panic!("pipes") };
    let mut from = std::io::BufReader::new(from);
    let cwd = std::env::current_dir().map(|p| p.display().to_string()).unwrap_or_else(|_| "/".into());
    let mut request = serde_json::to_vec(
        &json!({"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": cwd, "mcpServers": []}}),
    )
    .unwrap_or_default();
    request.push(b'\n');
    let mut line = Vec::new();
    let mut lat = Vec::with_capacity(rtts as usize);
    for _ in 0..rtts {
        let t = Instant::now();
        line.clear();
        if to.write_all(&request).is_err() || from.read_until(b'\n', &mut line).unwrap_or(0) == 0 {
            break;
        }
        lat.push(t.elapsed());
    }
    drop(to);
    let _ = child.wait();
    lat.sort();
    let pct = |p: f64| lat.get(((lat.len() as f64 - 1.0) * p) as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6);
    println!("{}", json!({"rtt_p50_us": pct(0.5), "rtt_p99_us": pct(0.99)}));
}

fn echo() {
    use std::io::{BufRead, Write};
    let mut input = std::io::stdin().lock();
    let mut output = std::io::stdout().lock();
    let mut line = Vec::new();
    while input.read_until(b'\n', &mut line).unwrap_or(0) > 0 {
        if output.write_all(&line).and_then(|()| output.flush()).is_err() {
            break;
        }
        line.clear();
    }
}

/// B5's event log: durable appends from concurrent writers (each append its own
/// commit, as the host's recorders make them), then a fill to `--fill` events for
/// the replay benchmark.
fn log(args: &[String], db: &str) {
    let writers = arg(args, "--writers", 8);
    let appends = arg(args, "--appends", 40_000);
    let fill = arg(args, "--fill", 0);
    let store = match pier_host::SqliteStore::open(std::path::Path::new(db)) {
        Ok(s) => Arc::new(s),
        Err(e) => panic!("open {db}: {e}"),
    };
    let plan = match pier_host::plan::parse("[[tasks]]\nid = \"t\"\nprompt = \"x\"\n", &|_| Ok(())) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let _ = pier_host::TaskStore::create_run(store.as_ref(), "bench", &plan, "bench");
    let note = |n: u64| {
        let update = SessionNotification::new(
            "s",
            SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(CHUNK)))),
        );
        ("bench".to_owned(), Some("t".to_owned()), "session_update".to_owned(), json!({"n": n, "update": update}))
    };
    let started = Instant::now();
    let threads: Vec<_> = (0..writers)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..appends / writers {
                    if let Err(e) = pier_host::TaskStore::append_events(store.as_ref(), &[note(w * 1_000_000 + i)]) {
                        panic!("append: {e}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    let s = started.elapsed().as_secs_f64();
    let done = appends / writers * writers;
    let mut have = pier_host::TaskStore::last_seq(store.as_ref()).unwrap_or(0) as u64;
    while have < fill {
        let batch: Vec<_> = (0..(fill - have).min(10_000)).map(note).collect();
        have = pier_host::TaskStore::append_events(store.as_ref(), &batch).unwrap_or(0) as u64;
    }
    println!(
        "{}",
        json!({"writers": writers, "appends": done, "seconds": s, "appends_per_s": done as f64 / s, "events_stored": have})
    );
}

/// B5's replay: every stored event from sequence 0 over `GET /events` (SSE) of a
/// running `pier serve`, counted and checked for gaps by one client.
async fn replay(args: &[String], url: &str) {
    let token = args.iter().position(|a| a == "--token").and_then(|i| args.get(i + 1)).cloned().unwrap_or_default();
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut response = match client
        .get(format!("{url}/events?after=0&follow=false"))
        .bearer_auth(token)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
    {
        Ok(r) => r,
        Err(e) => panic!("GET /events: {e}"),
    };
    let (mut count, mut last, mut gaps, mut bytes) = (0u64, 0i64, 0u64, 0usize);
    let mut carry: Vec<u8> = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        bytes += chunk.len();
        carry.extend_from_slice(&chunk);
        let mut start = 0;
        while let Some(end) = carry[start..].iter().position(|&b| b == b'\n') {
            let line = &carry[start..start + end];
            if let Some(id) = line.strip_prefix(b"id:") {
                let seq: i64 = std::str::from_utf8(id).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
                gaps += u64::from(seq != last + 1);
                last = seq;
                count += 1;
            }
            start += end + 1;
        }
        carry.drain(..start);
    }
    let s = started.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({"events": count, "last_seq": last, "gaps": gaps, "seconds": s, "events_per_s": count as f64 / s,
               "mb_per_s": bytes as f64 / s / 1e6})
    );
}

/// B5 end to end: `pier run` of a plan of independent trivial tasks against the bench
/// agent (one update per prompt), every commit durable, timed as a whole process.
async fn host(args: &[String], cmd: &[String]) {
    let tasks = arg(args, "--tasks", 10_000);
    let concurrency = arg(args, "--concurrency", 8);
    let Some(pier) = cmd.first() else { panic!("give the pier binary after --") };
    let dir = std::env::temp_dir().join(format!("pier-bench-host-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let write = |name: &str, text: String| {
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(name), text)) {
            panic!("write {name}: {e}");
        }
    };
    let exe = std::env::current_exe().unwrap_or_else(|_| "pier-bench".into());
    write("pier.toml", format!("[agents.bench]\ncommand = {:?}\nargs = [\"agent\"]\n", exe.display().to_string()));
    let mut plan = String::from("[defaults]\nagent = \"bench\"\n");
    for i in 0..tasks {
        plan.push_str(&format!("\n[[tasks]]\nid = \"t{i}\"\nprompt = \"1\"\n"));
    }
    write("plan.toml", plan);
    let started = Instant::now();
    let out = tokio::process::Command::new(pier)
        .args(["run", "plan.toml", "--format", "json", "--concurrency", &concurrency.to_string()])
        .current_dir(&dir)
        .env("PIER_HOME", dir.join("home"))
        .stderr(Stdio::inherit())
        .output()
        .await;
    let seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    let out = match out {
        Ok(o) => o,
        Err(e) => panic!("run {pier}: {e}"),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let summary: Value = text.lines().last().and_then(|l| serde_json::from_str(l).ok()).unwrap_or_default();
    let completed = summary["counts"]["completed"].as_u64().unwrap_or(0);
    println!(
        "{}",
        json!({"tasks": tasks, "completed": completed, "concurrency": concurrency, "seconds": seconds,
               "tasks_per_s": completed as f64 / seconds, "events": text.lines().count().saturating_sub(1)})
    );
}

async fn startup(args: &[String], cmd: &[String]) {
    let n = arg(args, "--n", 20);
    let mut init = Vec::new();
    let mut new = Vec::new();
    for _ in 0..n {
        let started = Instant::now();
        let mut child = spawn(cmd);
        let conn = connect(&mut child, Arc::new(AtomicU64::new(0)));
        call(&conn, "initialize", json!({"protocolVersion": 1})).await;
        init.push(started.elapsed());
        let cwd = std::env::current_dir().map(|p| p.display().to_string()).unwrap_or_else(|_| "/".into());
        call(&conn, "session/new", json!({"cwd": cwd, "mcpServers": []})).await;
        new.push(started.elapsed());
        drop(conn);
        end(child).await;
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    println!("{}", json!({"initialize_ms": median(&mut init), "session_new_ms": median(&mut new)}));
}

async fn sessions(args: &[String], cmd: &[String]) {
    let n = arg(args, "--sessions", 1000);
    let mut child = spawn(cmd);
    let pid = child.id().unwrap_or(0);
    let conn = connect(&mut child, Arc::new(AtomicU64::new(0)));
    call(&conn, "initialize", json!({"protocolVersion": 1})).await;
    let idle = rss_kb(pid);
    let cwd = std::env::current_dir().map(|p| p.display().to_string()).unwrap_or_else(|_| "/".into());
    for _ in 0..n {
        call(&conn, "session/new", json!({"cwd": cwd, "mcpServers": []})).await;
    }
    let with = rss_kb(pid);
    println!("{}", json!({"idle_rss_kb": idle, "sessions": n, "rss_with_sessions_kb": with}));
    drop(conn);
    end(child).await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let (opts, cmd) = (&args[..split], args.get(split + 1..).unwrap_or(&[]));
    match opts.first().map(String::as_str) {
        Some("agent") => agent().await,
        Some("client") => client(opts, cmd).await,
        Some("limit") => limit(opts),
        Some("floor") => floor(opts),
        Some("host") => host(opts, cmd).await,
        Some("log") => log(opts, cmd.first().map_or("bench.db", String::as_str)),
        Some("replay") => replay(opts, cmd.first().map_or("http://127.0.0.1:8477", String::as_str)).await,
        Some("echo") => echo(),
        Some("startup") => startup(opts, cmd).await,
        Some("sessions") => sessions(opts, cmd).await,
        _ => eprintln!(
            "usage: pier-bench agent | client [--updates N] [--rtt N] -- CMD | limit | floor | host -- PIER | log -- DB | replay -- URL | startup -- CMD | sessions -- CMD"
        ),
    }
}
