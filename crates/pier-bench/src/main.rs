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
//! - `host [--pg SERVER] -- PIER`: B5 end to end, `pier run` of N trivial tasks against the
//!   bench agent, on SQLite or (with `--pg`) a fresh PostgreSQL database.
//! - `serve [--nodes N] [--pg SERVER] -- PIER`: B5 on `pier serve`, N nodes on one store.
//! - `claims [--keys N] [--pg SERVER]`: the claim rate alone, 16 concurrent claimers (with N concurrency keys).
//! - `startup CMD…`: spawn → `initialize` answered → `session/new` answered.
//! - `sessions CMD…`: opens sessions and reports the agent's RSS.
//! - `stream --kind K CMD…`: B6, one answer of N tokens streamed by the fake model as fast as
//!   it can, through the agent (pier, codex-acp or claude-agent-acp, each pointed at a fake
//!   started here) to a client that counts `agent_message_chunk`s and times every token.
//! - `delegate --pier PATH`: B7, a delegation (spawn → answer) beside the same child run
//!   directly ([`delegate`]).
//! - `jail-startup --pier PATH CMD…` and `egress`: B8, an agent's start open and jailed, and a
//!   request direct and through the egress proxy ([`jail`]).

#![allow(clippy::print_stdout)]

mod delegate;
mod gateway;
mod jail;
mod latency;
mod mcp;
mod workers;

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

fn text_arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

/// With `--pg SERVER`, a fresh database on that PostgreSQL server for one measurement
/// (dropped with it); without, `None` (the SQLite default).
fn bench_db(args: &[String]) -> Option<pier_host::store::ScratchDatabase> {
    let server = text_arg(args, "--pg")?;
    Some(pier_host::store::ScratchDatabase::create(server, "pier_bench").unwrap_or_else(|e| panic!("--pg: {e}")))
}

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
                    // B11: a stamped prompt is answered with how long it took to come.
                    if let Some(said) = params["prompt"][0]["text"].as_str().and_then(latency::answer) {
                        let note = SessionNotification::new(
                            sid,
                            SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(
                                said,
                            )))),
                        );
                        let _ = cx.conn.notify("session/update", &note).await;
                        return Ok(json!(PromptResponse::new(StopReason::EndTurn)));
                    }
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
    let db = bench_db(args);
    let store = db.as_ref().map_or_else(|| dir.join("home/pier.db").display().to_string(), |d| d.url().to_owned());
    let started = Instant::now();
    let out = tokio::process::Command::new(pier)
        .args(["run", "plan.toml", "--format", "json", "--concurrency", &concurrency.to_string()])
        .args(["--store", &store])
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
               "store": if db.is_some() { "postgres" } else { "sqlite" },
               "tasks_per_s": completed as f64 / seconds, "events": text.lines().count().saturating_sub(1)})
    );
}

/// B5, several runs at once on one `pier serve`: `--runs` plans of `--tasks` trivial tasks
/// each, submitted together over HTTP to a server whose one host runs them all under a global
/// `--concurrency`; timed from the first submit to the last completion seen on `/events`.
/// Starts `nodes` `pier serve` processes on one store, each answering `/health`: the
/// processes and their addresses.
async fn start_servers(
    pier: &str,
    dir: &std::path::Path,
    store: &str,
    nodes: u64,
    concurrency: u64,
) -> (Vec<tokio::process::Child>, Vec<String>) {
    let http = reqwest::Client::new();
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    let mut servers = Vec::new();
    let mut bases = Vec::new();
    for n in 0..nodes {
        let port = port + n as u16;
        let server = tokio::process::Command::new(pier)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--token", "bench"])
            .args(["--concurrency", &concurrency.to_string(), "--store", store])
            .current_dir(dir)
            .env("PIER_HOME", dir.join(format!("home{n}")))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{pier}: {e}"));
        servers.push(server);
        let base = format!("http://127.0.0.1:{port}");
        for _ in 0..200 {
            if http.get(format!("{base}/health")).bearer_auth("bench").send().await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bases.push(base);
    }
    (servers, bases)
}

/// Follows `/events` from the start until `want` tasks have completed; how many did.
async fn count_completed(http: &reqwest::Client, base: &str, want: u64) -> u64 {
    let mut completed = 0u64;
    let response = http
        .get(format!("{base}/events?after=0"))
        .bearer_auth("bench")
        .send()
        .await
        .unwrap_or_else(|e| panic!("events: {e}"));
    let mut stream = response.bytes_stream();
    let mut line = Vec::new();
    use futures::StreamExt;
    'read: while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        for b in chunk {
            if b != b'\n' {
                line.push(b);
                continue;
            }
            if line.starts_with(b"data:") && line.windows(16).any(|w| w == b"\"to\":\"completed\"") {
                completed += 1;
                if completed == want {
                    break 'read;
                }
            }
            line.clear();
        }
    }
    completed
}

async fn serve_runs(args: &[String], cmd: &[String]) {
    let runs = arg(args, "--runs", 10);
    let tasks = arg(args, "--tasks", 1_000);
    let concurrency = arg(args, "--concurrency", 8);
    let Some(pier) = cmd.first() else { panic!("give the pier binary after --") };
    let dir = workers::scratch("serve");
    let nodes = arg(args, "--nodes", 1).max(1);
    let db = bench_db(args);
    let store = db.as_ref().map_or_else(|| dir.join("home/pier.db").display().to_string(), |d| d.url().to_owned());
    let (servers, bases) = start_servers(pier, &dir, &store, nodes, concurrency).await;
    let http = reqwest::Client::new();
    let base = bases[0].clone();
    let mut plan = String::from("[defaults]\nagent = \"bench\"\n");
    for i in 0..tasks {
        plan.push_str(&format!("\n[[tasks]]\nid = \"t{i}\"\nprompt = \"1\"\n"));
    }
    let started = Instant::now();
    let submits = (0..runs).map(|r| {
        let body = json!({"plan": plan, "run_id": format!("run{r}")}).to_string();
        http.post(format!("{}/runs", bases[r as usize % bases.len()]))
            .bearer_auth("bench")
            .header("content-type", "application/json")
            .body(body)
            .send()
    });
    for submitted in futures::future::join_all(submits).await {
        if let Err(e) = submitted.and_then(reqwest::Response::error_for_status) {
            panic!("submit: {e}");
        }
    }
    let want = runs * tasks;
    let completed = count_completed(&http, &base, want).await;
    let seconds = started.elapsed().as_secs_f64();
    for mut server in servers {
        let _ = server.start_kill();
        let _ = server.wait().await;
    }
    drop(db);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{}",
        json!({"runs": runs, "tasks": want, "completed": completed, "concurrency": concurrency, "nodes": nodes,
               "store": if store.starts_with("postgres") { "postgres" } else { "sqlite" }, "seconds": seconds,
               "tasks_per_s": completed as f64 / seconds})
    );
}

/// The claim rate alone: `--claimers` threads claim the `--tasks` pending tasks of one run
/// (each task offered to two claimers at once, so half the claims race and lose) and end
/// each claimed attempt; the store is SQLite in a temporary file, or PostgreSQL with `--pg`.
/// With `--keys N`, task `i` holds concurrency key `k{i % N}` (limit: the claimers, so no claim
/// waits for one and the figure is what counting the holders costs).
fn claims(args: &[String]) {
    let tasks = arg(args, "--tasks", 10_000);
    let claimers = arg(args, "--claimers", 16).max(2);
    let keys = arg(args, "--keys", 0);
    let db = bench_db(args);
    let dir = std::env::temp_dir().join(format!("pier-bench-claims-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let spec = db.as_ref().map_or_else(|| dir.join("pier.db").display().to_string(), |d| d.url().to_owned());
    let store = pier_host::store::open(&spec).unwrap_or_else(|e| panic!("{e}"));
    let mut plan = String::new();
    for i in 0..tasks {
        plan.push_str(&format!("[[tasks]]\nid = \"t{i}\"\nprompt = \"1\"\n"));
        if keys > 0 {
            plan.push_str(&format!("concurrency = [{{ key = \"k{}\", limit = {claimers} }}]\n", i % keys));
        }
        plan.push('\n');
    }
    let plan = pier_host::plan::parse(&plan, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    store.create_run("bench", &plan, "bench").unwrap_or_else(|e| panic!("{e}"));
    let next = Arc::new(AtomicU64::new(0));
    let won = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let threads: Vec<_> = (0..claimers)
        .map(|c| {
            let (store, next, won) = (store.clone(), next.clone(), won.clone());
            std::thread::spawn(move || {
                let owner = format!("claimer-{c}");
                loop {
                    // Two claimers per task: the pair (2k, 2k+1) both try task k.
                    let i = next.fetch_add(1, Ordering::Relaxed) / 2;
                    if i >= tasks {
                        return;
                    }
                    let far = pier_host::store::now_ms() + 600_000;
                    if let Ok(Some((attempt, _))) = store.claim("bench", &format!("t{i}"), &owner, far) {
                        won.fetch_add(1, Ordering::Relaxed);
                        let done = pier_host::Ending::Completed { result: String::new(), usage: None };
                        let _ = store.finish(&attempt, &done, None);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    let seconds = started.elapsed().as_secs_f64();
    let won = won.load(Ordering::Relaxed);
    drop(store);
    drop(db);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{}",
        json!({"tasks": tasks, "claimers": claimers, "keys": keys, "claimed": won, "seconds": seconds,
               "store": if spec.starts_with("postgres") { "postgres" } else { "sqlite" },
               "claims_per_s": won as f64 / seconds})
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

/// B6's counting client: what it saw of the one streamed answer.
#[derive(Default)]
struct StreamStats {
    /// `agent_message_chunk` updates and the bytes of their text.
    deltas: u64,
    text_bytes: usize,
    /// Bytes of chunks that are not the stream's next text, and the first of them.
    mismatched: usize,
    foreign: String,
    other_updates: u64,
    /// The chunks that carried the stream's text, and when the first and last arrived.
    token_deltas: u64,
    first: Option<Instant>,
    last: Option<Instant>,
    /// When each whole token had arrived (the chunk that completed it), in order.
    token_received: Vec<Instant>,
}

struct StreamCounter {
    token: Vec<u8>,
    stats: std::sync::Mutex<StreamStats>,
}

impl StreamCounter {
    fn note_text(&self, text: &str, at: Instant) {
        let mut s = self.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let len = self.token.len().max(1);
        let start = s.text_bytes;
        s.deltas += 1;
        if text.bytes().enumerate().any(|(i, b)| self.token.get((start + i) % len) != Some(&b)) {
            // Not the stream's next text (an agent's own notice): counted apart.
            s.mismatched += text.len();
            if s.foreign.len() < 200 {
                s.foreign.push_str(text);
            }
            return;
        }
        s.text_bytes += text.len();
        s.token_deltas += 1;
        s.first.get_or_insert(at);
        s.last = Some(at);
        let whole = s.text_bytes / len;
        while s.token_received.len() < whole {
            s.token_received.push(at);
        }
    }
}

impl Handler for StreamCounter {
    fn request(&self, _cx: RequestCx, _m: String, _p: Value) -> BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async { Err(Error::method_not_found()) })
    }
    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        let at = Instant::now();
        if method != "session/update" {
            return;
        }
        // Read into the schema type, as an editor would.
        match serde_json::from_value::<SessionNotification>(params) {
            Ok(SessionNotification {
                update: SessionUpdate::AgentMessageChunk(ContentChunk { content: ContentBlock::Text(t), .. }),
                ..
            }) => self.note_text(&t.text, at),
            _ => self.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner).other_updates += 1,
        }
    }
}

/// The fake model on a thread and runtime of its own, so serving the stream does not
/// share the client's thread. Stops when `stop` is dropped.
fn start_fake() -> (pier_fake_model::FakeModel, tokio::sync::oneshot::Sender<()>) {
    let (fake_tx, fake_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => panic!("fake model runtime: {e}"),
        };
        rt.block_on(async move {
            let _ = fake_tx.send(pier_fake_model::FakeModel::start().await);
            let _ = stopped.await;
        });
    });
    match fake_rx.recv() {
        Ok(Ok(fake)) => (fake, stop),
        Ok(Err(e)) => panic!("fake model: {e}"),
        Err(e) => panic!("fake model thread: {e}"),
    }
}

/// How each agent is pointed at the fake model, offline: pier by its variables, the others
/// as the interop check and the subagent tests do (`pier_fake_model::peers`).
fn stream_env(kind: &str, scratch: &std::path::Path, base: &str) -> Vec<(String, String)> {
    if kind != "pier" {
        return pier_fake_model::peers::env(kind, scratch, base).unwrap_or_else(|e| panic!("--kind {kind}: {e}"));
    }
    vec![
        ("HOME".to_owned(), scratch.join("home").display().to_string()),
        ("PIER_HOME".to_owned(), scratch.join("pier-home").display().to_string()),
        ("PIER_BASE_URL".to_owned(), base.to_owned()),
        ("PIER_MODEL".to_owned(), "fake-model".to_owned()),
        ("PIER_API_KEY".to_owned(), "fake-key".to_owned()),
    ]
}

/// The processes in process group `pgid` (the agent and everything it started).
fn group_pids(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // After the command's closing parenthesis: state, ppid, pgrp.
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(2)?.parse::<u32>().ok())
                == Some(pgid)
        })
        .collect()
}

fn status_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Samples the summed RSS of a process group every 10 ms until told to stop; returns the
/// peak sum and the most processes seen at once.
fn sample_group(pgid: u32, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<(u64, usize)> {
    std::thread::spawn(move || {
        let (mut peak, mut procs) = (0u64, 0usize);
        while !stop.load(Ordering::Relaxed) {
            let pids = group_pids(pgid);
            procs = procs.max(pids.len());
            peak = peak.max(pids.iter().map(|&p| status_kb(p, "VmRSS:")).sum());
            std::thread::sleep(Duration::from_millis(10));
        }
        (peak, procs)
    })
}

fn percentile_us(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
}

/// Send → receipt of each whole token, in µs (both instants on this process's monotonic clock).
fn latencies(sent: &[Instant], received: &[Instant]) -> Vec<f64> {
    let mut lat: Vec<f64> = sent
        .iter()
        .zip(received)
        .map(|(s, r)| match r.checked_duration_since(*s) {
            Some(d) => d.as_secs_f64() * 1e6,
            None => -(s.duration_since(*r).as_secs_f64() * 1e6),
        })
        .collect();
    lat.sort_by(f64::total_cmp);
    lat
}

/// The fake model's stream read straight over HTTP (Chat Completions), no agent: the
/// ceiling of the fake and the latency of loopback HTTP + SSE alone.
async fn stream_direct(base: &str, token: &str) -> StreamCounter {
    let counter = StreamCounter { token: token.as_bytes().to_vec(), stats: Default::default() };
    let body = json!({"model": "fake-model", "stream": true, "messages": [{"role": "user", "content": "Stream."}]});
    let mut response = match reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
    {
        Ok(r) => r,
        Err(e) => panic!("POST /chat/completions: {e}"),
    };
    let mut carry: Vec<u8> = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        let at = Instant::now();
        carry.extend_from_slice(&chunk);
        let mut start = 0;
        while let Some(end) = carry[start..].iter().position(|&b| b == b'\n') {
            // The fake's chunks are known: take `"content":"…"` without a JSON parse, so
            // this reader costs less than any agent.
            let line = &carry[start..start + end];
            const KEY: &[u8] = b"\"content\":\"";
            if let Some(at_key) = line.windows(KEY.len()).position(|w| w == KEY) {
                let text = &line[at_key + KEY.len()..];
                let text = &text[..text.iter().position(|&b| b == b'"').unwrap_or(text.len())];
                counter.note_text(std::str::from_utf8(text).unwrap_or(""), at);
            }
            start += end + 1;
        }
        carry.drain(..start);
    }
    counter
}

/// B6: one prompt answered with `--tokens` deltas streamed by the fake model as fast as it
/// can, through the agent (`--kind pier|codex|claude`, the command after `--`), or read
/// straight from the fake (`--kind direct`). Counts the agent's `agent_message_chunk`
/// updates, checks their text, times the stream and each token, and reads the agent's RSS.
/// Streams one prompt through the agent `cmd` (run in `work`), counting what it shows: the
/// counter, when the prompt went out and was answered, and the peaks of its memory (its own,
/// its process group's, the sampled group, the processes seen).
async fn stream_agent(
    cmd: &[String],
    env: &[(String, String)],
    work: &std::path::Path,
    scratch: &std::path::Path,
    token: &str,
    timeout: Duration,
    result: &mut Value,
) -> (Arc<StreamCounter>, Instant, Instant, (u64, u64, u64, usize)) {
    let Some((program, rest)) = cmd.split_first() else { panic!("give the agent command after --") };
    // The agent runs in a scratch directory: a relative program path is resolved here.
    let program = if program.contains('/') {
        std::path::absolute(program).map_or(program.clone(), |p| p.display().to_string())
    } else {
        program.clone()
    };
    let stderr = std::fs::File::create(scratch.join("agent.stderr")).map(Stdio::from).unwrap_or(Stdio::null());
    let mut child = match tokio::process::Command::new(&program)
        .args(rest)
        .envs(env.iter().cloned())
        .current_dir(work)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => panic!("spawn {program}: {e}"),
    };
    let pid = child.id().unwrap_or(0);
    let counter = Arc::new(StreamCounter { token: token.as_bytes().to_vec(), stats: Default::default() });
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else { panic!("pipes") };
    let conn = Connection::spawn(stdout, stdin, counter.clone(), ConnectionConfig::default());
    call(&conn, "initialize", json!({"protocolVersion": 1, "clientCapabilities": {}})).await;
    let session = call(&conn, "session/new", json!({"cwd": work.display().to_string(), "mcpServers": []})).await;
    let sid = session["sessionId"].as_str().unwrap_or("").to_owned();
    let stop_sampling = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_group(pid, stop_sampling.clone());
    let prompt_sent = Instant::now();
    let prompt = json!({"sessionId": sid, "prompt": [{"type": "text", "text": "Stream your answer."}]});
    let answer = tokio::time::timeout(timeout, conn.request_value("session/prompt", &prompt)).await;
    let answered = Instant::now();
    match answer {
        Ok(Ok(v)) => result["stop_reason"] = v["stopReason"].clone(),
        Ok(Err(e)) => result["error"] = json!(e.to_string()),
        Err(_) => result["error"] = json!("timed out"),
    }
    // Peaks read before the agent ends: its own, and the sum over its process group.
    let group = group_pids(pid);
    let agent_hwm = status_kb(pid, "VmHWM:");
    let group_hwm: u64 = group.iter().map(|&p| status_kb(p, "VmHWM:")).sum();
    stop_sampling.store(true, Ordering::Relaxed);
    let (group_rss_peak, procs) = sampler.join().unwrap_or((0, 0));
    drop(conn);
    end(child).await;
    (counter, prompt_sent, answered, (agent_hwm, group_hwm, group_rss_peak, procs.max(group.len())))
}

async fn stream(args: &[String], cmd: &[String]) {
    let tokens = arg(args, "--tokens", 20_000) as usize;
    let timeout = Duration::from_secs(arg(args, "--timeout-s", 600));
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let kind = flag("--kind").unwrap_or_else(|| "pier".into());
    let token = flag("--token").unwrap_or_else(|| "tok ".into());
    let (fake, stop_fake) = start_fake();
    fake.push(pier_fake_model::Reply::tokens(&token, tokens));
    // Anything else the agent asks (a title, a second request) gets a short answer.
    fake.set_fallback(|_| pier_fake_model::Reply::text("ok"));
    let base = fake.base_url();
    let scratch = std::env::temp_dir().join(format!("pier-bench-stream-{}", std::process::id()));
    let work = scratch.join("work");
    if let Err(e) = std::fs::create_dir_all(&work) {
        panic!("create {}: {e}", work.display());
    }
    let mut result = json!({"kind": kind, "tokens_expected": tokens});
    let started = Instant::now();
    let (counter, prompt_sent, answered, rss) = if kind == "direct" {
        let counter = stream_direct(&base, &token).await;
        (Arc::new(counter), started, Instant::now(), None)
    } else {
        let (counter, prompt_sent, answered, rss) =
            stream_agent(cmd, &stream_env(&kind, &scratch, &base), &work, &scratch, &token, timeout, &mut result).await;
        (counter, prompt_sent, answered, Some(rss))
    };
    let sent = fake.token_times();
    drop(stop_fake);
    let s = std::mem::take(&mut *counter.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    let stream_s = match (s.first, s.last) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    let fake_s = match (sent.first(), sent.last()) {
        (Some(a), Some(b)) => b.duration_since(*a).as_secs_f64(),
        _ => 0.0,
    };
    let lat = latencies(&sent, &s.token_received);
    let mean = if lat.is_empty() { 0.0 } else { lat.iter().sum::<f64>() / lat.len() as f64 };
    let expected_bytes = tokens * token.len();
    for (k, v) in [
        ("deltas", json!(s.deltas)),
        ("text_bytes", json!(s.text_bytes)),
        ("text_bytes_expected", json!(expected_bytes)),
        ("text_ok", json!(s.text_bytes == expected_bytes)),
        ("extra_text_bytes", json!(s.mismatched)),
        ("extra_text", json!(s.foreign)),
        ("other_updates", json!(s.other_updates)),
        ("tokens_sent", json!(sent.len())),
        ("stream_s", json!(stream_s)),
        ("token_deltas", json!(s.token_deltas)),
        ("deltas_per_s", json!(s.token_deltas as f64 / stream_s.max(1e-9))),
        ("tokens_per_s", json!((s.text_bytes / token.len().max(1)) as f64 / stream_s.max(1e-9))),
        ("fake_write_s", json!(fake_s)),
        ("fake_tokens_per_s", json!(sent.len() as f64 / fake_s.max(1e-9))),
        ("prompt_to_answer_s", json!(answered.duration_since(prompt_sent).as_secs_f64())),
        ("prompt_to_first_delta_ms", json!(s.first.map_or(0.0, |f| f.duration_since(prompt_sent).as_secs_f64() * 1e3))),
        ("latency_p50_us", json!(percentile_us(&lat, 0.5))),
        ("latency_p99_us", json!(percentile_us(&lat, 0.99))),
        ("latency_max_us", json!(percentile_us(&lat, 1.0))),
        ("latency_mean_us", json!(mean)),
        ("client_peak_rss_kb", json!(rss_kb(std::process::id()))),
    ] {
        result[k] = v;
    }
    if let Some((agent_hwm, group_hwm, group_peak, procs)) = rss {
        result["agent_peak_rss_kb"] = json!(agent_hwm);
        result["group_peak_rss_sum_kb"] = json!(group_hwm);
        result["group_rss_sampled_peak_kb"] = json!(group_peak);
        result["group_processes"] = json!(procs);
    }
    if result.get("error").is_some() || result["text_ok"] != true || s.mismatched > 0 {
        let log = std::fs::read_to_string(scratch.join("agent.stderr")).unwrap_or_default();
        let tail: String =
            log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
        eprintln!("pier-bench stream ({kind}): {}\nagent stderr (tail):\n{tail}", result);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    println!("{result}");
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
        Some("serve") => serve_runs(opts, cmd).await,
        Some("claims") => claims(opts),
        Some("log") => log(opts, cmd.first().map_or("bench.db", String::as_str)),
        Some("replay") => replay(opts, cmd.first().map_or("http://127.0.0.1:8477", String::as_str)).await,
        Some("echo") => echo(),
        Some("startup") => startup(opts, cmd).await,
        Some("jail-startup") => jail::startup(opts, cmd).await,
        Some("egress") => jail::egress(opts).await,
        Some("gateway") => gateway::run(opts).await,
        Some("gateway-serve") => gateway::serve(opts).await,
        Some("sessions") => sessions(opts, cmd).await,
        Some("stream") => stream(opts, cmd).await,
        Some("delegate") => delegate::run(opts).await,
        Some("workers") => workers::run(opts, cmd).await,
        Some("latency") => latency::run(opts, cmd).await,
        Some("mcp") => mcp::run(opts).await,
        _ => eprintln!(
            "usage: pier-bench agent | client [--updates N] [--rtt N] -- CMD | limit | floor | host [--pg SERVER] -- PIER | serve [--runs N] [--tasks N] [--concurrency N] [--nodes N] [--pg SERVER] -- PIER | mcp --pier PATH --server SCRIPT [--codex PATH] [--n N] | latency [--rate N] [--count N] [--concurrency N] [--pg SERVER] -- PIER | claims [--tasks N] [--claimers N] [--keys N] [--pg SERVER] | log -- DB | replay -- URL | startup -- CMD | sessions -- CMD | stream [--kind pier|codex|claude|direct] [--tokens N] [-- CMD]"
        ),
    }
}
