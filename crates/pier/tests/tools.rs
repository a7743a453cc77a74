//! End-to-end: the agent loop with real tools and the one-shot permission channel,
//! over real pipes, with a local model server that issues tool calls.

mod support;

use std::path::Path;
use std::time::Duration;

use pier_fake_model::{FakeModel, Reply};
use serde_json::{Value, json};
use support::{LIMIT, Options, PierProcess, agent_texts, group_alive, must, read_log, stop_reason};

async fn fake() -> FakeModel {
    must(FakeModel::start().await, "start the fake model")
}

/// The tool results the model received in request `i`.
fn tool_results(f: &FakeModel, i: usize) -> Vec<String> {
    let body = &f.requests()[i].body;
    body["messages"]
        .as_array()
        .map(|m| {
            m.iter().filter(|m| m["role"] == "tool").filter_map(|m| m["content"].as_str().map(str::to_owned)).collect()
        })
        .unwrap_or_default()
}

/// Reads frames until the agent's `session/request_permission`; returns it and the notifications before it.
async fn expect_permission_request(p: &mut PierProcess) -> (Value, Vec<Value>) {
    let mut notes = Vec::new();
    loop {
        let frame = p.next_frame().await;
        if frame["method"] == "session/request_permission" && frame.get("id").is_some() {
            return (frame, notes);
        }
        assert!(frame.get("result").is_none() && frame.get("error").is_none(), "a response came first: {frame}");
        notes.push(frame);
    }
}

async fn answer(p: &mut PierProcess, request: &Value, result: Value) {
    p.send(&json!({"jsonrpc": "2.0", "id": request["id"], "result": result})).await;
}

fn selected(option: &str) -> Value {
    json!({"outcome": {"outcome": "selected", "optionId": option}})
}

/// The statuses a tool call went through, from the session log.
fn transitions(dir: &Path, sid: &str, call_id: &str) -> Vec<String> {
    read_log(dir, sid)
        .iter()
        .filter(|r| r["type"] == "tool_call" && r["call"]["id"] == call_id)
        .filter_map(|r| r["call"]["status"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn allow_once_runs_the_tool_and_the_result_reaches_the_model() {
    let f = fake().await;
    f.push(Reply::tool_call("call_w", "write_file", r#"{"path": "notes/hello.txt", "content": "hi there\n"}"#));
    f.push(Reply::text("I wrote the file."));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "write a greeting").await;
    let (request, before) = expect_permission_request(&mut p).await;
    assert!(before.is_empty(), "no tool activity on the wire in the automation profile: {before:?}");
    let params = &request["params"];
    assert_eq!(params["sessionId"], sid.as_str());
    assert_eq!(params["toolCall"]["toolCallId"], "call_w");
    assert_eq!(params["toolCall"]["kind"], "edit");
    assert_eq!(params["toolCall"]["status"], "pending");
    assert_eq!(params["toolCall"]["title"], "Write notes/hello.txt");
    assert_eq!(params["toolCall"]["rawInput"]["content"], "hi there\n");
    let options: Vec<(&str, &str)> = params["options"]
        .as_array()
        .map(|o| o.iter().map(|o| (o["optionId"].as_str().unwrap_or(""), o["kind"].as_str().unwrap_or(""))).collect())
        .unwrap_or_default();
    assert_eq!(options, [("allow-once", "allow_once"), ("reject-once", "reject_once")]);
    assert!(!p.cwd().join("notes/hello.txt").exists(), "nothing runs before the answer");
    answer(&mut p, &request, selected("allow-once")).await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(agent_texts(&notes, &sid), vec!["I wrote the file."]);
    assert_eq!(std::fs::read_to_string(p.cwd().join("notes/hello.txt")).unwrap_or_default(), "hi there\n");
    let results = tool_results(&f, 1);
    assert_eq!(results.len(), 1);
    assert!(results[0].starts_with("Created notes/hello.txt"), "{results:?}");
    // The log holds the call through every state, with its diff.
    assert_eq!(transitions(&p.data_dir(), &sid, "call_w"), ["pending", "in_progress", "completed"]);
    let log = read_log(&p.data_dir(), &sid);
    let done = log.iter().rfind(|r| r["type"] == "tool_call").cloned().unwrap_or_default();
    assert_eq!(done["call"]["content"][0]["type"], "diff");
    assert_eq!(done["call"]["content"][0]["new_text"], "hi there\n");
    assert_eq!(done["call"]["content"][0]["old_text"], Value::Null);
    assert!(log.iter().any(|r| r["type"] == "permission" && r["answer"] == "AllowOnce"));
}

#[tokio::test]
async fn the_answer_never_becomes_a_standing_grant() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "write_file", r#"{"path": "a.txt", "content": "1"}"#));
    f.push(Reply::tool_call("c2", "write_file", r#"{"path": "b.txt", "content": "2"}"#));
    f.push(Reply::text("done"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "two writes").await;
    let (first, _) = expect_permission_request(&mut p).await;
    answer(&mut p, &first, selected("allow-once")).await;
    let (second, _) = expect_permission_request(&mut p).await;
    assert_eq!(second["params"]["toolCall"]["toolCallId"], "c2");
    answer(&mut p, &second, selected("allow-once")).await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
}

#[tokio::test]
async fn reject_once_leaves_the_tool_unrun_and_the_turn_goes_on() {
    let f = fake().await;
    f.push(Reply::tool_call("call_r", "run_command", r#"{"command": "touch ran"}"#));
    f.push(Reply::text("Understood, I will not run it."));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "run something").await;
    let (request, _) = expect_permission_request(&mut p).await;
    assert_eq!(request["params"]["toolCall"]["kind"], "execute");
    answer(&mut p, &request, selected("reject-once")).await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(agent_texts(&notes, &sid), vec!["Understood, I will not run it."]);
    assert!(!p.cwd().join("ran").exists());
    let results = tool_results(&f, 1);
    assert!(results[0].contains("rejected"), "{results:?}");
    assert_eq!(transitions(&p.data_dir(), &sid, "call_r"), ["pending", "failed"]);
}

#[tokio::test]
async fn an_error_or_malformed_answer_is_unavailable_and_the_tool_does_not_run() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "touch ran1"}"#));
    f.push(Reply::tool_call("c2", "run_command", r#"{"command": "touch ran2"}"#));
    f.push(Reply::tool_call("c3", "run_command", r#"{"command": "touch ran3"}"#));
    f.push(Reply::text("ok"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "go").await;
    let (r1, _) = expect_permission_request(&mut p).await;
    p.send(&json!({"jsonrpc": "2.0", "id": r1["id"], "error": {"code": -32603, "message": "ui crashed"}})).await;
    let (r2, _) = expect_permission_request(&mut p).await;
    answer(&mut p, &r2, json!({"outcome": {"outcome": "selected"}})).await;
    let (r3, _) = expect_permission_request(&mut p).await;
    answer(&mut p, &r3, selected("allow-always")).await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
    for file in ["ran1", "ran2", "ran3"] {
        assert!(!p.cwd().join(file).exists(), "{file}");
    }
    let results = tool_results(&f, 3);
    assert_eq!(results.len(), 3);
    assert!(results[0].contains("unavailable") && results[0].contains("ui crashed"), "{results:?}");
    assert!(results[1].contains("unavailable") && results[1].contains("malformed"), "{results:?}");
    assert!(results[2].contains("unavailable") && results[2].contains("allow-always"), "{results:?}");
}

#[tokio::test]
async fn a_cancelled_outcome_ends_the_turn_cancelled() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "write_file", r#"{"path": "x", "content": "x"}"#));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "go").await;
    let (request, _) = expect_permission_request(&mut p).await;
    answer(&mut p, &request, json!({"outcome": {"outcome": "cancelled"}})).await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "cancelled");
    assert!(!p.cwd().join("x").exists());
    assert_eq!(f.requests().len(), 1);
}

#[tokio::test]
async fn cancel_while_a_permission_is_pending_ends_cancelled_and_the_tool_never_runs() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "touch ran"}"#));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "go").await;
    let (request, _) = expect_permission_request(&mut p).await;
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    // The agent withdraws its question and ends the turn.
    let mut saw_withdrawal = false;
    let resp = loop {
        let frame = p.next_frame().await;
        if frame["method"] == "$/cancel_request" {
            assert_eq!(frame["params"]["requestId"], request["id"]);
            saw_withdrawal = true;
        } else if frame["id"] == json!(id) {
            break frame;
        }
    };
    assert_eq!(stop_reason(&resp), "cancelled");
    assert!(saw_withdrawal, "the pending permission request was withdrawn with $/cancel_request");
    // Whatever the client answers afterwards, the tool never runs.
    answer(&mut p, &request, selected("allow-once")).await;
    f.push(Reply::text("fresh start"));
    let id = p.prompt(&sid, "something else").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
    assert!(!p.cwd().join("ran").exists());
    assert_eq!(transitions(&p.data_dir(), &sid, "c1"), ["pending", "failed"]);
}

#[tokio::test]
async fn cancel_while_run_command_sleeps_ends_promptly_and_kills_the_group() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "echo $$ > ready; sleep 300"}"#));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url()).arg("--allow").arg("execute")).await;
    let fifo = p.cwd().join("ready");
    must(nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU), "mkfifo");
    let id = p.prompt(&sid, "sleep").await;
    // Opening the FIFO waits until the command writes its pid: it is running now.
    let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo));
    let pgid: i32 = must(must(must(tokio::time::timeout(LIMIT, read).await, "command start"), "join"), "read fifo")
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(group_alive(pgid));
    let asked = std::time::Instant::now();
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "cancelled");
    assert!(asked.elapsed() < Duration::from_secs(5), "cancellation took {:?}", asked.elapsed());
    assert!(!group_alive(pgid), "a process of the command's group survived");
    assert_eq!(transitions(&p.data_dir(), &sid, "c1"), ["pending", "in_progress", "failed"]);
}

#[tokio::test]
async fn read_tools_run_without_asking_and_results_reach_the_model() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "read_file", r#"{"path": "src/lib.rs"}"#));
    f.push(Reply::tool_call("c2", "grep", r#"{"pattern": "answer"}"#));
    f.push(Reply::tool_call("c3", "list_dir", r#"{"path": "src"}"#));
    f.push(Reply::tool_call(
        "c4",
        "update_plan",
        r#"{"entries": [{"content": "read", "priority": "high", "status": "completed"}]}"#,
    ));
    f.push(Reply::tool_call("c5", "read_file", r#"{"path": "../../etc/passwd"}"#));
    f.push(Reply::text("The answer is 42."));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    std::fs::create_dir_all(p.cwd().join("src")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(p.cwd().join("src/lib.rs"), "pub fn answer() -> u32 { 42 }\n").unwrap_or_else(|e| panic!("{e}"));
    let id = p.prompt(&sid, "what is the answer?").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(agent_texts(&notes, &sid), vec!["The answer is 42."]);
    let results = tool_results(&f, 5);
    assert_eq!(results[0], "pub fn answer() -> u32 { 42 }\n");
    assert_eq!(results[1], "src/lib.rs:1: pub fn answer() -> u32 { 42 }");
    assert_eq!(results[2], "lib.rs  (30 bytes)");
    assert!(results[3].starts_with("Plan updated: 1 steps"), "{results:?}");
    assert!(results[4].starts_with("error:") && results[4].contains("outside the session directory"), "{results:?}");
    // Tools were offered with their schemas.
    let first = f.requests()[0].body.clone();
    let tools: Vec<&str> = first["tools"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["function"]["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(tools, ["read_file", "list_dir", "grep", "write_file", "edit_file", "run_command", "update_plan"]);
    let log = read_log(&p.data_dir(), &sid);
    assert!(log.iter().any(|r| r["type"] == "plan" && r["entries"][0]["content"] == "read"));
    assert_eq!(transitions(&p.data_dir(), &sid, "c5"), ["pending", "in_progress", "failed"]);
}

#[tokio::test]
async fn policy_flags_deny_and_approve() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "touch ran"}"#));
    f.push(Reply::tool_call("c2", "write_file", r#"{"path": "w.txt", "content": "w"}"#));
    f.push(Reply::text("done"));
    let opts = Options::model(f.base_url()).arg("--approve-all").arg("--deny").arg("execute");
    let (mut p, sid) = PierProcess::start(opts).await;
    let id = p.prompt(&sid, "go").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert!(notes.iter().all(|n| n["method"] != "session/request_permission"), "{notes:?}");
    assert!(!p.cwd().join("ran").exists());
    assert!(tool_results(&f, 1)[0].contains("denies execute tools"));
    assert_eq!(std::fs::read_to_string(p.cwd().join("w.txt")).unwrap_or_default(), "w");
}

#[tokio::test]
async fn the_policy_comes_from_pier_toml_too() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "read_file", r#"{"path": "x"}"#));
    f.push(Reply::text("done"));
    let toml = format!(
        "provider = \"fake\"\n[providers.fake]\nbase_url = \"{}\"\nmodel = \"m\"\n[permissions]\nread = \"deny\"\n",
        f.base_url()
    );
    let (mut p, sid) = PierProcess::start(Options { pier_toml: Some(toml), ..Options::default() }).await;
    let id = p.prompt(&sid, "go").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
    assert!(tool_results(&f, 1)[0].contains("denies read tools"));
}

#[tokio::test]
async fn bad_tool_calls_fail_and_the_turn_goes_on() {
    let f = fake().await;
    f.push(Reply::tool_call("c1", "no_such_tool", "{}"));
    f.push(Reply::tool_call("c2", "read_file", "{not json"));
    f.push(Reply::tool_call("c3", "edit_file", r#"{"path": "f.txt", "old_text": "zzz", "new_text": "y"}"#));
    f.push(Reply::text("giving up"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url()).arg("--allow").arg("edit")).await;
    std::fs::write(p.cwd().join("f.txt"), "abc").unwrap_or_else(|e| panic!("{e}"));
    let id = p.prompt(&sid, "go").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
    let results = tool_results(&f, 3);
    assert!(results[0].contains("no tool named `no_such_tool`"), "{results:?}");
    assert!(results[1].contains("not valid JSON"), "{results:?}");
    assert!(results[2].contains("not found in f.txt"), "{results:?}");
    for c in ["c1", "c2"] {
        assert_eq!(transitions(&p.data_dir(), &sid, c), ["pending", "failed"]);
    }
    assert_eq!(transitions(&p.data_dir(), &sid, "c3"), ["pending", "in_progress", "failed"]);
}

#[tokio::test]
async fn a_model_that_calls_tools_forever_ends_with_max_turn_requests() {
    let f = fake().await;
    f.set_fallback(|_| Reply::tool_call("again", "list_dir", r#"{"path": "."}"#));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url()).arg("--max-turn-requests").arg("5")).await;
    let id = p.prompt(&sid, "loop").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "max_turn_requests");
    assert_eq!(f.requests().len(), 5);
    let completed = read_log(&p.data_dir(), &sid)
        .iter()
        .filter(|r| r["type"] == "tool_call" && r["call"]["status"] == "completed")
        .count();
    assert_eq!(completed, 5);
}
