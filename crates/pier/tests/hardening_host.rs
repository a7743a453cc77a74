//! Issue #16, the host's part: `pier serve` and `pier run` facing deep plans, bad
//! numbers, malformed requests, weak token files, stores they cannot trust and a
//! full disk. Every wait is bounded; none sleeps to synchronise.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::{LIMIT, must, pier_exe};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

/// `pier ARGS` in `home`, in its own process group, stdin closed, output piped.
fn pier(home: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(pier_exe());
    cmd.args(args)
        .current_dir(home)
        .env_clear()
        .envs(vars(home))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    cmd
}
const TOKEN: &str = "hardening-token";

fn vars(home: &Path) -> Vec<(String, String)> {
    vec![
        ("HOME".to_owned(), home.display().to_string()),
        ("PIER_HOME".to_owned(), home.join("data").display().to_string()),
        ("PATH".to_owned(), std::env::var("PATH").unwrap_or_default()),
        ("RUST_LOG".to_owned(), "error".to_owned()),
    ]
}

fn serve_command(home: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(pier_exe());
    cmd.arg("serve")
        .args(args)
        .current_dir(home)
        .env_clear()
        .envs(vars(home))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

struct Server {
    child: Child,
    base: String,
    http: reqwest::Client,
    /// The server's stderr, line by line.
    log: tokio::sync::mpsc::UnboundedReceiver<String>,
}

/// Starts `pier serve` in `home` and waits (bounded) for its address.
async fn serve(home: &Path, args: &[&str]) -> Server {
    serve_logging(home, args, "error").await
}

/// `serve` with `RUST_LOG=level`.
async fn serve_logging(home: &Path, args: &[&str], level: &str) -> Server {
    let mut cmd = serve_command(home, &[&["--listen", "127.0.0.1:0"], args].concat());
    cmd.env("RUST_LOG", level);
    let mut child = must(cmd.spawn(), "spawn");
    let stderr = child.stderr.take().unwrap_or_else(|| panic!("stderr"));
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    let base = loop {
        let line = must(tokio::time::timeout(LIMIT, lines.next_line()).await, "serve started");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier serve exited"));
        if let Some(url) = line.strip_prefix("pier serve: listening on ") {
            break url.to_owned();
        }
    };
    let (log_tx, log) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = log_tx.send(line);
        }
    });
    Server { child, base, http: reqwest::Client::new(), log }
}

impl Server {
    async fn request(&self, req: reqwest::RequestBuilder, limit: Duration) -> (u16, Value) {
        let resp =
            must(must(tokio::time::timeout(limit, req.bearer_auth(TOKEN).send()).await, "answer in time"), "send");
        let status = resp.status().as_u16();
        let text = must(resp.text().await, "body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn submit(&self, body: Value, limit: Duration) -> (u16, Value) {
        let req = self.http.post(format!("{}/runs", self.base)).header("content-type", "application/json");
        self.request(req.body(body.to_string()), limit).await
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.request(self.http.get(format!("{}{path}", self.base)), LIMIT).await
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// `N` tasks `t0 … t{N-1}`, each depending on the next (listed before what it
/// depends on), the last on `t0` when `cycle`; all for pull workers.
fn chain(n: usize, cycle: bool) -> String {
    let mut text = String::with_capacity(n * 48);
    text.push_str("[defaults]\nagent = \"worker\"\n");
    for i in 0..n {
        text.push_str(&format!("[[tasks]]\nid = \"t{i}\"\nprompt = \"p\"\n"));
        if i + 1 < n {
            text.push_str(&format!("depends_on = [\"t{}\"]\n", i + 1));
        } else if cycle {
            text.push_str("depends_on = [\"t0\"]\n");
        }
    }
    text
}

#[tokio::test]
async fn serve_checks_a_100_000_task_chain_and_cycle_and_stays_up() {
    let home = must(tempfile::tempdir(), "dir");
    let mut s = serve(home.path(), &["--token", TOKEN]).await;
    // Debug builds parse 6 MB of TOML slowly; the bound is generous, the test is not about speed.
    let slow = LIMIT * 9;
    let (status, body) = s.submit(json!({"plan": chain(100_000, false), "run_id": "chain"}), slow).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = s.submit(json!({"plan": chain(100_000, true), "run_id": "cycle"}), slow).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "bad_plan", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("dependency cycle: t0 -> t1 -> t2"), "{message}");
    assert!(message.contains("-> t99999 -> t0 (100000 tasks)"), "{message}");
    assert!(s.alive(), "pier serve died");
    assert_eq!(s.get("/health").await.0, 200);
    let (status, run) = s.get("/runs/chain").await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(run["tasks"].as_array().map(Vec::len), Some(100_000));
}

/// Waits for `child` (bounded); if it does not exit, kills its group and fails with what it wrote.
async fn finished_or_tell(mut child: Child, limit: Duration) -> Output {
    let pid = child.id().unwrap_or(0) as i32;
    let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
    let collect = async move {
        use tokio::io::AsyncReadExt;
        let (mut o, mut e) = (Vec::new(), Vec::new());
        if let Some(s) = out.as_mut() {
            let _ = s.read_to_end(&mut o).await;
        }
        if let Some(s) = err.as_mut() {
            let _ = s.read_to_end(&mut e).await;
        }
        (o, e)
    };
    let collecting = tokio::spawn(collect);
    match tokio::time::timeout(limit, child.wait()).await {
        Ok(status) => {
            let (stdout, stderr) = must(collecting.await, "output");
            Output { status: must(status, "wait"), stdout, stderr }
        }
        Err(_) => {
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait().await;
            let (stdout, stderr) = must(collecting.await, "output");
            let tail = |b: &[u8]| String::from_utf8_lossy(&b[b.len().saturating_sub(3000)..]).into_owned();
            panic!("did not exit in {limit:?}\nstdout: {}\nstderr: {}", tail(&stdout), tail(&stderr));
        }
    }
}

async fn finished(child: Child, limit: Duration) -> Output {
    must(must(tokio::time::timeout(limit, child.wait_with_output()).await, "finished in time"), "wait")
}

#[tokio::test]
async fn pier_run_accepts_a_10_000_task_reverse_chain() {
    let home = must(tempfile::tempdir(), "dir");
    let plan = home.path().join("chain.toml");
    must(std::fs::write(&plan, chain(10_000, false)), "write");
    let mut run = pier(home.path(), &["run", &plan.display().to_string(), "--run-id", "deep", "--format", "json"]);
    let out = finished(must(run.spawn(), "spawn"), LIMIT * 6).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).find(|v| v["type"] == "summary");
    // Pull-worker tasks wait for a worker: the run is stored whole and left pending.
    let summary = summary.unwrap_or_else(|| panic!("no summary: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(summary["counts"]["pending"], 10_000, "{summary}");
}

#[tokio::test]
async fn an_empty_run_id_is_refused_by_serve_and_run() {
    let home = must(tempfile::tempdir(), "dir");
    let s = serve(home.path(), &["--token", TOKEN]).await;
    for id in ["", "  ", "a/b"] {
        let (status, body) = s.submit(json!({"plan": chain(1, false), "run_id": id}), LIMIT).await;
        assert_eq!(status, 400, "{id:?}: {body}");
        assert_eq!(body["error"]["code"], "bad_request", "{body}");
    }
    let plan = home.path().join("one.toml");
    must(std::fs::write(&plan, chain(1, false)), "write");
    let mut run = pier(home.path(), &["run", &plan.display().to_string(), "--run-id", ""]);
    let out = finished(must(run.spawn(), "spawn"), LIMIT).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the run id is empty"), "{out:?}");
}

#[tokio::test]
async fn a_malformed_last_event_id_or_after_is_a_400_not_a_replay() {
    let home = must(tempfile::tempdir(), "dir");
    let s = serve(home.path(), &["--token", TOKEN]).await;
    assert_eq!(s.submit(json!({"plan": chain(3, false), "run_id": "r"}), LIMIT).await.0, 201);
    for header in ["abc", "-1", "1.5", "", "99999999999999999999"] {
        let req = s.http.get(format!("{}/events?follow=false", s.base)).header("Last-Event-ID", header);
        let (status, body) = s.request(req, LIMIT).await;
        assert_eq!(status, 400, "Last-Event-ID {header:?}: {body}");
        assert_eq!(body["error"]["code"], "bad_request", "{body}");
        assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("Last-Event-ID")), "{body}");
    }
    for query in ["after=abc", "after=-3", "after=", "follow=maybe"] {
        let (status, body) = s.get(&format!("/events?{query}")).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert_eq!(body["error"]["code"], "bad_request", "{body}");
    }
    // A well-formed one still resumes exactly.
    let req = s.http.get(format!("{}/events?follow=false", s.base)).header("Last-Event-ID", "2");
    let resp = must(req.bearer_auth(TOKEN).send().await, "send");
    assert_eq!(resp.status().as_u16(), 200);
    let text = must(resp.text().await, "text");
    assert!(text.contains("id: 3\n") && !text.contains("id: 2\n"), "{text}");
}

#[tokio::test]
async fn an_empty_token_is_refused_at_start() {
    let home = must(tempfile::tempdir(), "dir");
    let child = must(serve_command(home.path(), &["--listen", "127.0.0.1:0", "--token", ""]).spawn(), "spawn");
    let out = finished(child, LIMIT).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--token is empty"), "{out:?}");
}

#[tokio::test]
async fn the_token_file_is_created_0600_and_one_others_can_read_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let home = must(tempfile::tempdir(), "dir");
    let token = pier_server::token_path(&home.path().join("data"));
    {
        let _s = serve(home.path(), &[]).await;
        let mode = must(std::fs::metadata(&token), "token file").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the token file is {mode:o}");
    }
    for mode in [0o644, 0o640, 0o604] {
        must(std::fs::set_permissions(&token, std::fs::Permissions::from_mode(mode)), "chmod");
        let out =
            finished(must(serve_command(home.path(), &["--listen", "127.0.0.1:0"]).spawn(), "spawn"), LIMIT).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(&format!("chmod 600 {}", token.display())), "{stderr}");
    }
}

/// Stores run `r` as an older pier could have: its specs are written as given, unchecked.
fn store_run(home: &Path, tasks: Vec<pier_host::TaskSpec>) -> PathBuf {
    use pier_host::TaskStore;
    let db = home.join("data/pier.db");
    let store = must(pier_host::SqliteStore::open(&db), "open");
    must(store.create_run("r", &pier_host::Plan { tasks, lines: Default::default() }, "older pier"), "create run");
    db
}

fn spec(id: &str, prompt: &str) -> pier_host::TaskSpec {
    pier_host::TaskSpec {
        id: id.into(),
        prompt: prompt.into(),
        agent: "pier".into(),
        depends_on: vec![],
        cwd: None,
        timeout: None,
        max_time: None,
        max_attempts: 3,
        retry_on: vec![],
        idempotent: false,
        metadata: Default::default(),
        permissions: Default::default(),
        roots: vec![],
        writable: None,
        fresh_agent: false,
        requires: vec![],
        sandbox: None,
        network: vec![],
        limits: Default::default(),
        budget: None,
        run_budget: None,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_stored_task_with_bad_numbers_fails_named_instead_of_panicking() {
    use pier_host::TaskStore;
    let home = must(tempfile::tempdir(), "dir");
    let db = store_run(
        home.path(),
        vec![
            pier_host::TaskSpec { timeout: Some(-1.0), ..spec("negative", "x") },
            // JSON has no infinity or NaN (they are stored as null): a finite bad number is what a store can hold.
            pier_host::TaskSpec { max_time: Some(-5.0), ..spec("backwards", "x") },
            pier_host::TaskSpec { timeout: Some(1e300), ..spec("huge", "x") },
        ],
    );
    let mut run = pier(home.path(), &["run", "--resume", "r"]);
    let out = finished(must(run.spawn(), "spawn"), LIMIT * 3).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let store = must(pier_host::SqliteStore::open(&db), "open");
    for (task, wanted) in [("negative", "timeout = -1"), ("backwards", "max_time = -5"), ("huge", "timeout = 1e300")] {
        let row = must(store.task("r", task), "read").unwrap_or_else(|| panic!("no task {task}"));
        assert_eq!(row.state, pier_host::TaskState::Failed, "{task}: {row:?}");
        assert_eq!(row.attempt, 1, "{task} was retried");
        let error = row.error.unwrap_or_default();
        assert!(error.contains(&format!("task `{task}` cannot start")) && error.contains(wanted), "{error}");
    }
}

#[tokio::test]
async fn a_task_row_with_corrupt_json_fails_the_command_and_leaves_the_file_untouched() {
    let home = must(tempfile::tempdir(), "dir");
    let db = store_run(home.path(), vec![spec("fine", "a"), spec("victim", "CORRUPT-ME")]);
    // Corrupt the task's spec in place (the store is closed, its WAL checkpointed).
    let mut bytes = must(std::fs::read(&db), "read");
    let (from, to) = (b"\"prompt\":\"CORRUPT-ME\"", b"\"prompt\":!CORRUPT-ME\"");
    let mut patched = 0;
    for at in 0..bytes.len().saturating_sub(from.len()) {
        if &bytes[at..at + from.len()] == from {
            bytes[at..at + from.len()].copy_from_slice(to);
            patched += 1;
        }
    }
    assert!(patched > 0, "the spec was not found in the file");
    must(std::fs::write(&db, &bytes), "write");
    let mut run = pier(home.path(), &["run", "--resume", "r"]);
    let out = finished(must(run.spawn(), "spawn"), LIMIT).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("task `victim` of run `r`") && stderr.contains("corrupt"), "{stderr}");
    assert_eq!(must(std::fs::read(&db), "read"), bytes, "pier run changed the file");
    // `pier serve` goes through every unfinished run at start: it refuses to start.
    let out = tokio::time::timeout(LIMIT, async {
        let child = must(serve_command(home.path(), &["--listen", "127.0.0.1:0", "--token", TOKEN]).spawn(), "spawn");
        finished(child, LIMIT).await
    })
    .await;
    let out = must(out, "serve ended");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("task `victim` of run `r`"), "{stderr}");
    assert_eq!(must(std::fs::read(&db), "read"), bytes, "pier serve changed the file");
}

/// A small tmpfs, unmounted when dropped. Mounting needs root: where it cannot be
/// mounted the test fails with the reason rather than skip.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = must(tempfile::tempdir(), "dir");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run mount (the full-disk test needs root to mount a tmpfs): {e}"));
        assert!(
            out.status.success(),
            "cannot mount a {size} tmpfs for the full-disk test (it needs root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { dir }
    }

    fn resize(&self, size: &str) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(self.dir.path())
            .status();
        assert!(status.is_ok_and(|s| s.success()), "cannot grow the tmpfs");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.dir.path()).status();
    }
}

#[tokio::test]
async fn a_full_disk_stops_pier_run_plainly_and_resume_completes_the_run() {
    use pier_host::TaskStore;
    const TASKS: usize = 20;
    let home = must(tempfile::tempdir(), "dir");
    let disk = Tmpfs::mount("3m");
    let data = disk.dir.path().join("data");
    let fake = must(pier_fake_model::FakeModel::start().await, "fake");
    // Every answer is 20 KB (which the session logs and the store keep several times
    // over): 3 MB fill within a few tasks.
    fake.set_fallback(|_| pier_fake_model::Reply::text(&"all work and no play ".repeat(1_000)));
    let mut plan = String::new();
    for i in 0..TASKS {
        plan.push_str(&format!("[[tasks]]\nid = \"t{i}\"\nprompt = \"task {i}\"\nmax_attempts = 2\n\n"));
    }
    must(std::fs::write(home.path().join("plan.toml"), plan), "write");
    let run = |args: &[&str]| {
        let mut cmd = pier(home.path(), args);
        cmd.env("PIER_HOME", &data).env("PIER_BASE_URL", fake.base_url()).env("PIER_MODEL", "fake-model");
        cmd
    };
    let first = finished_or_tell(
        must(run(&["run", "plan.toml", "--run-id", "full", "--format", "json", "--concurrency", "1"]).spawn(), "spawn"),
        LIMIT * 3,
    )
    .await;
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert_eq!(first.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("disk is full") && stderr.contains(&data.display().to_string()), "{stderr}");
    // What was announced as completed before the disk filled.
    let announced: Vec<String> = String::from_utf8_lossy(&first.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["type"] == "transition" && v["to"] == "completed")
        .filter_map(|v| v["task"].as_str().map(str::to_owned))
        .collect();
    disk.resize("64m");
    let second =
        finished(must(run(&["run", "--resume", "full", "--concurrency", "1"]).spawn(), "spawn"), LIMIT * 6).await;
    let df = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("df -h {0}; du -a {0} | sort -n | tail -5", data.display()))
        .output();
    assert_eq!(
        second.status.code(),
        Some(0),
        "{}\n{:?}",
        String::from_utf8_lossy(&second.stderr).chars().take(3000).collect::<String>(),
        df.map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    );
    let store = must(pier_host::SqliteStore::open(&data.join("pier.db")), "open");
    let tasks = must(store.tasks("full"), "tasks");
    assert_eq!(tasks.len(), TASKS);
    assert!(announced.len() < TASKS, "the disk did not fill during the first run");
    for t in &tasks {
        assert_eq!(t.state, pier_host::TaskState::Completed, "{t:?}");
        if announced.contains(&t.id) {
            assert_eq!(t.attempt, 1, "{} was announced completed and ran again", t.id);
        }
    }
    drop(store);
}

/// The body of a chunked HTTP/1.1 response, after its headers.
fn dechunk(raw: &[u8]) -> Vec<u8> {
    let start = raw.windows(4).position(|w| w == b"\r\n\r\n").map_or(raw.len(), |p| p + 4);
    let (mut rest, mut body) = (&raw[start..], Vec::new());
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < eol + 2 + size {
            break;
        }
        body.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
        rest = &rest[(eol + 4 + size).min(rest.len())..];
    }
    body
}

/// The `id:` lines of an SSE text, in order.
fn sse_ids(text: &str) -> Vec<i64> {
    text.lines().filter_map(|l| l.strip_prefix("id: ")).filter_map(|n| n.trim().parse().ok()).collect()
}

#[tokio::test]
async fn an_events_client_that_stops_reading_is_cut_with_a_note_and_resumes_exactly() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let home = must(tempfile::tempdir(), "dir");
    let args = ["--token", TOKEN, "--sse-buffer", "16", "--sse-patience-ms", "300"];
    let mut s = serve_logging(home.path(), &args, "warn").await;
    // 2,000 task_created events of 10 KB each: far more than the socket buffers hold.
    let mut plan = String::from("[defaults]\nagent = \"worker\"\n");
    let pad = "x".repeat(10_000);
    for i in 0..2_000 {
        plan.push_str(&format!("[[tasks]]\nid = \"t{i}\"\nprompt = \"p\"\nmetadata = {{ pad = \"{pad}\" }}\n"));
    }
    assert_eq!(s.submit(json!({"plan": plan, "run_id": "r"}), LIMIT * 3).await.0, 201);
    let total = 2_001;
    // A client with a small receive window that reads nothing.
    let addr: std::net::SocketAddr = must(s.base.trim_start_matches("http://").parse(), "address");
    let socket = must(tokio::net::TcpSocket::new_v4(), "socket");
    must(socket.set_recv_buffer_size(4096), "rcvbuf");
    let mut slow = must(socket.connect(addr).await, "connect");
    let request = format!(
        "GET /events?follow=false HTTP/1.1\r\nHost: pier\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
    );
    must(slow.write_all(request.as_bytes()).await, "request");
    // The server says when it cuts the client (bounded wait on its log, not a sleep).
    loop {
        let line = must(tokio::time::timeout(LIMIT, s.log.recv()).await, "the slow client was cut");
        if line.unwrap_or_else(|| panic!("pier serve exited")).contains("cut a slow /events client") {
            break;
        }
    }
    let mut raw = Vec::new();
    must(must(tokio::time::timeout(LIMIT, slow.read_to_end(&mut raw)).await, "read in time"), "read");
    let text = String::from_utf8_lossy(&dechunk(&raw)).into_owned();
    let ids = sse_ids(&text);
    let note = text.lines().find_map(|l| l.strip_prefix(": too slow; reconnect with Last-Event-ID "));
    let resume: i64 = note.and_then(|n| n.trim().parse().ok()).unwrap_or_else(|| panic!("no cut note"));
    assert!(resume < total, "the whole log was sent: {resume}");
    assert_eq!(ids, (1..=resume).collect::<Vec<_>>(), "the slow client got a gap or a repeat");
    // Resuming from the note delivers exactly the rest.
    let req = s.http.get(format!("{}/events?follow=false", s.base)).header("Last-Event-ID", resume.to_string());
    let resp = must(must(tokio::time::timeout(LIMIT, req.bearer_auth(TOKEN).send()).await, "resume"), "send");
    let rest = sse_ids(&must(resp.text().await, "text"));
    assert_eq!(rest, ((resume + 1)..=total).collect::<Vec<_>>());
    assert!(s.alive());
}

/// The resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next());
    kb.and_then(|k| k.parse::<u64>().ok()).unwrap_or(0) * 1024
}

/// The highest resident memory of `pid` seen over `over`, sampled every 50 ms.
async fn peak_rss(pid: u32, over: Duration) -> u64 {
    let until = tokio::time::Instant::now() + over;
    let mut peak = 0;
    while tokio::time::Instant::now() < until {
        peak = peak.max(rss(pid));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    peak
}

/// 200 `/events` readers of a 10,000-task run that stop reading hold a bounded read-ahead
/// each (not the log), and the memory comes back when they leave. Found by a probe: they
/// took the server from ~340 MB to 0.8–1.0 GB, and it stayed there.
#[tokio::test]
async fn stalled_event_readers_hold_a_bounded_read_ahead_and_give_it_back() {
    let home = must(tempfile::tempdir(), "home");
    let mut s = serve(home.path(), &["--token", TOKEN]).await;
    let pid = s.child.id().unwrap_or_else(|| panic!("serve's pid"));
    let mut plan = String::from("[defaults]\nagent = \"worker:none\"\n");
    for i in 0..10_000 {
        plan.push_str(&format!("[[tasks]]\nid = \"t{i}\"\nprompt = \"a prompt of some length for task {i}\"\n"));
    }
    let (code, body) = s.submit(json!({"plan": plan, "run_id": "mem"}), LIMIT * 4).await;
    assert_eq!(code, 201, "{body}");
    // One whole replay first, so what the server keeps anyway is in the baseline.
    let whole = s.http.get(format!("{}/events?after=0&follow=false", s.base)).bearer_auth(TOKEN).send().await;
    let whole = must(must(whole, "replay").text().await, "replay body");
    assert!(whole.matches("event: task_created").count() >= 10_000);
    let baseline = peak_rss(pid, Duration::from_millis(500)).await;

    let mut readers = Vec::new();
    for _ in 0..200 {
        let client = reqwest::Client::new();
        let resp = client.get(format!("{}/events?after=0", s.base)).bearer_auth(TOKEN).send().await;
        readers.push((client, must(resp, "reader")));
    }
    let held = peak_rss(pid, Duration::from_secs(3)).await;
    let per_reader = held.saturating_sub(baseline) / 200;
    eprintln!("RSS {baseline} before, {held} with 200 stalled readers: {per_reader} bytes a reader");
    assert!(per_reader < 1_500_000, "{per_reader} bytes a reader ({baseline} before, {held} with 200)");
    assert!(s.alive());

    drop(readers);
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let now = rss(pid);
        if now <= baseline + 64 * 1024 * 1024 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{now} bytes kept after the readers left ({baseline} before)");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
