//! Issue #32 end to end: task types declared in pier.toml, ad-hoc tasks of a type submitted
//! from the CLI and over HTTP, their input checked (every problem at once, nothing stored) and
//! rendered into the prompt the agent is given and `pier show` prints.

mod support;

use std::process::Stdio;

use pier_fake_model::FakeModel;
use serde_json::json;
use support::serve::{TOKEN, cli, server_configured};
use support::{LIMIT, echo, must};
use tokio::process::Command;

const PIER: &str = env!("CARGO_BIN_EXE_pier");

const TYPES: &str = r#"
[types.greet]
prompt = "Say hello to {{input.who}}, {{input.times}} times."
priority = 3
concurrency = [{ key = "greeter:{input.who}", limit = 1 }]
input = { type = "object", required = ["who", "times"], additionalProperties = false, properties = { who = { type = "string", minLength = 1 }, times = { type = "integer", minimum = 1 } } }
"#;

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[tokio::test]
async fn a_task_of_a_declared_type_is_submitted_checked_rendered_and_shown() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let (s, _) = server_configured(Some(f.base_url()), &[], Some(TYPES)).await;

    let o =
        cli(&s, &["submit", "--type", "greet", "--input", "who=world", "--input", "times=2", "--run-id", "g1"]).await;
    assert_eq!((o.status.code(), String::from_utf8_lossy(&o.stdout).trim()), (Some(0), "g1"), "{}", text(&o));
    s.events_until(None, |e| e["task"] == "greet" && e["to"] == "completed").await;
    let asked: Vec<String> = f.requests().iter().map(|r| r.body.to_string()).collect();
    assert!(
        asked.iter().any(|b| b.contains("Say hello to world, 2 times.")),
        "the agent got the rendered prompt: {asked:?}"
    );
    let shown = text(&cli(&s, &["show", "g1", "greet"]).await);
    for line in
        ["type: greet, input {\"times\":2,\"who\":\"world\"}", "priority: 3", "concurrency: greeter:world (limit 1)"]
    {
        assert!(shown.contains(line), "`{line}` in:\n{shown}");
    }
    assert!(shown.contains("prompt:\n  Say hello to world, 2 times."), "{shown}");

    // Over HTTP, with the task's own id and priority.
    let body =
        json!({"type": "greet", "input": {"who": "http", "times": 1}, "priority": 7, "task_id": "h", "run_id": "g2"});
    let (code, answer) = s.call(reqwest::Method::POST, "/runs", Some(body)).await;
    assert_eq!((code, &answer["run"]), (201, &json!("g2")), "{answer}");
    let (_, task) = s.call(reqwest::Method::GET, "/runs/g2/tasks/h", None).await;
    assert_eq!(task["task"]["spec"]["priority"], 7, "{task}");
    assert_eq!(task["task"]["spec"]["prompt"], "Say hello to http, 1 times.", "{task}");
}

#[tokio::test]
async fn a_bad_input_is_refused_with_every_field_and_nothing_is_stored() {
    let (s, _) = server_configured(None, &[], Some(TYPES)).await;
    let body = json!({"type": "greet", "input": {"who": "", "times": "x", "extra": 1}, "run_id": "bad"});
    let (code, answer) = s.call(reqwest::Method::POST, "/runs", Some(body)).await;
    assert_eq!(code, 400, "{answer}");
    let said = answer.to_string();
    for part in ["/who", "/times", "extra", "task `greet`"] {
        assert!(said.contains(part), "`{part}` in {said}");
    }
    let o = cli(&s, &["submit", "--type", "nope", "--input", "a=1"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("unknown type `nope` (declared: greet)"), "{}", text(&o));
    let o = cli(&s, &["submit", "--type", "greet", "--input", "who=x", "--priority", "12"]).await;
    assert!(text(&o).contains("priority = 12") && text(&o).contains("times"), "both problems at once: {}", text(&o));
    let (code, answer) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": "x", "type": "greet"}))).await;
    assert_eq!(code, 400, "{answer}");
    let (_, runs) = s.call(reqwest::Method::GET, "/runs", None).await;
    assert_eq!(runs["runs"], json!([]), "nothing was stored: {runs}");
}

#[tokio::test]
async fn a_type_that_cannot_hold_stops_the_server_at_start_naming_it() {
    let dir = must(tempfile::tempdir(), "dir");
    must(
        std::fs::write(
            dir.path().join("pier.toml"),
            "[types.t]\nprompt = \"{{input.x}}\"\ninput = { type = \"object\", properties = { y = { type = \"string\" } } }\n",
        ),
        "toml",
    );
    let o = Command::new(PIER)
        .args(["serve", "--listen", "127.0.0.1:0", "--token", TOKEN])
        .current_dir(dir.path())
        .env("HOME", dir.path())
        .env("PIER_HOME", dir.path().join("data"))
        .stdin(Stdio::null())
        .output();
    let o = must(must(tokio::time::timeout(LIMIT, o).await, "serve in time"), "serve");
    assert_ne!(o.status.code(), Some(0));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(said.contains("[types]") && said.contains("type `t`") && said.contains("`x`"), "{said}");
}

#[tokio::test]
async fn tasks_of_one_key_in_two_runs_all_run_one_at_a_time() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let (s, _) = server_configured(Some(f.base_url()), &["--concurrency", "4"], None).await;
    for run in ["k1", "k2"] {
        let plan: String = (0..4)
            .map(|i| {
                format!(
                    "[[tasks]]\nid = \"{run}-{i}\"\nprompt = \"p\"\nconcurrency = [{{ key = \"one\", limit = 1 }}]\n\n"
                )
            })
            .collect();
        let (code, answer) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": run}))).await;
        assert_eq!(code, 201, "{answer}");
    }
    let mut done = 0;
    let log = s
        .events_until(None, |e| {
            done += usize::from(e["type"] == "transition" && e["to"] == "completed");
            done == 8
        })
        .await;
    let mut live = 0;
    for e in log.iter().filter(|e| e["type"] == "transition") {
        match (e["from"].as_str(), e["to"].as_str()) {
            (Some("pending"), Some("running")) => live += 1,
            (Some("running"), _) => live -= 1,
            _ => {}
        }
        assert!(live <= 1, "two tasks of key `one` ran at once: {log:?}");
    }
}

#[tokio::test]
async fn a_task_waiting_for_a_full_key_says_so_and_workers_cannot_lease_past_it() {
    let (s, _) = server_configured(None, &[], None).await;
    let plan: String = ["first", "second"]
        .iter()
        .map(|id| {
            format!(
                "[[tasks]]\nid = \"{id}\"\nagent = \"worker:echo\"\nprompt = \"p\"\n\
                 concurrency = [{{ key = \"repo:foo\", limit = 1 }}]\n\n"
            )
        })
        .collect();
    let (code, answer) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "w"}))).await;
    assert_eq!(code, 201, "{answer}");
    let lease = json!({"worker": "w1", "capabilities": ["echo"], "ttl_ms": 60_000});
    let (code, leased) = s.call(reqwest::Method::POST, "/lease", Some(lease.clone())).await;
    assert_eq!((code, &leased["task"]["id"]), (200, &json!("first")), "{leased}");
    let (code, none) = s.call(reqwest::Method::POST, "/lease", Some(lease)).await;
    assert_eq!(code, 204, "a worker leased past the key's limit: {none}");
    let shown = text(&cli(&s, &["show", "w", "second"]).await);
    assert!(shown.contains("waiting for concurrency key repo:foo: 1 of 1 running"), "{shown}");
    let (_, task) = s.call(reqwest::Method::GET, "/runs/w/tasks/second", None).await;
    assert_eq!(task["keys"], json!([{"key": "repo:foo", "limit": 1, "running": 1}]), "{task}");
}

/// A plan uses the types of the `types.toml` beside it (submitted with it), and `--priority`
/// at submit puts every task of the plan at that priority, over what the plan says.
#[tokio::test]
async fn a_plan_uses_the_types_beside_it_and_a_priority_given_at_submit() {
    let (s, _) = server_configured(None, &[], None).await;
    let dir = must(tempfile::tempdir(), "plans");
    let types = "[types.note]\nprompt = \"Write {{input.what}}.\"\npriority = 2\n\
                 input = { type = \"object\", required = [\"what\"] }\n";
    must(std::fs::write(dir.path().join("types.toml"), types), "types");
    let plan = "[[tasks]]\nid = \"a\"\ntype = \"note\"\ninput = { what = \"docs\" }\npriority = 4\nagent = \"worker\"\n\n\
                [[tasks]]\nid = \"b\"\nprompt = \"plain\"\nagent = \"worker\"\n";
    let path = dir.path().join("plan.toml");
    must(std::fs::write(&path, plan), "plan");
    let path = path.display().to_string();
    let o = cli(&s, &["submit", &path, "--run-id", "beside", "--priority", "7"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    for task in ["a", "b"] {
        let (_, v) = s.call(reqwest::Method::GET, &format!("/runs/beside/tasks/{task}"), None).await;
        assert_eq!(v["task"]["spec"]["priority"], 7, "{v}");
    }
    let (_, v) = s.call(reqwest::Method::GET, "/runs/beside/tasks/a", None).await;
    assert_eq!(v["task"]["spec"]["prompt"], "Write docs.", "{v}");

    // A broken types file is named, with its line.
    must(std::fs::write(dir.path().join("types.toml"), "[types.note]\nprompt = 3\n"), "types");
    let o = cli(&s, &["submit", &path, "--run-id", "broken"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("types.toml: line"), "{}", text(&o));
    let o = cli(&s, &["submit", &path, "--run-id", "high", "--priority", "12"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

/// Issue #34: the same plan submitted again under the same run id is accepted (exit 0, 200)
/// and runs nothing again; another plan under that id is still refused (`run_exists`).
#[tokio::test]
async fn an_identical_resubmission_is_accepted_and_runs_nothing_again() {
    let (s, _) = server_configured(None, &[], None).await;
    let plan = "[[tasks]]\nid = \"a\"\nprompt = \"p\"\nagent = \"worker\"\n";
    let body = json!({"plan": plan, "run_id": "again"});
    let (code, v) = s.call(reqwest::Method::POST, "/runs", Some(body.clone())).await;
    assert_eq!((code, &v["created"]), (201, &json!(true)), "{v}");
    let (code, v) = s.call(reqwest::Method::POST, "/runs", Some(body)).await;
    assert_eq!((code, &v["run"], &v["created"]), (200, &json!("again"), &json!(false)), "{v}");
    let (_, run) = s.call(reqwest::Method::GET, "/runs/again", None).await;
    assert_eq!(run["tasks"].as_array().map(Vec::len), Some(1), "{run}");
    let dir = must(tempfile::tempdir(), "plans");
    let path = dir.path().join("plan.toml");
    must(std::fs::write(&path, plan), "plan");
    let o = cli(&s, &["submit", &path.display().to_string(), "--run-id", "again"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("submitted with this plan already"), "{}", text(&o));
    let other = json!({"plan": "[[tasks]]\nid = \"b\"\nprompt = \"q\"\nagent = \"worker\"\n", "run_id": "again"});
    let (code, v) = s.call(reqwest::Method::POST, "/runs", Some(other)).await;
    assert_eq!((code, &v["error"]["code"]), (409, &json!("run_exists")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("another run id")), "{v}");
}
