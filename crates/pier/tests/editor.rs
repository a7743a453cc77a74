//! End-to-end tests of `pier agent --profile editor` over real pipes, with the
//! fake model: the whole surface an editor renders, checked against the schema types.

mod support;

use std::path::{Path, PathBuf};

use agent_client_protocol_schema::v1::{
    InitializeResponse, ListSessionsResponse, LoadSessionResponse, NewSessionResponse, RequestPermissionRequest,
    SessionNotification,
};
use pier_fake_model::{FakeModel, Gate, Reply, Step};
use serde_json::{Value, json};
use support::{LIMIT, Options, PierProcess, error_code, must, stop_reason};

async fn fake() -> FakeModel {
    must(FakeModel::start().await, "start the fake model")
}

/// A `pier.toml` for the editor profile over the fake model.
fn editor_toml(base_url: &str, extra: &str) -> String {
    format!(
        "profile = \"editor\"\nprovider = \"fake\"\n{extra}\n[providers.fake]\nbase_url = \"{base_url}\"\nmodel = \"fake-model\"\nmax_retries = 0\ncontext_window = 32000\n"
    )
}

fn opts(f: &FakeModel) -> Options {
    Options { pier_toml: Some(editor_toml(&f.base_url(), "")), ..Options::default() }
}

/// Every frame must be a well-formed message of the schema: updates parse as
/// `SessionNotification`, permission requests as `RequestPermissionRequest`.
fn check_shapes(frames: &[Value]) {
    for f in frames {
        match f["method"].as_str() {
            Some("session/update") => {
                if let Err(e) = serde_json::from_value::<SessionNotification>(f["params"].clone()) {
                    panic!("a session/update does not match the schema ({e}): {f}");
                }
            }
            Some("session/request_permission") => {
                if let Err(e) = serde_json::from_value::<RequestPermissionRequest>(f["params"].clone()) {
                    panic!("a permission request does not match the schema ({e}): {f}");
                }
            }
            _ => {}
        }
    }
}

/// The updates that match `keep`, in order.
fn updates_where(frames: &[Value], keep: impl Fn(&Value) -> bool) -> Vec<&Value> {
    frames
        .iter()
        .filter(|f| f["method"] == "session/update")
        .map(|f| &f["params"]["update"])
        .filter(|u| keep(u))
        .collect()
}

fn updates<'a>(frames: &'a [Value], kind: &str) -> Vec<&'a Value> {
    updates_where(frames, |u| u["sessionUpdate"] == kind)
}

fn texts(frames: &[Value], kind: &str) -> Vec<String> {
    updates(frames, kind).iter().filter_map(|u| u["content"]["text"].as_str().map(str::to_owned)).collect()
}

/// The updates of one tool call, in order.
fn call_updates<'a>(frames: &'a [Value], id: &str) -> Vec<&'a Value> {
    updates_where(frames, |u| u["toolCallId"] == id)
}

fn last_status(frames: &[Value], id: &str) -> Option<String> {
    call_updates(frames, id).iter().rev().find_map(|u| u["status"].as_str().map(str::to_owned))
}

async fn start(f: &FakeModel) -> (PierProcess, String) {
    start_with(opts(f)).await
}

async fn start_with(o: Options) -> (PierProcess, String) {
    let mut p = PierProcess::spawn(o).await;
    p.initialize().await;
    let sid = p.new_session().await;
    (p, sid)
}

async fn answer(p: &mut PierProcess, request: &Value, option: &str) {
    let result = json!({"outcome": {"outcome": "selected", "optionId": option}});
    p.send(&json!({"jsonrpc": "2.0", "id": request["id"], "result": result})).await;
}

/// Reads frames up to the response `id`, answering each permission request with `choose`;
/// returns all frames before the response, the response, and the permission requests.
async fn run_turn(
    p: &mut PierProcess,
    id: i64,
    mut choose: impl FnMut(&Value) -> &'static str,
) -> (Vec<Value>, Value, Vec<Value>) {
    let (mut frames, mut asked) = (Vec::new(), Vec::new());
    loop {
        let frame = p.next_frame().await;
        if frame.get("method").is_none() && frame["id"] == id {
            check_shapes(&frames);
            return (frames, frame, asked);
        }
        if frame["method"] == "session/request_permission" {
            let option = choose(&frame);
            answer(p, &frame, option).await;
            asked.push(frame.clone());
        }
        frames.push(frame);
    }
}

async fn turn(p: &mut PierProcess, sid: &str, text: &str) -> (Vec<Value>, Value, Vec<Value>) {
    let id = p.prompt(sid, text).await;
    run_turn(p, id, |_| "allow-once").await
}

fn canonical(p: &Path) -> PathBuf {
    must(p.canonicalize(), "canonicalize")
}

#[tokio::test]
async fn handshake_advertises_the_editor_surface_and_sessions_carry_modes() {
    let f = fake().await;
    let mut p = PierProcess::spawn(opts(&f)).await;
    let r = p.initialize().await;
    let parsed: InitializeResponse = must(serde_json::from_value(r["result"].clone()), "initialize shape");
    let caps = &r["result"]["agentCapabilities"];
    assert_eq!(caps["loadSession"], true);
    assert_eq!(caps["promptCapabilities"], json!({"image": false, "audio": false, "embeddedContext": true}));
    assert_eq!(caps["mcpCapabilities"]["http"], true);
    let sc = &caps["sessionCapabilities"];
    for cap in ["list", "resume", "close", "delete", "additionalDirectories"] {
        assert!(sc[cap].is_object(), "sessionCapabilities.{cap} missing: {caps}");
    }
    assert!(parsed.agent_capabilities.load_session);

    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": []})).await;
    let new: NewSessionResponse = must(serde_json::from_value(r["result"].clone()), "session/new shape");
    let modes = must(new.modes.ok_or("no modes"), "modes");
    assert_eq!(modes.current_mode_id.0.as_ref(), "ask");
    let ids: Vec<&str> = modes.available_modes.iter().map(|m| m.id.0.as_ref()).collect();
    assert_eq!(ids, ["read-only", "ask", "auto"]);
    let options = r["result"]["configOptions"].as_array().cloned().unwrap_or_default();
    assert_eq!(options.len(), 1, "one provider: no model select: {options:?}");
    assert_eq!((options[0]["id"].as_str(), options[0]["category"].as_str()), (Some("mode"), Some("mode")));
    assert_eq!(options[0]["currentValue"], "ask");
}

#[tokio::test]
async fn text_and_thoughts_stream_as_deltas_with_title_and_usage() {
    let f = fake().await;
    f.push(Reply::Stream(vec![
        Step::Reasoning("think ".into()),
        Step::Reasoning("hard".into()),
        Step::Text("Hel".into()),
        Step::Text("lo".into()),
        Step::Text(" world".into()),
        Step::Finish("stop".into()),
        Step::Usage { prompt: 10, completion: 5 },
        Step::Done,
    ]));
    let (mut p, sid) = start(&f).await;
    let (frames, resp, _) = turn(&mut p, &sid, "Say hello\nplease, at length").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(texts(&frames, "agent_thought_chunk"), ["think ", "hard"]);
    assert_eq!(texts(&frames, "agent_message_chunk"), ["Hel", "lo", " world"], "one chunk per delta");
    let info = updates(&frames, "session_info_update");
    assert_eq!(info.len(), 1);
    assert_eq!(info[0]["title"], "Say hello");
    let usage = updates(&frames, "usage_update");
    assert_eq!((usage[0]["used"].as_u64(), usage[0]["size"].as_u64()), (Some(15), Some(32000)));
    assert!(updates(&frames, "user_message_chunk").is_empty(), "user chunks only on replay");
    // A second turn does not rename the session.
    f.push(Reply::text("again"));
    let (frames, _, _) = turn(&mut p, &sid, "Another").await;
    assert!(updates(&frames, "session_info_update").is_empty());
}

#[tokio::test]
async fn tool_calls_carry_kinds_locations_diffs_and_output() {
    let f = fake().await;
    let (mut p, sid) = start(&f).await;
    let cwd = canonical(&p.cwd());
    must(std::fs::write(cwd.join("a.txt"), "one\ntwo\nthree\n"), "seed a.txt");
    f.push(Reply::tool_call("r1", "read_file", r#"{"path": "a.txt", "line": 2}"#));
    f.push(Reply::tool_call("e1", "edit_file", r#"{"path": "a.txt", "old_text": "two", "new_text": "TWO"}"#));
    f.push(Reply::tool_call("w1", "write_file", r#"{"path": "new.txt", "content": "fresh\n"}"#));
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "echo hello-from-command"}"#));
    f.push(Reply::tool_call("c2", "run_command", r#"{"command": "echo oops-from-command; exit 3"}"#));
    f.push(Reply::text("done"));
    let (frames, resp, asked) = turn(&mut p, &sid, "work").await;
    assert_eq!(stop_reason(&resp), "end_turn");

    // read: allowed without asking; a location with the absolute path and the line.
    let r1 = call_updates(&frames, "r1");
    assert_eq!(r1[0]["sessionUpdate"], "tool_call");
    assert_eq!(r1[0]["kind"], "read");
    // `pending` is the schema's default status, which it leaves out.
    assert!(r1[0].get("status").is_none_or(|s| s == "pending"), "{}", r1[0]);
    assert_eq!(r1[0]["locations"], json!([{"path": cwd.join("a.txt"), "line": 2}]));
    assert_eq!(r1[0]["rawInput"], json!({"path": "a.txt", "line": 2}));
    assert_eq!(r1[1], &json!({"sessionUpdate": "tool_call_update", "toolCallId": "r1", "status": "in_progress"}));
    assert_eq!(last_status(&frames, "r1").as_deref(), Some("completed"));
    // What was read is the call's content, not only its rawOutput.
    let read = r1.last().copied().unwrap_or(&Value::Null);
    assert!(read["content"][0]["content"]["text"].as_str().is_some_and(|t| t.contains("two")), "{read}");

    // edit: asked with the diff in the request; the whole file before and after.
    let edit_ask = asked.iter().find(|a| a["params"]["toolCall"]["toolCallId"] == "e1");
    let edit_ask = must(edit_ask.ok_or("no permission request for the edit"), "edit asked");
    let kinds: Vec<&str> =
        edit_ask["params"]["options"].as_array().into_iter().flatten().filter_map(|o| o["kind"].as_str()).collect();
    assert_eq!(kinds, ["allow_once", "allow_always", "reject_once", "reject_always"]);
    let diff = json!({"type": "diff", "path": cwd.join("a.txt"), "oldText": "one\ntwo\nthree\n", "newText": "one\nTWO\nthree\n"});
    assert_eq!(edit_ask["params"]["toolCall"]["content"], json!([diff]));
    assert_eq!(edit_ask["params"]["toolCall"]["kind"], "edit");
    let e1 = call_updates(&frames, "e1");
    assert_eq!(e1[0]["content"], json!([diff]), "the pending call shows the diff too");
    // The client hears of the call before it is asked about it.
    let shown = frames.iter().position(|f| f["params"]["update"]["toolCallId"] == "e1");
    let asked_at = frames
        .iter()
        .position(|f| f["method"] == "session/request_permission" && f["params"]["toolCall"]["toolCallId"] == "e1");
    assert!(shown.is_some() && shown < asked_at, "tool_call at {shown:?}, permission request at {asked_at:?}");
    assert_eq!(e1[0]["locations"], json!([{"path": cwd.join("a.txt"), "line": 2}]));
    assert_eq!(last_status(&frames, "e1").as_deref(), Some("completed"));
    assert_eq!(must(std::fs::read_to_string(cwd.join("a.txt")), "read a.txt"), "one\nTWO\nthree\n");

    // new file: a diff without oldText.
    let w1 = call_updates(&frames, "w1");
    let new_diff = &w1[0]["content"][0];
    assert_eq!(new_diff["path"], json!(cwd.join("new.txt")));
    assert!(new_diff.get("oldText").is_none_or(Value::is_null), "{new_diff}");
    assert_eq!(new_diff["newText"], "fresh\n");

    // command: kind execute, its output as content; asked, never a terminal/* request.
    let c1 = call_updates(&frames, "c1");
    assert_eq!(c1[0]["kind"], "execute");
    let done = c1.last().copied().unwrap_or(&Value::Null);
    assert_eq!(done["status"], "completed");
    assert!(done["content"][0]["content"]["text"].as_str().is_some_and(|t| t.contains("hello-from-command")), "{done}");
    assert!(done["rawOutput"]["exit_code"] == 0, "{done}");
    assert!(frames.iter().all(|f| !f["method"].as_str().unwrap_or("").starts_with("terminal/")));
    // Updates after the first carry only what changed: no title again on in_progress.
    assert!(c1[1].get("title").is_none() && c1[1].get("rawInput").is_none(), "{}", c1[1]);
    // A failed command: its output once, not again as the reason it failed.
    let c2 = call_updates(&frames, "c2");
    let failed = c2.last().copied().unwrap_or(&Value::Null);
    assert_eq!(failed["status"], "failed", "{failed}");
    assert_eq!(failed["content"].to_string().matches("oops-from-command").count(), 1, "{failed}");
    assert!(failed["content"].to_string().contains("exit code 3"), "{failed}");
}

#[tokio::test]
async fn always_answers_are_remembered_by_scope_and_survive_load_in_a_new_process() {
    let f = fake().await;
    let shared = must(tempfile::tempdir(), "shared PIER_HOME");
    let data = shared.path().to_owned();
    let (mut p, sid) = start_with(Options { pier_home: Some(data.clone()), ..opts(&f) }).await;
    f.push(Reply::tool_call("c1", "run_command", r#"{"command": "git --version > /dev/null; true"}"#));
    f.push(Reply::text("ok"));
    let id = p.prompt(&sid, "one").await;
    let (frames, _, asked) = run_turn(&mut p, id, |_| "allow-always").await;
    assert_eq!(asked.len(), 1);
    assert_eq!(last_status(&frames, "c1").as_deref(), Some("completed"));

    // git and true are allowed now; rm still asks and is rejected for good.
    f.push(Reply::tool_call("c2", "run_command", r#"{"command": "FOO=1 git status --short || true"}"#));
    f.push(Reply::tool_call("c3", "run_command", r#"{"command": "rm -f nothing-here"}"#));
    f.push(Reply::tool_call("c4", "run_command", r#"{"command": "git log | rm -f x"}"#));
    f.push(Reply::text("ok"));
    let id = p.prompt(&sid, "two").await;
    let (frames, _, asked) = run_turn(&mut p, id, |_| "reject-always").await;
    let asked_ids: Vec<&str> = asked.iter().filter_map(|a| a["params"]["toolCall"]["toolCallId"].as_str()).collect();
    assert_eq!(asked_ids, ["c3"], "only rm asked");
    assert_eq!(last_status(&frames, "c2").as_deref(), Some("completed"));
    assert_eq!(last_status(&frames, "c3").as_deref(), Some("failed"));
    assert_eq!(last_status(&frames, "c4").as_deref(), Some("failed"), "a pipeline with rm fails at once");
    // The turn went on after the rejections.
    assert_eq!(texts(&frames, "agent_message_chunk"), ["ok"]);
    // The first agent exits (its working directory stays, for the sessions' cwd).
    p.close_stdin();
    assert!(p.wait_exit().await.success());

    // A new process, the same PIER_HOME: the memory holds after session/load.
    let mut o = opts(&f);
    o.pier_home = Some(data);
    let mut q = PierProcess::spawn(o).await;
    q.initialize().await;
    let r = q.call("session/load", json!({"sessionId": sid, "cwd": q.cwd(), "mcpServers": []})).await;
    assert!(r.get("result").is_some(), "{r}");
    f.push(Reply::tool_call("c5", "run_command", r#"{"command": "git --version"}"#));
    f.push(Reply::tool_call("c6", "run_command", r#"{"command": "rm -f y"}"#));
    f.push(Reply::text("ok"));
    let id = q.prompt(&sid, "three").await;
    let (frames, _, asked) = run_turn(&mut q, id, |_| "allow-once").await;
    assert!(asked.is_empty(), "nothing asked after load: {asked:?}");
    assert_eq!(last_status(&frames, "c5").as_deref(), Some("completed"));
    assert_eq!(last_status(&frames, "c6").as_deref(), Some("failed"));
    let reason = call_updates(&frames, "c6").last().map(|u| u["content"].to_string()).unwrap_or_default();
    assert!(reason.contains("rejected"), "{reason}");
}

#[tokio::test]
async fn modes_decide_without_asking_and_both_views_follow() {
    let f = fake().await;
    let (mut p, sid) = start(&f).await;
    let r = p.call("session/set_mode", json!({"sessionId": sid, "modeId": "sideways"})).await;
    assert_eq!(error_code(&r), -32602, "{r}");

    let id = p.request("session/set_mode", json!({"sessionId": sid, "modeId": "read-only"})).await;
    let (notes, r) = p.read_until_response(id).await;
    assert!(r.get("result").is_some(), "{r}");
    check_shapes(&notes);
    let update = updates(&notes, "config_option_update");
    assert_eq!(update.len(), 1, "{notes:?}");
    assert_eq!(update[0]["configOptions"][0]["currentValue"], "read-only");

    f.push(Reply::tool_call("w1", "write_file", r#"{"path": "x.txt", "content": "x"}"#));
    f.push(Reply::tool_call("r1", "list_dir", r#"{"path": "."}"#));
    f.push(Reply::text("ok"));
    let (frames, _, asked) = turn(&mut p, &sid, "write").await;
    assert!(asked.is_empty());
    assert_eq!(last_status(&frames, "w1").as_deref(), Some("failed"));
    assert_eq!(last_status(&frames, "r1").as_deref(), Some("completed"));
    assert!(!p.cwd().join("x.txt").exists());

    let id =
        p.request("session/set_config_option", json!({"sessionId": sid, "configId": "mode", "value": "auto"})).await;
    let (notes, r) = p.read_until_response(id).await;
    assert_eq!(r["result"]["configOptions"][0]["currentValue"], "auto", "{r}");
    let update = updates(&notes, "current_mode_update");
    assert_eq!(update.first().map(|u| u["currentModeId"].clone()), Some(json!("auto")));
    let r = p.call("session/set_config_option", json!({"sessionId": sid, "configId": "speed", "value": "x"})).await;
    assert_eq!(error_code(&r), -32602);

    f.push(Reply::tool_call("w2", "write_file", r#"{"path": "x.txt", "content": "x"}"#));
    f.push(Reply::tool_call("c2", "run_command", r#"{"command": "true"}"#));
    f.push(Reply::text("ok"));
    let (frames, _, asked) = turn(&mut p, &sid, "write again").await;
    let asked_ids: Vec<&str> = asked.iter().filter_map(|a| a["params"]["toolCall"]["toolCallId"].as_str()).collect();
    assert_eq!(asked_ids, ["c2"], "auto: edits run, commands ask");
    assert_eq!(last_status(&frames, "w2").as_deref(), Some("completed"));
    assert!(p.cwd().join("x.txt").exists());
}

/// A session opened with a file (`pier exec -f FILE`: an embedded resource) is titled from the
/// file's first line, not from the wrapper that gives the model its URI.
#[tokio::test]
async fn a_file_prompt_titles_the_session_with_its_first_line() {
    let f = fake().await;
    f.push(Reply::text("ok"));
    let (mut p, sid) = start(&f).await;
    let file =
        json!({"type": "resource", "resource": {"uri": "file:///w/notes.md", "text": "\n# Release notes\nmore"}});
    let id = p.request("session/prompt", json!({"sessionId": sid, "prompt": [file]})).await;
    let (frames, resp, _) = run_turn(&mut p, id, |_| "allow-once").await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    let info = updates(&frames, "session_info_update");
    assert_eq!(info.len(), 1, "{info:?}");
    assert_eq!(info[0]["title"], "# Release notes");
    assert!(
        f.requests()[0].body.to_string().contains("<resource uri=\\\"file:///w/notes.md\\\">"),
        "the model still reads the URI"
    );
}

/// A running command's output shows on its call before the command ends (as
/// `tool_call_update` content, the client not having advertised `terminal`).
#[tokio::test]
async fn a_commands_output_shows_on_its_call_while_it_runs() {
    let f = fake().await;
    let (mut p, sid) = start(&f).await;
    let gate = canonical(&p.cwd()).join("gate");
    let made = std::process::Command::new("mkfifo").arg(&gate).status();
    assert!(must(made, "mkfifo").success());
    // The command prints, then waits on the fifo until the test has seen the print.
    f.push(Reply::tool_call(
        "c1",
        "run_command",
        r#"{"command": "echo first-part; read word < gate; echo then-$word"}"#,
    ));
    f.push(Reply::text("done"));
    let id = p.prompt(&sid, "work").await;
    loop {
        let frame = p.next_frame().await;
        assert!(frame["id"] != id, "the turn ended before the output showed: {frame}");
        if frame["method"] == "session/request_permission" {
            answer(&mut p, &frame, "allow-once").await;
            continue;
        }
        let update = &frame["params"]["update"];
        if update["toolCallId"] == "c1" && update["content"].to_string().contains("first-part") {
            assert!(update.get("status").is_none_or(|s| s == "in_progress"), "{update}");
            assert!(!update["content"].to_string().contains("then-"), "{update}");
            break;
        }
    }
    let open = tokio::task::spawn_blocking(move || std::fs::write(gate, "go\n"));
    must(must(tokio::time::timeout(LIMIT, open).await, "release the command"), "join")
        .unwrap_or_else(|e| panic!("{e}"));
    let (frames, resp, _) = run_turn(&mut p, id, |_| "allow-once").await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    let c1 = call_updates(&frames, "c1");
    let done = c1.last().copied().unwrap_or(&Value::Null);
    assert_eq!(done["status"], "completed", "{done}");
    assert!(done["content"].to_string().contains("then-go"), "{done}");
}

#[tokio::test]
async fn each_plan_update_replaces_the_whole_plan() {
    let f = fake().await;
    let (mut p, sid) = start(&f).await;
    f.push(Reply::tool_call(
        "p1",
        "update_plan",
        r#"{"entries": [{"content": "read", "priority": "high", "status": "in_progress"}, {"content": "write", "priority": "medium", "status": "pending"}]}"#,
    ));
    f.push(Reply::tool_call(
        "p2",
        "update_plan",
        r#"{"entries": [{"content": "read", "priority": "high", "status": "completed"}, {"content": "write", "priority": "medium", "status": "in_progress"}]}"#,
    ));
    f.push(Reply::text("ok"));
    let (frames, _, _) = turn(&mut p, &sid, "plan").await;
    let plans = updates(&frames, "plan");
    assert_eq!(plans.len(), 2);
    let statuses = |p: &Value| -> Vec<String> {
        p["entries"].as_array().into_iter().flatten().filter_map(|e| e["status"].as_str().map(str::to_owned)).collect()
    };
    assert_eq!(statuses(plans[0]), ["in_progress", "pending"]);
    assert_eq!(statuses(plans[1]), ["completed", "in_progress"]);
    // One plan, not two: the calls that made it are not shown as tool calls as well.
    let calls: Vec<&Value> =
        updates(&frames, "tool_call").into_iter().chain(updates(&frames, "tool_call_update")).collect();
    assert!(calls.is_empty(), "{calls:#?}");
}

#[tokio::test]
async fn load_replays_everything_before_answering_and_the_session_continues() {
    let f = fake().await;
    let shared = must(tempfile::tempdir(), "shared PIER_HOME");
    let data = shared.path().to_owned();
    let (mut p, sid) = start_with(Options { pier_home: Some(data.clone()), ..opts(&f) }).await;
    let cwd = p.cwd();
    f.push(Reply::Stream(vec![
        Step::Reasoning("pondering".into()),
        Step::ToolCallStart { index: 0, id: "w1".into(), name: "write_file".into() },
        Step::ToolCallArgs { index: 0, fragment: r#"{"path": "f.txt", "content": "v1"}"#.into() },
        Step::Finish("tool_calls".into()),
        Step::Done,
    ]));
    f.push(Reply::text("first answer"));
    let (_, resp, _) = turn(&mut p, &sid, "first question").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    // The first agent exits (its working directory stays, for the sessions' cwd).
    p.close_stdin();
    assert!(p.wait_exit().await.success());

    let mut o = opts(&f);
    o.pier_home = Some(data);
    let mut q = PierProcess::spawn(o).await;
    q.initialize().await;
    let id = q.request("session/load", json!({"sessionId": sid, "cwd": cwd, "mcpServers": []})).await;
    let (notes, r) = q.read_until_response(id).await;
    let _: LoadSessionResponse = must(serde_json::from_value(r["result"].clone()), "load shape");
    check_shapes(&notes);
    let kinds: Vec<&str> = notes.iter().filter_map(|n| n["params"]["update"]["sessionUpdate"].as_str()).collect();
    assert_eq!(kinds, ["user_message_chunk", "agent_thought_chunk", "tool_call", "agent_message_chunk"], "{notes:?}");
    assert_eq!(texts(&notes, "user_message_chunk"), ["first question"]);
    assert_eq!(texts(&notes, "agent_message_chunk"), ["first answer"]);
    let call = updates(&notes, "tool_call");
    assert_eq!((call[0]["toolCallId"].as_str(), call[0]["status"].as_str()), (Some("w1"), Some("completed")));
    assert_eq!(call[0]["content"][0]["newText"], "v1");

    // The conversation continues with its history.
    f.push(Reply::text("second answer"));
    let (frames, resp, _) = turn(&mut q, &sid, "second question").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(texts(&frames, "agent_message_chunk").concat(), "second answer");
    let body = &f.requests().last().map(|r| r.body.clone()).unwrap_or_default();
    let contents: Vec<String> = body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect();
    for said in ["first question", "first answer", "second question"] {
        assert!(contents.iter().any(|c| c == said), "{said} missing from {contents:?}");
    }

    // resume: no replay before the answer; unknown sessions are -32002 and the agent stays up.
    let id = q.request("session/resume", json!({"sessionId": sid, "cwd": cwd, "mcpServers": []})).await;
    let (notes, r) = q.read_until_response(id).await;
    assert!(r.get("result").is_some(), "{r}");
    assert!(notes.is_empty(), "resume replayed: {notes:?}");
    for method in ["session/load", "session/resume"] {
        let r = q.call(method, json!({"sessionId": "no-such-session", "cwd": cwd, "mcpServers": []})).await;
        assert_eq!(error_code(&r), -32002, "{method}: {r}");
    }
    let r = q.call("session/close", json!({"sessionId": "no-such-session"})).await;
    assert_eq!(error_code(&r), -32002);
    let r = q.call("session/load", json!({"sessionId": "../../etc/passwd", "cwd": cwd, "mcpServers": []})).await;
    assert_eq!(error_code(&r), -32002);
}

#[tokio::test]
async fn list_filters_by_cwd_and_pages_and_delete_removes_across_restarts() {
    let f = fake().await;
    let shared = must(tempfile::tempdir(), "shared PIER_HOME");
    let data = shared.path().to_owned();
    let (mut p, first) = start_with(Options { pier_home: Some(data.clone()), ..opts(&f) }).await;
    f.push(Reply::text("hi"));
    turn(&mut p, &first, "Titled session").await;
    let elsewhere = must(tempfile::tempdir(), "other cwd");
    let mut ids = vec![first.clone()];
    for _ in 0..55 {
        let r = p.call("session/new", json!({"cwd": elsewhere.path(), "mcpServers": []})).await;
        ids.push(r["result"]["sessionId"].as_str().unwrap_or_default().to_owned());
    }
    // The first agent exits (its working directory stays, for the sessions' cwd).
    p.close_stdin();
    assert!(p.wait_exit().await.success());
    let mut o = opts(&f);
    o.pier_home = Some(data);
    let mut q = PierProcess::spawn(o).await;
    q.initialize().await;

    let r = q.call("session/list", json!({"cwd": q.cwd()})).await;
    assert_eq!(r["result"]["sessions"], json!([]), "no match is an empty list (R073)");
    let r = q.call("session/list", json!({"cwd": "relative"})).await;
    assert_eq!(error_code(&r), -32602);

    // All sessions, in pages.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..5 {
        let r = q.call("session/list", json!({"cursor": cursor})).await;
        let page: ListSessionsResponse = must(serde_json::from_value(r["result"].clone()), "list shape");
        assert!(page.sessions.len() <= 50);
        seen.extend(page.sessions.iter().map(|s| s.session_id.0.to_string()));
        cursor = page.next_cursor;
        if cursor.is_none() {
            break;
        }
    }
    seen.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(seen, expected, "every session exactly once across pages");
    let r = q.call("session/list", json!({"cursor": "not-a-cursor"})).await;
    assert_eq!(error_code(&r), -32602);

    // The cwd filter, with title and updatedAt.
    let first_cwd = q.call("session/list", json!({"cwd": canonical(&p.cwd())})).await;
    let titled: Vec<Value> = first_cwd["result"]["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["sessionId"] == first.as_str())
        .cloned()
        .collect();
    assert_eq!(titled.len(), 1);
    assert_eq!(titled[0]["title"], "Titled session");
    assert!(titled[0]["updatedAt"].as_str().is_some_and(|t| t.ends_with('Z')), "{titled:?}");
    let filtered = q.call("session/list", json!({"cwd": titled[0]["cwd"]})).await;
    let only: Vec<&str> = filtered["result"]["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["sessionId"].as_str())
        .collect();
    assert_eq!(only, [first.as_str()]);

    // delete: gone from the list and from load; deleting again succeeds (R081).
    let r = q.call("session/delete", json!({"sessionId": first})).await;
    assert!(r.get("result").is_some(), "{r}");
    let r = q.call("session/delete", json!({"sessionId": first})).await;
    assert!(r.get("result").is_some(), "{r}");
    let r = q.call("session/load", json!({"sessionId": first, "cwd": titled[0]["cwd"], "mcpServers": []})).await;
    assert_eq!(error_code(&r), -32002);
    let filtered = q.call("session/list", json!({"cwd": titled[0]["cwd"]})).await;
    assert_eq!(filtered["result"]["sessions"], json!([]));
}

#[tokio::test]
async fn close_cancels_a_running_prompt_and_frees_the_session() {
    let f = fake().await;
    let gate = Gate::new();
    f.push(Reply::Stream(vec![Step::Text("partial".into()), Step::Gate(gate.clone()), Step::Text(" rest".into())]));
    let (mut p, sid) = start(&f).await;
    let prompt = p.prompt(&sid, "long").await;
    f.wait_for_requests(1).await;
    let close = p.request("session/close", json!({"sessionId": sid})).await;
    let (mut frames, first) = {
        let mut frames = Vec::new();
        loop {
            let frame = p.next_frame().await;
            if frame.get("method").is_none() {
                break (frames, frame);
            }
            frames.push(frame);
        }
    };
    // The prompt answers `cancelled` before close answers.
    assert_eq!(first["id"], prompt, "{first}");
    assert_eq!(stop_reason(&first), "cancelled");
    let (more, closed) = p.read_until_response(close).await;
    frames.extend(more);
    assert!(closed.get("result").is_some(), "{closed}");
    check_shapes(&frames);
    let r = p.call("session/prompt", json!({"sessionId": sid, "prompt": [{"type": "text", "text": "x"}]})).await;
    assert_eq!(error_code(&r), -32002, "a closed session is gone: {r}");
    gate.open();
}

#[tokio::test]
async fn additional_directories_are_roots_and_everything_else_is_refused() {
    let f = fake().await;
    let mut p = PierProcess::spawn(opts(&f)).await;
    p.initialize().await;
    let extra = must(tempfile::tempdir(), "extra root");
    let outside = must(tempfile::tempdir(), "outside");
    let r =
        p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [], "additionalDirectories": ["relative/x"]})).await;
    assert_eq!(error_code(&r), -32602);
    let r =
        p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [], "additionalDirectories": [extra.path()]})).await;
    let sid = r["result"]["sessionId"].as_str().unwrap_or_default().to_owned();
    let inside = extra.path().join("in.txt");
    let escape = outside.path().join("out.txt");
    f.push(Reply::tool_call("w1", "write_file", &json!({"path": inside, "content": "in"}).to_string()));
    f.push(Reply::tool_call("w2", "write_file", &json!({"path": escape, "content": "out"}).to_string()));
    f.push(Reply::text("ok"));
    p.call("session/set_mode", json!({"sessionId": sid, "modeId": "auto"})).await;
    let (frames, _, _) = turn(&mut p, &sid, "write both").await;
    assert_eq!(last_status(&frames, "w1").as_deref(), Some("completed"));
    assert_eq!(last_status(&frames, "w2").as_deref(), Some("failed"));
    assert!(inside.exists() && !escape.exists());
}

#[tokio::test]
async fn embedded_text_resources_reach_the_model_and_blobs_are_refused() {
    let f = fake().await;
    f.push(Reply::text("seen"));
    let (mut p, sid) = start(&f).await;
    let prompt = json!([
        {"type": "text", "text": "Review this"},
        {"type": "resource", "resource": {"uri": "file:///src/main.rs", "text": "fn main() {}", "mimeType": "text/x-rust"}}
    ]);
    let id = p.request("session/prompt", json!({"sessionId": sid, "prompt": prompt})).await;
    let (_, resp, _) = run_turn(&mut p, id, |_| "allow-once").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let body = f.requests().last().map(|r| r.body.clone()).unwrap_or_default();
    let user = body["messages"].as_array().into_iter().flatten().rfind(|m| m["role"] == "user").cloned();
    let text = user.and_then(|u| u["content"].as_str().map(str::to_owned)).unwrap_or_default();
    assert!(
        text.contains("Review this") && text.contains("file:///src/main.rs") && text.contains("fn main() {}"),
        "{text}"
    );

    let blob = json!([{"type": "resource", "resource": {"uri": "file:///a.bin", "blob": "AAEC"}}]);
    let r = p.call("session/prompt", json!({"sessionId": sid, "prompt": blob})).await;
    assert_eq!(error_code(&r), -32602);
    assert!(r["error"].to_string().contains("block 0"), "{r}");
    let image = json!([{"type": "image", "mimeType": "image/png", "data": "AAEC"}]);
    let r = p.call("session/prompt", json!({"sessionId": sid, "prompt": image})).await;
    assert_eq!(error_code(&r), -32602, "no vision configured: {r}");
}

#[tokio::test]
async fn images_go_to_a_vision_model_as_image_parts() {
    let f = fake().await;
    f.push(Reply::text("a cat"));
    let toml =
        editor_toml(&f.base_url(), "").replace("context_window = 32000", "context_window = 32000\nvision = true");
    let mut p = PierProcess::spawn(Options { pier_toml: Some(toml), ..Options::default() }).await;
    let r = p.initialize().await;
    assert_eq!(r["result"]["agentCapabilities"]["promptCapabilities"]["image"], true);
    let sid = p.new_session().await;
    let prompt = json!([{"type": "text", "text": "What is this?"}, {"type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo="}]);
    let id = p.request("session/prompt", json!({"sessionId": sid, "prompt": prompt})).await;
    let (_, resp, _) = run_turn(&mut p, id, |_| "allow-once").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let body = f.requests().last().map(|r| r.body.clone()).unwrap_or_default();
    let user = body["messages"].as_array().into_iter().flatten().rfind(|m| m["role"] == "user").cloned();
    let parts = user.map(|u| u["content"].clone()).unwrap_or_default();
    assert_eq!(parts[1]["image_url"]["url"], "data:image/png;base64,iVBORw0KGgo=", "{parts}");
}

#[tokio::test]
async fn cancel_during_a_command_settles_every_call_and_leaves_no_process() {
    let f = fake().await;
    f.push(Reply::Stream(vec![
        Step::ToolCallStart { index: 0, id: "c1".into(), name: "run_command".into() },
        Step::ToolCallArgs { index: 0, fragment: r#"{"command": "echo $$ > ready; sleep 300"}"#.into() },
        Step::ToolCallStart { index: 1, id: "c2".into(), name: "read_file".into() },
        Step::ToolCallArgs { index: 1, fragment: r#"{"path": "ready"}"#.into() },
        Step::Finish("tool_calls".into()),
        Step::Done,
    ]));
    let (mut p, sid) = start(&f).await;
    let fifo = p.cwd().join("ready");
    must(nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU), "mkfifo");
    let id = p.prompt(&sid, "sleep").await;
    // The command asks first; allow it, then wait for it to write its pid into the FIFO.
    let mut frames = Vec::new();
    loop {
        let frame = p.next_frame().await;
        if frame["method"] == "session/request_permission" {
            answer(&mut p, &frame, "allow-once").await;
            break;
        }
        frames.push(frame);
    }
    let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo));
    let pgid: i32 = must(must(must(tokio::time::timeout(LIMIT, read).await, "command start"), "join"), "read fifo")
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    let (more, resp) = p.read_until_response(id).await;
    frames.extend(more);
    check_shapes(&frames);
    assert_eq!(stop_reason(&resp), "cancelled");
    assert_eq!(last_status(&frames, "c1").as_deref(), Some("failed"));
    for call in updates(&frames, "tool_call") {
        let id = call["toolCallId"].as_str().unwrap_or_default();
        let status = last_status(&frames, id);
        assert!(matches!(status.as_deref(), Some("completed" | "failed")), "{id} left {status:?}");
    }
    assert!(!support::group_alive(pgid), "the command's group survived");
    // The session is usable again: the unanswered second call got a result, so the model accepts the history.
    f.push(Reply::text("fine"));
    let (_, resp, _) = turn(&mut p, &sid, "again").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let body = f.requests().last().map(|r| r.body.clone()).unwrap_or_default();
    let answered: Vec<&str> =
        body["messages"].as_array().into_iter().flatten().filter_map(|m| m["tool_call_id"].as_str()).collect();
    assert_eq!(answered, ["c1", "c2"], "every call of the cancelled message is answered");
}

fn mcp_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../pier-mcp/tests/fixtures/mcp_server.py")
}

fn stdio_server(name: &str, pid_file: &Path) -> Value {
    json!({
        "name": name,
        "command": "python3",
        "args": [mcp_fixture()],
        "env": [{"name": "MCP_PID_FILE", "value": pid_file}]
    })
}

fn pid_in(file: &Path) -> i32 {
    must(std::fs::read_to_string(file), "read the MCP server's pid").trim().parse().unwrap_or_else(|e| panic!("{e}"))
}

/// Waits (bounded) until process `pid` is gone or a zombie nobody will reap.
async fn gone(pid: i32) -> bool {
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.is_empty() || stat.split(") ").nth(1).is_some_and(|rest| rest.starts_with('Z')) {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Issue #33: an MCP tool's image reaches a model that takes images as an image part (after
/// the tool messages, which carry text only), and a model that does not gets the text that
/// describes it and no image.
#[tokio::test]
async fn an_mcp_tools_image_is_shown_to_a_vision_model_and_described_to_others() {
    for vision in [true, false] {
        let f = fake().await;
        let extra = if vision { "context_window = 32000\nvision = true" } else { "context_window = 32000" };
        let toml = editor_toml(&f.base_url(), "").replace("context_window = 32000", extra);
        let mut p = PierProcess::spawn(Options { pier_toml: Some(toml), ..Options::default() }).await;
        p.initialize().await;
        let pids = must(tempfile::tempdir(), "pid dir");
        let r = p
            .call("session/new", json!({"cwd": p.cwd(), "mcpServers": [stdio_server("notes", &pids.path().join("a"))]}))
            .await;
        let sid = r["result"]["sessionId"].as_str().unwrap_or_else(|| panic!("session/new failed: {r}")).to_owned();
        f.push(Reply::tool_call("m3", "notes__mixed", "{}"));
        f.push(Reply::text("seen"));
        let (_, resp, _) = turn(&mut p, &sid, "show me everything").await;
        assert_eq!(stop_reason(&resp), "end_turn");
        let messages = f.requests()[1].body["messages"].as_array().cloned().unwrap_or_default();
        let tool = messages.iter().find(|m| m["role"] == "tool").cloned().unwrap_or_default();
        assert!(
            tool["content"].as_str().is_some_and(|t| t.contains("first") && t.contains("[image image/png, 3 bytes]")),
            "{tool}"
        );
        let after = messages.iter().skip_while(|m| m["role"] != "tool").find(|m| m["role"] == "user").cloned();
        let image = after.as_ref().and_then(|m| {
            m["content"].as_array().and_then(|parts| parts.iter().find(|p| p["type"] == "image_url").cloned())
        });
        if vision {
            assert_eq!(
                image.map(|i| i["image_url"]["url"].clone()),
                Some(json!("data:image/png;base64,AAAA")),
                "{messages:?}"
            );
        } else {
            assert!(after.is_none() && image.is_none(), "no image for a model without vision: {messages:?}");
        }
    }
}

#[tokio::test]
async fn an_mcp_server_s_tools_are_called_in_a_turn_and_the_server_stops_with_its_session() {
    let f = fake().await;
    let mut p = PierProcess::spawn(opts(&f)).await;
    p.initialize().await;
    let pids = must(tempfile::tempdir(), "pid dir");
    let (pid_a, pid_b) = (pids.path().join("a"), pids.path().join("b"));
    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [stdio_server("notes", &pid_a)]})).await;
    let sid = r["result"]["sessionId"].as_str().unwrap_or_else(|| panic!("session/new failed: {r}")).to_owned();
    let server = pid_in(&pid_a);

    // The model sees the server's tools, prefixed; a read-only one runs without asking, another asks.
    f.push(Reply::tool_call("m1", "notes__echo", r#"{"text": "hello mcp"}"#));
    f.push(Reply::tool_call("m2", "notes__write_note", r#"{"name": "note.txt", "text": "kept"}"#));
    f.push(Reply::text("done"));
    let (frames, resp, asked) = turn(&mut p, &sid, "use the tools").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let first = &f.requests()[0].body;
    let names: Vec<&str> =
        first["tools"].as_array().into_iter().flatten().filter_map(|t| t["function"]["name"].as_str()).collect();
    assert!(names.contains(&"notes__echo") && names.contains(&"read_file"), "{names:?}");
    let m1 = call_updates(&frames, "m1");
    assert_eq!(m1[0]["kind"], "read");
    assert_eq!(last_status(&frames, "m1").as_deref(), Some("completed"));
    let asked_ids: Vec<&str> = asked.iter().filter_map(|a| a["params"]["toolCall"]["toolCallId"].as_str()).collect();
    assert_eq!(asked_ids, ["m2"]);
    // `other` is the schema's default kind, which it leaves out.
    assert!(call_updates(&frames, "m2")[0].get("kind").is_none_or(|k| k == "other"));
    assert_eq!(must(std::fs::read_to_string(p.cwd().join("note.txt")), "note"), "kept");
    let results: Vec<String> = f.requests()[1].body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect();
    assert!(results.iter().any(|r| r.contains("hello mcp")), "{results:?}");
    // The editor sees the server's content blocks themselves, unchanged.
    let echoed = call_updates(&frames, "m1").last().map(|u| u["content"].clone()).unwrap_or_default();
    assert_eq!(echoed, json!([{"type": "content", "content": {"type": "text", "text": "hello mcp"}}]));
    f.push(Reply::tool_call("m3", "notes__mixed", "{}"));
    f.push(Reply::text("seen"));
    let (frames, resp, _) = turn(&mut p, &sid, "show me everything").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let mixed = call_updates(&frames, "m3").last().map(|u| u["content"].clone()).unwrap_or_default();
    let blocks: Vec<&Value> = mixed.as_array().into_iter().flatten().map(|c| &c["content"]).collect();
    assert_eq!(
        blocks,
        [
            &json!({"type": "text", "text": "first"}),
            &json!({"type": "image", "data": "AAAA", "mimeType": "image/png"}),
            &json!({"type": "resource", "resource": {"uri": "file:///note.txt", "text": "embedded text"}}),
            &json!({"type": "resource_link", "uri": "file:///other.txt", "name": "other"}),
        ],
        "{mixed}"
    );

    // Closing the session stops its server.
    let r = p.call("session/close", json!({"sessionId": sid})).await;
    assert!(r.get("result").is_some(), "{r}");
    assert!(gone(server).await, "the MCP server outlived session/close");

    // A server that cannot start fails session/new, naming it.
    let broken = json!({"name": "broken", "command": "python3", "args": [mcp_fixture(), "--exit-at-once", "no config found"], "env": []});
    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [broken]})).await;
    assert_eq!(error_code(&r), -32603, "{r}");
    let message = r["error"].to_string();
    assert!(message.contains("broken") && message.contains("no config found"), "{message}");

    // A server of a live session stops when the agent exits.
    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [stdio_server("other", &pid_b)]})).await;
    assert!(r.get("result").is_some(), "{r}");
    let server = pid_in(&pid_b);
    p.close_stdin();
    assert!(p.wait_exit().await.success());
    assert!(gone(server).await, "the MCP server outlived the agent");
}

/// What a stdio MCP server starts in a session of its own (as `npx` and `uvx` launchers do)
/// ends with the server: at `session/close`, and when the agent is SIGKILLed.
#[tokio::test]
async fn an_mcp_server_s_detached_children_end_with_its_session_and_with_the_agent() {
    let f = fake().await;
    let pids = must(tempfile::tempdir(), "pid dir");
    let server = |name: &str| {
        json!({"name": name, "command": "python3", "args": [mcp_fixture()], "env": [
            {"name": "MCP_PID_FILE", "value": pids.path().join(format!("{name}.server"))},
            {"name": "MCP_DETACHED_PID_FILE", "value": pids.path().join(format!("{name}.detached"))}]})
    };
    let mut p = PierProcess::spawn(opts(&f)).await;
    p.initialize().await;
    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [server("one")]})).await;
    let sid = r["result"]["sessionId"].as_str().unwrap_or_else(|| panic!("session/new failed: {r}")).to_owned();
    let (srv, detached) = (pid_in(&pids.path().join("one.server")), pid_in(&pids.path().join("one.detached")));
    let r = p.call("session/close", json!({"sessionId": sid})).await;
    assert!(r.get("result").is_some(), "{r}");
    assert!(gone(srv).await, "the MCP server outlived session/close");
    assert!(gone(detached).await, "its detached child outlived session/close");

    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [server("two")]})).await;
    assert!(r.get("result").is_some(), "{r}");
    let (srv, detached) = (pid_in(&pids.path().join("two.server")), pid_in(&pids.path().join("two.detached")));
    p.sigkill();
    assert!(gone(srv).await, "the MCP server outlived the SIGKILLed agent");
    assert!(gone(detached).await, "its detached child outlived the SIGKILLed agent");
}

#[tokio::test]
async fn pier_exec_s_idle_timer_sees_pier_s_deltas_so_a_slow_long_answer_is_not_cut() {
    let f = fake().await;
    // A generation slower than the idle timeout as a whole, but never silent for that long.
    let mut steps = Vec::new();
    for i in 0..6 {
        steps.push(Step::Text(format!("part{i} ")));
        steps.push(Step::Pause(std::time::Duration::from_millis(300)));
    }
    steps.extend([Step::Finish("stop".into()), Step::Done]);
    f.push(Reply::Stream(steps));
    let dir = must(tempfile::tempdir(), "dir");
    let vars: Vec<(String, String)> = vec![
        ("HOME".into(), dir.path().display().to_string()),
        ("PIER_HOME".into(), dir.path().join("data").display().to_string()),
        ("PATH".into(), std::env::var("PATH").unwrap_or_default()),
        ("PIER_BASE_URL".into(), f.base_url()),
        ("PIER_MODEL".into(), "fake-model".into()),
    ];
    let child = must(
        support::pier_command(dir.path(), &vars, &["exec", "--timeout", "1", "--format", "quiet", "write at length"])
            .spawn(),
        "spawn pier exec",
    );
    let out = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "in time"), "wait");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "part0 part1 part2 part3 part4 part5");
}

#[tokio::test]
async fn with_two_providers_a_model_select_switches_the_session_s_model() {
    let f = fake().await;
    let toml = format!(
        "profile = \"editor\"\nprovider = \"first\"\n[providers.first]\nbase_url = \"{u}\"\nmodel = \"model-a\"\nmax_retries = 0\n[providers.second]\nbase_url = \"{u}\"\nmodel = \"model-b\"\nmax_retries = 0\n",
        u = f.base_url()
    );
    let (mut p, sid) = start_with(Options { pier_toml: Some(toml), ..Options::default() }).await;
    let r = p.call("session/set_config_option", json!({"sessionId": sid, "configId": "model", "value": "nope"})).await;
    assert_eq!(error_code(&r), -32602, "{r}");
    let r =
        p.call("session/set_config_option", json!({"sessionId": sid, "configId": "model", "value": "second"})).await;
    let options = r["result"]["configOptions"].as_array().cloned().unwrap_or_default();
    let model = options.iter().find(|o| o["id"] == "model").cloned().unwrap_or_default();
    assert_eq!((model["category"].as_str(), model["currentValue"].as_str()), (Some("model"), Some("second")), "{r}");
    f.push(Reply::text("from b"));
    let (_, resp, _) = turn(&mut p, &sid, "hi").await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(f.requests().last().map(|r| r.body["model"].clone()), Some(json!("model-b")));
}
