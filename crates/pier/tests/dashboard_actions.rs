//! Issue #34: a person acts from the dashboard — approves inline on the run page (by keyboard
//! alone), retries a failed task with its dependents, cancels a running one, each behind a
//! page that says what will happen — and the audit trail names them; a users file's roles
//! are checked on every page, form and API route. In the real headless Chromium, against a
//! real `pier serve` with pier's agents on the fake model.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use pier_fake_model::{FakeModel, Gate, Reply, Step};
use reqwest::Method;
use serde_json::{Value, json};
use support::browser::{Browser, node_state};
use support::serve::server_with;
use support::{LIMIT, echo, must};

/// `printf %s alice-token | sha256sum`, and the same of `vera-token`.
const USERS: &str = "[[user]]\nname = \"alice\"\nrole = \"operator\"\n\
    token_sha256 = \"9c220f200955d76c0a38d308225e0ef10c5f971acaf2f8d1d8f732affa5bd1dc\"\n\n\
    [[user]]\nname = \"vera\"\nrole = \"viewer\"\n\
    token_sha256 = \"e8634684693f147f3d593d3ace2dc53e542d4d8b4e2d61e128199b9e320307e0\"\n";

fn notice_has(text: &str) -> String {
    format!("(document.querySelector('.notice') || {{}}).textContent?.includes({text:?})")
}

/// A call of the API with `token`.
async fn call(base: &str, token: &str, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut req = reqwest::Client::new().request(method, format!("{base}{path}")).bearer_auth(token);
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b.to_string());
    }
    let resp = must(must(tokio::time::timeout(LIMIT, req.send()).await, "answer in time"), "send");
    let status = resp.status().as_u16();
    (status, serde_json::from_str(&must(resp.text().await, "body")).unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_person_acts_from_the_pages_and_the_trail_names_them() {
    let f = must(FakeModel::start().await, "fake");
    let gate = Gate::new();
    let (g, lints) = (gate.clone(), Arc::new(AtomicUsize::new(0)));
    let l = lints.clone();
    f.set_fallback(move |body| {
        let last = body["messages"].as_array().and_then(|m| m.iter().rev().find(|m| m["role"] == "user")).cloned();
        let said = last.map(|m| m["content"].to_string()).unwrap_or_default();
        let answered = body["messages"].as_array().is_some_and(|m| m.iter().any(|m| m["role"] == "tool"));
        if said.contains("Lint") && l.fetch_add(1, Ordering::SeqCst) == 0 {
            // The first lint fails (a refusal); its retry succeeds.
            Reply::Stream(vec![Step::Finish("content_filter".into()), Step::Done])
        } else if said.contains("Soak") {
            Reply::Stream(vec![
                Step::Gate(g.clone()),
                Step::Text("never".into()),
                Step::Finish("stop".into()),
                Step::Done,
            ])
        } else if said.contains("Edit") && !answered {
            Reply::tool_call("w1", "write_file", r#"{"path": "notes.txt", "content": "new\n"}"#)
        } else if said.contains("Wipe") && !answered {
            Reply::tool_call("w2", "write_file", r#"{"path": "wiped.txt", "content": ""}"#)
        } else {
            echo(body)
        }
    });
    let users = must(tempfile::NamedTempFile::new(), "users file");
    must(std::fs::write(users.path(), USERS), "users");
    let users_path = users.path().display().to_string();
    let (s, _) = server_with(Some(f.base_url()), &["--users", &users_path]).await;
    let plan = "[[tasks]]\nid = \"lint\"\nprompt = \"Lint the code\"\n\n\
                [[tasks]]\nid = \"fix\"\nprompt = \"Fix what lint found\"\ndepends_on = [\"lint\"]\n\n\
                [[tasks]]\nid = \"soak\"\nprompt = \"Soak test\"\n\n\
                [[tasks]]\nid = \"edit\"\nprompt = \"Edit the notes\"\n\n\
                [[tasks]]\nid = \"wipe\"\nprompt = \"Wipe the notes\"\n";
    assert_eq!(
        call(&s.base, "alice-token", Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "acts"}))).await.0,
        201
    );

    let b = Browser::start("dashboard-actions").await;
    b.login(&s.base, None, "alice-token").await;
    assert_eq!(b.text(&b.find("header .who").await.unwrap_or_default()).await, "alice");
    let run_page = format!("{}/ui/runs/acts", s.base);
    b.goto(&run_page).await;
    for (task, state) in [
        ("lint", "failed"),
        ("fix", "cancelled"),
        ("soak", "running"),
        ("edit", "awaiting_input"),
        ("wipe", "awaiting_input"),
    ] {
        b.wait_for(&format!("{task} {state}"), &format!("{} === '{state}'", node_state(task)), LIMIT).await;
    }

    // Approve on the run page, by keyboard alone: Tab from the top of the page to the agent's
    // allow-once option, then Enter.
    let allow = "section.waiting .approval[data-task=\"edit\"] button[data-kind=\"allow_once\"]";
    b.wait_for("the inline approval", &format!("!!document.querySelector('{allow}')"), LIMIT).await;
    let mut at = b.find("a.brand").await.unwrap_or_else(|| panic!("no first link"));
    let mut tabs = 0;
    loop {
        let on =
            b.script(&format!("return document.activeElement === document.querySelector('{allow}')"), vec![]).await;
        if on == json!(true) {
            break;
        }
        assert!(tabs < 60, "the allow option is not reached by Tab");
        b.type_into(&at, "\u{E004}").await;
        tabs += 1;
        let active = b.script("return document.activeElement", vec![]).await;
        at = active[support::browser::ELEMENT].as_str().unwrap_or_default().to_owned();
    }
    b.type_into(&at, "\u{E007}").await;
    b.wait_for("answered, back on the run page", &notice_has("answered `allow-once`"), LIMIT).await;
    assert!(b.url().await.contains("/ui/runs/acts"), "the answer goes back to the page it was given on");
    b.wait_for("edit completed", &format!("{} === 'completed'", node_state("edit")), LIMIT).await;

    // Deny on the run page: the task fails with what was denied (on_deny = "fail").
    let reject = "section.waiting .approval[data-task=\"wipe\"] button[data-kind=\"reject_once\"]";
    b.wait_for("the inline denial", &format!("!!document.querySelector('{reject}')"), LIMIT).await;
    b.click(&b.find(reject).await.unwrap_or_else(|| panic!("no reject button"))).await;
    b.wait_for("denied", &notice_has("answered `reject-once`"), LIMIT).await;
    b.wait_for("wipe failed", &format!("{} === 'failed'", node_state("wipe")), LIMIT).await;
    assert!(!s.dir.path().join("wiped.txt").exists(), "nothing written after the denial");

    // Retry the failed task with the task it cancelled: a page says what happens first.
    let retry = b.find("tr[data-task=\"lint\"] a.action").await.unwrap_or_else(|| panic!("no retry link"));
    assert_eq!(b.text(&retry).await, "Retry…");
    b.click(&retry).await;
    b.wait_for("the retry page", "location.pathname === '/ui/runs/acts/tasks/lint/retry'", LIMIT).await;
    let ticked = b.script("return document.querySelector('form.confirm input[name=dependents]').checked", vec![]).await;
    assert_eq!(ticked, json!(true), "dependents are retried with it by default");
    let go = b.find("form.confirm button").await.unwrap_or_else(|| panic!("no confirm button"));
    b.click(&go).await;
    b.wait_for("retried", &notice_has("task lint and 1 task(s) below it run again"), LIMIT).await;
    b.goto(&run_page).await;
    for task in ["lint", "fix"] {
        b.wait_for(&format!("{task} completed"), &format!("{} === 'completed'", node_state(task)), LIMIT).await;
    }

    // No other action has a page (it once fell through to the cancel page).
    b.goto(&format!("{}/ui/runs/acts/tasks/lint/explode", s.base)).await;
    b.wait_for("refused", "document.body.innerText.includes('No action \"explode\" on a task.')", LIMIT).await;
    assert!(b.find("form.confirm").await.is_none());

    // Cancel the running task from its page, through the same kind of confirmation.
    b.goto(&format!("{}/ui/runs/acts/tasks/soak", s.base)).await;
    let cancel = b.find(".facts a.action.danger").await.unwrap_or_else(|| panic!("no cancel link"));
    b.click(&cancel).await;
    b.wait_for("the cancel page", "location.pathname === '/ui/runs/acts/tasks/soak/cancel'", LIMIT).await;
    let keep = b.find("form.confirm a").await.unwrap_or_else(|| panic!("no way back"));
    assert_eq!(b.text(&keep).await, "Keep it as it is");
    let go = b.find("form.confirm button.danger").await.unwrap_or_else(|| panic!("no confirm button"));
    b.click(&go).await;
    b.wait_for("cancelled", &notice_has("task soak is cancelled"), LIMIT).await;
    b.wait_for("shown cancelled", "!!document.querySelector('.facts .state-cancelled')", LIMIT).await;

    // The audit trail names her on each act.
    let mut wanted = vec![
        "\"by\":\"dashboard:alice\"",
        "a person retried it (dashboard:alice)",
        "retried with lint, which it depends on (dashboard:alice)",
        "cancelled from the dashboard by alice",
    ];
    s.events_until(Some(0), |e| {
        let text = e.to_string();
        wanted.retain(|w| !text.contains(w));
        wanted.is_empty()
    })
    .await;
    s.events_until(Some(0), |e| e["type"] == "answer" && e["task"] == "wipe" && e["by"] == "dashboard:alice").await;

    // A viewer sees the run, and nothing to act with; a forged form and the API refuse her.
    let out = b.find("form.logout button").await.unwrap_or_else(|| panic!("no logout"));
    b.click(&out).await;
    b.wait_for("logged out", "location.pathname === '/ui/login'", LIMIT).await;
    b.login(&s.base, None, "vera-token").await;
    b.goto(&run_page).await;
    b.wait_for("the run", &format!("{} === 'completed'", node_state("lint")), LIMIT).await;
    assert_eq!(
        b.script("return document.querySelectorAll('a.action, section.waiting').length", vec![]).await,
        json!(0)
    );
    b.script(
        "const f = document.createElement('form'); f.method = 'post'; f.action = '/ui/runs/acts/tasks/lint/retry'; \
         const i = document.createElement('input'); i.type = 'hidden'; i.name = 'csrf'; \
         i.value = document.querySelector('form.logout input[name=csrf]').value; f.append(i); \
         document.body.append(f); f.submit(); return true",
        vec![],
    )
    .await;
    b.wait_for(
        "refused by role",
        "document.body.innerText.includes('vera is a viewer: this needs the operator role')",
        LIMIT,
    )
    .await;
    let (code, v) = call(&s.base, "vera-token", Method::GET, "/runs/acts", None).await;
    assert_eq!(code, 200, "{v}");
    let (code, v) = call(&s.base, "vera-token", Method::POST, "/runs/acts/tasks/lint/retry", None).await;
    assert_eq!((code, v["error"]["code"].as_str()), (403, Some("forbidden")), "{v}");
    let schedule = json!({"id": "n", "every": "1h", "plan": "[[tasks]]\nid = \"a\"\nprompt = \"p\"\n"});
    let (code, v) = call(&s.base, "alice-token", Method::POST, "/schedules", Some(schedule)).await;
    assert_eq!((code, v["error"]["code"].as_str()), (403, Some("forbidden")), "an operator changes no schedule: {v}");
    gate.open();
}
