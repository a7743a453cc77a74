//! The worker API (`/v1`, issue #31) against a real `pier serve`, driven as a worker on another
//! machine would drive it: a lease that waits for work, progress in ordered batches written
//! once, a permission question answered by a person, a person's interrupting message and an
//! HTTP cancel noticed by one long-poll, the ending with the attempt's output and usage, and the
//! worker listed on `/nodes`.

mod support;

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use support::serve::{Server, TOKEN, server};
use support::{LIMIT, must};

async fn post(s: &Server, path: &str, body: Value) -> (u16, Value) {
    s.call(Method::POST, path, Some(body)).await
}

fn at(run: &str, task: &str, n: i64, rest: &str) -> String {
    format!("/v1/runs/{run}/tasks/{task}/attempts/{n}/{rest}")
}

fn chunk(text: &str) -> Value {
    json!({"type": "session_update", "sessionId": "s1",
           "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}})
}

fn tool_call(id: &str) -> Value {
    json!({"type": "session_update", "sessionId": "s1",
           "update": {"sessionUpdate": "tool_call", "toolCallId": id, "title": "Run make", "kind": "execute", "status": "pending"}})
}

/// Posts `body` to `path` on its own task (a long-poll), with the answer's status, body and
/// arrival.
fn spawn_post(s: &Server, path: &str, body: Value) -> tokio::task::JoinHandle<(u16, Value, Instant)> {
    let (http, url) = (s.http.clone(), format!("{}{path}", s.base));
    tokio::spawn(async move {
        let req = http.post(url).bearer_auth(TOKEN).header("content-type", "application/json").body(body.to_string());
        let resp = must(req.send().await, "send");
        let status = resp.status().as_u16();
        let text = must(resp.text().await, "body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null), Instant::now())
    })
}

async fn joined(h: tokio::task::JoinHandle<(u16, Value, Instant)>) -> (u16, Value, Instant) {
    must(tokio::time::timeout(LIMIT, h).await, "answered in time").unwrap_or_else(|e| panic!("{e}"))
}

/// Leases the next task for `wk`, waiting for it.
async fn lease(s: &Server, wait_ms: u64) -> (u16, Value) {
    post(s, "/v1/lease", json!({"worker": "wk", "capabilities": ["build"], "ttl_ms": 60_000, "wait_ms": wait_ms})).await
}

#[tokio::test]
async fn a_worker_drives_its_attempt_through_the_v1_api_like_a_local_one() {
    let s = server(None).await;
    // A lease asked before any work exists waits for it.
    let body = json!({"worker": "wk", "capabilities": ["build"], "ttl_ms": 60_000, "wait_ms": 10_000});
    let waiting = spawn_post(&s, "/v1/lease", body);
    let plan = "[[tasks]]\nid = \"a\"\nagent = \"worker:build\"\nprompt = \"build it\"\n\n\
                [[tasks]]\nid = \"b\"\nagent = \"worker:build\"\nprompt = \"and this\"\ndepends_on = [\"a\"]\n";
    let submitted = Instant::now();
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "w"})).await.0, 201);
    let (code, leased, got) = joined(waiting).await;
    assert_eq!(code, 200, "{leased}");
    assert!(got - submitted < Duration::from_secs(1), "the waiting lease got the task at once");
    assert_eq!((leased["task"]["id"].as_str(), leased["prompt"].as_str()), (Some("a"), Some("build it")));
    let n = leased["task"]["attempt"].as_i64().unwrap_or_default();

    // Progress: ordered batches, each written once; nonsense refused with nothing written.
    let batch = json!({"worker": "wk", "seq": 1, "events": [chunk("Building"), tool_call("t1")]});
    assert_eq!(post(&s, &at("w", "a", n, "progress"), batch.clone()).await, (200, json!({"written": true})));
    assert_eq!(post(&s, &at("w", "a", n, "progress"), batch).await, (200, json!({"written": false})), "a replay");
    let bad = json!({"worker": "wk", "seq": 2, "events": [{"type": "transition", "to": "completed"}]});
    let (code, v) = post(&s, &at("w", "a", n, "progress"), bad).await;
    assert_eq!((code, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    let (code, v) =
        post(&s, &at("w", "a", n, "progress"), json!({"worker": "intruder", "seq": 2, "events": [chunk("x")]})).await;
    assert_eq!((code, v["error"]["code"].as_str()), (409, Some("lease_lost")), "another worker: {v}");
    // A wrong token writes nothing.
    let forged = json!({"worker": "wk", "seq": 3, "events": [chunk("forged")]}).to_string();
    let url = format!("{}{}", s.base, at("w", "a", n, "progress"));
    let resp =
        s.http.post(url).bearer_auth("wrong").header("content-type", "application/json").body(forged).send().await;
    assert_eq!(must(resp, "send").status().as_u16(), 401);
    assert_eq!(
        post(&s, &at("w", "a", n, "progress"), json!({"worker": "wk", "seq": 2, "events": [chunk(" done")]})).await.0,
        200
    );

    // A permission question parks the task until a person answers it.
    let request = json!({"sessionId": "s1", "toolCall": {"toolCallId": "t1", "title": "Run make"},
        "options": [{"optionId": "yes", "name": "Allow", "kind": "allow_once"}, {"optionId": "no", "name": "Reject", "kind": "reject_once"}]});
    let (code, v) = post(&s, &at("w", "a", n, "questions"), json!({"worker": "wk", "request": request})).await;
    assert_eq!(code, 201, "{v}");
    let q = v["question"].as_i64().unwrap_or_default();
    let (_, t) = s.call(Method::GET, "/runs/w/tasks/a", None).await;
    assert_eq!(t["task"]["state"], "awaiting_input", "{t}");
    let answered =
        spawn_post(&s, &at("w", "a", n, &format!("questions/{q}/wait")), json!({"worker": "wk", "wait_ms": 10_000}));
    let (code, v) = post(&s, "/runs/w/tasks/a/answer", json!({"allow": true})).await;
    assert_eq!(code, 200, "{v}");
    let (_, answer, _) = joined(answered).await;
    assert!(answer["answer"].as_str().is_some_and(|a| a.contains("yes")), "{answer}");
    let (_, t) = s.call(Method::GET, "/runs/w/tasks/a", None).await;
    assert_eq!(t["task"]["state"], "running", "the task runs again: {t}");

    // A person's interrupting message ends the worker's long-poll at once.
    let notice = spawn_post(&s, &at("w", "a", n, "notice"), json!({"worker": "wk", "wait_ms": 20_000}));
    let said = Instant::now();
    let (code, v) = post(&s, "/runs/w/tasks/a/messages", json!({"text": "use -j4", "interrupt": true})).await;
    assert_eq!(code, 201, "{v}");
    let (_, notice, seen) = joined(notice).await;
    assert_eq!((notice["held"].as_bool(), notice["interrupt"].as_bool()), (Some(true), Some(true)), "{notice}");
    assert!(seen - said < Duration::from_secs(1), "noticed in {:?}", seen - said);
    let (_, taken) = post(&s, &at("w", "a", n, "messages"), json!({"worker": "wk"})).await;
    assert_eq!(taken["messages"][0]["text"], "use -j4", "{taken}");

    // An ending that would leave a person's message unsent is refused, with nothing written.
    assert_eq!(post(&s, "/runs/w/tasks/a/messages", json!({"text": "and the docs"})).await.0, 201);
    let early = json!({"worker": "wk", "status": "completed", "idempotency_key": "end-0", "result": "built",
        "unless_messages": true, "progress": {"seq": 3, "events": [chunk(" never")]}});
    let (code, v) = post(&s, &at("w", "a", n, "end"), early).await;
    assert_eq!((code, v["error"]["code"].as_str()), (409, Some("messages_waiting")), "{v}");
    let (_, taken) = post(&s, &at("w", "a", n, "messages"), json!({"worker": "wk"})).await;
    assert_eq!(taken["messages"][0]["text"], "and the docs", "{taken}");

    // The ending: the output kept and the usage counted with it, once.
    // Its last progress batch rides with it, written ahead of it in its commit, and the next
    // task (b, whose dependency it completes) is leased in that commit too; a repeat of the
    // report answers the same lease.
    let end = json!({"worker": "wk", "status": "completed", "idempotency_key": "end-1", "result": "built",
        "output": {"text": "Building done"}, "usage": {"provider": "openai", "model": "m", "input": 10, "output": 5},
        "progress": {"seq": 3, "events": [chunk(" and tested")]},
        "next": {"capabilities": ["build"], "ttl_ms": 60_000}});
    let (code, first) = post(&s, &at("w", "a", n, "end"), end.clone()).await;
    assert_eq!(code, 200, "{first}");
    assert_eq!((first["next"]["task"]["id"].as_str(), first["next"]["prompt"].as_str()), (Some("b"), Some("and this")));
    let (code, again) = post(&s, &at("w", "a", n, "end"), end.clone()).await;
    assert_eq!((code, &again), (200, &first), "a repeat answers the first report's answer, its lease included");
    let leased = first["next"].clone();
    let (_, t) = s.call(Method::GET, "/runs/w/tasks/a", None).await;
    assert_eq!((t["task"]["state"].as_str(), t["task"]["result"].as_str()), (Some("completed"), Some("built")), "{t}");
    assert_eq!(t["attempts"][0]["output"]["text"], "Building done", "{t}");
    assert_eq!(t["spend"]["requests"], 1, "{t}");
    let events = s.events_until(Some(0), |e| e["task"] == "a" && e["to"] == "completed").await;
    let said: Vec<&str> = events
        .iter()
        .filter(|e| e["task"] == "a" && e["type"] == "session_update")
        .filter_map(|e| e["update"]["content"]["text"].as_str().or(e["update"]["toolCallId"].as_str()))
        .collect();
    assert_eq!(
        said,
        ["Building", "t1", " done", " and tested"],
        "in order, once each; a refused ending wrote none of its batch"
    );
    let last = events.iter().rposition(|e| e["task"] == "a" && e["type"] == "session_update");
    let ended = events.iter().position(|e| e["task"] == "a" && e["to"] == "completed");
    assert!(last < ended, "the ending's batch is logged ahead of it");
    let claimed = s.events_until(Some(0), |e| e["task"] == "b" && e["to"] == "running").await;
    let seq = |e: Option<&Value>| e.and_then(|e| e["seq"].as_i64()).unwrap_or_default();
    assert_eq!(seq(claimed.last()), seq(ended.and_then(|i| events.get(i))) + 1, "claimed in the ending's commit");

    // The next task: an HTTP cancel reaches the worker's long-poll within a second; the worker
    // ends the task with its output, and the cancel answers once it has.
    assert_eq!(leased["task"]["id"].as_str(), Some("b"), "{leased}");
    let (_, nodes) = s.call(Method::GET, "/nodes", None).await;
    let wk =
        nodes["workers"].as_array().and_then(|w| w.iter().find(|w| w["name"] == "wk")).cloned().unwrap_or_default();
    assert_eq!(wk["capabilities"], json!(["build"]), "{nodes}");
    assert_eq!(wk["running"], json!([["w", "b", 1]]), "{nodes}");
    let notice = spawn_post(&s, &at("w", "b", 1, "notice"), json!({"worker": "wk", "wait_ms": 20_000}));
    let cancelled = Instant::now();
    let cancel = spawn_post(&s, "/runs/w/tasks/b/cancel", json!({}));
    let (_, notice, seen) = joined(notice).await;
    assert_eq!(
        (notice["held"].as_bool(), notice["state"].as_str(), notice["cancel"].as_str()),
        (Some(true), Some("running"), Some("cancelled over HTTP")),
        "{notice}"
    );
    assert!(seen - cancelled < Duration::from_secs(1), "the cancel reached the worker in {:?}", seen - cancelled);
    // It asks nothing more; its ending (whatever it reports) is the cancel, with its output.
    let request = json!({"sessionId": "s1", "toolCall": {"toolCallId": "t2", "title": "Run make"},
        "options": [{"optionId": "yes", "name": "Allow", "kind": "allow_once"}]});
    let (code, v) = post(&s, &at("w", "b", 1, "questions"), json!({"worker": "wk", "request": request})).await;
    assert_eq!((code, v["error"]["code"].as_str()), (409, Some("cancel_requested")), "{v}");
    let output = json!({"text": "half built", "toolCalls": []});
    let end = json!({"worker": "wk", "status": "interrupted", "idempotency_key": "e-b", "output": output,
                     "progress": {"seq": 1, "events": [chunk("half built")]}});
    let (code, v) = post(&s, &at("w", "b", 1, "end"), end).await;
    assert_eq!((code, v["task"]["state"].as_str()), (200, Some("cancelled")), "{v}");
    let (code, answered, _) = joined(cancel).await;
    assert_eq!((code, answered["task"]["state"].as_str()), (200, Some("cancelled")), "{answered}");
    let (_, t) = s.call(Method::GET, "/runs/w/tasks/b", None).await;
    assert_eq!(t["attempts"][0]["output"], output, "{t}");
    let (code, v) =
        post(&s, &at("w", "b", 1, "progress"), json!({"worker": "wk", "seq": 2, "events": [chunk("late")]})).await;
    assert_eq!((code, v["error"]["code"].as_str()), (409, Some("lease_lost")), "{v}");
}

/// A repeat of a report whose commit leased nothing leases nothing either: a task that fits
/// by then is left for the next lease, not held for an answer the worker may never read.
#[tokio::test]
async fn a_repeated_report_never_leases_a_second_task() {
    let s = server(None).await;
    let plan = "[[tasks]]\nid = \"a\"\nagent = \"worker:build\"\nprompt = \"one\"\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "r1"})).await.0, 201);
    let (code, leased) = lease(&s, 5_000).await;
    assert_eq!((code, leased["task"]["id"].as_str()), (200, Some("a")), "{leased}");
    let n = leased["task"]["attempt"].as_i64().unwrap_or_default();
    let end = json!({"worker": "wk", "status": "completed", "idempotency_key": "e1", "result": "ok",
                     "next": {"capabilities": ["build"], "ttl_ms": 60_000}});
    let (code, first) = post(&s, &at("r1", "a", n, "end"), end.clone()).await;
    assert_eq!((code, first["task"]["state"].as_str(), &first["next"]), (200, Some("completed"), &Value::Null));
    let plan = "[[tasks]]\nid = \"b\"\nagent = \"worker:build\"\nprompt = \"two\"\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "r2"})).await.0, 201);
    let (code, again) = post(&s, &at("r1", "a", n, "end"), end).await;
    assert_eq!((code, &again), (200, &first), "the repeat answers the first answer");
    let (code, leased) = lease(&s, 0).await;
    assert_eq!((code, leased["task"]["id"].as_str()), (200, Some("b")), "{leased}");
}

/// `pier worker ARGS…` on its own home and directory (as another machine would be), with the
/// host's `token` and, if given, a `model` for its agents.
fn worker_command(token: &str, model: Option<&str>, args: &[&str]) -> (tempfile::TempDir, tokio::process::Command) {
    let dir = must(tempfile::tempdir(), "worker dir");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pier"));
    cmd.arg("worker")
        .args(args)
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", dir.path())
        .env("PIER_HOME", dir.path().join("data"))
        .env("PIER_TOKEN", token)
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some(model) = model {
        cmd.env("PIER_BASE_URL", model).env("PIER_MODEL", "fake-model");
    }
    (dir, cmd)
}

/// A running `pier worker ARGS…` with the host's token and agents on `model`.
fn worker(model: &str, args: &[&str]) -> (tempfile::TempDir, tokio::process::Child) {
    let (dir, mut cmd) = worker_command(TOKEN, Some(model), args);
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    (dir, must(cmd.spawn(), "spawn pier worker"))
}

/// `pier approve`, `pier say` … as a person at the host runs them, on the server's store.
async fn person(s: &Server, args: &[&str]) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pier"));
    cmd.args(args)
        .current_dir(s.dir.path())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", s.dir.path())
        .env("PIER_HOME", s.dir.path().join("data"))
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = must(must(tokio::time::timeout(LIMIT, cmd.output()).await, "in time"), "run");
    assert!(out.status.success(), "pier {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// `pier worker` runs a task's agent on its machine: the agent's messages and tool calls reach
/// the task's log in order, its permission request is answered by a person on the host with
/// `pier approve`, a person's `pier say --interrupt` reaches it, and an HTTP cancel stops it within a second with
/// its partial output kept.
#[tokio::test]
async fn pier_worker_runs_the_agent_here_and_the_host_cannot_tell_the_difference() {
    use pier_fake_model::{FakeModel, Gate, Reply, Step};
    let f = must(FakeModel::start().await, "fake");
    let s = server(None).await;
    let base = f.base_url();
    let args = ["--server", &s.base, "--capability", "build", "--name", "wk1", "--lease-ttl-ms", "3000"];
    let (_dir, _worker) = worker(&base, &args);
    // The agent asks to run a command (a person allows it), then answers.
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "echo from-the-worker"}"#));
    f.push(Reply::text("All built."));
    let plan =
        "[[tasks]]\nid = \"a\"\nagent = \"worker:build\"\nprompt = \"build it\"\npermissions = { execute = \"ask\" }\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "pw"})).await.0, 201);
    s.events_until(Some(0), |e| e["task"] == "a" && e["type"] == "question").await;
    person(&s, &["approve", "a", "--run", "pw"]).await;
    s.events_until(Some(0), |e| e["task"] == "a" && e["to"] == "completed").await;
    let (_, t) = s.call(Method::GET, "/runs/pw/tasks/a", None).await;
    assert_eq!(t["task"]["result"], "All built.", "{t}");
    let events = s.events_until(Some(0), |e| e["task"] == "a" && e["to"] == "completed").await;
    let kinds: Vec<String> = events
        .iter()
        .filter(|e| e["task"] == "a")
        .map(|e| match e["type"].as_str() {
            Some("session_update") => e["update"]["sessionUpdate"].as_str().unwrap_or("?").to_owned(),
            Some(k) => k.to_owned(),
            None => "?".into(),
        })
        .collect();
    let pos = |k: &str| kinds.iter().position(|x| x == k).unwrap_or_else(|| panic!("no {k} in {kinds:?}"));
    // The agent's own events in the order it sent them; the question and its answer before
    // the decision the agent was given.
    assert!(pos("tool_call") < pos("permission") && pos("permission") < pos("tool_call_update"), "{kinds:?}");
    assert!(pos("tool_call_update") < pos("agent_message_chunk"), "{kinds:?}");
    assert!(pos("question") < pos("answer") && pos("answer") < pos("permission"), "{kinds:?}");
    // Its model traffic went through the worker's own gateway and was billed with the ending.
    assert_eq!(t["spend"]["requests"], 2, "{}", t["spend"]);
    assert_eq!(t["spend"]["by_node"]["worker:wk1"]["requests"], 2, "{}", t["spend"]);
    assert_eq!(t["spend"]["tokens"]["input"], 10, "{}", t["spend"]);
    let out = t["attempts"][0]["output"]["toolCalls"].to_string();
    assert!(out.contains("c1"), "the output keeps the tool call: {t}");
    let (_, nodes) = s.call(Method::GET, "/nodes", None).await;
    assert!(nodes["workers"].as_array().is_some_and(|w| w.iter().any(|w| w["name"] == "wk1")), "{nodes}");

    // A turn that streams and then waits: an interrupting message goes to the agent at once,
    // on the same session; a cancel then stops it within a second, its output kept.
    let gate = Gate::new();
    f.push(Reply::Stream(vec![Step::Text("Working on b".into()), Step::Gate(gate.clone()), Step::Done]));
    f.push(Reply::Stream(vec![Step::Text("Switching to -j4".into()), Step::Hang]));
    let plan = "[[tasks]]\nid = \"b\"\nagent = \"worker:build\"\nprompt = \"long build\"\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "pw2"})).await.0, 201);
    s.events_until(Some(0), |e| e["task"] == "b" && e["update"]["content"]["text"] == "Working on b").await;
    person(&s, &["say", "b", "--run", "pw2", "use -j4", "--interrupt"]).await;
    s.events_until(Some(0), |e| e["task"] == "b" && e["update"]["content"]["text"] == "Switching to -j4").await;
    let asked = f.requests();
    let last = asked.last().map(|r| r.body.to_string()).unwrap_or_default();
    assert!(last.contains("use -j4") && last.contains("long build"), "the message went on the same session: {last}");
    // The worker's attempt ends the task with its output once its agent has stopped, and
    // the cancel answers then: within a second.
    let cancelled = Instant::now();
    let (code, answered) = post(&s, "/runs/pw2/tasks/b/cancel", json!({})).await;
    assert!(
        cancelled.elapsed() < Duration::from_secs(1),
        "the agent stopped {:?} after the cancel",
        cancelled.elapsed()
    );
    assert_eq!((code, answered["task"]["state"].as_str()), (200, Some("cancelled")), "{answered}");
    let (_, t) = s.call(Method::GET, "/runs/pw2/tasks/b", None).await;
    let text = t["attempts"][0]["output"]["text"].as_str().unwrap_or_default();
    assert!(text.contains("Switching"), "the partial output is kept with the ending: {t}");
}

/// A worker with the wrong token is refused at its first call and stops, saying what to do;
/// the host writes nothing of it.
#[tokio::test]
async fn a_worker_with_the_wrong_token_stops_at_once_and_leaves_nothing() {
    let s = server(None).await;
    let (_dir, mut cmd) =
        worker_command("not-the-token", None, &["--server", &s.base, "--capability", "build", "--name", "intruder"]);
    let out = must(must(tokio::time::timeout(LIMIT, cmd.output()).await, "it stopped in time"), "run");
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("refused the worker's token") && said.contains("PIER_TOKEN"), "{said}");
    let (_, workers) = s.call(Method::GET, "/v1/workers", None).await;
    assert_eq!(workers["workers"], json!([]), "{workers}");
}

/// A TCP forwarder to `target` that can be cut (every connection dropped, new ones refused)
/// and restored: the network between a worker and its host.
struct Link {
    base: String,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    open: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    refused: tokio::sync::watch::Receiver<usize>,
}

impl Link {
    async fn to(target: &str) -> Link {
        let target = target.trim_start_matches("http://").to_owned();
        let listener = must(tokio::net::TcpListener::bind("127.0.0.1:0").await, "bind");
        let base = format!("http://{}", must(listener.local_addr(), "addr"));
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (refused_tx, refused) = tokio::sync::watch::channel(0usize);
        let (c, o) = (cut.clone(), open.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if c.load(std::sync::atomic::Ordering::SeqCst) {
                    refused_tx.send_modify(|n| *n += 1);
                    drop(inbound);
                    continue;
                }
                let target = target.clone();
                let conn = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                o.lock().unwrap_or_else(|e| e.into_inner()).push(conn);
            }
        });
        Link { base, cut, open, refused }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for conn in self.open.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            conn.abort();
        }
    }

    fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A worker cut off from its host for less than its lease keeps its agent working, and what
/// it could not send (the rest of the answer, the ending) arrives once the host is back.
#[tokio::test]
async fn a_worker_cut_off_from_its_host_for_less_than_its_lease_loses_nothing() {
    use pier_fake_model::{FakeModel, Gate, Reply, Step};
    let f = must(FakeModel::start().await, "fake");
    let s = server(None).await;
    let link = Link::to(&s.base).await;
    let base = f.base_url();
    let args = ["--server", &link.base, "--capability", "build", "--name", "far", "--lease-ttl-ms", "8000"];
    let (_dir, _worker) = worker(&base, &args);
    let gate = Gate::new();
    f.push(Reply::Stream(vec![
        Step::Text("half".into()),
        Step::Gate(gate.clone()),
        Step::Text(" and the rest".into()),
        Step::Finish("stop".into()),
        Step::Done,
    ]));
    let plan = "[[tasks]]\nid = \"far\"\nagent = \"worker:build\"\nprompt = \"go\"\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "cut"})).await.0, 201);
    s.events_until(Some(0), |e| e["task"] == "far" && e["update"]["content"]["text"] == "half").await;
    // Cut: the agent goes on, and the worker's calls fail until the host is back.
    link.cut();
    gate.open();
    let mut refused = link.refused.clone();
    must(tokio::time::timeout(LIMIT, refused.wait_for(|n| *n >= 1)).await, "the worker tried while cut off")
        .map(|_| ())
        .unwrap_or_else(|e| panic!("{e}"));
    let (_, t) = s.call(Method::GET, "/runs/cut/tasks/far", None).await;
    assert_eq!(t["task"]["state"], "running", "nothing ended while cut off: {t}");
    link.restore();
    s.events_until(Some(0), |e| e["task"] == "far" && e["to"] == "completed").await;
    let (_, t) = s.call(Method::GET, "/runs/cut/tasks/far", None).await;
    assert_eq!(t["task"]["result"], "half and the rest", "{t}");
    assert_eq!(t["task"]["attempt"], 1, "the same attempt finished: {t}");
    let events = s.events_until(Some(0), |e| e["task"] == "far" && e["to"] == "completed").await;
    let said: Vec<&str> = events
        .iter()
        .filter(|e| e["task"] == "far" && e["update"]["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|e| e["update"]["content"]["text"].as_str())
        .collect();
    assert_eq!(said, ["half", " and the rest"], "every chunk once, in order");
}

/// `pier worker --agent pier` also takes tasks that name that agent, beside the host's own
/// agents: with the host's one slot busy, the worker runs the other task.
#[tokio::test]
async fn a_worker_with_an_agent_takes_the_tasks_naming_it_beside_the_host() {
    use pier_fake_model::{FakeModel, Gate, Reply, Step};
    let f = must(FakeModel::start().await, "fake");
    let gate = Gate::new();
    let g = gate.clone();
    f.set_fallback(move |body| {
        if body.to_string().contains("slow one") {
            Reply::Stream(vec![
                Step::Gate(g.clone()),
                Step::Text("slow done".into()),
                Step::Finish("stop".into()),
                Step::Done,
            ])
        } else {
            Reply::text("quick done")
        }
    });
    let (s, _) = support::serve::server_with(Some(f.base_url()), &["--concurrency", "1"]).await;
    let base = f.base_url();
    let (_dir, _worker) = worker(&base, &["--server", &s.base, "--agent", "pier", "--name", "helper"]);
    let plan =
        "[[tasks]]\nid = \"a\"\nprompt = \"the slow one\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"the quick one\"\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "both"})).await.0, 201);
    // One of the two finishes while the other waits at the gate: the slot that runs it is free.
    s.events_until(Some(0), |e| e["type"] == "transition" && e["to"] == "completed").await;
    gate.open();
    let mut done = 0;
    let events = s
        .events_until(Some(0), |e| {
            done += usize::from(e["type"] == "transition" && e["to"] == "completed");
            done == 2
        })
        .await;
    let owners: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "transition" && e["to"] == "running")
        .filter_map(|e| e["owner"].as_str())
        .collect();
    assert!(owners.contains(&"helper"), "the worker ran one of them: {owners:?}");
    assert!(owners.iter().any(|o| *o != "helper"), "the host ran the other: {owners:?}");
}

/// A third-party worker on the unversioned calls and a `/v1` worker share one run.
#[tokio::test]
async fn an_old_worker_and_a_v1_worker_share_a_run() {
    let s = server(None).await;
    let plan = "[[tasks]]\nid = \"a\"\nagent = \"worker:build\"\nprompt = \"one\"\n\n\
                [[tasks]]\nid = \"b\"\nagent = \"worker:build\"\nprompt = \"two\"\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "mixed"})).await.0, 201);
    let (code, old) = post(&s, "/lease", json!({"worker": "old", "capabilities": ["build"], "ttl_ms": 60_000})).await;
    assert_eq!(code, 200, "{old}");
    let (code, new) = lease(&s, 0).await;
    assert_eq!(code, 200, "{new}");
    let (old_task, new_task) = (old["task"]["id"].as_str().unwrap_or(""), new["task"]["id"].as_str().unwrap_or(""));
    assert_ne!(old_task, new_task, "each got its own task");
    let path = format!("/runs/mixed/tasks/{old_task}/heartbeat");
    assert_eq!(post(&s, &path, json!({"worker": "old", "attempt": 1, "ttl_ms": 60_000})).await.0, 200);
    let report =
        json!({"worker": "old", "attempt": 1, "status": "completed", "idempotency_key": "k", "result": "old done"});
    assert_eq!(post(&s, &format!("/runs/mixed/tasks/{old_task}/update"), report).await.0, 200);
    let end = json!({"worker": "wk", "status": "completed", "idempotency_key": "k", "result": "new done"});
    assert_eq!(post(&s, &at("mixed", new_task, 1, "end"), end).await.0, 200);
    let (_, run) = s.call(Method::GET, "/runs/mixed", None).await;
    assert_eq!(run["counts"], json!({"completed": 2}), "{run}");
}

/// Issue #34: a person's denial on a pull worker's attempt ends it as it does a local one
/// (`on_deny = "fail"` by default): the task fails saying what was denied, is not retried,
/// and the task depending on it is cancelled.
#[tokio::test]
async fn a_denial_on_a_worker_fails_the_task_and_cancels_its_dependents() {
    use pier_fake_model::{FakeModel, Reply};
    let f = must(FakeModel::start().await, "fake");
    let s = server(None).await;
    let base = f.base_url();
    let args = ["--server", &s.base, "--capability", "build", "--name", "wk-deny", "--lease-ttl-ms", "3000"];
    let (_dir, _worker) = worker(&base, &args);
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "rm -rf build"}"#));
    f.set_fallback(|_| Reply::text("went on anyway"));
    let plan = "[[tasks]]\nid = \"a\"\nagent = \"worker:build\"\nprompt = \"clean\"\npermissions = { execute = \"ask\" }\n\n\
                [[tasks]]\nid = \"b\"\nagent = \"worker:build\"\nprompt = \"then build\"\ndepends_on = [\"a\"]\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "pd"})).await.0, 201);
    s.events_until(Some(0), |e| e["task"] == "a" && e["type"] == "question").await;
    person(&s, &["deny", "a", "--run", "pd"]).await;
    s.events_until(Some(0), |e| e["task"] == "b" && e["to"] == "cancelled").await;
    let (_, run) = s.call(Method::GET, "/runs/pd", None).await;
    let state =
        |id: &str| run["tasks"].as_array().and_then(|t| t.iter().find(|t| t["id"] == id)).map(|t| t["state"].clone());
    assert_eq!((state("a"), state("b")), (Some(json!("failed")), Some(json!("cancelled"))), "{run}");
    let (_, t) = s.call(Method::GET, "/runs/pd/tasks/a", None).await;
    let error = t["task"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("denied") && error.contains("rm -rf build"), "says what was denied: {t}");
    assert_eq!(t["task"]["attempt"], 1, "a denial is not retried: {t}");
}

/// Issue #33: an agent on a pull worker gets the host's MCP endpoint too (`{server}/mcp` with its
/// attempt's token, from the lease), reaches it from its strict jail through the proxy, and adds
/// a follow-up task of a declared type to its run, which the worker then runs.
#[tokio::test]
async fn a_workers_agent_adds_a_follow_up_task_through_the_hosts_mcp_endpoint() {
    use pier_fake_model::body::tool_results;
    use pier_fake_model::{FakeModel, Reply};
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|body| {
        if body.to_string().contains("Fix w-bug.") {
            return Reply::text("fixed");
        }
        match tool_results(body).pop() {
            None => Reply::tool_call(
                "c1",
                "pier__submit_task",
                r#"{"type": "fix", "input": {"what": "w-bug"}, "id": "fix-w"}"#,
            ),
            Some(result) => Reply::text(&format!("added: {result}")),
        }
    });
    let types = "[types.fix]\nagent = \"worker:build\"\nprompt = \"Fix {{input.what}}.\"\n\
                 input = { type = \"object\", required = [\"what\"], properties = { what = { type = \"string\" } } }\n";
    let (s, _) = support::serve::server_configured(None, &[], Some(types)).await;
    let args = ["--server", &s.base, "--capability", "build", "--name", "wk1"];
    let (_dir, _worker) = worker(&f.base_url(), &args);
    let plan = "[[tasks]]\nid = \"a\"\nagent = \"worker:build\"\nprompt = \"triage\"\n";
    assert_eq!(post(&s, "/runs", json!({"plan": plan, "run_id": "wm"})).await.0, 201);
    s.events_until(Some(0), |e| e["task"] == "fix-w" && e["to"] == "completed").await;
    let (_, run) = s.call(Method::GET, "/runs/wm", None).await;
    let tasks = run["tasks"].as_array().cloned().unwrap_or_default();
    let fix = tasks.iter().find(|t| t["id"] == "fix-w").unwrap_or_else(|| panic!("no follow-up in {run}"));
    assert_eq!((&fix["spec"]["added_by"], &fix["result"]), (&json!("a"), &json!("fixed")), "{fix}");
    let a = tasks.iter().find(|t| t["id"] == "a").unwrap_or_else(|| panic!("{run}"));
    assert!(a["result"].as_str().is_some_and(|r| r.contains(r#""added":true"#)), "{a}");
}
