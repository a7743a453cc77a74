//! End-to-end tests of `pier agent` (automation profile) over real pipes, with a
//! local model server speaking the OpenAI streaming format.

mod support;

use pier_fake_model::{FakeModel, Gate, Reply, Step};
use serde_json::{Value, json};
use support::{LIMIT, Options, PierProcess, agent_texts, error_code, fast_toml, must, read_log, stop_reason};

async fn fake() -> FakeModel {
    must(FakeModel::start().await, "start the fake model")
}

fn user_contents(body: &Value) -> Vec<String> {
    body["messages"]
        .as_array()
        .map(|m| {
            m.iter().filter(|m| m["role"] == "user").filter_map(|m| m["content"].as_str().map(str::to_owned)).collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn handshake_advertises_the_automation_contract() {
    let mut p = PierProcess::spawn(Options::default()).await;
    let r = p.call("initialize", json!({"protocolVersion": 1, "clientInfo": {"name": "t", "version": "1"}})).await;
    let result = &r["result"];
    assert_eq!(result["protocolVersion"], 1);
    assert_eq!(result["agentInfo"]["name"], "pier");
    assert!(result["agentInfo"]["version"].is_string());
    let caps = &result["agentCapabilities"];
    assert_eq!(caps["loadSession"], false);
    assert_eq!(caps["promptCapabilities"], json!({"image": false, "audio": false, "embeddedContext": false}));
    assert_eq!(caps["mcpCapabilities"]["http"], false);
    assert_eq!(caps["mcpCapabilities"]["sse"], false);
    assert!(result["authMethods"].as_array().is_none_or(Vec::is_empty), "{result}");
}

#[tokio::test]
async fn version_negotiation_answers_one() {
    let mut p = PierProcess::spawn(Options::default()).await;
    for requested in [1, 2, 7, 0] {
        let r = p.call("initialize", json!({"protocolVersion": requested})).await;
        assert_eq!(r["result"]["protocolVersion"], 1, "asked for {requested}: {r}");
    }
    let r = p.call("initialize", json!({"protocolVersion": "1.0"})).await;
    assert_eq!(error_code(&r), -32602);
}

#[tokio::test]
async fn session_new_rejects_what_the_profile_does_not_take() {
    let mut p = PierProcess::spawn(Options::default()).await;
    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": []})).await;
    assert_eq!(error_code(&r), -32600, "before initialize: {r}");
    p.initialize().await;
    let cwd = p.cwd();
    let cases = [
        json!({"cwd": "relative/dir", "mcpServers": []}),
        json!({"cwd": cwd, "mcpServers": [{"name": "x", "command": "/bin/true", "args": [], "env": []}]}),
        json!({"cwd": cwd, "mcpServers": [], "additionalDirectories": ["/tmp"]}),
        json!({"cwd": cwd.join("does-not-exist"), "mcpServers": []}),
        json!({"mcpServers": []}),
    ];
    for params in cases {
        let r = p.call("session/new", params.clone()).await;
        assert_eq!(error_code(&r), -32602, "{params} -> {r}");
        assert!(r["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let ok = p.call("session/new", json!({"cwd": cwd, "mcpServers": []})).await;
    let a = ok["result"]["sessionId"].as_str().map(str::to_owned);
    let ok2 = p.call("session/new", json!({"cwd": cwd, "mcpServers": []})).await;
    assert!(a.is_some() && a.as_deref() != ok2["result"]["sessionId"].as_str(), "session ids are unique");
}

#[tokio::test]
async fn a_turn_commits_whole_messages_and_ends_end_turn() {
    let f = fake().await;
    f.push(Reply::Stream(vec![
        Step::Reasoning("let me think".into()),
        Step::Text("Hello".into()),
        Step::Text(", world".into()),
        Step::Finish("stop".into()),
        Step::Usage { prompt: 5, completion: 2 },
        Step::Done,
    ]));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "Say hello").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    // Exactly one update: the committed message, no deltas, no reasoning.
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert_eq!(agent_texts(&notes, &sid), vec!["Hello, world"]);
    let body = &f.requests()[0].body;
    assert_eq!(user_contents(body), vec!["Say hello"]);
    assert_eq!(f.requests()[0].authorization.as_deref(), Some("Bearer sk-test"));

    // The session log holds the story, reasoning included.
    let log = read_log(&p.data_dir(), &sid);
    let types: Vec<&str> = log.iter().filter_map(|r| r["type"].as_str()).collect();
    assert_eq!(
        types,
        [
            "session_started",
            "prompt",
            "title",
            "model_request",
            "model_response",
            "reasoning",
            "message",
            "history",
            "turn_ended"
        ]
    );
    assert_eq!(log[2]["title"], "Say hello");
    assert_eq!(log[4]["usage"]["total_tokens"], 7);
    assert_eq!(log[5]["text"], "let me think");
    assert_eq!(log[8]["stop_reason"], "end_turn");

    // The next turn carries the history.
    f.push(Reply::text("again"));
    let id = p.prompt(&sid, "And again").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let body = &f.requests()[1].body;
    assert_eq!(user_contents(body), vec!["Say hello", "And again"]);
    assert!(
        body["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "assistant" && m["content"] == "Hello, world"))
    );
}

#[tokio::test]
async fn prompt_rejections_are_clear_and_harmless() {
    let f = fake().await;
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let cases = [
        (json!({"sessionId": sid, "prompt": []}), -32602),
        (json!({"sessionId": sid, "prompt": [{"type": "text", "text": "   \n "}]}), -32602),
        (json!({"sessionId": sid, "prompt": [{"type": "image", "data": "AA==", "mimeType": "image/png"}]}), -32602),
        (json!({"sessionId": sid, "prompt": [{"type": "audio", "data": "AA==", "mimeType": "audio/wav"}]}), -32602),
        (
            json!({"sessionId": sid, "prompt": [{"type": "text", "text": "see"}, {"type": "resource", "resource": {"uri": "file:///a", "text": "x"}}]}),
            -32602,
        ),
        (json!({"sessionId": "no-such-session", "prompt": [{"type": "text", "text": "hi"}]}), -32002),
        (json!({"sessionId": sid, "prompt": "hi"}), -32602),
    ];
    for (params, code) in cases {
        let r = p.call("session/prompt", params.clone()).await;
        assert_eq!(error_code(&r), code, "{params} -> {r}");
    }
    assert!(f.requests().is_empty(), "no rejected prompt reached the model");
    f.push(Reply::text("fine"));
    let id = p.prompt(&sid, "still works").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    // Rejected prompts left no trace in the history.
    assert_eq!(user_contents(&f.requests()[0].body), vec!["still works"]);
}

#[tokio::test]
async fn a_second_prompt_in_flight_is_rejected_and_the_first_goes_on() {
    let f = fake().await;
    let gate = Gate::new();
    f.push(Reply::Stream(vec![
        Step::Text("first ".into()),
        Step::Gate(gate.clone()),
        Step::Text("answer".into()),
        Step::Finish("stop".into()),
        Step::Done,
    ]));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let first = p.prompt(&sid, "one").await;
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "first model request");
    let second = p.prompt(&sid, "two").await;
    let (notes, resp) = p.read_until_response(second).await;
    assert!(notes.is_empty());
    assert_eq!(error_code(&resp), -32600, "{resp}");
    assert!(resp["error"]["data"]["reason"].as_str().is_some_and(|r| r.contains("already in flight")), "{resp}");
    gate.open();
    let (notes, resp) = p.read_until_response(first).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(agent_texts(&notes, &sid), vec!["first answer"]);
    assert_eq!(f.requests().len(), 1);
}

#[tokio::test]
async fn resource_links_are_flattened_into_the_text() {
    let f = fake().await;
    f.push(Reply::text("ok"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p
        .request(
            "session/prompt",
            json!({"sessionId": sid, "prompt": [
                {"type": "text", "text": "Review"},
                {"type": "resource_link", "name": "lib.rs", "uri": "file:///repo/src/lib.rs", "mimeType": "text/x-rust"},
            ]}),
        )
        .await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(user_contents(&f.requests()[0].body), vec!["Review\n[lib.rs](file:///repo/src/lib.rs)"]);
}

#[tokio::test]
async fn concurrent_sessions_are_isolated() {
    let f = fake().await;
    let (gate_a, gate_b) = (Gate::new(), Gate::new());
    let (ga, gb) = (gate_a.clone(), gate_b.clone());
    f.set_fallback(move |body| {
        let last = user_contents(body).pop().unwrap_or_default();
        let (gate, word) = if last.contains("alpha") { (ga.clone(), "ALPHA") } else { (gb.clone(), "BETA") };
        Reply::Stream(vec![Step::Gate(gate), Step::Text(word.into()), Step::Finish("stop".into()), Step::Done])
    });
    let mut p = PierProcess::spawn(Options::model(f.base_url())).await;
    p.initialize().await;
    let a = p.new_session().await;
    let b = p.new_session().await;
    let pa = p.prompt(&a, "alpha").await;
    let pb = p.prompt(&b, "beta").await;
    // Both model requests are in flight at once: the turns run concurrently.
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(2)).await, "both model requests");
    gate_b.open();
    let (notes_b, resp_b) = p.read_until_response(pb).await;
    assert_eq!(stop_reason(&resp_b), "end_turn");
    assert_eq!(agent_texts(&notes_b, &b), vec!["BETA"]);
    assert!(agent_texts(&notes_b, &a).is_empty());
    gate_a.open();
    let (notes_a, resp_a) = p.read_until_response(pa).await;
    assert_eq!(stop_reason(&resp_a), "end_turn");
    assert_eq!(agent_texts(&notes_a, &a), vec!["ALPHA"]);
    // A second turn on b sees only b's history.
    gate_b.open();
    let id = p.prompt(&b, "beta again").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let last = f.requests().pop().map(|r| r.body).unwrap_or_default();
    assert_eq!(user_contents(&last), vec!["beta", "beta again"]);
}

#[tokio::test]
async fn max_tokens_when_the_model_hits_its_limit() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Text("cut sh".into()), Step::Finish("length".into()), Step::Done]));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "long essay").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "max_tokens");
    assert_eq!(agent_texts(&notes, &sid), vec!["cut sh"]);
}

#[tokio::test]
async fn max_turn_requests_stops_a_model_that_loops() {
    let f = fake().await;
    f.set_fallback(|_| Reply::tool_call("call_1", "read_file", "{\"path\":\"a\"}"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url()).arg("--max-turn-requests").arg("3")).await;
    let id = p.prompt(&sid, "loop forever").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "max_turn_requests");
    assert!(notes.is_empty(), "no tool activity on the wire in this profile: {notes:?}");
    assert_eq!(f.requests().len(), 3);
    // Each tool call was answered in the next request.
    let third = &f.requests()[2].body;
    let tool_msgs = third["messages"].as_array().map(|m| m.iter().filter(|m| m["role"] == "tool").count());
    assert_eq!(tool_msgs, Some(2));
}

#[tokio::test]
async fn refusal_leaves_the_prompt_out_of_later_history() {
    let f = fake().await;
    f.push(Reply::text("sure"));
    f.push(Reply::Stream(vec![
        Step::Refusal("I can't help with that.".into()),
        Step::Finish("stop".into()),
        Step::Done,
    ]));
    f.push(Reply::Stream(vec![Step::Finish("content_filter".into()), Step::Done]));
    f.push(Reply::text("ok"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "fine question").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
    let id = p.prompt(&sid, "forbidden question").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "refusal");
    assert_eq!(agent_texts(&notes, &sid), vec!["I can't help with that."]);
    let id = p.prompt(&sid, "filtered question").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "refusal");
    let id = p.prompt(&sid, "next question").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
    let last = &f.requests()[3].body;
    assert_eq!(user_contents(last), vec!["fine question", "next question"]);
}

#[tokio::test]
async fn cancel_mid_stream_ends_cancelled_and_drops_the_model_stream() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Text("partial".into()), Step::Hang]));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "long task").await;
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "model request");
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "cancelled");
    assert!(agent_texts(&notes, &sid).is_empty(), "uncommitted text is not sent: {notes:?}");
    must(tokio::time::timeout(LIMIT, f.wait_for_disconnects(1)).await, "the model stream was dropped");
    // The session is usable again.
    f.push(Reply::text("done"));
    let id = p.prompt(&sid, "short task").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(agent_texts(&notes, &sid), vec!["done"]);
    let log = read_log(&p.data_dir(), &sid);
    assert!(log.iter().any(|r| r["type"] == "turn_ended" && r["stop_reason"] == "cancelled"));
}

#[tokio::test]
async fn cancel_while_the_model_has_not_answered_yet() {
    let f = fake().await;
    f.push(Reply::Hang);
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "q").await;
    // No waiting for the model: the cancel may even arrive before the request.
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "cancelled");
}

#[tokio::test]
async fn cancel_request_answers_minus_32800() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Hang]));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "q").await;
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "model request");
    p.notify("$/cancel_request", json!({"requestId": id})).await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(error_code(&resp), -32800, "{resp}");
    must(tokio::time::timeout(LIMIT, f.wait_for_disconnects(1)).await, "the model stream was dropped");
}

#[tokio::test]
async fn model_errors_surface_on_the_prompt_with_the_provider_message() {
    let f = fake().await;
    f.push(Reply::status(401, "Incorrect API key provided: sk-te****"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "q").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(error_code(&resp), -32603);
    assert!(resp["error"]["message"].as_str().is_some_and(|m| m.contains("Incorrect API key provided")), "{resp}");
    assert_eq!(resp["error"]["data"]["status"], 401);
    // The failed prompt is not in the history of the next turn.
    f.push(Reply::text("ok"));
    let id = p.prompt(&sid, "q2").await;
    assert_eq!(stop_reason(&p.read_until_response(id).await.1), "end_turn");
    assert_eq!(user_contents(&f.requests()[1].body), vec!["q2"]);
}

#[tokio::test]
async fn a_stream_cut_after_output_ends_the_turn_with_an_error() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Text("half".into()), Step::Cut]));
    let opts = Options { pier_toml: Some(fast_toml(&f.base_url(), 5000, 3)), ..Options::default() };
    let (mut p, sid) = PierProcess::start(opts).await;
    let id = p.prompt(&sid, "q").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert!(notes.is_empty());
    assert_eq!(resp["error"]["data"]["kind"], "provider_stream_cut", "{resp}");
    assert_eq!(f.requests().len(), 1, "no silent retry after output");
}

#[tokio::test]
async fn a_silent_model_times_out_per_the_config_file() {
    let f = fake().await;
    f.push(Reply::Hang);
    let opts = Options { pier_toml: Some(fast_toml(&f.base_url(), 300, 0)), ..Options::default() };
    let (mut p, sid) = PierProcess::start(opts).await;
    let id = p.prompt(&sid, "q").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(resp["error"]["data"]["kind"], "provider_timeout", "{resp}");
}

#[tokio::test]
async fn without_a_model_prompts_fail_fast_saying_how_to_configure_one() {
    let (mut p, sid) = PierProcess::start(Options::default()).await;
    let id = p.prompt(&sid, "hello?").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(error_code(&resp), -32603);
    assert_eq!(resp["error"]["data"]["kind"], "model_not_configured");
    let msg = resp["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("PIER_MODEL") && msg.contains("pier.toml"), "{msg}");
}

#[tokio::test]
async fn methods_outside_the_profile_answer_method_not_found() {
    let mut p = PierProcess::spawn(Options::default()).await;
    p.initialize().await;
    let sid = p.new_session().await;
    let cwd = p.cwd();
    for (method, params) in [
        ("session/load", json!({"sessionId": sid, "cwd": cwd, "mcpServers": []})),
        ("session/list", json!({})),
        ("session/resume", json!({"sessionId": sid, "cwd": cwd})),
        ("session/close", json!({"sessionId": sid})),
        ("session/delete", json!({"sessionId": sid})),
        ("session/set_mode", json!({"sessionId": sid, "modeId": "x"})),
        ("session/set_config_option", json!({"sessionId": sid, "configId": "x", "value": "y"})),
        ("authenticate", json!({"methodId": "x"})),
        ("_pier/anything", json!({})),
        ("no/such/method", json!({})),
    ] {
        let r = p.call(method, params).await;
        assert_eq!(error_code(&r), -32601, "{method}: {r}");
    }
}

#[tokio::test]
async fn bad_input_gets_the_right_error_and_the_connection_stays_up() {
    let mut p = PierProcess::spawn(Options::default().arg("--max-frame-bytes").arg("4096")).await;
    p.send_raw(b"this is not json\n").await;
    let r = p.next_frame().await;
    assert_eq!((error_code(&r), r["id"].clone()), (-32700, Value::Null));
    p.send_raw(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\"\n").await;
    assert_eq!(error_code(&p.next_frame().await), -32700);
    p.send_raw(b"[1,2]\n").await;
    assert_eq!(error_code(&p.next_frame().await), -32600);
    p.send_raw(b"{\"id\":5,\"method\":\"initialize\"}\n").await;
    let r = p.next_frame().await;
    assert_eq!((error_code(&r), r["id"].clone()), (-32600, json!(5)));
    let mut big = b"{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"initialize\",\"params\":{\"x\":\"".to_vec();
    big.extend(std::iter::repeat_n(b'a', 100_000));
    big.extend_from_slice(b"\"}}\n");
    p.send_raw(&big).await;
    let r = p.next_frame().await;
    assert_eq!((error_code(&r), r["id"].clone()), (-32700, Value::Null), "oversized frame: {r}");
    // Wrong params carry the serde path.
    let r = p.call("initialize", json!({"protocolVersion": "one"})).await;
    assert_eq!(error_code(&r), -32602, "{r}");
    assert_eq!(r["error"]["data"]["path"], "protocolVersion", "{r}");
    p.initialize().await;
    let r = p.call("session/new", json!({"cwd": p.cwd(), "mcpServers": [{"name": 5}]})).await;
    assert_eq!(error_code(&r), -32602, "{r}");
    assert!(r["error"]["data"]["path"].as_str().is_some_and(|path| path.starts_with("mcpServers")), "{r}");
    // Unknown notifications and malformed cancels are ignored without a reply.
    p.notify("unknown/notification", json!({})).await;
    p.notify("session/cancel", json!({"wrong": true})).await;
    p.notify("session/cancel", json!({"sessionId": "nope"})).await;
    p.send_raw(b"{\"jsonrpc\":\"2.0\",\"method\":\"x\",\"params\":7}\n").await;
    // A CRLF-terminated frame is fine, and the connection is still up.
    p.send_raw(
        b"{\"jsonrpc\":\"2.0\",\"id\":\"s-1\",\"method\":\"initialize\",\"params\":{\"protocolVersion\":1}}\r\n",
    )
    .await;
    let r = p.next_frame().await;
    assert_eq!(r["id"], "s-1", "the ignored notifications got no reply: {r}");
    assert_eq!(r["result"]["protocolVersion"], 1);
    p.close_stdin();
    assert!(p.wait_exit().await.success());
}

#[tokio::test]
async fn closing_stdin_mid_turn_exits_promptly_and_leaves_nothing_behind() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Text("partial".into()), Step::Hang]));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let _id = p.prompt(&sid, "long task").await;
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "model request");
    p.close_stdin();
    let status = p.wait_exit().await;
    assert!(status.success(), "{status:?}");
    must(tokio::time::timeout(LIMIT, f.wait_for_disconnects(1)).await, "the model stream was dropped");
    assert!(!p.group_alive(), "a process of pier's group survived");
    let log = read_log(&p.data_dir(), &sid);
    let last_two: Vec<&str> = log.iter().rev().take(2).filter_map(|r| r["type"].as_str()).collect();
    assert_eq!(last_two, ["session_closed", "turn_ended"], "{log:?}");
}

#[tokio::test]
async fn sigterm_settles_like_a_close() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Hang]));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url())).await;
    let id = p.prompt(&sid, "q").await;
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "model request");
    #[allow(unsafe_code)]
    // SAFETY: sending SIGTERM to a child we own.
    unsafe {
        libc::kill(p.pid, libc::SIGTERM);
    }
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "cancelled");
    assert!(p.wait_exit().await.success());
}

#[tokio::test]
async fn stdout_stays_pure_under_verbose_logging() {
    let f = fake().await;
    f.push(Reply::text("quiet please"));
    let (mut p, sid) = PierProcess::start(Options::model(f.base_url()).env("RUST_LOG", "trace")).await;
    let id = p.prompt(&sid, "q").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    assert_eq!(notes.len(), 1);
    p.close_stdin();
    assert!(p.wait_exit().await.success());
}

#[tokio::test]
async fn the_api_key_never_reaches_the_logs() {
    let f = fake().await;
    f.push(Reply::status(401, "bad key"));
    f.push(Reply::text("ok"));
    let opts = Options { capture_stderr: true, ..Options::model(f.base_url()) }
        .env("RUST_LOG", "trace")
        .env("PIER_API_KEY", "sk-very-secret-value");
    let (mut p, sid) = PierProcess::start(opts).await;
    for text in ["a", "b"] {
        let id = p.prompt(&sid, text).await;
        p.read_until_response(id).await;
    }
    p.close_stdin();
    assert!(p.wait_exit().await.success());
    assert_eq!(f.requests()[0].authorization.as_deref(), Some("Bearer sk-very-secret-value"));
    let stderr = p.stderr();
    assert!(stderr.contains("pier agent starting"), "logging was on: {stderr}");
    assert!(!stderr.contains("sk-very-secret-value"), "the key leaked into the logs");
}

#[test]
fn the_frame_checker_rejects_stray_output() {
    for bad in [
        "hello",
        "",
        "{\"jsonrpc\":\"2.0\"}",
        "{\"id\":1,\"result\":1}",
        "[1]",
        "{\"jsonrpc\":\"2.0\",\"method\":\"m\",\"x\":1}",
    ] {
        assert!(support::check_frame(bad).is_err(), "{bad}");
    }
    assert!(support::check_frame("{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":null}").is_ok());
}

fn test_model() -> std::path::PathBuf {
    let path = std::env::var("PIER_TEST_MODEL").map(std::path::PathBuf::from).unwrap_or_else(|_| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-peers/models/smollm2.q8_0.gguf")
    });
    assert!(path.is_file(), "the embedded model is missing at {}; run scripts/test", path.display());
    path
}

async fn local_agent() -> (PierProcess, String) {
    let mut p = PierProcess::spawn(Options::default().env("PIER_MODEL", "local")).await;
    let models = p.data_dir().join("models");
    must(std::fs::create_dir_all(&models), "models dir");
    must(std::os::unix::fs::symlink(test_model(), models.join("smollm2.q8_0.gguf")), "link the model");
    p.initialize().await;
    let sid = p.new_session().await;
    (p, sid)
}

#[tokio::test]
async fn the_embedded_model_answers_over_acp_offline() {
    let (mut p, sid) = local_agent().await;
    let id = p.prompt(&sid, "What is the capital of France?").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn");
    let text = agent_texts(&notes, &sid).join("");
    assert!(text.contains("Paris"), "{text}");
    let log = read_log(&p.data_dir(), &sid);
    assert!(
        log.iter()
            .any(|r| r["type"] == "model_request" && r["provider"].as_str().is_some_and(|d| d.starts_with("local")))
    );
}

#[tokio::test]
async fn cancelling_the_embedded_model_mid_generation_is_prompt() {
    let (mut p, sid) = local_agent().await;
    // Warm up: the first prompt loads the model.
    let id = p.prompt(&sid, "Say hi.").await;
    p.read_until_response(id).await;
    let id = p.prompt(&sid, "Write a very long essay about the history of the sea, in many paragraphs.").await;
    // Wait until generation is under way: the session log shows the model request.
    let started = std::time::Instant::now();
    loop {
        let requests = read_log(&p.data_dir(), &sid).iter().filter(|r| r["type"] == "model_request").count();
        if requests >= 2 {
            break;
        }
        assert!(started.elapsed() < LIMIT, "the second model request never started");
        tokio::task::yield_now().await;
    }
    let cancelled_at = std::time::Instant::now();
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "cancelled");
    let took = cancelled_at.elapsed();
    assert!(took < std::time::Duration::from_millis(500), "cancel took {took:?}");
}

#[tokio::test]
async fn sessions_hold_no_descriptor_while_idle_so_a_low_limit_serves_many() {
    let f = fake().await;
    f.set_fallback(|_| Reply::text("ok"));
    // 40 descriptors in all; before, each session kept its log open and the 30th or so failed.
    let mut o = Options::model(f.base_url());
    o.nofile = Some(40);
    let mut p = PierProcess::spawn(o).await;
    p.initialize().await;
    for i in 0..120 {
        let sid = p.new_session().await;
        let id = p.prompt(&sid, &format!("prompt {i}")).await;
        let (_, resp) = p.read_until_response(id).await;
        assert_eq!(stop_reason(&resp), "end_turn", "session {i}: {resp}");
    }
}

/// The session log keeps a retry marker for a model request sent again (S3-13), between the
/// request and its answer.
#[tokio::test]
async fn a_retried_model_request_leaves_a_retry_marker_in_the_session_log() {
    let f = must(FakeModel::start().await, "fake");
    f.push(Reply::Status { code: 503, message: "overloaded".into(), retry_after_secs: None });
    f.push(Reply::text("made it"));
    let opts = Options { pier_toml: Some(fast_toml(&f.base_url(), 5_000, 2)), ..Options::default() };
    let (mut p, sid) = PierProcess::start(opts).await;
    let id = p.prompt(&sid, "try").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    assert_eq!(agent_texts(&notes, &sid), vec!["made it"]);
    let log = read_log(&p.data_dir(), &sid);
    let types: Vec<&str> = log.iter().filter_map(|r| r["type"].as_str()).collect();
    let at = |t: &str| types.iter().position(|x| *x == t).unwrap_or_else(|| panic!("no {t} in {types:?}"));
    assert!(at("model_request") < at("retry") && at("retry") < at("model_response"), "{types:?}");
    let retry = &log[at("retry")];
    assert_eq!((retry["n"].as_u64(), retry["attempt"].as_u64()), (Some(1), Some(2)), "{retry}");
    assert!(retry["error"].as_str().is_some_and(|e| e.contains("overloaded")), "{retry}");
}
