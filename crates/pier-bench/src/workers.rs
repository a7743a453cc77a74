//! B10: agents on a pull worker against agents of the host itself, on one machine.
//!
//! `pier-bench workers --tasks N --concurrency C -- PIER`: the same plan of N one-chunk tasks
//! on the bench agent, once run by a `pier serve`'s own agents (concurrency C), once by one
//! `pier worker` (concurrency C) leasing them through `/v1` from a `pier serve`; tasks per
//! second for each. Then the latency of one progress event: a worker's batch posted to `/v1`
//! until an `/events` reader has it, p50 and p99 over `--events` of them.

use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use crate::{arg, count_completed, start_servers};

pub async fn run(args: &[String], cmd: &[String]) {
    let tasks = arg(args, "--tasks", 500);
    let concurrency = arg(args, "--concurrency", 4);
    let events = arg(args, "--events", 200);
    let Some(pier) = cmd.first() else { panic!("give the pier binary after --") };
    let local = tasks_per_s(pier, tasks, concurrency, false).await;
    let workers = tasks_per_s(pier, tasks, concurrency, true).await;
    let (p50, p99) = progress_latency(pier, events).await;
    println!(
        "{}",
        json!({"tasks": tasks, "concurrency": concurrency, "local_tasks_per_s": local, "worker_tasks_per_s": workers,
               "local_over_worker": local / workers, "progress_p50_ms": p50, "progress_p99_ms": p99})
    );
}

/// A fresh directory for one bench, with a pier.toml naming the bench agent (`bench`).
pub(crate) fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("pier-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let exe = std::env::current_exe().unwrap_or_else(|_| "pier-bench".into());
    let toml = format!("[agents.bench]\ncommand = {:?}\nargs = [\"agent\"]\n", exe.display().to_string());
    std::fs::write(dir.join("pier.toml"), toml).unwrap_or_else(|e| panic!("pier.toml: {e}"));
    dir
}

/// Runs the plan on the host's own agents, or on one worker's; tasks per second.
async fn tasks_per_s(pier: &str, tasks: u64, concurrency: u64, on_worker: bool) -> f64 {
    let dir = scratch(if on_worker { "workers" } else { "local" });
    let store = dir.join("home/pier.db").display().to_string();
    let (mut servers, bases) = start_servers(pier, &dir, &store, 1, concurrency).await;
    let base = bases[0].clone();
    let mut worker = on_worker.then(|| {
        tokio::process::Command::new(pier)
            .args(["worker", "--server", &base, "--capability", "bench", "--agent", "bench"])
            .args(["--concurrency", &concurrency.to_string(), "--name", "bench-worker"])
            .current_dir(&dir)
            .env("PIER_HOME", dir.join("worker-home"))
            .env("PIER_TOKEN", "bench")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{pier} worker: {e}"))
    });
    let agent = if on_worker { "worker:bench" } else { "bench" };
    let mut plan = format!("[defaults]\nagent = \"{agent}\"\n");
    for i in 0..tasks {
        plan.push_str(&format!("\n[[tasks]]\nid = \"t{i}\"\nprompt = \"1\"\n"));
    }
    let http = reqwest::Client::new();
    let started = Instant::now();
    let body = json!({"plan": plan, "run_id": "b10"}).to_string();
    let submitted = http
        .post(format!("{base}/runs"))
        .bearer_auth("bench")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status);
    if let Err(e) = submitted {
        panic!("submit: {e}");
    }
    let completed = count_completed(&http, &base, tasks).await;
    let seconds = started.elapsed().as_secs_f64();
    if let Some(w) = worker.as_mut() {
        let _ = w.start_kill();
        let _ = w.wait().await;
    }
    for server in &mut servers {
        let _ = server.start_kill();
        let _ = server.wait().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    completed as f64 / seconds
}

/// Posts `events` progress batches of one event as a worker would, each after the reader has
/// the one before; the milliseconds from each post to its arrival at an `/events` reader.
async fn progress_latency(pier: &str, events: u64) -> (f64, f64) {
    let dir = scratch("progress");
    let store = dir.join("home/pier.db").display().to_string();
    let (mut servers, bases) = start_servers(pier, &dir, &store, 1, 1).await;
    let base = bases[0].clone();
    let http = reqwest::Client::new();
    let post = |path: String, body: Value| {
        http.post(format!("{base}{path}"))
            .bearer_auth("bench")
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    let plan = "[[tasks]]\nid = \"w\"\nagent = \"worker:bench\"\nprompt = \"p\"\n";
    let submitted = post("/runs".into(), json!({"plan": plan, "run_id": "lat"})).await;
    if let Err(e) = submitted.and_then(reqwest::Response::error_for_status) {
        panic!("submit: {e}");
    }
    let leased = post(
        "/v1/lease".into(),
        json!({"worker": "b", "capabilities": ["bench"], "ttl_ms": 600_000, "wait_ms": 5_000}),
    );
    let leased = leased.await.unwrap_or_else(|e| panic!("lease: {e}")).text().await.unwrap_or_default();
    let leased: Value = serde_json::from_str(&leased).unwrap_or_default();
    let n = leased["task"]["attempt"].as_i64().unwrap_or(1);
    let reader = http
        .get(format!("{base}/events?run=lat"))
        .bearer_auth("bench")
        .send()
        .await
        .unwrap_or_else(|e| panic!("events: {e}"));
    let mut stream = reader.bytes_stream();
    let mut pending = Vec::new();
    let mut millis = Vec::with_capacity(events as usize);
    for seq in 1..=events {
        let event = json!({"type": "session_update", "sessionId": "s",
            "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": format!("m{seq}")}}});
        let sent = Instant::now();
        let posted = post(
            format!("/v1/runs/lat/tasks/w/attempts/{n}/progress"),
            json!({"worker": "b", "seq": seq, "events": [event]}),
        );
        let marker = format!("\"text\":\"m{seq}\"");
        let arrived = async {
            loop {
                if let Some(i) = pending.windows(marker.len()).position(|w| w == marker.as_bytes()) {
                    pending.drain(..i + marker.len());
                    return Instant::now();
                }
                match stream.next().await {
                    Some(Ok(chunk)) => pending.extend_from_slice(&chunk),
                    _ => panic!("the event stream ended"),
                }
            }
        };
        let (response, arrived) = tokio::join!(posted, tokio::time::timeout(Duration::from_secs(10), arrived));
        if let Err(e) = response.and_then(reqwest::Response::error_for_status) {
            panic!("progress: {e}");
        }
        let Ok(arrived) = arrived else { panic!("event {seq} never arrived") };
        millis.push((arrived - sent).as_secs_f64() * 1000.0);
    }
    for server in &mut servers {
        let _ = server.start_kill();
        let _ = server.wait().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    millis.sort_by(f64::total_cmp);
    let at = |q: f64| millis[((millis.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99))
}
