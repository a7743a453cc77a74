//! Issue #33: the host's own MCP endpoint (`pier serve`'s `/mcp`). An agent in a strictly
//! confined task reaches it through its jail's proxy with its attempt's token, asks a person,
//! adds a follow-up task of a declared type to its run (which then runs) and reads a task's
//! state; a call without a running attempt's token is refused.

mod support;

use pier_fake_model::body::{tool_names, tool_results};
use pier_fake_model::{FakeModel, Reply};
use serde_json::{Value, json};
use support::must;
use support::serve::server_configured;

const TYPES: &str = r#"
[types.fix]
prompt = "Fix {{input.what}}."
input = { type = "object", required = ["what"], additionalProperties = false, properties = { what = { type = "string" } } }
"#;

/// The triage task's agent, step by step as its tool results come back; the follow-up's answers.
fn script(body: &Value) -> Reply {
    if body.to_string().contains("Fix bug-b.") {
        return Reply::text("fixed");
    }
    let results = tool_results(body);
    match results.len() {
        0 => Reply::tool_call("c1", "pier__ask_person", r#"{"question": "Which bug first?", "options": ["a", "b"]}"#),
        1 => Reply::tool_call("c2", "pier__submit_task", r#"{"type": "nope", "input": {}}"#),
        2 => {
            let answer: Value = serde_json::from_str(&results[0]).unwrap_or(Value::Null);
            let what = format!("bug-{}", answer["answer"].as_str().unwrap_or("?"));
            let args = json!({"type": "fix", "input": {"what": what}, "id": "fix-1", "depends_on": ["triage"]});
            Reply::tool_call("c3", "pier__submit_task", &args.to_string())
        }
        3 => Reply::tool_call("c4", "pier__task_result", r#"{"task": "fix-1"}"#),
        _ => Reply::text(&format!("triaged: {}", results.join(" | "))),
    }
}

#[tokio::test]
async fn a_confined_agent_asks_its_host_and_adds_a_follow_up_task_to_its_run() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(script);
    let (s, _) = server_configured(Some(f.base_url()), &[], Some(TYPES)).await;
    // Nothing but a running attempt's token opens the endpoint.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    for token in [None, Some("not-a-token"), Some(support::serve::TOKEN)] {
        let mut req = s.http.post(format!("{}/mcp", s.base)).body(init.to_string());
        req = req.header("content-type", "application/json").header("accept", "application/json, text/event-stream");
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let answer = must(must(tokio::time::timeout(support::LIMIT, req.send()).await, "in time"), "send");
        assert_eq!(answer.status().as_u16(), 401, "{token:?}");
    }

    let plan = "[[tasks]]\nid = \"triage\"\nprompt = \"triage the bugs\"\n";
    let (code, body) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "m"}))).await;
    assert_eq!(code, 201, "{body}");
    s.events_until(Some(0), |e| e["type"] == "question" && e["task"] == "triage").await;
    let (code, body) =
        s.call(reqwest::Method::POST, "/runs/m/tasks/triage/answer", Some(json!({"content": {"answer": "b"}}))).await;
    assert_eq!(code, 200, "{body}");
    s.events_until(Some(0), |e| e["task"] == "fix-1" && e["type"] == "transition" && e["to"] == "completed").await;

    let (_, run) = s.call(reqwest::Method::GET, "/runs/m", None).await;
    let tasks = run["tasks"].as_array().cloned().unwrap_or_default();
    let fix = tasks.iter().find(|t| t["id"] == "fix-1").unwrap_or_else(|| panic!("no follow-up in {run}"));
    assert_eq!(fix["spec"]["added_by"], "triage", "{fix}");
    assert_eq!(fix["spec"]["type"], "fix", "{fix}");
    assert_eq!(fix["spec"]["prompt"], "Fix bug-b.", "{fix}");
    assert_eq!(fix["spec"]["depends_on"], json!(["triage"]), "{fix}");
    assert_eq!(fix["result"], "fixed", "{fix}");
    let triage = tasks.iter().find(|t| t["id"] == "triage").unwrap_or_else(|| panic!("{run}"));
    let said = triage["result"].as_str().unwrap_or_default();
    // The unknown type was refused to the agent, naming it; the follow-up waited for its adder.
    assert!(said.contains("nope"), "{said}");
    assert!(said.contains(r#""task":"fix-1""#) && said.contains(r#""added":true"#), "{said}");
    assert!(said.contains(r#""state":"pending""#), "{said}");

    // The host let its agent call its tools without asking anyone, and says so.
    let log = s.events_until(Some(0), |e| e["type"] == "permission" && e["toolCall"]["toolCallId"] == "c4").await;
    let permissions: Vec<&Value> = log.iter().filter(|e| e["type"] == "permission").collect();
    assert_eq!(permissions.len(), 4, "{permissions:#?}");
    for p in permissions {
        assert_eq!(p["reason"], "allowed by the host: a tool of its own MCP endpoint", "{p}");
    }
    let offered = tool_names(&f.requests()[0].body);
    for tool in ["pier__task_result", "pier__ask_person", "pier__submit_task"] {
        assert!(offered.contains(&tool.to_owned()), "{tool} in {offered:?}");
    }
    // The run's plan as submitted is still the run's: submitting it again joins the run.
    let (code, body) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "m"}))).await;
    assert!(code == 200 || code == 201, "{code} {body}");
    assert_eq!(body["created"], false, "{body}");
}
