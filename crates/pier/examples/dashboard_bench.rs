//! D1, the dashboard's page weight (bench/run.sh; figures in docs/benchmarks.md): a `pier
//! serve` holding a run of 1,000 pull-worker tasks (100 layers of 10, each task below the
//! one ten before it), its run page loaded in headless Chromium (the navigation's load
//! event, median of 5), then 10 tabs open on it, live, while workers complete 50 tasks: how
//! long after the last completion every tab shows it. With `--tasks N` the run has N tasks;
//! with `--runs M`, M more runs of one task each are submitted first and the runs page
//! (`/ui/`) is timed too. Prints one JSON line.
//!
//!   cargo run --release -p pier --example dashboard_bench [-- --tasks 10000 --runs 10000]

#![allow(clippy::print_stdout)]

#[path = "../tests/support/browser.rs"]
mod browser;

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

const TOKEN: &str = "bench-token";
const LIMIT: Duration = Duration::from_secs(60);

pub fn must<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

async fn call(http: &reqwest::Client, method: reqwest::Method, url: String, body: Option<Value>) -> (u16, Value) {
    let mut req = http.request(method, url).bearer_auth(TOKEN);
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b.to_string());
    }
    let resp = must(req.send().await, "call");
    let status = resp.status().as_u16();
    (status, serde_json::from_str(&resp.text().await.unwrap_or_default()).unwrap_or(Value::Null))
}

/// The value of flag `name` on the command line, or `default`.
fn flag(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
}

/// The median of the navigation's load time over 5 loads of `url` after a warm-up, and the
/// page's size.
async fn page_load(b: &browser::Browser, url: &str) -> (f64, u64) {
    let mut loads = Vec::new();
    let mut bytes = 0;
    for _ in 0..6 {
        b.goto(url).await;
        b.wait_for("loaded", "performance.getEntriesByType('navigation')[0].loadEventEnd > 0", LIMIT).await;
        let nav = b.script("const n = performance.getEntriesByType('navigation')[0]; return [n.loadEventEnd - n.startTime, n.decodedBodySize]", vec![]).await;
        loads.push(nav[0].as_f64().unwrap_or(f64::NAN));
        bytes = nav[1].as_u64().unwrap_or(0);
    }
    loads.remove(0); // the first load warms the server's and the browser's caches
    loads.sort_by(f64::total_cmp);
    (loads[loads.len() / 2], bytes)
}

#[tokio::main]
async fn main() {
    let (tasks, runs) = (flag("--tasks", 1000), flag("--runs", 0));
    let exe = must(std::env::current_exe(), "exe");
    let pier = exe.parent().and_then(|d| d.parent()).map(|d| d.join("pier")).unwrap_or_default();
    let dir = must(tempfile::tempdir(), "dir");
    let mut child = must(
        tokio::process::Command::new(&pier)
            .args(["serve", "--listen", "127.0.0.1:0", "--token", TOKEN])
            .current_dir(dir.path())
            .env("PIER_HOME", dir.path().join("data"))
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn(),
        "pier serve",
    );
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap_or_else(|| panic!("stderr"))).lines();
    let base = loop {
        let line = must(tokio::time::timeout(LIMIT, lines.next_line()).await, "serve").ok().flatten();
        let line = line.unwrap_or_else(|| panic!("pier serve exited"));
        if let Some(url) = line.strip_prefix("pier serve: listening on ") {
            break url.to_owned();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let mut plan = String::new();
    for i in 0..tasks {
        plan.push_str(&format!("[[tasks]]\nid = \"t{i:04}\"\nagent = \"worker:bench\"\nprompt = \"task {i}\"\n"));
        if i >= 10 {
            plan.push_str(&format!("depends_on = [\"t{:04}\"]\n", i - 10));
        }
        plan.push('\n');
    }
    let http = reqwest::Client::new();
    let (code, _) =
        call(&http, reqwest::Method::POST, format!("{base}/runs"), Some(json!({"plan": plan, "run_id": "big"}))).await;
    assert_eq!(code, 201);
    // The other runs, eight submissions at a time.
    let one = "[[tasks]]\nid = \"only\"\nagent = \"worker:elsewhere\"\nprompt = \"one task\"\n";
    for chunk in (0..runs).collect::<Vec<_>>().chunks(8) {
        let submits = chunk.iter().map(|i| {
            let body = json!({"plan": one, "run_id": format!("r{i:05}")});
            call(&http, reqwest::Method::POST, format!("{base}/runs"), Some(body))
        });
        for (code, v) in futures::future::join_all(submits).await {
            assert_eq!(code, 201, "{v}");
        }
    }

    let b = browser::Browser::start("dashboard-bench").await;
    b.login(&base, Some("bench"), TOKEN).await;
    let (runs_median, runs_bytes) = page_load(&b, &format!("{base}/ui/")).await;
    let page = format!("{base}/ui/runs/big");
    let (median, bytes) = page_load(&b, &page).await;

    // Ten tabs, live on the same run.
    let mut tabs = vec![b.handle().await];
    for _ in 1..10 {
        tabs.push(b.new_tab(&page).await);
    }
    let started = Instant::now();
    let mut last = String::new();
    for n in 0..50 {
        let (code, leased) = call(
            &http,
            reqwest::Method::POST,
            format!("{base}/lease"),
            Some(json!({"worker": "w", "capabilities": ["bench"], "ttl_ms": 60000})),
        )
        .await;
        assert_eq!(code, 200, "{leased}");
        let task = leased["task"]["id"].as_str().unwrap_or_default().to_owned();
        let body = json!({"worker": "w", "attempt": leased["task"]["attempt"], "status": "completed", "idempotency_key": format!("k{n}"), "result": "ok"});
        let (code, v) =
            call(&http, reqwest::Method::POST, format!("{base}/runs/big/tasks/{task}/update"), Some(body)).await;
        assert_eq!(code, 200, "{v}");
        last = task;
    }
    let updates_done = started.elapsed();
    let check = format!(
        "(document.querySelector('[data-region] [data-task=\"{last}\"]') || {{dataset: {{}}}}).dataset.state === 'completed'"
    );
    // The tab in front (the last opened) first, then every other one.
    b.wait_for("the front tab is current", &check, LIMIT).await;
    let front = started.elapsed() - updates_done;
    for t in &tabs {
        b.switch_to(t).await;
        b.wait_for("the tab is current", &check, LIMIT).await;
    }
    let live = started.elapsed() - updates_done;
    // What visiting the ten tabs costs by itself, every tab already current.
    let visit = Instant::now();
    for t in &tabs {
        b.switch_to(t).await;
        b.wait_for("the tab is current", &check, LIMIT).await;
    }
    let visiting = visit.elapsed();
    let (_, metrics) = (0, http.get(format!("{base}/metrics")).bearer_auth(TOKEN).send().await.ok());
    let sse = match metrics {
        Some(r) => {
            r.text().await.unwrap_or_default().lines().find(|l| l.starts_with("pier_sse_clients ")).map(str::to_owned)
        }
        None => None,
    };
    println!(
        "{}",
        json!({
            "tasks": tasks, "run_page_load_ms": median, "run_page_bytes": bytes, "tabs": tabs.len(),
            "runs": runs + 1, "runs_page_load_ms": runs_median, "runs_page_bytes": runs_bytes,
            "updates": 50, "updates_ms": updates_done.as_millis(), "front_tab_current_after_ms": front.as_millis(), "all_tabs_current_after_ms": live.as_millis(), "visiting_the_tabs_ms": visiting.as_millis(),
            "sse_clients": sse.and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse::<f64>().ok())),
        })
    );
    drop(b);
    let _ = child.kill().await;
}
