//! Several `pier serve` nodes over one store (a SQLite file; a PostgreSQL database on the
//! server `PIER_TEST_PG` names, which `scripts/test` starts): every attempt runs exactly
//! once, with the nodes live, and with nodes SIGKILLed and restarted under load.

mod support;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use futures::StreamExt;
use pier_fake_model::FakeModel;
use pier_model::sse::SseDecoder;
use serde_json::{Value, json};
use support::{LIMIT, echo, must};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

const PIER: &str = env!("CARGO_BIN_EXE_pier");
const TOKEN: &str = "nodes-token";

struct Node {
    child: Child,
    base: String,
    /// Its stderr lines at `warn` and above.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// Starts a node on the shared store `db` (a path or a URL), with its own home under `dir`.
async fn node(dir: &Path, name: &str, db: &str, model: &str, lease_ms: u64) -> Node {
    node_named(dir, name, db, model, lease_ms, &format!("node-{name}")).await
}

async fn node_named(dir: &Path, name: &str, db: &str, model: &str, lease_ms: u64, id: &str) -> Node {
    let home = dir.join(name);
    let mut cmd = Command::new(PIER);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--token", TOKEN, "--concurrency", "4", "--node-id", id])
        .arg("--store")
        .arg(db)
        .args(["--lease-ttl-ms", &lease_ms.to_string()])
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("PIER_HOME", &home)
        .env("PIER_BASE_URL", model)
        .env("PIER_MODEL", "fake-model")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = must(cmd.spawn(), "spawn pier serve");
    let stderr = child.stderr.take().unwrap_or_else(|| panic!("stderr"));
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    let base = loop {
        let line = must(tokio::time::timeout(LIMIT, lines.next_line()).await, "serve started");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier serve exited"));
        if let Some(url) = line.strip_prefix("pier serve: listening on ") {
            break url.to_owned();
        }
    };
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = log.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(line);
        }
    });
    Node { child, base, log }
}

impl Node {
    async fn submit(&self, plan: &str, run: &str) {
        let resp = reqwest::Client::new()
            .post(format!("{}/runs", self.base))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(json!({"plan": plan, "run_id": run}).to_string())
            .send()
            .await;
        let resp = must(resp, "submit");
        assert_eq!(resp.status().as_u16(), 201, "{:?}", resp.text().await);
    }

    /// The whole log as this node serves it (`follow=false`).
    async fn log(&self) -> Vec<Value> {
        self.events(|_| false, false).await
    }

    /// Events from the start until `stop` says so (or, without `follow`, until caught up).
    async fn events(&self, mut stop: impl FnMut(&Value) -> bool, follow: bool) -> Vec<Value> {
        let url = format!("{}/events?after=0&follow={follow}", self.base);
        let resp = must(reqwest::Client::new().get(url).bearer_auth(TOKEN).send().await, "events");
        let mut stream = resp.bytes_stream();
        let mut sse = SseDecoder::new(1 << 24);
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + LIMIT * 6;
        loop {
            let chunk = match must(tokio::time::timeout_at(deadline, stream.next()).await, "events in time") {
                Some(chunk) => must(chunk, "chunk"),
                None => return out,
            };
            for data in sse.push(&chunk).unwrap_or_default() {
                let v: Value = must(serde_json::from_str(&data), "event json");
                let done = stop(&v);
                out.push(v);
                if done {
                    return out;
                }
            }
        }
    }

    fn kill(&mut self) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        }
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM);
        }
        let _ = tokio::time::timeout(LIMIT, self.child.wait()).await;
    }
}

/// Every model answer waits at the returned gate until it is dropped (with `echo` as the
/// fallback again, answers then flow).
fn gated(f: &FakeModel) -> pier_fake_model::Gate {
    let gate = pier_fake_model::Gate::new();
    let held = gate.clone();
    f.set_fallback(move |body| {
        let mut reply = echo(body);
        if let pier_fake_model::Reply::Stream(steps) = &mut reply {
            steps.insert(0, pier_fake_model::Step::Gate(held.clone()));
        }
        reply
    });
    gate
}

/// Waits on `watch` until `n` tasks completed; the log as `read` serves it, checked gap-free
/// with each of `n` tasks completed exactly once.
async fn every_task_once(watch: &Node, read: &Node, n: usize) -> Vec<Value> {
    let mut done = 0;
    watch
        .events(
            |e| {
                done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                done == n
            },
            true,
        )
        .await;
    let log = read.log().await;
    assert_eq!(seqs(&log), (1..=log.len() as i64).collect::<Vec<_>>(), "the log has a gap");
    let completed = completed_per_task(&log);
    assert_eq!(completed.len(), n);
    assert!(completed.values().all(|n| *n == 1), "a task completed twice: {completed:?}");
    log
}

/// A fake model whose every answer (`echo`) waits `ms` first.
async fn paused_model(ms: u64) -> FakeModel {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(move |body| {
        let mut reply = echo(body);
        if let pier_fake_model::Reply::Stream(steps) = &mut reply {
            steps.insert(0, pier_fake_model::Step::Pause(Duration::from_millis(ms)));
        }
        reply
    });
    f
}

/// SIGKILLs one of `nodes`, picked by `rng`, and starts it again.
async fn kill_one(
    nodes: &mut [Node],
    rng: &mut fastrand::Rng,
    dir: &Path,
    names: &[&str],
    db: &str,
    model: &str,
    lease: u64,
) {
    let victim = rng.usize(..nodes.len());
    nodes[victim].kill();
    let _ = nodes[victim].child.wait().await;
    nodes[victim] = node(dir, names[victim], db, model, lease).await;
}

/// A node of each of `names` on `db`.
async fn three_nodes(dir: &Path, names: &[&str], db: &str, model: &str, lease: u64) -> Vec<Node> {
    let mut nodes = Vec::new();
    for name in names {
        nodes.push(node(dir, name, db, model, lease).await);
    }
    nodes
}

/// A database of its own on the test server (`PIER_TEST_PG`), dropped at the end.
fn database() -> pier_host::store::ScratchDatabase {
    let server = std::env::var("PIER_TEST_PG").unwrap_or_else(|_| {
        panic!("PIER_TEST_PG is not set: the PostgreSQL tests need a server (scripts/test starts one with scripts/pg)")
    });
    must(pier_host::store::ScratchDatabase::create(&server, "pier_nodes"), "a database on PIER_TEST_PG")
}

fn plan(n: usize) -> String {
    (0..n).map(|i| format!("[[tasks]]\nid = \"t{i:03}\"\nprompt = \"task {i}\"\n\n")).collect()
}

/// Model requests per task prompt ("task N").
fn requests_per_task(f: &FakeModel) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in f.requests().iter().filter(|r| !r.auxiliary) {
        let user = r.body["messages"].as_array().and_then(|m| m.iter().find(|m| m["role"] == "user")).cloned();
        if let Some(text) = user.and_then(|m| m["content"].as_str().map(str::to_owned)) {
            *counts.entry(text).or_default() += 1;
        }
    }
    counts
}

fn completed_per_task(log: &[Value]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for e in log.iter().filter(|e| e["type"] == "transition" && e["to"] == "completed") {
        *counts.entry(e["task"].as_str().unwrap_or("").to_owned()).or_default() += 1;
    }
    counts
}

fn seqs(log: &[Value]) -> Vec<i64> {
    log.iter().filter_map(|e| e["seq"].as_i64()).collect()
}

/// Live processes whose environment names `marker` (the nodes' agents carry their home).
fn processes_with_env(marker: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let zombie = stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
            let environ = std::fs::read(e.path().join("environ")).ok()?;
            (!zombie && String::from_utf8_lossy(&environ).contains(marker)).then_some(pid)
        })
        .collect()
}

#[tokio::test]
async fn two_live_nodes_on_one_store_run_every_task_exactly_once() {
    let dir = must(tempfile::tempdir(), "dir");
    let db: PathBuf = dir.path().join("shared.db");
    two_live_nodes(dir.path(), &db.display().to_string()).await;
}

#[tokio::test]
async fn two_live_nodes_on_postgres_run_every_task_exactly_once() {
    let dir = must(tempfile::tempdir(), "dir");
    let db = database();
    two_live_nodes(dir.path(), db.url()).await;
}

async fn two_live_nodes(dir: &Path, db: &str) {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let a = node(dir, "a", db, &f.base_url(), 15_000).await;
    let b = node(dir, "b", db, &f.base_url(), 15_000).await;
    a.submit(&plan(100), "hundred").await;
    // Node b serves the run it never saw submitted, to its end.
    let mut done = 0;
    b.events(
        |e| {
            done += usize::from(e["type"] == "transition" && e["to"] == "completed");
            done == 100
        },
        true,
    )
    .await;
    let per_task = requests_per_task(&f);
    assert_eq!(per_task.len(), 100, "{per_task:?}");
    let twice: Vec<_> = per_task.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "prompts that reached the model more than once: {twice:?}");
    let log = a.log().await;
    assert!(completed_per_task(&log).values().all(|n| *n == 1));
    let owners: std::collections::HashSet<&str> = log
        .iter()
        .filter(|e| e["type"] == "transition" && e["to"] == "running")
        .filter_map(|e| e["owner"].as_str())
        .collect();
    eprintln!("attempts were run by {} nodes", owners.len());
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn nodes_killed_and_restarted_complete_every_task_exactly_once() {
    let dir = must(tempfile::tempdir(), "dir");
    let db: PathBuf = dir.path().join("shared.db");
    killed_and_restarted(dir.path(), &db.display().to_string(), 2, 4).await;
}

/// `n` nodes on `db`; `rounds` times, some work lands, then one node is SIGKILLed and
/// started again. Every task completes exactly once, the log is gap-free and the same
/// on every node, and no agent is left.
async fn killed_and_restarted(dir: &Path, db: &str, n: usize, rounds: usize) {
    let f = must(FakeModel::start().await, "fake");
    // Slow enough that kills land mid-turn.
    f.set_fallback(|body| {
        let mut reply = echo(body);
        if let pier_fake_model::Reply::Stream(steps) = &mut reply {
            steps.insert(0, pier_fake_model::Step::Pause(Duration::from_millis(150)));
        }
        reply
    });
    let model = f.base_url();
    let lease = 1_000;
    let names = ["a", "b", "c", "d"];
    let mut nodes = Vec::new();
    for name in &names[..n] {
        nodes.push(node(dir, name, db, &model, lease).await);
    }
    nodes[0].submit(&plan(60), "sixty").await;
    for round in 0..rounds {
        // Let some work land, then kill one node and start it again.
        let target = 5 * (round + 1);
        let mut done = 0;
        nodes[(round + 1) % n]
            .events(
                |e| {
                    done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                    done >= target
                },
                true,
            )
            .await;
        let victim = round % n;
        nodes[victim].kill();
        let _ = nodes[victim].child.wait().await;
        nodes[victim] = node(dir, names[victim], db, &model, lease).await;
    }
    let mut done = 0;
    nodes[0]
        .events(
            |e| {
                done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                done == 60
            },
            true,
        )
        .await;
    let log_a = nodes[0].log().await;
    assert_eq!(seqs(&log_a), (1..=log_a.len() as i64).collect::<Vec<_>>(), "the log has a gap");
    for other in &nodes[1..] {
        assert_eq!(seqs(&log_a), seqs(&other.log().await), "every node serves the same stream");
    }
    let completed = completed_per_task(&log_a);
    assert_eq!(completed.len(), 60);
    let started = log_a.iter().filter(|e| e["type"] == "transition" && e["to"] == "running").count();
    assert!(started > 60, "no kill landed mid-attempt ({started} attempts); the test proves nothing");
    assert!(completed.values().all(|n| *n == 1), "a task completed twice: {completed:?}");
    for node in nodes {
        node.stop().await;
    }
    // Agents of killed nodes see their stdin close and exit; none is left behind.
    let marker = dir.display().to_string();
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !processes_with_env(&marker).is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(processes_with_env(&marker), Vec::<i32>::new(), "agent processes outlived their nodes");
}

/// A cluster of this test's own (`scripts/pg`), stopped and removed when dropped.
struct Cluster {
    dir: tempfile::TempDir,
    url: String,
}

fn scripts_pg(args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg");
    let out = must(std::process::Command::new(script).args(args).output(), "scripts/pg");
    assert!(out.status.success(), "scripts/pg {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl Cluster {
    fn start() -> Cluster {
        let dir = must(tempfile::tempdir(), "dir");
        must(std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)), "chmod");
        let url = scripts_pg(&["start", &dir.path().join("pg").display().to_string()]);
        Cluster { dir, url }
    }

    fn restart(&self) {
        scripts_pg(&["restart", &self.dir.path().join("pg").display().to_string()]);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg"))
            .args(["stop", &self.dir.path().join("pg").display().to_string()])
            .output();
    }
}

#[tokio::test]
async fn a_postgres_restart_mid_run_loses_and_doubles_nothing() {
    let cluster = Cluster::start();
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|body| {
        let mut reply = echo(body);
        if let pier_fake_model::Reply::Stream(steps) = &mut reply {
            steps.insert(0, pier_fake_model::Step::Pause(Duration::from_millis(100)));
        }
        reply
    });
    let dir = must(tempfile::tempdir(), "dir");
    let (model, lease) = (f.base_url(), 3_000);
    let nodes = [
        node(dir.path(), "a", &cluster.url, &model, lease).await,
        node(dir.path(), "b", &cluster.url, &model, lease).await,
    ];
    nodes[0].submit(&plan(40), "forty").await;
    let mut done = 0;
    nodes[1]
        .events(
            |e| {
                done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                done >= 10
            },
            true,
        )
        .await;
    // The server goes away mid-run (its connections cut) and comes back.
    cluster.restart();
    every_task_once(&nodes[0], &nodes[0], 40).await;
    for node in nodes {
        let lines = node.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let outages = lines.iter().filter(|l| l.contains("cannot reach the database")).count();
        assert!(outages <= 1, "one line per outage, not a flood: {lines:#?}");
        node.stop().await;
    }
}

async fn nodes_of(n: &Node) -> Value {
    let resp = reqwest::Client::new().get(format!("{}/nodes", n.base)).bearer_auth(TOKEN).send().await;
    let text = must(must(resp, "GET /nodes").text().await, "nodes body");
    must(serde_json::from_str(&text), "nodes json")
}

/// The runs node `id` drives, as `GET /nodes` on `n` says.
async fn runs_of(n: &Node, id: &str) -> Vec<String> {
    let nodes = nodes_of(n).await;
    let node = nodes["nodes"].as_array().and_then(|a| a.iter().find(|x| x["id"] == id)).cloned().unwrap_or_default();
    node["runs"]
        .as_array()
        .map(|r| r.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// A run submitted to a serving node is driven by that node from the commit that creates it:
/// its lease is taken there (`driven_by` in its `run_created` event), so no node has to find
/// it free and take it in a second commit first.
#[tokio::test]
async fn a_node_drives_a_run_submitted_to_it_from_its_creation() {
    let dir = must(tempfile::tempdir(), "dir");
    let db = database();
    let file = dir.path().join("shared.db").display().to_string();
    for (store, name) in [(file.as_str(), "sqlite"), (db.url(), "postgres")] {
        let f = must(FakeModel::start().await, "fake");
        f.set_fallback(echo);
        let a = node_named(dir.path(), name, store, &f.base_url(), 15_000, "node-a").await;
        // The first run may come before the node's first pass has counted the live nodes.
        for run in ["first", "second"] {
            a.submit(&plan(1), run).await;
            let mut done = false;
            a.events(
                |e| {
                    done |= e["run"] == run && e["type"] == "transition" && e["to"] == "completed";
                    done
                },
                true,
            )
            .await;
        }
        let log = a.log().await;
        let created = log.iter().find(|e| e["run"] == "second" && e["type"] == "run_created").cloned();
        assert_eq!(created.map(|e| e["driven_by"].clone()), Some(json!("node-a")), "{name}: {log:?}");
        a.stop().await;
    }
}

#[tokio::test]
async fn one_node_drives_a_run_and_its_sigterm_hands_the_run_over_at_once() {
    let f = must(FakeModel::start().await, "fake");
    let gate = gated(&f);
    let dir = must(tempfile::tempdir(), "dir");
    let db = database();
    // Leases far longer than the test: the run can change hands only by being handed over.
    let lease = 120_000;
    let mut a = node_named(dir.path(), "a", db.url(), &f.base_url(), lease, "node-a").await;
    a.submit(&plan(4), "four").await;
    tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await.unwrap_or_else(|_| panic!("no task started"));
    let b = node_named(dir.path(), "b", db.url(), &f.base_url(), lease, "node-b").await;
    assert_eq!(runs_of(&b, "node-a").await, ["four"]);
    assert_eq!(runs_of(&b, "node-b").await, Vec::<String>::new(), "a live node's run is not taken");
    // SIGTERM: a stops its agents (the attempts go back to the queue) and hands the run back;
    // the attempts b starts then are answered at once.
    f.set_fallback(echo);
    if let Some(pid) = a.child.id() {
        must(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM),
            "SIGTERM",
        );
    }
    must(must(tokio::time::timeout(LIMIT, a.child.wait()).await, "a stopped in time"), "wait");
    drop(gate);
    let mut done = 0;
    b.events(
        |e| {
            done += usize::from(e["type"] == "transition" && e["to"] == "completed");
            done == 4
        },
        true,
    )
    .await;
    let nodes = nodes_of(&b).await;
    let ids: Vec<&str> =
        nodes["nodes"].as_array().map(|a| a.iter().filter_map(|n| n["id"].as_str()).collect()).unwrap_or_default();
    assert_eq!(ids, ["node-b"], "a node that stopped is not listed: {nodes}");
    assert!(nodes["nodes"][0]["heartbeat_at_ms"].as_i64().is_some_and(|t| t > 0), "{nodes}");
    b.stop().await;
}

/// A `pier run` beside a `pier serve` node on one PostgreSQL database: the run is the
/// `pier run`'s (the node, which takes its share of every run, leaves a run whose lease is
/// held), and when the `pier run` is killed the node takes the run over once that lease runs
/// out and finishes it, every task completed once.
#[tokio::test]
async fn a_pier_run_beside_a_serve_node_keeps_its_run_and_the_node_takes_it_over_when_it_dies() {
    let f = must(FakeModel::start().await, "fake");
    let gate = gated(&f);
    let dir = must(tempfile::tempdir(), "dir");
    let db = database();
    let lease = 1_500;
    let b = node_named(dir.path(), "b", db.url(), &f.base_url(), lease, "node-b").await;
    must(std::fs::write(dir.path().join("plan.toml"), plan(6)), "plan");
    let home = dir.path().join("run-home");
    let mut run = Command::new(PIER);
    run.args(["run", "plan.toml", "--run-id", "mine", "--concurrency", "2", "--format", "json"])
        .args(["--lease-ttl-ms", &lease.to_string()])
        .arg("--store")
        .arg(db.url())
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("PIER_HOME", &home)
        .env("PIER_BASE_URL", f.base_url())
        .env("PIER_MODEL", "fake-model")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut run = must(run.spawn(), "spawn pier run");
    // Both of the `pier run`'s attempts wait at the gate.
    tokio::time::timeout(LIMIT, f.wait_for_requests(2)).await.unwrap_or_else(|_| panic!("pier run started nothing"));
    assert_eq!(runs_of(&b, "node-b").await, Vec::<String>::new(), "the node leaves a run whose lease is held");
    let before = b.log().await;
    // An attempt's owner is `HOST:PID:…` of the process that runs it.
    let mark = format!(":{}:", run.id().unwrap_or_default());
    if let Some(pid) = run.id() {
        must(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL), "kill");
    }
    must(must(tokio::time::timeout(LIMIT, run.wait()).await, "pier run died"), "wait");
    f.set_fallback(echo);
    drop(gate);
    let mut done = 0;
    let log = b
        .events(
            |e| {
                done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                done == 6
            },
            true,
        )
        .await;
    let started = |log: &[Value]| -> Vec<String> {
        log.iter()
            .filter(|e| e["type"] == "transition" && e["to"] == "running")
            .filter_map(|e| e["owner"].as_str().map(str::to_owned))
            .collect()
    };
    let first = started(&before);
    assert_eq!(first.len(), 2, "{before:?}");
    assert!(first.iter().all(|o| o.contains(&mark)), "pier run started them, not the node: {first:?} ({mark})");
    let later = started(&log[before.len()..]);
    assert!(!later.is_empty() && later.iter().all(|o| !o.contains(&mark)), "the node took the run over: {later:?}");
    let completed = completed_per_task(&log);
    assert_eq!(completed.len(), 6, "{completed:?}");
    assert!(completed.values().all(|&n| n == 1), "every task completed once: {completed:?}");
    b.stop().await;
}

/// A DAG of 300 tasks: a root, 298 in the middle that fan out from it (every tenth a pull
/// worker's, `worker:w`), and a last one that fans in from all of them.
fn dag() -> String {
    let mut plan = String::from("[[tasks]]\nid = \"t000\"\nprompt = \"task 0\"\n\n");
    for i in 1..299 {
        plan.push_str(&format!("[[tasks]]\nid = \"t{i:03}\"\nprompt = \"task {i}\"\ndepends_on = [\"t000\"]\n"));
        if i % 10 == 0 {
            plan.push_str("agent = \"worker:w\"\n");
        }
        plan.push('\n');
    }
    let all: Vec<String> = (1..299).map(|i| format!("\"t{i:03}\"")).collect();
    plan.push_str(&format!("[[tasks]]\nid = \"t299\"\nprompt = \"task 299\"\ndepends_on = [{}]\n", all.join(", ")));
    plan
}

/// A pull worker that leases `worker:w` tasks from whichever of `bases` answers and reports
/// each done, until `stop`; a node killed under it is just skipped.
async fn pull_worker(
    name: String,
    bases: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stop: tokio_util::sync::CancellationToken,
) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().unwrap_or_default();
    let mut turn = 0usize;
    while !stop.is_cancelled() {
        turn += 1;
        let base = {
            let b = bases.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            b[turn % b.len()].clone()
        };
        let body = json!({"worker": name, "capabilities": ["w"], "ttl_ms": 3_000});
        let leased = http
            .post(format!("{base}/lease"))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await;
        let Ok(leased) = leased else { continue };
        if leased.status().as_u16() != 200 {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
            }
        }
        let Ok(text) = leased.text().await else { continue };
        let Ok(leased) = serde_json::from_str::<Value>(&text) else { continue };
        let t = &leased["task"];
        let (run, id) = (t["run_id"].as_str().unwrap_or(""), t["id"].as_str().unwrap_or(""));
        let report = json!({"worker": name, "attempt": t["attempt"], "status": "completed",
                            "idempotency_key": format!("{id}-{}", t["attempt"]), "result": format!("{id} by {name}")});
        // Reported to any node; a node killed meanwhile means another try elsewhere.
        for k in 0..4 {
            let base = {
                let b = bases.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                b[(turn + k) % b.len()].clone()
            };
            let sent = http
                .post(format!("{base}/runs/{run}/tasks/{id}/update"))
                .bearer_auth(TOKEN)
                .header("content-type", "application/json")
                .body(report.to_string())
                .send()
                .await;
            if sent.is_ok_and(|r| r.status().as_u16() < 500) {
                break;
            }
        }
    }
}

/// Reads `/events` from one node after another, resuming with `Last-Event-ID` on the next
/// node after a few events (or when its node dies), until `want` completions: every event
/// once, in order.
async fn hopping_reader(bases: std::sync::Arc<std::sync::Mutex<Vec<String>>>, want: usize) -> (Vec<Value>, usize) {
    let http = reqwest::Client::new();
    let mut out: Vec<Value> = Vec::new();
    let mut completed = 0;
    let deadline = tokio::time::Instant::now() + LIMIT * 12;
    for hop in 0usize.. {
        assert!(tokio::time::Instant::now() < deadline, "the hopping reader saw {completed} completions in time");
        let base = {
            let b = bases.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            b[hop % b.len()].clone()
        };
        let last = out.last().and_then(|e| e["seq"].as_i64()).unwrap_or(0);
        let Ok(resp) = http
            .get(format!("{base}/events"))
            .bearer_auth(TOKEN)
            .header("Last-Event-ID", last.to_string())
            .send()
            .await
        else {
            continue;
        };
        let mut stream = resp.bytes_stream();
        let mut sse = SseDecoder::new(1 << 24);
        let mut taken = 0;
        // A few events per node, then the next node.
        'node: while let Ok(Some(Ok(chunk))) = tokio::time::timeout(Duration::from_secs(2), stream.next()).await {
            for data in sse.push(&chunk).unwrap_or_default() {
                let v: Value = must(serde_json::from_str(&data), "event json");
                completed += usize::from(v["type"] == "transition" && v["to"] == "completed");
                out.push(v);
                taken += 1;
                if completed == want {
                    return (out, hop);
                }
                if taken >= 40 {
                    break 'node;
                }
            }
        }
    }
    (out, 0)
}

#[tokio::test]
async fn three_nodes_on_postgres_under_fifty_random_kills_complete_a_dag_exactly_once() {
    // Slow enough that kills land mid-turn.
    let f = paused_model(60).await;
    let dir = must(tempfile::tempdir(), "dir");
    let db = database();
    let (model, lease) = (f.base_url(), 1_000);
    let names = ["a", "b", "c"];
    let mut nodes = three_nodes(dir.path(), &names, db.url(), &model, lease).await;
    let bases = std::sync::Arc::new(std::sync::Mutex::new(nodes.iter().map(|n| n.base.clone()).collect::<Vec<_>>()));
    nodes[0].submit(&dag(), "dag").await;
    // Pull workers on nodes b and c; a reader hopping between all three.
    let stop = tokio_util::sync::CancellationToken::new();
    let worker_bases =
        std::sync::Arc::new(std::sync::Mutex::new(bases.lock().map(|b| b[1..].to_vec()).unwrap_or_default()));
    let workers: Vec<_> =
        (0..2).map(|w| tokio::spawn(pull_worker(format!("w{w}"), worker_bases.clone(), stop.clone()))).collect();
    let reader = tokio::spawn(hopping_reader(bases.clone(), 300));
    let mut rng = fastrand::Rng::with_seed(13);
    for round in 0..50 {
        let target = 5 * (round + 1);
        let mut done = 0;
        let watcher = (round + 1) % 3;
        nodes[watcher]
            .events(
                |e| {
                    done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                    done >= target.min(295)
                },
                true,
            )
            .await;
        let victim = rng.usize(..3);
        nodes[victim].kill();
        let _ = nodes[victim].child.wait().await;
        nodes[victim] = node(dir.path(), names[victim], db.url(), &model, lease).await;
        let mut b = bases.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        b[victim] = nodes[victim].base.clone();
        if victim > 0 {
            worker_bases.lock().unwrap_or_else(std::sync::PoisonError::into_inner)[victim - 1] =
                nodes[victim].base.clone();
        }
    }
    let mut done = 0;
    nodes[0]
        .events(
            |e| {
                done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                done == 300
            },
            true,
        )
        .await;
    stop.cancel();
    for w in workers {
        let _ = w.await;
    }
    let (hopped, hops) = must(reader.await, "the hopping reader");
    let log = nodes[0].log().await;
    assert_eq!(seqs(&log), (1..=log.len() as i64).collect::<Vec<_>>(), "the log has a gap");
    for other in &nodes[1..] {
        assert_eq!(seqs(&log), seqs(&other.log().await), "every node serves the same stream");
    }
    let n = hopped.len();
    assert_eq!(seqs(&hopped), seqs(&log[..n]), "the hopping reader saw every event once, in order");
    let completed = completed_per_task(&log);
    assert_eq!(completed.len(), 300);
    assert!(completed.values().all(|n| *n == 1), "a task completed twice: {completed:?}");
    // The fan-in ran last, after every task it depends on.
    let seq_of =
        |id: &str| log.iter().find(|e| e["task"] == id && e["to"] == "completed").and_then(|e| e["seq"].as_i64());
    let last = seq_of("t299").unwrap_or_default();
    assert!((0..299).all(|i| seq_of(&format!("t{i:03}")).is_some_and(|s| s < last)));
    // Every tenth task is a pull worker's: completing them all took the workers.
    let started = log.iter().filter(|e| e["type"] == "transition" && e["to"] == "running").count();
    assert!(started > 300, "no kill landed mid-attempt ({started} attempts); the test proves nothing");
    assert!(hops > 5, "the reader hopped {hops} times");
    for node in nodes {
        node.stop().await;
    }
    let marker = dir.path().display().to_string();
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !processes_with_env(&marker).is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(processes_with_env(&marker), Vec::<i32>::new(), "agent processes outlived their nodes");
}

/// A `pier worker` with a home and directory of its own under `dir` (as another machine).
fn worker(dir: &Path, name: &str, base: &str, model: &str) -> Child {
    let home = dir.join(name);
    must(std::fs::create_dir_all(&home), "worker home");
    let mut cmd = Command::new(PIER);
    cmd.args(["worker", "--server", base, "--capability", "build", "--name", name, "--lease-ttl-ms", "1500"])
        .current_dir(&home)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", &home)
        .env("PIER_HOME", home.join("data"))
        .env("PIER_TOKEN", TOKEN)
        .env("PIER_BASE_URL", model)
        .env("PIER_MODEL", "fake-model")
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    must(cmd.spawn(), "spawn pier worker")
}

/// Two `pier worker`s and a `pier serve` on PostgreSQL: a 200-task plan, half of it for the
/// node's own agents and half for workers, completes exactly once each through ten worker
/// SIGKILLs; a worker task's log carries its agent's messages; no agent outlives its worker.
#[tokio::test]
async fn workers_killed_ten_times_leave_every_task_done_exactly_once_on_postgres() {
    let db = database();
    let dir = must(tempfile::tempdir(), "dir");
    let f = must(FakeModel::start().await, "fake");
    // Slow enough that kills land mid-turn.
    f.set_fallback(|body| {
        let mut reply = echo(body);
        if let pier_fake_model::Reply::Stream(steps) = &mut reply {
            steps.insert(0, pier_fake_model::Step::Pause(Duration::from_millis(100)));
        }
        reply
    });
    let model = f.base_url();
    let node = node(dir.path(), "host", db.url(), &model, 2_000).await;
    let names = ["w1", "w2"];
    let mut workers: Vec<Child> = names.iter().map(|n| worker(dir.path(), n, &node.base, &model)).collect();
    let plan: String = (0..200)
        .map(|i| {
            let agent = if i % 2 == 1 { "agent = \"worker:build\"\n" } else { "" };
            format!("[[tasks]]\nid = \"t{i:03}\"\nprompt = \"task {i}\"\n{agent}\n")
        })
        .collect();
    node.submit(&plan, "fleet").await;
    let by_worker = |e: &Value| {
        e["type"] == "transition"
            && e["to"] == "completed"
            && e["task"].as_str().and_then(|t| t[1..].parse::<usize>().ok()).is_some_and(|i| i % 2 == 1)
    };
    for kill in 0..10 {
        let mut done = 0;
        node.events(
            |e| {
                done += usize::from(by_worker(e));
                done >= 7 * (kill + 1)
            },
            true,
        )
        .await;
        let victim = kill % 2;
        if let Some(pid) = workers[victim].id() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        }
        let _ = workers[victim].wait().await;
        workers[victim] = worker(dir.path(), names[victim], &node.base, &model);
    }
    let mut done = 0;
    node.events(
        |e| {
            done += usize::from(e["type"] == "transition" && e["to"] == "completed");
            done == 200
        },
        true,
    )
    .await;
    let log = node.log().await;
    assert_eq!(seqs(&log), (1..=log.len() as i64).collect::<Vec<_>>(), "the log has a gap");
    let completed = completed_per_task(&log);
    assert_eq!(completed.len(), 200, "{completed:?}");
    assert!(completed.values().all(|n| *n == 1), "a task completed twice: {completed:?}");
    let leased_by_workers = log
        .iter()
        .filter(|e| e["type"] == "transition" && e["to"] == "running")
        .filter(|e| e["owner"].as_str().is_some_and(|o| names.contains(&o)))
        .count();
    assert!(leased_by_workers > 100, "kills landed mid-attempt: {leased_by_workers} worker attempts for 100 tasks");
    let said = log.iter().any(|e| {
        e["task"] == "t001" && e["type"] == "session_update" && e["update"]["sessionUpdate"] == "agent_message_chunk"
    });
    assert!(said, "a worker task's log carries its agent's messages");
    for mut w in workers {
        let _ = w.kill().await;
    }
    node.stop().await;
    // Agents of killed workers die with them; none is left behind.
    let marker = dir.path().display().to_string();
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !processes_with_env(&marker).is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(processes_with_env(&marker), Vec::<i32>::new(), "agent processes outlived their workers");
}

/// Issue #32: three nodes on PostgreSQL under ten SIGKILLs never run more of a concurrency
/// key's tasks at once than its limit (read from the event log: every attempt from its
/// `running` to the transition that ends it), and a priority-9 task submitted behind 100
/// ready priority-0 ones of its key starts in the key's next free place.
#[tokio::test]
async fn three_nodes_on_postgres_under_ten_kills_hold_a_keys_limit_and_put_priority_first() {
    // Slow enough that the key's tasks overlap and kills land mid-turn.
    let f = paused_model(40).await;
    let dir = must(tempfile::tempdir(), "dir");
    let db = database();
    let (model, lease) = (f.base_url(), 1_000);
    let names = ["a", "b", "c"];
    let mut nodes = three_nodes(dir.path(), &names, db.url(), &model, lease).await;
    let keyed = |id: &str, priority: u8| {
        format!(
            "[[tasks]]\nid = \"{id}\"\nprompt = \"task {id}\"\npriority = {priority}\n\
             concurrency = [{{ key = \"provider:x\", limit = 2 }}]\n\n"
        )
    };
    // Two runs, so more than one node drives the key's tasks.
    for run in ["low1", "low2"] {
        let plan: String = (0..60).map(|i| keyed(&format!("{run}-{i:02}"), 0)).collect();
        nodes[0].submit(&plan, run).await;
    }
    let mut rng = fastrand::Rng::with_seed(32);
    for round in 0..10 {
        let mut started = 0;
        nodes[(round + 1) % 3]
            .events(
                |e| {
                    started += usize::from(e["type"] == "transition" && e["to"] == "running");
                    started >= 4 * (round + 1)
                },
                true,
            )
            .await;
        kill_one(&mut nodes, &mut rng, dir.path(), &names, db.url(), &model, lease).await;
    }
    nodes[1].submit(&keyed("urgent", 9), "urgent").await;
    let log = every_task_once(&nodes[2], &nodes[0], 121).await;
    // At every point of the log, the attempts between their `running` and their ending.
    let mut live = HashSet::new();
    let mut most = 0;
    for e in log.iter().filter(|e| e["type"] == "transition") {
        let task = e["task"].as_str().unwrap_or_default().to_owned();
        match e["to"].as_str() {
            Some("running") if e["from"] == "pending" => {
                live.insert(task);
            }
            Some("running" | "awaiting_input") => {}
            _ => {
                live.remove(&task);
            }
        }
        most = most.max(live.len());
    }
    assert_eq!(most, 2, "the key's limit of 2 was exceeded (or never reached)");
    let started = log.iter().filter(|e| e["type"] == "transition" && e["to"] == "running").count();
    assert!(started > 121, "no kill landed mid-attempt ({started} attempts); the test proves nothing");
    // The urgent task: created behind the low ones still waiting, it takes a place of its key
    // as soon as a node drives its run (the other nodes keep that place for it meanwhile; the
    // key's other place goes on serving the low ones until then, a few of them: 0 to 5 seen).
    // Had priority been ignored, every low task waiting when it came would have gone first.
    let at = |pred: &dyn Fn(&Value) -> bool| log.iter().position(pred).unwrap_or(usize::MAX);
    let created = at(&|e| e["task"] == "urgent");
    let began = at(&|e| e["task"] == "urgent" && e["to"] == "running");
    let starts = |events: &[Value]| -> HashSet<String> {
        events
            .iter()
            .filter(|e| e["type"] == "transition" && e["to"] == "running" && e["from"] == "pending")
            .filter_map(|e| e["task"].as_str().map(str::to_owned))
            .collect()
    };
    let waiting = 120 - starts(&log[..created]).len();
    assert!(waiting >= 30, "only {waiting} low tasks still waited when the urgent one came; the test proves nothing");
    let before = starts(&log[created..began]).len();
    assert!(before <= 6, "{before} of the {waiting} waiting low-priority tasks started before the urgent one");
    for node in nodes {
        node.stop().await;
    }
}

/// Issue #32: an `every = "2s"` schedule on three PostgreSQL nodes under ten SIGKILLs, over a
/// minute: each occurrence creates exactly one run (no gap, no duplicate), under the id its
/// time gives, whichever node fired it; and each of those runs' tasks completes once.
#[tokio::test]
async fn three_nodes_on_postgres_under_ten_kills_run_every_occurrence_of_a_schedule_once() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let dir = must(tempfile::tempdir(), "dir");
    let db = database();
    let (model, lease) = (f.base_url(), 1_000);
    let names = ["a", "b", "c"];
    let mut nodes = three_nodes(dir.path(), &names, db.url(), &model, lease).await;
    let schedule = json!({"id": "tick", "every": "2s", "overlap": "allow",
                          "plan": "[[tasks]]\nid = \"t\"\nprompt = \"tick\"\n"});
    let http = reqwest::Client::new();
    let post = |node: &Node, path: &str, body: Value| {
        http.post(format!("{}{path}", node.base))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    let resp = must(post(&nodes[0], "/schedules", schedule).await, "declare");
    assert_eq!(resp.status().as_u16(), 201, "{:?}", resp.text().await);
    let created = |e: &Value| e["type"] == "run_created" && e["run"].as_str().is_some_and(|r| r.starts_with("tick-"));
    let mut rng = fastrand::Rng::with_seed(322);
    for round in 0..10 {
        // Three occurrences (six seconds) per kill: ten kills over the minute.
        let mut seen = 0;
        nodes[(round + 1) % 3]
            .events(
                |e| {
                    seen += usize::from(created(e));
                    seen >= 3 * (round + 1)
                },
                true,
            )
            .await;
        kill_one(&mut nodes, &mut rng, dir.path(), &names, db.url(), &model, lease).await;
    }
    let mut seen = 0;
    nodes[0]
        .events(
            |e| {
                seen += usize::from(created(e));
                seen >= 31
            },
            true,
        )
        .await;
    // Paused (fenced in the store), the number of runs is final: each must complete once.
    let resp = must(post(&nodes[2], "/schedules/tick/pause", json!({})).await, "pause");
    assert_eq!(resp.status().as_u16(), 200, "{:?}", resp.text().await);
    let runs: Vec<String> = nodes[1]
        .log()
        .await
        .iter()
        .filter(|e| created(e))
        .filter_map(|e| e["run"].as_str().map(str::to_owned))
        .collect();
    let unique: HashSet<&String> = runs.iter().collect();
    assert_eq!(unique.len(), runs.len(), "a run was created twice: {runs:?}");
    let mut times: Vec<i64> = runs
        .iter()
        .map(|r| {
            let stamp = r.trim_start_matches("tick-").trim_end_matches('Z');
            let t = must(jiff::fmt::strtime::parse("%Y%m%dT%H%M%S", stamp).and_then(|t| t.to_datetime()), "run id");
            must(t.to_zoned(jiff::tz::TimeZone::UTC), "utc").timestamp().as_millisecond()
        })
        .collect();
    times.sort_unstable();
    assert!(times.len() >= 31, "{} occurrences in a minute: {runs:?}", times.len());
    let gaps: Vec<i64> = times.windows(2).map(|w| w[1] - w[0]).filter(|d| *d != 2_000).collect();
    assert!(gaps.is_empty(), "occurrences missed or doubled (gaps {gaps:?}): {runs:?}");
    let mut done = 0;
    nodes[0]
        .events(
            |e| {
                done += usize::from(e["type"] == "transition" && e["to"] == "completed");
                done >= runs.len()
            },
            true,
        )
        .await;
    let log = nodes[1].log().await;
    let mut per_run: HashMap<String, usize> = HashMap::new();
    for e in log.iter().filter(|e| e["type"] == "transition" && e["to"] == "completed") {
        *per_run.entry(e["run"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
    }
    assert_eq!(per_run.len(), runs.len(), "every run's task completed: {per_run:?}");
    assert!(per_run.values().all(|n| *n == 1), "a task completed twice: {per_run:?}");
    for node in nodes {
        node.stop().await;
    }
}
