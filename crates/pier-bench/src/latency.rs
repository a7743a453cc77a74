//! B11: how long a task takes from `POST /runs` to its agent receiving `session/prompt`, with
//! warm agents, at a steady rate of submitted one-task runs. Each prompt carries the moment its
//! POST was sent (`stamp:MICROS`, the wall clock both processes share); the bench agent answers
//! with how long ago that was (`lat:MICROS`), which becomes the task's result.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::{arg, bench_db, count_completed, start_servers};

/// Microseconds since the epoch on the wall clock.
pub fn now_us() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

/// The bench agent's answer to a stamped prompt: `lat:MICROS` since the stamp.
pub fn answer(prompt: &str) -> Option<String> {
    let stamp: i64 = prompt.strip_prefix("stamp:")?.trim().parse().ok()?;
    Some(format!("lat:{}", now_us() - stamp))
}

fn plan(agent: &str) -> String {
    format!("[[tasks]]\nid = \"t\"\nagent = \"{agent}\"\nprompt = \"stamp:{}\"\n", now_us())
}

/// Submits `count` one-task runs to `base` at `rate` a second (open loop: each POST is sent on
/// its tick whether or not the ones before were answered), named `{prefix}{i}`.
async fn submit_at(http: &reqwest::Client, base: &str, prefix: &str, count: u64, rate: u64) {
    let every = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let start = tokio::time::Instant::now();
    let mut sent = Vec::new();
    for i in 0..count {
        tokio::time::sleep_until(start + every * i as u32).await;
        let body = json!({"plan": plan("bench"), "run_id": format!("{prefix}{i}")}).to_string();
        let post = http
            .post(format!("{base}/runs"))
            .bearer_auth("bench")
            .header("content-type", "application/json")
            .body(body)
            .send();
        sent.push(tokio::spawn(post));
    }
    for post in sent {
        match post.await {
            Ok(Ok(r)) if r.status().is_success() => {}
            Ok(Ok(r)) => panic!("submit: {}", r.status()),
            Ok(Err(e)) => panic!("submit: {e}"),
            Err(e) => panic!("submit: {e}"),
        }
    }
}

/// Each run's latency, read from its task's result.
async fn latencies(http: &reqwest::Client, base: &str, prefix: &str, count: u64) -> Vec<f64> {
    let mut out = Vec::new();
    for i in 0..count {
        let v: Value = match http.get(format!("{base}/runs/{prefix}{i}")).bearer_auth("bench").send().await {
            Ok(r) => serde_json::from_str(&r.text().await.unwrap_or_default()).unwrap_or(Value::Null),
            Err(e) => panic!("GET run: {e}"),
        };
        let result = v["tasks"][0]["result"].as_str().unwrap_or_default();
        match result.trim().strip_prefix("lat:").and_then(|l| l.parse::<f64>().ok()) {
            Some(us) => out.push(us / 1000.0),
            None => panic!("run {prefix}{i}: no latency in its result {v}"),
        }
    }
    out
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or(f64::NAN)
}

/// `pier-bench latency [--rate N] [--count N] [--concurrency N] [--pg SERVER] -- PIER`.
pub async fn run(args: &[String], cmd: &[String]) {
    let rate = arg(args, "--rate", 100);
    let count = arg(args, "--count", 1_000);
    let concurrency = arg(args, "--concurrency", 16);
    let Some(pier) = cmd.first() else { panic!("give the pier binary after --") };
    let dir = crate::workers::scratch("latency");
    let db = bench_db(args);
    let store = db.as_ref().map_or_else(|| dir.join("home0/pier.db").display().to_string(), |d| d.url().to_owned());
    let (mut servers, bases) = start_servers(pier, &dir, &store, 1, concurrency).await;
    let http = reqwest::Client::new();
    let base = &bases[0];
    // Warm: every agent process of the pool started and its session ended once.
    let warm = concurrency * 4;
    submit_at(&http, base, "warm", warm, rate).await;
    count_completed(&http, base, warm).await;
    let started = Instant::now();
    submit_at(&http, base, "lat", count, rate).await;
    let submitted_s = started.elapsed().as_secs_f64();
    count_completed(&http, base, warm + count).await;
    let mut ms = latencies(&http, base, "lat", count).await;
    ms.sort_by(f64::total_cmp);
    for server in &mut servers {
        let _ = server.start_kill();
        let _ = server.wait().await;
    }
    drop(db);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{}",
        json!({"store": if store.starts_with("postgres") { "postgres" } else { "sqlite" }, "rate": rate,
               "achieved_rate": count as f64 / submitted_s, "count": count, "concurrency": concurrency,
               "p50_ms": percentile(&ms, 0.5), "p90_ms": percentile(&ms, 0.9), "p99_ms": percentile(&ms, 0.99),
               "max_ms": ms.last().copied().unwrap_or(f64::NAN)})
    );
}
