//! The client methods an agent calls, served over a real connection (an in-memory
//! pipe) with the agent side played by a second connection.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use pier_acp::schema::Error;
use pier_acp::schema::RequestPermissionRequest;
use pier_acp::{Connection, ConnectionConfig, Handler, RequestCx, RequestError};
use pier_client::handler::{AskAnswer, Asker, ClientHandler, ClientState, EventReceiver, event_channel};
use pier_client::sandbox::Sandbox;
use pier_client::{ClientEvent, ClientPolicy};
use serde_json::{Value, json};

struct Quiet;
impl Handler for Quiet {
    fn request(&self, _: RequestCx, _: String, _: Value) -> BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async { Err(Error::method_not_found()) })
    }
    fn notification(&self, _: &Connection, _: &str, _: Value) {}
}

struct Setup {
    dir: tempfile::TempDir,
    extra: tempfile::TempDir,
    agent: Connection,
    state: Arc<ClientState>,
    events: EventReceiver,
}

fn setup_with(policy: ClientPolicy, fs: bool, terminal: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let extra = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let cwd = dir.path().canonicalize().unwrap_or_else(|e| panic!("{e}"));
    let sandbox = Sandbox::new(&cwd, &[extra.path().to_owned()]).unwrap_or_else(|e| panic!("{e}"));
    let (tx, events) = event_channel();
    let state = Arc::new(ClientState::new(sandbox, cwd, fs, terminal, policy, false, tx));
    // The agent's requests are all for session `s`, whose turn is served.
    state.serve_session("s");
    let (a, b) = tokio::io::duplex(1 << 20);
    let (ar, aw) = tokio::io::split(a);
    let (br, bw) = tokio::io::split(b);
    let _client = Connection::spawn(ar, aw, Arc::new(ClientHandler(state.clone())), ConnectionConfig::default());
    let agent = Connection::spawn(br, bw, Arc::new(Quiet), ConnectionConfig::default());
    Setup { dir, extra, agent, state, events }
}

fn setup() -> Setup {
    setup_with(ClientPolicy::default(), true, true)
}

fn approving() -> Setup {
    let mut p = ClientPolicy::default();
    p.approve_all();
    setup_with(p, true, true)
}

impl Setup {
    /// A terminal running `sleep 300` in its own group, and that group's id once the
    /// command has printed it.
    async fn sleeping_terminal(&self) -> (Value, i64) {
        let create = json!({"sessionId": "s", "command": "sh", "args": ["-c", "echo $$; exec sleep 300"]});
        let id = self.call("terminal/create", create).await.unwrap_or_default()["terminalId"].clone();
        loop {
            let out =
                self.call("terminal/output", json!({"sessionId": "s", "terminalId": id})).await.unwrap_or_default();
            if let Some(pid) = out["output"].as_str().and_then(|o| o.trim().parse::<i64>().ok()) {
                return (id, pid);
            }
            tokio::task::yield_now().await;
        }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().canonicalize().unwrap_or_else(|e| panic!("{e}"))
    }
    async fn call(&self, method: &str, params: Value) -> Result<Value, Error> {
        match tokio::time::timeout(Duration::from_secs(20), self.agent.request::<_, Value>(method, &params)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(RequestError::Remote(e))) => Err(e),
            Ok(Err(e)) => panic!("{method}: {e}"),
            Err(_) => panic!("{method} did not answer"),
        }
    }
    async fn code(&self, method: &str, params: Value) -> i32 {
        match self.call(method, params.clone()).await {
            Ok(v) => panic!("{method} {params} succeeded: {v}"),
            Err(e) => i32::from(e.code),
        }
    }
}

#[tokio::test]
async fn read_text_file_serves_lines_inside_the_sandbox_only() {
    let s = setup();
    let file = s.root().join("a.txt");
    std::fs::write(&file, "one\ntwo\nthree\n").unwrap_or_else(|e| panic!("{e}"));
    let r = s.call("fs/read_text_file", json!({"sessionId": "s", "path": file})).await;
    assert_eq!(r.ok().map(|v| v["content"].clone()), Some(json!("one\ntwo\nthree\n")));
    let r = s.call("fs/read_text_file", json!({"sessionId": "s", "path": file, "line": 2, "limit": 1})).await;
    assert_eq!(r.ok().map(|v| v["content"].clone()), Some(json!("two\n")));
    let missing = s.call("fs/read_text_file", json!({"sessionId": "s", "path": s.root().join("nope")})).await;
    let missing = missing.err().unwrap_or_else(|| panic!("missing file was read"));
    assert_eq!(i32::from(missing.code), -32002);
    assert!(missing.data.is_some_and(|d| d["uri"].as_str().is_some_and(|u| u.ends_with("/nope"))));
    assert_eq!(s.code("fs/read_text_file", json!({"sessionId": "s", "path": "a.txt"})).await, -32602, "relative");
    assert_eq!(s.code("fs/read_text_file", json!({"sessionId": "s", "path": "/etc/passwd"})).await, -32602, "outside");
    let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(outside.path().join("secret"), "s").unwrap_or_else(|e| panic!("{e}"));
    std::os::unix::fs::symlink(outside.path(), s.root().join("link")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        s.code("fs/read_text_file", json!({"sessionId": "s", "path": s.root().join("link/secret")})).await,
        -32602
    );
    // An --allow-dir is served too.
    let allowed = s.extra.path().join("b.txt");
    std::fs::write(&allowed, "extra").unwrap_or_else(|e| panic!("{e}"));
    let r = s.call("fs/read_text_file", json!({"sessionId": "s", "path": allowed})).await;
    assert_eq!(r.ok().map(|v| v["content"].clone()), Some(json!("extra")));
}

#[tokio::test]
async fn write_text_file_creates_files_inside_and_nothing_outside() {
    let mut s = approving();
    let target = s.root().join("new/dir/f.txt");
    let r = s.call("fs/write_text_file", json!({"sessionId": "s", "path": target, "content": "hello"})).await;
    assert_eq!(r.ok(), Some(json!({})));
    assert_eq!(std::fs::read_to_string(&target).unwrap_or_default(), "hello");
    let outside = std::env::temp_dir().join(format!("pier-outside-{}", std::process::id()));
    assert_eq!(s.code("fs/write_text_file", json!({"sessionId": "s", "path": outside, "content": "x"})).await, -32602);
    assert!(!outside.exists());
    let mut calls = Vec::new();
    while let Ok(e) = s.events.try_recv() {
        if let ClientEvent::ClientCall { method, error, .. } = e {
            calls.push((method, error.is_none()));
        }
    }
    assert_eq!(calls, [("fs/write_text_file".to_owned(), true), ("fs/write_text_file".to_owned(), false)]);
}

#[tokio::test]
async fn a_denied_kind_refuses_the_method_and_disabled_methods_are_not_found() {
    let mut deny = ClientPolicy::default();
    deny.deny_all();
    let s = setup_with(deny, true, true);
    let file = s.root().join("a.txt");
    std::fs::write(&file, "x").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.code("fs/read_text_file", json!({"sessionId": "s", "path": file})).await, -32603);
    assert_eq!(s.code("terminal/create", json!({"sessionId": "s", "command": "true"})).await, -32603);
    let off = setup_with(ClientPolicy::default(), false, false);
    assert_eq!(off.code("fs/read_text_file", json!({"sessionId": "s", "path": file})).await, -32601);
    assert_eq!(off.code("terminal/create", json!({"sessionId": "s", "command": "true"})).await, -32601);
}

fn group_alive(pgid: i64) -> bool {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten().any(|e| {
                let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                let f: Vec<String> = stat
                    .rsplit_once(')')
                    .map(|(_, r)| r.split_whitespace().map(str::to_owned).collect())
                    .unwrap_or_default();
                f.len() > 2 && f[2] == pgid.to_string() && f[0] != "Z"
            })
        })
        .unwrap_or(false)
}

#[tokio::test]
async fn terminals_run_report_truncate_kill_and_release() {
    let s = approving();
    let create = |cmd: &str, limit: Option<u64>| json!({"sessionId": "s", "command": "sh", "args": ["-c", cmd], "outputByteLimit": limit});
    let id = s
        .call("terminal/create", create("echo out; echo err >&2; exit 7", None))
        .await
        .ok()
        .map(|v| v["terminalId"].clone());
    let id = id.unwrap_or_else(|| panic!("create failed"));
    let exit = s.call("terminal/wait_for_exit", json!({"sessionId": "s", "terminalId": id})).await;
    assert_eq!(exit.ok().map(|v| v["exitCode"].clone()), Some(json!(7)));
    let out = s.call("terminal/output", json!({"sessionId": "s", "terminalId": id})).await.unwrap_or_default();
    let text = out["output"].as_str().unwrap_or_default();
    assert!(text.contains("out\n") && text.contains("err\n"), "{out}");
    assert_eq!(out["truncated"], false);
    assert_eq!(out["exitStatus"]["exitCode"], 7);

    // Output past the limit is cut from the start at a character boundary.
    let id = s.call("terminal/create", create("printf 'aaaaaéééé'", Some(5))).await.unwrap_or_default()["terminalId"]
        .clone();
    s.call("terminal/wait_for_exit", json!({"sessionId": "s", "terminalId": id})).await.ok();
    let out = s.call("terminal/output", json!({"sessionId": "s", "terminalId": id})).await.unwrap_or_default();
    assert_eq!((out["output"].clone(), out["truncated"].clone()), (json!("éé"), json!(true)), "{out}");

    // Kill keeps the terminal valid; release invalidates it.
    let (id, pgid) = s.sleeping_terminal().await;
    assert!(group_alive(pgid));
    assert!(s.call("terminal/kill", json!({"sessionId": "s", "terminalId": id})).await.is_ok());
    let exit = s.call("terminal/wait_for_exit", json!({"sessionId": "s", "terminalId": id})).await.unwrap_or_default();
    assert_eq!(exit["signal"], "SIGKILL", "{exit}");
    assert!(!group_alive(pgid));
    assert!(s.call("terminal/release", json!({"sessionId": "s", "terminalId": id})).await.is_ok());
    assert_eq!(s.code("terminal/output", json!({"sessionId": "s", "terminalId": id})).await, -32602);

    // Shutdown kills what is still running.
    let (id, pgid) = s.sleeping_terminal().await;
    s.state.terminals.kill_all();
    let exit = s.call("terminal/wait_for_exit", json!({"sessionId": "s", "terminalId": id})).await;
    assert!(exit.is_err() || !group_alive(pgid));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while group_alive(pgid) && std::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    assert!(!group_alive(pgid));
    // A cwd outside the sandbox is refused.
    let bad = json!({"sessionId": "s", "command": "true", "cwd": "/"});
    assert_eq!(s.code("terminal/create", bad).await, -32602);
}

#[tokio::test]
async fn permission_requests_follow_the_policy_and_cancellation() {
    let s = setup();
    let request = |kind: &str| {
        json!({
            "sessionId": "s",
            "toolCall": {"toolCallId": "t1", "title": "do it", "kind": kind},
            "options": [
                {"optionId": "yes-always", "name": "Always", "kind": "allow_always"},
                {"optionId": "yes", "name": "Yes", "kind": "allow_once"},
                {"optionId": "no", "name": "No", "kind": "reject_once"},
            ],
        })
    };
    let r = s.call("session/request_permission", request("read")).await.unwrap_or_default();
    assert_eq!(r["outcome"], json!({"outcome": "selected", "optionId": "yes"}));
    let r = s.call("session/request_permission", request("execute")).await.unwrap_or_default();
    assert_eq!(r["outcome"], json!({"outcome": "selected", "optionId": "no"}), "ask without a terminal: deny");
    s.state.cancelling().cancel();
    let r = s.call("session/request_permission", request("read")).await.unwrap_or_default();
    assert_eq!(r["outcome"], json!({"outcome": "cancelled"}), "R088");
}

#[tokio::test]
async fn writes_and_edit_permissions_are_fenced_to_the_writable_paths() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let cwd = dir.path().canonicalize().unwrap_or_else(|e| panic!("{e}"));
    std::fs::create_dir(cwd.join("out")).unwrap_or_else(|e| panic!("{e}"));
    let sandbox =
        Sandbox::new(&cwd, &[]).and_then(|s| s.with_writable(&[cwd.join("out")])).unwrap_or_else(|e| panic!("{e}"));
    let (tx, _events) = event_channel();
    let mut policy = ClientPolicy::default();
    policy.approve_all();
    let state = Arc::new(ClientState::new(sandbox, cwd.clone(), true, true, policy, false, tx));
    state.serve_session("s");
    let (a, b) = tokio::io::duplex(1 << 20);
    let (ar, aw) = tokio::io::split(a);
    let (br, bw) = tokio::io::split(b);
    let _client = Connection::spawn(ar, aw, Arc::new(ClientHandler(state)), ConnectionConfig::default());
    let agent = Connection::spawn(br, bw, Arc::new(Quiet), ConnectionConfig::default());
    let ok = agent
        .request::<_, Value>(
            "fs/write_text_file",
            &json!({"sessionId": "s", "path": cwd.join("out/a.txt"), "content": "x"}),
        )
        .await;
    assert!(ok.is_ok());
    let fenced = agent
        .request::<_, Value>(
            "fs/write_text_file",
            &json!({"sessionId": "s", "path": cwd.join("b.txt"), "content": "x"}),
        )
        .await;
    assert!(matches!(fenced, Err(RequestError::Remote(ref e)) if i32::from(e.code) == -32602), "{fenced:?}");
    assert!(!cwd.join("b.txt").exists());
    let ask = |path: PathBuf| {
        json!({
            "sessionId": "s",
            "toolCall": {"toolCallId": "t", "kind": "edit", "locations": [{"path": path}]},
            "options": [{"optionId": "y", "name": "Yes", "kind": "allow_once"}, {"optionId": "n", "name": "No", "kind": "reject_once"}],
        })
    };
    let inside: Value =
        agent.request("session/request_permission", &ask(cwd.join("out/c.txt"))).await.unwrap_or_default();
    assert_eq!(inside["outcome"]["optionId"], "y");
    let outside: Value =
        agent.request("session/request_permission", &ask(PathBuf::from("/etc/hosts"))).await.unwrap_or_default();
    assert_eq!(outside["outcome"]["optionId"], "n", "approve-all does not reach past the writable paths");
}

/// Answers the permission requests of real tool calls `allow-once` (as a person through
/// the host would) and never answers a client method's own question; each question is
/// reported on `asked`.
struct Person {
    asked: tokio::sync::mpsc::UnboundedSender<String>,
}

impl Asker for Person {
    fn ask(&self, request: &RequestPermissionRequest) -> BoxFuture<'static, AskAnswer> {
        let id = request.tool_call.tool_call_id.0.to_string();
        let _ = self.asked.send(id.clone());
        Box::pin(async move {
            if id.starts_with("client-method-") {
                std::future::pending::<()>().await;
            }
            AskAnswer::Option("yes".to_owned())
        })
    }
}

fn permission_request(id: &str, kind: &str) -> Value {
    json!({
        "sessionId": "s",
        "toolCall": {"toolCallId": id, "title": "run it", "kind": kind},
        "options": [
            {"optionId": "yes", "name": "Yes", "kind": "allow_once"},
            {"optionId": "no", "name": "No", "kind": "reject_once"},
        ],
    })
}

#[tokio::test]
async fn a_client_method_that_asks_is_served_while_a_granted_call_of_its_kind_runs() {
    let s = setup();
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel();
    s.state.begin_turn(Some(Arc::new(Person { asked: asked_tx })));
    s.state.serve_session("s");
    let create = json!({"sessionId": "s", "command": "true"});
    let r = s.call("session/request_permission", permission_request("t1", "execute")).await.unwrap_or_default();
    assert_eq!(r["outcome"]["optionId"], "yes");
    assert!(s.call("terminal/create", create.clone()).await.is_ok(), "the granted call runs its command");
    // An edit was not granted: fs/write_text_file goes to the person, who is asked and
    // has not answered when the turn is cancelled.
    let write = json!({"sessionId": "s", "path": s.root().join("w.txt"), "content": "x"});
    let agent = s.agent.clone();
    let pending = tokio::spawn(async move { agent.request::<_, Value>("fs/write_text_file", &write).await });
    loop {
        let id = asked.recv().await.unwrap_or_default();
        if id.starts_with("client-method-fs/write_text_file") {
            break;
        }
    }
    s.state.cancelling().cancel();
    let refused = must_join(pending).await;
    assert!(matches!(refused, Err(RequestError::Remote(ref e)) if e.message.contains("is refused")), "{refused:?}");
    assert!(!s.root().join("w.txt").exists());
    // Once the granted call ends, its kind asks again (and, cancelling, nobody is asked).
    let done = json!({"sessionId": "s", "update": {"sessionUpdate": "tool_call_update", "toolCallId": "t1", "status": "completed"}});
    s.agent.notify("session/update", &done).await.unwrap_or_else(|e| panic!("{e}"));
    let refused = s.call("terminal/create", create).await;
    assert!(refused.is_err_and(|e| e.message.contains("is refused")));
}

#[tokio::test]
async fn a_question_pending_with_the_host_is_answered_cancelled_once_cancelling_r088() {
    let s = setup();
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel();
    s.state.begin_turn(Some(Arc::new(Person { asked: asked_tx })));
    s.state.serve_session("s");
    // A client method's question is never answered by `Person`: use its id for a tool call.
    let agent = s.agent.clone();
    let request = permission_request("client-method-pending", "edit");
    let pending = tokio::spawn(async move { agent.request::<_, Value>("session/request_permission", &request).await });
    assert_eq!(asked.recv().await.as_deref(), Some("client-method-pending"));
    s.state.cancelling().cancel();
    let answer = must_join(pending).await.unwrap_or_default();
    assert_eq!(answer["outcome"], json!({"outcome": "cancelled"}), "not a rejection: R088");
}

async fn must_join<T>(task: tokio::task::JoinHandle<T>) -> T {
    match tokio::time::timeout(Duration::from_secs(20), task).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!("no answer"),
    }
}

/// A permission request answers only for the session whose turn the client serves (S3-19):
/// another session's, or one outside any turn, is refused and nobody is asked.
#[tokio::test]
async fn a_permission_request_for_another_session_is_refused() {
    let s = setup();
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel();
    s.state.begin_turn(Some(Arc::new(Person { asked: asked_tx })));
    let outside = s.call("session/request_permission", permission_request("t0", "execute")).await;
    assert!(outside.is_err_and(|e| i32::from(e.code) == -32602 && e.message.contains("no turn")));
    s.state.serve_session("s");
    let mut other = permission_request("t1", "execute");
    other["sessionId"] = json!("someone-else");
    let refused = s.call("session/request_permission", other).await;
    assert!(refused.is_err_and(|e| i32::from(e.code) == -32602 && e.message.contains("someone-else")));
    assert!(asked.try_recv().is_err(), "nobody was asked");
    let r = s.call("session/request_permission", permission_request("t2", "execute")).await.unwrap_or_default();
    assert_eq!(r["outcome"]["optionId"], "yes");
}

/// A tool call that embeds one of this client's terminals is shown with what the terminal
/// printed and how it ended, live and after the agent released it (the text view, the host's
/// transcript and the dashboard all read these events).
#[tokio::test]
async fn a_tool_calls_terminal_is_shown_with_its_output() {
    let mut s = approving();
    let create = json!({"sessionId": "s", "command": "sh", "args": ["-c", "echo from-the-terminal; exit 4"]});
    let id = s.call("terminal/create", create).await.unwrap_or_default()["terminalId"].clone();
    s.call("terminal/wait_for_exit", json!({"sessionId": "s", "terminalId": id})).await.ok();
    let embed = |status: &str| {
        json!({"sessionId": "s", "update": {"sessionUpdate": "tool_call_update", "toolCallId": "t1", "status": status,
            "content": [{"type": "terminal", "terminalId": id}]}})
    };
    s.agent.notify("session/update", &embed("in_progress")).await.unwrap_or_else(|e| panic!("{e}"));
    s.call("terminal/release", json!({"sessionId": "s", "terminalId": id})).await.ok();
    s.agent.notify("session/update", &embed("completed")).await.unwrap_or_else(|e| panic!("{e}"));
    let mut shown = Vec::new();
    while shown.len() < 2 {
        let event = tokio::time::timeout(Duration::from_secs(20), s.events.recv()).await;
        let event = event.unwrap_or_else(|_| panic!("the updates were not shown; shown so far: {shown:?}"));
        let Some(event) = event else { panic!("the client's events ended; shown so far: {shown:?}") };
        let ClientEvent::Update(n) = event else { continue };
        let update = serde_json::to_value(&n.update).unwrap_or_default();
        if update["toolCallId"] == "t1" {
            shown.push(update["content"].clone());
        }
    }
    for content in shown {
        assert_eq!(content[0], json!({"type": "terminal", "terminalId": id}), "{content}");
        let text = content[1]["content"]["text"].as_str().unwrap_or_default();
        assert!(text.contains("from-the-terminal") && text.ends_with("[exit code 4]"), "{content}");
    }
}
