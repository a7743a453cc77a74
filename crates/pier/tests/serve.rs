//! End-to-end tests of `pier serve`: the token, plan submission, the SSE stream
//! with exact resume, answers over HTTP, and pull workers.

mod support;

use support::serve::{Server, TOKEN, cli, server, server_with};

use std::process::Stdio;

use futures::StreamExt;
use pier_fake_model::FakeModel;
use pier_fake_model::body::user_messages;
use pier_model::sse::SseDecoder;
use serde_json::{Value, json};
use support::{LIMIT, echo, must, sdk_agent};
use tokio::process::Command;

const PIER: &str = env!("CARGO_BIN_EXE_pier");
#[tokio::test]
async fn every_route_needs_the_token() {
    let s = server(None).await;
    let routes = [
        ("GET", "/runs"),
        ("GET", "/agents"),
        ("GET", "/nodes"),
        ("POST", "/runs/r/tasks/t/messages"),
        ("POST", "/runs"),
        ("GET", "/runs/r"),
        ("GET", "/runs/r/tasks/t"),
        ("POST", "/runs/r/cancel"),
        ("POST", "/runs/r/tasks/t/cancel"),
        ("POST", "/runs/r/tasks/t/answer"),
        ("POST", "/runs/r/tasks/t/heartbeat"),
        ("POST", "/runs/r/tasks/t/update"),
        ("POST", "/lease"),
        ("GET", "/events"),
        ("GET", "/metrics"),
    ];
    // Wrong credentials on the first four routes only: one address may make ten wrong
    // guesses at once before all its requests wait (tested on its own below).
    for (i, (method, path)) in routes.into_iter().enumerate() {
        let auths: &[Option<&str>] = if i < 4 { &[None, Some("Bearer wrong"), Some("Basic abc")] } else { &[None] };
        for &auth in auths {
            let mut req = s.http.request(method.parse().unwrap_or(reqwest::Method::GET), format!("{}{path}", s.base));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = must(req.send().await, "send");
            assert_eq!(resp.status().as_u16(), 401, "{method} {path} with {auth:?}");
            let body: Value = must(serde_json::from_str(&must(resp.text().await, "text")), "json");
            assert_eq!(body["error"]["code"], "unauthorized");
        }
    }
    // The two probes a supervisor needs answer without the token, and give nothing away.
    for (path, body) in [("/health", json!({"ok": true})), ("/ready", json!({"ready": true}))] {
        let resp = must(s.http.get(format!("{}{path}", s.base)).send().await, "probe");
        assert_eq!(resp.status().as_u16(), 200, "{path}");
        let got: Value = must(serde_json::from_str(&must(resp.text().await, "text")), "json");
        assert_eq!(got, body, "{path}");
    }
}

#[tokio::test]
async fn a_submitted_plan_runs_and_the_event_stream_resumes_without_gap_or_duplicate() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"a\"\nprompt = \"root\"\n\n[[tasks]]\nid = \"b\"\ndepends_on = [\"a\"]\nprompt = \"left\"\n\n[[tasks]]\nid = \"c\"\ndepends_on = [\"a\"]\nprompt = \"right\"\n\n[[tasks]]\nid = \"d\"\ndepends_on = [\"b\", \"c\"]\nprompt = \"{{tasks.b.result}} + {{tasks.c.result}}\"\n";
    let (code, body) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "web"}))).await;
    assert_eq!((code, body["run"].clone()), (201, json!("web")));
    // Follow the stream with forced reconnects every few events until d completes.
    let mut seen: Vec<Value> = Vec::new();
    let mut last: Option<i64> = None;
    let mut reconnects = 0;
    loop {
        let mut n = 0;
        let batch = s
            .events_until(last, |e| {
                n += 1;
                n >= 3 || (e["task"] == "d" && e["to"] == "completed")
            })
            .await;
        reconnects += 1;
        last = batch.last().and_then(|e| e["seq"].as_i64()).or(last);
        let done = batch.iter().any(|e| e["task"] == "d" && e["to"] == "completed");
        seen.extend(batch);
        if done {
            break;
        }
    }
    assert!(reconnects > 3);
    let seqs: Vec<i64> = seen.iter().filter_map(|e| e["seq"].as_i64()).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>(), "gap or duplicate across reconnects");
    let (code, run) = s.call(reqwest::Method::GET, "/runs/web", None).await;
    assert_eq!(code, 200);
    assert_eq!(run["counts"]["completed"], 4);
    let d = run["tasks"].as_array().and_then(|t| t.iter().find(|t| t["id"] == "d")).cloned().unwrap_or_default();
    assert_eq!(d["result"], "done: done: left + done: right");
    // ?after= works as well as Last-Event-ID.
    let resp = must(
        s.http.get(format!("{}/events?after={}", s.base, seqs.len() - 2)).bearer_auth(TOKEN).send().await,
        "after",
    );
    let mut stream = resp.bytes_stream();
    let mut sse = SseDecoder::new(1 << 20);
    let mut got = Vec::new();
    while got.len() < 2 {
        let chunk = must(
            must(tokio::time::timeout(LIMIT, stream.next()).await, "in time").unwrap_or_else(|| panic!("ended")),
            "chunk",
        );
        for data in sse.push(&chunk).unwrap_or_default() {
            got.push(must(serde_json::from_str::<Value>(&data), "json")["seq"].as_i64().unwrap_or(0));
        }
    }
    assert_eq!(got, [seqs.len() as i64 - 1, seqs.len() as i64]);
    // Bad plans and unknown runs get stable codes.
    let (code, bad) = s
        .call(
            reqwest::Method::POST,
            "/runs",
            Some(json!({"plan": "[[tasks]]\nid = \"x\"\nprompt = \"p\"\ndepends_on = [\"nope\"]\n"})),
        )
        .await;
    assert_eq!((code, bad["error"]["code"].clone()), (400, json!("bad_plan")));
    assert_eq!(bad["error"]["details"][0]["line"], 1);
    let (code, unknown) = s.call(reqwest::Method::GET, "/runs/nope", None).await;
    assert_eq!((code, unknown["error"]["code"].clone()), (404, json!("unknown_run")));
}

#[tokio::test]
async fn awaiting_input_is_answered_over_http() {
    let s = server(None).await;
    let plan = format!("[[tasks]]\nid = \"cfg\"\nagent = \"{}\"\nprompt = \"fix the config\"\n", sdk_agent());
    let (code, _) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "ask"}))).await;
    assert_eq!(code, 201);
    let before = s.events_until(None, |e| e["type"] == "question").await;
    assert!(before.iter().any(|e| e["to"] == "awaiting_input"));
    let (code, wrong) = s
        .call(reqwest::Method::POST, "/runs/ask/tasks/cfg/answer", Some(json!({"allow": true, "option": "nope"})))
        .await;
    assert_eq!((code, wrong["error"]["code"].clone()), (400, json!("bad_request")));
    let (code, ok) = s.call(reqwest::Method::POST, "/runs/ask/tasks/cfg/answer", Some(json!({"allow": true}))).await;
    assert_eq!((code, ok["answered"].clone()), (200, json!("allow")));
    let last = before.last().and_then(|e| e["seq"].as_i64());
    s.events_until(last, |e| e["task"] == "cfg" && e["to"] == "completed").await;
    let (_, run) = s.call(reqwest::Method::GET, "/runs/ask", None).await;
    assert!(run["tasks"][0]["result"].as_str().is_some_and(|r| r.contains("successfully updated")), "{run}");
}

#[tokio::test]
async fn pull_workers_lease_heartbeat_and_report_through_the_same_state_machine() {
    let s = server(None).await;
    let plan = "[[tasks]]\nid = \"w1\"\nagent = \"worker:echo\"\nprompt = \"echo me\"\n\n[[tasks]]\nid = \"w2\"\nagent = \"worker:other\"\nprompt = \"not for echo\"\n\n\
                [[tasks]]\nid = \"w3\"\nagent = \"worker:echo\"\ndepends_on = [\"w1\"]\nprompt = \"after {{tasks.w1.result}}\"\n";
    let (code, _) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "pull"}))).await;
    assert_eq!(code, 201);
    let (code, leased) = s
        .call(
            reqwest::Method::POST,
            "/lease",
            Some(json!({"worker": "wk-1", "capabilities": ["echo"], "ttl_ms": 60000})),
        )
        .await;
    assert_eq!(code, 200, "{leased}");
    assert_eq!((leased["task"]["id"].clone(), leased["task"]["state"].clone()), (json!("w1"), json!("running")));
    assert_eq!(leased["prompt"], "echo me");
    let version = leased["task"]["version"].as_i64().unwrap_or(0);
    let attempt = leased["task"]["attempt"].as_i64().unwrap_or(0);
    // Nothing else fits this worker (w3 waits for w1).
    let (code, _) =
        s.call(reqwest::Method::POST, "/lease", Some(json!({"worker": "wk-1", "capabilities": ["echo"]}))).await;
    assert_eq!(code, 204);
    let hb = |worker: &str| json!({"worker": worker, "attempt": attempt, "ttl_ms": 60000});
    assert_eq!(s.call(reqwest::Method::POST, "/runs/pull/tasks/w1/heartbeat", Some(hb("wk-1"))).await.0, 200);
    let (code, lost) = s.call(reqwest::Method::POST, "/runs/pull/tasks/w1/heartbeat", Some(hb("intruder"))).await;
    assert_eq!((code, lost["error"]["code"].clone()), (409, json!("lease_lost")));
    let update = |status: &str, n: i64, key: &str| json!({"worker": "wk-1", "status": status, "version": version, "idempotency_key": key, "attempt": n, "result": "echo me"});
    let (code, stale) =
        s.call(reqwest::Method::POST, "/runs/pull/tasks/w1/update", Some(update("completed", attempt - 1, "k0"))).await;
    assert_eq!((code, stale["error"]["code"].clone()), (409, json!("lease_lost")), "another attempt's report");
    let (code, done) =
        s.call(reqwest::Method::POST, "/runs/pull/tasks/w1/update", Some(update("completed", attempt, "k1"))).await;
    assert_eq!((code, done["task"]["state"].clone()), (200, json!("completed")));
    let (code, replay) =
        s.call(reqwest::Method::POST, "/runs/pull/tasks/w1/update", Some(update("completed", attempt, "k1"))).await;
    assert_eq!((code, replay), (200, done.clone()), "a replayed update returns the first answer");
    let (code, next) =
        s.call(reqwest::Method::POST, "/lease", Some(json!({"worker": "wk-1", "capabilities": ["echo"]}))).await;
    assert_eq!((code, next["task"]["id"].clone(), next["prompt"].clone()), (200, json!("w3"), json!("after echo me")));
    let (code, illegal) =
        s.call(reqwest::Method::POST, "/runs/pull/tasks/w1/update", Some(update("running", attempt, "k2"))).await;
    assert_eq!((code, illegal["error"]["code"].clone()), (409, json!("bad_transition")));
    // A worker cannot end a task it does not hold, pending or not.
    let jump = json!({"worker": "wk-1", "status": "completed", "idempotency_key": "j", "attempt": 0});
    let (code, jumped) = s.call(reqwest::Method::POST, "/runs/pull/tasks/w2/update", Some(jump)).await;
    assert_eq!((code, jumped["error"]["code"].clone()), (409, json!("lease_lost")));
    let (code, shown) = s.call(reqwest::Method::GET, "/runs/pull/tasks/w1", None).await;
    assert_eq!((code, shown["task"]["result"].clone()), (200, json!("echo me")));
    let (code, missing) = s.call(reqwest::Method::GET, "/runs/pull/tasks/zz", None).await;
    assert_eq!((code, missing["error"]["code"].clone()), (404, json!("unknown_task")));
    // w2 (pending) ends at once; w3 is the worker's to end: its heartbeat says so (the lease
    // renewed), and its report, whatever it says, ends it cancelled.
    let (code, cancelled) = s.call(reqwest::Method::POST, "/runs/pull/cancel", Some(json!({"wait_ms": 0}))).await;
    assert_eq!((code, cancelled["cancelled"].clone(), cancelled["stopping"].clone()), (200, json!(1), json!(1)));
    let w3 = next["task"]["attempt"].as_i64().unwrap_or(0);
    let hb = json!({"worker": "wk-1", "attempt": w3, "ttl_ms": 60000});
    let (code, told) = s.call(reqwest::Method::POST, "/runs/pull/tasks/w3/heartbeat", Some(hb)).await;
    assert_eq!((code, told["error"]["code"].clone()), (409, json!("cancel_requested")), "{told}");
    let (_, shown) = s.call(reqwest::Method::GET, "/runs/pull/tasks/w3", None).await;
    assert_eq!(
        (shown["task"]["state"].as_str(), shown["task"]["cancel_requested"].as_str()),
        (Some("running"), Some("run cancelled over HTTP"))
    );
    let report =
        json!({"worker": "wk-1", "status": "completed", "idempotency_key": "k3", "attempt": w3, "result": "x"});
    let (code, ended) = s.call(reqwest::Method::POST, "/runs/pull/tasks/w3/update", Some(report)).await;
    assert_eq!(
        (code, ended["task"]["state"].clone(), ended["task"]["result"].clone()),
        (200, json!("cancelled"), Value::Null)
    );
}

#[tokio::test]
async fn submit_status_events_and_cancel_talk_to_the_server() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let s = server(Some(f.base_url())).await;
    let dir = must(tempfile::tempdir(), "dir");
    let plan = dir.path().join("plan.toml");
    must(std::fs::write(&plan, "[[tasks]]\nid = \"only\"\nprompt = \"hello\"\n"), "write plan");
    let o = cli(&s, &["submit", plan.to_str().unwrap_or_default(), "--run-id", "cli-run"]).await;
    assert_eq!(
        (o.status.code(), String::from_utf8_lossy(&o.stdout).trim().to_owned()),
        (Some(0), "cli-run".to_owned())
    );
    s.events_until(None, |e| e["task"] == "only" && e["to"] == "completed").await;
    // For a person by default, the same views as `pier runs` and `pier show`; JSON on request.
    let text = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let o = cli(&s, &["status"]).await;
    let listed = text(&o);
    assert!(listed.starts_with("RUN ") && listed.lines().nth(1).is_some_and(|l| l.starts_with("cli-run")), "{listed}");
    assert!(listed.contains("completed") && listed.contains("1 tasks  1 completed"), "{listed}");
    assert_eq!(text(&o), text(&cli(&s, &["runs"]).await), "pier runs reads the server PIER_SERVER names");
    let o = cli(&s, &["status", "cli-run"]).await;
    assert!(text(&o).lines().any(|l| l.starts_with("only") && l.contains("completed")), "{}", text(&o));
    let o = cli(&s, &["status", "cli-run", "--format", "json"]).await;
    let status: Value = must(serde_json::from_slice(&o.stdout), "status json");
    assert_eq!(status["tasks"][0]["state"], "completed", "{status}");
    let o = cli(&s, &["show", "cli-run", "only", "--server", &s.base]).await;
    assert!(text(&o).starts_with("task only of run cli-run: completed"), "{}", text(&o));
    assert!(text(&o).contains("agent: pier (pier "), "{}", text(&o));
    let o = cli(&s, &["cancel", "cli-run"]).await;
    assert_eq!(text(&o).trim(), "run cli-run: 0 unfinished task(s) cancelled");
    let o = cli(&s, &["cancel", "cli-run", "only"]).await;
    assert_eq!(text(&o).trim(), "task only of run cli-run is completed; there was nothing to cancel");
    let o = cli(&s, &["show", "nope", "--server", &s.base]).await;
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown_run"), "{}", String::from_utf8_lossy(&o.stderr));
    let o = cli(&s, &["events", "--run", "cli-run", "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let seqs: Vec<i64> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?["seq"].as_i64())
        .collect();
    assert!(seqs.len() > 4 && seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let o = cli(&s, &["cancel", "nope"]).await;
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown_run"));
    let o = Command::new(PIER).args(["status"]).env("PIER_TOKEN", "wrong").env("PIER_SERVER", &s.base).output().await;
    let o = must(o, "status");
    assert!(String::from_utf8_lossy(&o.stderr).contains("unauthorized"), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Leases the next task for `worker` (capability `echo`) with a lease of `ttl_ms`.
async fn lease(s: &Server, worker: &str, ttl_ms: i64) -> Value {
    let body = json!({"worker": worker, "capabilities": ["echo"], "ttl_ms": ttl_ms});
    let (code, leased) = s.call(reqwest::Method::POST, "/lease", Some(body)).await;
    assert_eq!(code, 200, "{leased}");
    leased
}

/// Run `run` of one task `w` for `worker:echo`, leased by `worker` for `ttl_ms`.
async fn one_worker_task(s: &Server, run: &str, worker: &str, ttl_ms: i64) -> Value {
    let plan = "[[tasks]]\nid = \"w\"\nagent = \"worker:echo\"\nprompt = \"p\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": run}))).await.0, 201);
    lease(s, worker, ttl_ms).await
}

fn report(leased: &Value, worker: &str, status: &str, key: &str, extra: Value) -> Value {
    let mut body = json!({
        "worker": worker, "attempt": leased["task"]["attempt"], "version": leased["task"]["version"],
        "status": status, "idempotency_key": key,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test]
async fn only_the_holder_of_the_live_lease_ends_a_task() {
    let f = must(FakeModel::start().await, "fake");
    f.push(pier_fake_model::Reply::Stream(vec![pier_fake_model::Step::Hang]));
    let s = server(Some(f.base_url())).await;
    let plan =
        "[[tasks]]\nid = \"w\"\nagent = \"worker:echo\"\nprompt = \"p\"\n\n[[tasks]]\nid = \"own\"\nprompt = \"p\"\n";
    let (code, _) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "f"}))).await;
    assert_eq!(code, 201);
    let leased = lease(&s, "wk-1", 60_000).await;
    let url = "/runs/f/tasks/w/update";
    let (code, refused) = s
        .call(
            reqwest::Method::POST,
            url,
            Some(report(&leased, "intruder", "completed", "k", json!({"result": "mine"}))),
        )
        .await;
    assert_eq!((code, refused["error"]["code"].clone()), (409, json!("lease_lost")), "{refused}");
    // pier's own agent runs `own`: nobody completes it over HTTP, whatever they read.
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "own started");
    let (_, own) = s.call(reqwest::Method::GET, "/runs/f/tasks/own", None).await;
    let forged = json!({
        "worker": own["task"]["lease_owner"], "attempt": own["task"]["attempt"], "version": own["task"]["version"],
        "status": "completed", "idempotency_key": "forged", "result": "forged",
    });
    let (code, refused) = s.call(reqwest::Method::POST, "/runs/f/tasks/own/update", Some(forged)).await;
    assert_eq!((code, refused["error"]["code"].clone()), (409, json!("not_a_worker_task")), "{refused}");
    let (_, own) = s.call(reqwest::Method::GET, "/runs/f/tasks/own", None).await;
    assert_eq!(own["task"]["state"], "running");
    let (code, done) = s
        .call(reqwest::Method::POST, url, Some(report(&leased, "wk-1", "completed", "k", json!({"result": "ok"}))))
        .await;
    assert_eq!((code, done["task"]["state"].clone()), (200, json!("completed")), "{done}");
}

#[tokio::test]
async fn an_idempotency_key_reused_with_another_body_is_refused() {
    let s = server(None).await;
    let leased = one_worker_task(&s, "i", "wk-1", 60_000).await;
    let url = "/runs/i/tasks/w/update";
    let first = report(&leased, "wk-1", "completed", "k1", json!({"result": "one"}));
    let (code, done) = s.call(reqwest::Method::POST, url, Some(first.clone())).await;
    assert_eq!(code, 200, "{done}");
    assert_eq!(s.call(reqwest::Method::POST, url, Some(first)).await, (200, done), "the same body replays");
    let other = report(&leased, "wk-1", "completed", "k1", json!({"result": "two"}));
    let (code, refused) = s.call(reqwest::Method::POST, url, Some(other)).await;
    assert_eq!((code, refused["error"]["code"].clone()), (409, json!("idempotency_conflict")), "{refused}");
    let (_, shown) = s.call(reqwest::Method::GET, "/runs/i/tasks/w", None).await;
    assert_eq!(shown["task"]["result"], "one");
}

#[tokio::test]
async fn a_dead_workers_lease_is_taken_back_within_the_lease_time() {
    let s = server(None).await;
    let leased = one_worker_task(&s, "d", "wk-dead", 1_000).await;
    let from = leased["task"]["version"].as_i64();
    // The worker never heartbeats: the host must act on the expiry by itself.
    let events = s
        .events_until(Some(0), |e| {
            e["type"] == "transition" && e["task"] == "w" && e["to"] == "pending" && e["from"] == "running"
        })
        .await;
    let back = events.last().cloned().unwrap_or_default();
    assert!(
        back["reason"].as_str().is_some_and(|r| r.contains("lease expired")),
        "{back} (leased at version {from:?})"
    );
    let again = lease(&s, "wk-2", 60_000).await;
    assert_eq!(again["task"]["attempt"], 2);
}

#[tokio::test]
async fn worker_failures_are_retried_by_class_and_bad_bodies_get_json_errors() {
    let s = server(None).await;
    let plan = "[defaults]\nmax_attempts = 3\n\n[[tasks]]\nid = \"p\"\nagent = \"worker:echo\"\nprompt = \"p\"\n\n\
                [[tasks]]\nid = \"b\"\nagent = \"worker:echo\"\nprompt = \"b\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "c"}))).await.0, 201);
    let first = lease(&s, "wk", 60_000).await;
    let second = lease(&s, "wk", 60_000).await;
    let (protocol, business) = if first["task"]["id"] == "p" { (first, second) } else { (second, first) };
    let url = |t: &str| format!("/runs/c/tasks/{t}/update");
    let body = report(&protocol, "wk", "failed", "x", json!({"error": "the agent wrote garbage", "class": "protocol"}));
    let (code, failed) = s.call(reqwest::Method::POST, &url("p"), Some(body)).await;
    assert_eq!((code, failed["task"]["state"].clone()), (200, json!("failed")), "a protocol error is a bug: {failed}");
    let body = report(&business, "wk", "failed", "y", json!({"error": "the model is down", "class": "business"}));
    let (code, retried) = s.call(reqwest::Method::POST, &url("b"), Some(body)).await;
    assert_eq!((code, retried["task"]["state"].clone()), (200, json!("pending")), "retried with backoff: {retried}");
    // A body that is not JSON, or not the right shape, gets the JSON error envelope.
    let resp = must(
        s.http
            .post(format!("{}{}", s.base, url("b")))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body("{not json")
            .send()
            .await,
        "send",
    );
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = must(serde_json::from_str(&must(resp.text().await, "text")), "a JSON error body");
    assert_eq!(v["error"]["code"], "bad_request", "{v}");
    let (code, v) = s.call(reqwest::Method::POST, &url("b"), Some(json!({"status": 7}))).await;
    assert_eq!((code, v["error"]["code"].clone()), (400, json!("bad_request")), "{v}");
}

#[tokio::test]
async fn a_question_open_when_a_person_cancels_the_task_is_answered_cancelled() {
    let s = server(None).await;
    let agent = sdk_agent();
    let plan = format!("[[tasks]]\nid = \"cfg\"\nagent = \"{agent}\"\nprompt = \"fix the config\"\n");
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "x"}))).await.0, 201);
    let before = s.events_until(Some(0), |e| e["type"] == "question").await;
    let last = before.last().and_then(|e| e["seq"].as_i64());
    let (code, _) = s.call(reqwest::Method::POST, "/runs/x/tasks/cfg/cancel", Some(json!({}))).await;
    assert_eq!(code, 200);
    let after = s.events_until(last, |e| e["type"] == "permission").await;
    let answer = after.last().cloned().unwrap_or_default();
    assert_eq!(answer["outcome"]["outcome"], "cancelled", "R088: {answer}");
}

/// Seed 001 §3.5: stopping a running task is graceful and at once; what it did is kept.
/// Issue #35.1: the cancel's answer, and every read from the moment of the cancel on, that
/// sees the task ended sees its attempt's output too (they were seen apart 3 times in 3).
#[tokio::test]
async fn a_running_task_cancelled_over_http_ends_at_once_with_its_partial_output() {
    use pier_fake_model::{Gate, Reply, Step};
    let f = must(FakeModel::start().await, "fake");
    let never = Gate::new();
    f.set_fallback(move |_| {
        Reply::Stream(vec![
            Step::Text("half of ".into()),
            Step::Text("the answer".into()),
            Step::Gate(never.clone()),
            Step::Text(" and the rest".into()),
            Step::Finish("stop".into()),
            Step::Done,
        ])
    });
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"long\"\nprompt = \"a long job\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "stop"}))).await.0, 201);
    s.events_until(Some(0), |e| {
        e["type"] == "session_update" && e["update"]["content"]["text"].as_str() == Some("the answer")
    })
    .await;
    // A reader in a tight loop from before the cancel until it sees the task ended.
    let reader = {
        let (http, url) = (s.http.clone(), format!("{}/runs/stop/tasks/long", s.base));
        tokio::spawn(async move {
            let mut reads = 0;
            loop {
                let shown: Value = match http.get(&url).bearer_auth(TOKEN).send().await {
                    Ok(r) => serde_json::from_str(&r.text().await.unwrap_or_default()).unwrap_or_default(),
                    Err(e) => panic!("a read failed: {e}"),
                };
                reads += 1;
                if shown["task"]["state"] == "cancelled" {
                    return (reads, shown);
                }
            }
        })
    };
    let cancelled_at = std::time::Instant::now();
    let (code, answered) = s.call(reqwest::Method::POST, "/runs/stop/tasks/long/cancel", Some(json!({}))).await;
    let took = cancelled_at.elapsed();
    assert_eq!((code, answered["task"]["state"].as_str()), (200, Some("cancelled")), "{answered}");
    assert!(took < std::time::Duration::from_secs(1), "the attempt ended {took:?} after the cancel");
    let (reads, seen) = must(tokio::time::timeout(LIMIT, reader).await, "the reader saw the ending")
        .unwrap_or_else(|e| panic!("the reader: {e}"));
    assert_eq!(
        seen["attempts"][0]["output"]["text"], "half of the answer",
        "read {reads}: ended without output: {seen}"
    );
    let (_, shown) = s.call(reqwest::Method::GET, "/runs/stop/tasks/long", None).await;
    assert_eq!(shown["task"]["cancel_requested"], Value::Null, "{shown}");
    let transitions = s.events_until(Some(0), |e| e["to"] == "cancelled").await;
    let ended = transitions.last().cloned().unwrap_or_default();
    assert_eq!(ended["reason"], "cancelled over HTTP", "{ended}");
}

/// Seed 001 §3.1, §3.3: a worker gets only tasks whose requirements it meets, and with the
/// lease the task's requirements, metadata and prompt.
#[tokio::test]
async fn a_pull_worker_gets_only_tasks_it_can_do_with_their_requirements_and_metadata() {
    let s = server(None).await;
    let plan = "[[tasks]]\nid = \"train\"\nagent = \"worker:gpu\"\nprompt = \"train the model\"\nrequires = [\"cuda\"]\n\
                metadata = { owner = \"ml\" }\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "w"}))).await.0, 201);
    let body = |caps: Value| json!({"worker": "w1", "capabilities": caps, "ttl_ms": 10_000});
    let (code, _) = s.call(reqwest::Method::POST, "/lease", Some(body(json!(["gpu"])))).await;
    assert_eq!(code, 204, "a worker without cuda gets nothing");
    let (code, leased) = s.call(reqwest::Method::POST, "/lease", Some(body(json!(["gpu", "cuda"])))).await;
    assert_eq!(code, 200, "{leased}");
    assert_eq!(leased["prompt"], "train the model");
    assert_eq!(leased["task"]["spec"]["requires"], json!(["cuda"]));
    assert_eq!(leased["task"]["spec"]["metadata"], json!({"owner": "ml"}));
}

#[tokio::test]
async fn a_plan_needing_what_its_agent_lacks_is_a_bad_plan_and_agents_shows_why() {
    let s = server(None).await;
    let agent = sdk_agent();
    let plan = format!("[[tasks]]\nid = \"pic\"\nagent = \"{agent}\"\nprompt = \"look\"\nrequires = [\"audio\"]\n");
    let (code, body) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan}))).await;
    assert_eq!(code, 400, "{body}");
    assert_eq!(body["error"]["code"], "bad_plan", "{body}");
    let problems = body["error"].to_string();
    assert!(problems.contains("requires `audio`") && problems.contains("\"line\":1"), "{body}");
    let (code, agents) = s.call(reqwest::Method::GET, "/agents", None).await;
    assert_eq!(code, 200);
    let sdk = &agents["agents"][0];
    assert_eq!(sdk["spec"], agent.as_str(), "{agents}");
    assert!(sdk["init"]["agentCapabilities"].is_object(), "{agents}");
}

async fn task_result(s: &Server, run: &str, task: &str) -> Value {
    s.events_until(Some(0), |e| e["task"] == task && e["type"] == "transition" && e["to"] == "completed").await;
    s.call(reqwest::Method::GET, &format!("/runs/{run}/tasks/{task}"), None).await.1
}

/// Seed 001 §3.5: a message to a running task waits for its turn to end, then goes to the
/// agent on the same session; the task's result is the last answer.
#[tokio::test]
async fn a_queued_message_is_the_next_prompt_of_the_same_session() {
    use pier_fake_model::{Gate, Reply, Step};
    let f = must(FakeModel::start().await, "fake");
    let gate = Gate::new();
    let g = gate.clone();
    f.set_fallback(move |body| match user_messages(body).last().map(String::as_str) {
        Some("write a long essay") => Reply::Stream(vec![
            Step::Text("a very long draft".into()),
            Step::Gate(g.clone()),
            Step::Finish("stop".into()),
            Step::Done,
        ]),
        Some("make it shorter") => Reply::text("short"),
        other => Reply::text(&format!("unexpected {other:?}")),
    });
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"essay\"\nprompt = \"write a long essay\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "m"}))).await.0, 201);
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "the first turn runs");
    let (code, said) =
        s.call(reqwest::Method::POST, "/runs/m/tasks/essay/messages", Some(json!({"text": "make it shorter"}))).await;
    assert_eq!(code, 201, "{said}");
    gate.open();
    let shown = task_result(&s, "m", "essay").await;
    assert_eq!(shown["task"]["result"], "short", "{shown}");
    // The same session: the second request carries the first turn.
    let last = f.requests().pop().map(|r| r.body).unwrap_or_default();
    assert_eq!(user_messages(&last), vec!["write a long essay", "make it shorter"]);
    let events = s.events_until(Some(0), |e| e["type"] == "message_sent").await;
    let message = events.iter().find(|e| e["type"] == "message").cloned().unwrap_or_default();
    assert_eq!((message["text"].as_str(), message["interrupt"].as_bool()), (Some("make it shorter"), Some(false)));
    // A task that has ended takes no message.
    let (code, refused) =
        s.call(reqwest::Method::POST, "/runs/m/tasks/essay/messages", Some(json!({"text": "more"}))).await;
    assert_eq!((code, refused["error"]["code"].as_str()), (409, Some("not_running")), "{refused}");
}

#[tokio::test]
async fn an_interrupting_message_cancels_the_turn_and_goes_at_once() {
    use pier_fake_model::{Gate, Reply, Step};
    let f = must(FakeModel::start().await, "fake");
    let never = Gate::new();
    f.set_fallback(move |body| match user_messages(body).last().map(String::as_str) {
        Some("count to a million") => {
            Reply::Stream(vec![Step::Text("1, 2, 3".into()), Step::Gate(never.clone()), Step::Done])
        }
        Some("stop counting, just say done") => Reply::text("done"),
        other => Reply::text(&format!("unexpected {other:?}")),
    });
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"count\"\nprompt = \"count to a million\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "i"}))).await.0, 201);
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "the first turn runs");
    let body = json!({"text": "stop counting, just say done", "interrupt": true});
    let (code, said) = s.call(reqwest::Method::POST, "/runs/i/tasks/count/messages", Some(body)).await;
    assert_eq!(code, 201, "{said}");
    let shown = task_result(&s, "i", "count").await;
    assert_eq!(shown["task"]["result"], "done", "{shown}");
    assert_eq!(shown["task"]["attempt"], 1, "the same attempt went on: {shown}");
}

/// Seed 001 §3.5: a question from the agent is answered over HTTP, checked against its fields.
#[tokio::test]
async fn an_agents_question_is_answered_over_http() {
    let s = server(None).await;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/elicit_agent.py");
    let record = tempfile::NamedTempFile::new().map(|f| f.into_temp_path()).unwrap_or_else(|e| panic!("{e}"));
    let plan = format!(
        "[[tasks]]\nid = \"q\"\nagent = \"env ELICIT_RECORD={} python3 {}\"\nprompt = \"labels\"\n",
        record.display(),
        script.display()
    );
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "h"}))).await.0, 201);
    s.events_until(Some(0), |e| e["type"] == "question").await;
    let bad = json!({"content": {"name": "Ada", "count": 99}});
    let (code, body) = s.call(reqwest::Method::POST, "/runs/h/tasks/q/answer", Some(bad)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (400, Some("bad_request")), "{body}");
    let good = json!({"content": {"name": "Ada", "count": 2}});
    let (code, body) = s.call(reqwest::Method::POST, "/runs/h/tasks/q/answer", Some(good)).await;
    assert_eq!(code, 200, "{body}");
    let shown = task_result(&s, "h", "q").await;
    let result = shown["task"]["result"].as_str().unwrap_or_default();
    assert_eq!(result, r#"got: {"action": "accept", "content": {"count": 2, "name": "Ada"}}"#, "{shown}");
}

#[tokio::test]
async fn a_message_to_a_pull_worker_task_is_queued_for_its_worker_to_take() {
    let s = server(None).await;
    let leased = one_worker_task(&s, "pw", "w1", 10_000).await;
    let (code, body) = s.call(reqwest::Method::POST, "/runs/pw/tasks/w/messages", Some(json!({"text": "hello"}))).await;
    assert_eq!(code, 201, "{body}");
    let n = leased["task"]["attempt"].as_i64().unwrap_or_default();
    let path = format!("/v1/runs/pw/tasks/w/attempts/{n}/messages");
    let (code, taken) = s.call(reqwest::Method::POST, &path, Some(json!({"worker": "w1"}))).await;
    assert_eq!((code, taken["messages"][0]["text"].as_str()), (200, Some("hello")), "{taken}");
    let (_, again) = s.call(reqwest::Method::POST, &path, Some(json!({"worker": "w1"}))).await;
    assert_eq!(again["messages"], json!([]), "taken once: {again}");
}

/// A task's inbox holds 100 unsent messages: the next is refused with 429 and nothing is
/// queued, until its agent takes them.
#[tokio::test]
async fn a_full_inbox_refuses_more_messages_until_they_are_taken() {
    let s = server(None).await;
    let leased = one_worker_task(&s, "in", "w1", 60_000).await;
    for i in 0..100 {
        let (code, body) =
            s.call(reqwest::Method::POST, "/runs/in/tasks/w/messages", Some(json!({"text": format!("m{i}")}))).await;
        assert_eq!(code, 201, "{i}: {body}");
    }
    let (code, body) =
        s.call(reqwest::Method::POST, "/runs/in/tasks/w/messages", Some(json!({"text": "one more"}))).await;
    assert_eq!((code, body["error"]["code"].as_str()), (429, Some("too_many_requests")), "{body}");
    let n = leased["task"]["attempt"].as_i64().unwrap_or_default();
    let path = format!("/v1/runs/in/tasks/w/attempts/{n}/messages");
    let (_, taken) = s.call(reqwest::Method::POST, &path, Some(json!({"worker": "w1"}))).await;
    assert_eq!(taken["messages"].as_array().map(Vec::len), Some(100), "the refused one was not queued");
    let (code, _) = s.call(reqwest::Method::POST, "/runs/in/tasks/w/messages", Some(json!({"text": "now"}))).await;
    assert_eq!(code, 201);
}

/// A guessable token is refused on any address but loopback (before anything listens), and
/// on loopback starts with a warning.
#[tokio::test]
async fn a_weak_token_is_refused_off_loopback() {
    let dir = must(tempfile::tempdir(), "dir");
    let o = Command::new(PIER)
        .args(["serve", "--listen", "0.0.0.0:0", "--token", "tok123"])
        .current_dir(dir.path())
        .env("PIER_HOME", dir.path().join("data"))
        .stdin(Stdio::null())
        .output();
    let o = must(must(tokio::time::timeout(LIMIT, o).await, "in time"), "run");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("under 128") && err.contains("openssl rand -hex 16"), "{err}");
    assert!(!dir.path().join("data/pier.db").exists(), "refused before the store was touched");
}

/// Wrong tokens from one address: ten at once, then 429 with `Retry-After` for every
/// request from it, the right token too (a throttled guess learns nothing); requests
/// without a credential are not guesses, and the dashboard's login counts the same way.
#[tokio::test]
async fn guessing_the_token_is_throttled_per_address() {
    let s = server(None).await;
    let get = |auth: Option<String>| {
        let mut req = s.http.get(format!("{}/runs", s.base));
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        async move { must(must(tokio::time::timeout(LIMIT, req.send()).await, "in time"), "send") }
    };
    for _ in 0..20 {
        assert_eq!(get(None).await.status().as_u16(), 401, "no credential is no guess");
    }
    let login = |token: &'static str| {
        let req = s.http.post(format!("{}/ui/login", s.base)).form(&[("token", token)]);
        async move { must(must(tokio::time::timeout(LIMIT, req.send()).await, "in time"), "send").status().as_u16() }
    };
    assert_eq!(login("not-it").await, 401);
    for i in 1..10 {
        assert_eq!(get(Some("Bearer guess".into())).await.status().as_u16(), 401, "guess {i}");
    }
    let throttled = get(Some("Bearer guess".into())).await;
    assert_eq!(throttled.status().as_u16(), 429);
    let retry: u64 = throttled
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_default();
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    let body: Value = must(serde_json::from_str(&must(throttled.text().await, "text")), "json");
    assert_eq!(body["error"]["code"], "too_many_requests");
    assert_eq!(get(Some(format!("Bearer {TOKEN}"))).await.status().as_u16(), 429, "the right token waits too");
    assert_eq!(login(TOKEN).await, 429, "and so does the login form");
}

#[tokio::test]
async fn every_error_is_the_json_envelope_with_a_documented_code() {
    let s = server(None).await;
    let send = |req: reqwest::RequestBuilder| async move {
        let resp = must(must(tokio::time::timeout(LIMIT, req.bearer_auth(TOKEN).send()).await, "in time"), "send");
        let status = resp.status().as_u16();
        let text = must(resp.text().await, "body");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not the JSON envelope ({e}): {text:?}"));
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        (status, v["error"]["code"].as_str().unwrap_or_default().to_owned())
    };
    let url = |p: &str| format!("{}{p}", s.base);
    let cases = [
        (s.http.get(url("/no/such/route")), 404, "not_found"),
        (s.http.delete(url("/runs")), 405, "method_not_allowed"),
        (s.http.post(url("/runs")).header("content-type", "text/plain").body("plan"), 415, "unsupported_media_type"),
        (s.http.post(url("/runs")).body("{}"), 415, "unsupported_media_type"),
        (s.http.post(url("/runs")).header("content-type", "application/json").body("{oops"), 400, "bad_request"),
        (
            s.http.post(url("/runs")).header("content-type", "application/json").body("{\"plan\": 7}"),
            400,
            "bad_request",
        ),
        (
            // A client of its own: the server answers before reading the body and closes that
            // connection, which a shared pool would hand to the next request.
            reqwest::Client::new()
                .post(url("/lease"))
                .header("content-type", "application/json")
                .body(vec![b' '; 3 << 20]),
            413,
            "too_large",
        ),
        (s.http.get(url("/runs/%FF%FE")), 400, "bad_request"),
        (s.http.get(url("/events?after=x")), 400, "bad_request"),
        (s.http.get(url("/runs/nope")), 404, "unknown_run"),
    ];
    for (req, status, code) in cases {
        assert_eq!(send(req).await, (status, code.to_owned()));
    }
}

#[test]
fn the_readme_lists_every_error_code_with_its_status() {
    let readme = must(std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")), "README");
    for code in pier_host::ErrorCode::ALL {
        let row = format!("| `{code}` | {} |", pier_server::status_of(code).as_u16());
        assert!(readme.contains(&row), "README's error table lacks {row}");
    }
}

#[tokio::test]
async fn a_failed_task_retried_over_http_runs_again_on_the_server() {
    let f = must(FakeModel::start().await, "fake");
    f.push(pier_fake_model::Reply::Stream(vec![
        pier_fake_model::Step::Finish("content_filter".into()),
        pier_fake_model::Step::Done,
    ]));
    f.set_fallback(echo);
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"a\"\nprompt = \"hello\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "rt"}))).await.0, 201);
    s.events_until(None, |e| e["task"] == "a" && e["to"] == "failed").await;
    // A running or completed task cannot be retried: 409 bad_transition, after the retry too.
    let o = cli(&s, &["retry", "rt", "a"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("task a of run rt: pending again (attempt 2 next)"));
    s.events_until(None, |e| e["task"] == "a" && e["to"] == "completed").await;
    assert_eq!(task_result(&s, "rt", "a").await["task"]["attempt"], 2);
    let (code, v) = s.call(reqwest::Method::POST, "/runs/rt/tasks/a/retry", None).await;
    assert_eq!((code, v["error"]["code"].as_str()), (409, Some("bad_transition")), "{v}");
}

#[tokio::test]
async fn metrics_are_prometheus_text_behind_the_token_or_on_their_own_address() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let (s, metrics_url) = server_with(Some(f.base_url()), &["--metrics-listen", "127.0.0.1:0"]).await;
    let plan = "[[tasks]]\nid = \"a\"\nprompt = \"hello\"\n\n[[tasks]]\nid = \"w\"\nagent = \"worker:echo\"\nprompt = \"p\"\n\n[defaults]\nmax_attempts = 2\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "m"}))).await.0, 201);
    s.events_until(None, |e| e["task"] == "a" && e["to"] == "completed").await;
    // A worker's business failure is retried: counted by class.
    let leased = lease(&s, "wk", 60_000).await;
    let body = report(&leased, "wk", "failed", "k1", json!({"error": "down", "class": "business"}));
    assert_eq!(s.call(reqwest::Method::POST, "/runs/m/tasks/w/update", Some(body)).await.0, 200);
    // An SSE client is counted while it is connected.
    let sse = must(s.http.get(format!("{}/events", s.base)).bearer_auth(TOKEN).send().await, "sse");
    let scrape = |url: String, token: bool| {
        let req = s.http.get(url);
        let req = if token { req.bearer_auth(TOKEN) } else { req };
        async move {
            let resp = must(must(tokio::time::timeout(LIMIT, req.send()).await, "in time"), "send");
            let status = resp.status().as_u16();
            let ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            (status, ctype, must(resp.text().await, "text"))
        }
    };
    let (status, ctype, text) = scrape(format!("{}/metrics", s.base), true).await;
    assert_eq!(status, 200, "{text}");
    assert!(ctype.starts_with("text/plain"), "{ctype}");
    for line in [
        "pier_tasks{state=\"completed\"} 1",
        "pier_tasks{state=\"pending\"} 1",
        "pier_tasks{state=\"failed\"} 0",
        "pier_attempts_total 2",
        "pier_retries_total{class=\"business\"} 1",
        "pier_sse_clients 1",
        "pier_agent_processes 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    assert!(text.lines().any(|l| l.starts_with("pier_events_total ")), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("pier_http_request_duration_seconds_bucket{")
            && l.contains("route=\"/runs\"")
            && l.contains("method=\"POST\"")
            && l.contains("status=\"201\"")),
        "{text}"
    );
    drop(sse);
    // Without the token on the API address: refused; on the metrics address: served.
    assert_eq!(scrape(format!("{}/metrics", s.base), false).await.0, 401);
    let url = metrics_url.unwrap_or_else(|| panic!("no metrics address"));
    let (status, _, text) = scrape(url.clone(), false).await;
    assert_eq!(status, 200);
    assert!(text.contains("pier_tasks{state=\"completed\"} 1"), "{text}");
    // Only /metrics lives there.
    let (status, _, _) = scrape(url.replace("/metrics", "/runs"), false).await;
    assert_eq!(status, 404);
}

/// A worker's report carries what its agent spent: recorded as `model_request` events with
/// the ending in one commit, priced from pier.toml where the worker gave no cost, counted once
/// however often the report is repeated; bad usage is refused with nothing written.
#[tokio::test]
async fn a_worker_s_report_carries_its_usage_once() {
    let toml = "[prices.\"m-priced\"]\ninput = 1.0\noutput = 2.0\n";
    let (s, _) = support::serve::server_configured(None, &[], Some(toml)).await;
    let leased = one_worker_task(&s, "wu", "wk", 60_000).await;
    let bad = report(&leased, "wk", "completed", "k0", json!({"result": "r", "usage": {"model": "m", "cost": -1.0}}));
    let (code, v) = s.call(reqwest::Method::POST, "/runs/wu/tasks/w/update", Some(bad)).await;
    assert_eq!((code, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    let (_, t) = s.call(reqwest::Method::GET, "/runs/wu/tasks/w", None).await;
    assert_eq!(t["task"]["state"], "running", "nothing was written: {t}");
    assert!(t["spend"].is_null(), "{t}");
    let usage = json!([
        {"provider": "anthropic", "model": "m-priced", "input": 1_000_000, "output": 500_000},
        {"provider": "anthropic", "model": "m-own", "input": 10, "cached_input": 4, "output": 5, "reasoning": 2, "cost": 0.5},
    ]);
    let body = report(&leased, "wk", "completed", "k1", json!({"result": "done", "usage": usage}));
    for _ in 0..2 {
        let (code, v) = s.call(reqwest::Method::POST, "/runs/wu/tasks/w/update", Some(body.clone())).await;
        assert_eq!(code, 200, "{v}");
    }
    let (_, t) = s.call(reqwest::Method::GET, "/runs/wu/tasks/w", None).await;
    assert_eq!(t["task"]["state"], "completed", "{t}");
    let spend = &t["spend"];
    assert_eq!(spend["requests"], 2, "a repeated report counts once: {spend}");
    assert_eq!(spend["tokens"]["input"], 1_000_010, "{spend}");
    assert_eq!(spend["by_model"]["m-priced"]["cost"].as_f64(), Some(2.0), "{spend}");
    assert_eq!(spend["by_model"]["m-own"]["cost"].as_f64(), Some(0.5), "{spend}");
    assert_eq!(spend["by_provider"]["anthropic"]["requests"], 2, "{spend}");
    assert_eq!(spend["by_node"]["worker:wk"]["requests"], 2, "{spend}");
    assert_eq!(spend["by_agent"]["worker:echo"]["requests"], 2, "{spend}");
    let (_, run) = s.call(reqwest::Method::GET, "/runs/wu", None).await;
    assert_eq!(run["spend"]["cost"].as_f64(), Some(2.5), "{run}");
}

/// A finite read of `/events?QUERY` (`follow=false`): the events, or the error's status and body.
async fn events_of(s: &Server, query: &str) -> Result<Vec<Value>, (u16, Value)> {
    let url = format!("{}/events?follow=false&{query}", s.base);
    let resp =
        must(must(tokio::time::timeout(LIMIT, s.http.get(url).bearer_auth(TOKEN).send()).await, "in time"), "send");
    let status = resp.status().as_u16();
    let text = must(must(tokio::time::timeout(LIMIT, resp.text()).await, "in time"), "body");
    if status != 200 {
        return Err((status, serde_json::from_str(&text).unwrap_or(Value::Null)));
    }
    let mut sse = SseDecoder::new(1 << 20);
    Ok(sse.push(text.as_bytes()).unwrap_or_default().iter().map(|d| must(serde_json::from_str(d), "event")).collect())
}

/// Issue #34: `/events` filters by task, type and time on the server, and merges an agent's
/// text deltas per message on request (the log keeps every delta); `pier events --server`
/// asks the server for what it prints.
#[tokio::test]
async fn events_are_filtered_and_deltas_merged_by_the_server() {
    let f = must(FakeModel::start().await, "fake");
    let said = "The answer comes in several small deltas, one message.";
    f.set_fallback(move |_| pier_fake_model::Reply::text(said));
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"a\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\ndepends_on = [\"a\"]\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "ev"}))).await.0, 201);
    s.events_until(None, |e| e["task"] == "b" && e["to"] == "completed").await;

    let chunks = |events: &[Value]| -> Vec<Value> {
        events.iter().filter(|e| e["update"]["sessionUpdate"] == "agent_message_chunk").cloned().collect()
    };
    let raw = must(events_of(&s, "run=ev&task=a").await.map_err(|e| format!("{e:?}")), "raw");
    assert!(raw.iter().all(|e| e["task"] == "a"), "only task a");
    let deltas = chunks(&raw);
    assert!(deltas.len() > 3, "the log keeps every delta: {}", deltas.len());
    let text: String = deltas.iter().filter_map(|e| e["update"]["content"]["text"].as_str()).collect();
    assert_eq!(text, said);

    let merged = must(events_of(&s, "run=ev&task=a&merge=deltas").await.map_err(|e| format!("{e:?}")), "merged");
    let one = chunks(&merged);
    assert_eq!(one.len(), 1, "one event for the message: {one:#?}");
    assert_eq!(one[0]["update"]["content"]["text"], said);
    assert_eq!(one[0]["merged"].as_u64(), Some(deltas.len() as u64));
    assert_eq!(
        (one[0]["first_seq"].clone(), one[0]["seq"].clone()),
        (deltas[0]["seq"].clone(), deltas[deltas.len() - 1]["seq"].clone())
    );
    assert_eq!(merged.len(), raw.len() - deltas.len() + 1, "nothing else is merged");

    let typed = must(events_of(&s, "run=ev&type=transition,run_created").await.map_err(|e| format!("{e:?}")), "typed");
    assert!(
        typed.iter().all(|e| e["type"] == "transition" || e["type"] == "run_created") && typed.len() >= 5,
        "{typed:#?}"
    );
    let later = must(events_of(&s, "run=ev&since=2999-01-01T00:00:00Z").await.map_err(|e| format!("{e:?}")), "later");
    assert!(later.is_empty(), "nothing is from the future");
    let recent = must(events_of(&s, "run=ev&since=1h").await.map_err(|e| format!("{e:?}")), "recent");
    assert_eq!(recent.len(), must(events_of(&s, "run=ev").await.map_err(|e| format!("{e:?}")), "all").len());
    let Err((code, v)) = events_of(&s, "since=yesterday").await else { panic!("a bad since is refused") };
    assert_eq!((code, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    let Err((code, _)) = events_of(&s, "merge=all").await else { panic!("a bad merge is refused") };
    assert_eq!(code, 400);

    let o = cli(&s, &["events", "--run", "ev", "--task", "b", "--type", "transition", "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<Value> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| must(serde_json::from_str(l), "json")).collect();
    assert!(!lines.is_empty() && lines.iter().all(|e| e["task"] == "b" && e["type"] == "transition"), "{lines:#?}");
    let o = cli(&s, &["events", "--run", "ev", "--merge-deltas", "--task", "a", "--format", "json"]).await;
    let merged_cli = String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.contains("agent_message_chunk")).count();
    assert_eq!(merged_cli, 1, "{}", String::from_utf8_lossy(&o.stdout));
}
