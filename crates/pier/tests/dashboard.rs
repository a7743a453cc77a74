//! The dashboard in a real browser: Debian's headless Chromium driven through chromedriver
//! (`support::browser`), against a real `pier serve` with pier's own agents on the fake
//! model. Waits poll the page's state with a bound; a failing test leaves a screenshot
//! under `target/browser-screenshots/`.

mod support;

use pier_fake_model::{FakeModel, Gate, Reply, Step};
use serde_json::json;
use support::browser::{Browser, node_state};
use support::serve::{TOKEN, server};
use support::{LIMIT, echo, must};

/// Logs the browser in as `pat` with the server's token.
async fn login(b: &Browser, base: &str) {
    b.login(base, Some("pat"), TOKEN).await;
}

#[tokio::test]
async fn a_person_logs_in_watches_a_run_change_state_live_and_logs_out() {
    let f = must(FakeModel::start().await, "fake");
    let gate = Gate::new();
    let g = gate.clone();
    f.set_fallback(move |body| {
        let last = body["messages"].as_array().and_then(|m| m.iter().rev().find(|m| m["role"] == "user")).cloned();
        if last.is_some_and(|m| m["content"].to_string().contains("alpha-go")) {
            Reply::Stream(vec![
                Step::Gate(g.clone()),
                Step::Text("done".into()),
                Step::Finish("stop".into()),
                Step::Done,
            ])
        } else {
            echo(body)
        }
    });
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"first\"\nprompt = \"alpha-go\"\n\n[[tasks]]\nid = \"second\"\nprompt = \"beta-go\"\ndepends_on = [\"first\"]\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "live"}))).await.0, 201);

    let b = Browser::start("live-run").await;
    // Without a session every page sends the browser to the login page.
    b.goto(&format!("{}/ui/runs/live", s.base)).await;
    b.wait_for("the login page", "location.pathname === '/ui/login'", LIMIT).await;
    // A wrong token: the login page again, saying so (a page, not the API's JSON).
    let name = b.find("#name").await.unwrap_or_else(|| panic!("no name field"));
    b.type_into(&name, "pat").await;
    let field = b.find("#token").await.unwrap_or_else(|| panic!("no token field"));
    b.type_into(&field, "not-the-token").await;
    let submit = b.find("form.login button").await.unwrap_or_else(|| panic!("no login button"));
    b.click(&submit).await;
    b.wait_for("refused", "(document.querySelector('.notice') || {}).textContent?.includes('not the token')", LIMIT)
        .await;
    login(&b, &s.base).await;
    b.wait_for("the run listed", "!!document.querySelector('tr[data-run=\"live\"]')", LIMIT).await;

    b.goto(&format!("{}/ui/runs/live", s.base)).await;
    b.wait_for("first running", &format!("{} === 'running'", node_state("first")), LIMIT).await;
    assert_eq!(b.script(&format!("return {}", node_state("second")), vec![]).await, json!("pending"));
    // The page is not reloaded: a mark set now must survive the change of state.
    b.script("window.__mark = 42; return true", vec![]).await;
    gate.open();
    b.wait_for("second completed, live", &format!("{} === 'completed'", node_state("second")), LIMIT).await;
    assert_eq!(b.script("return window.__mark", vec![]).await, json!(42), "the page was reloaded");
    // The state is said in words and glyphs, not colour alone; the rail carries the events.
    let row = b.find("tr[data-task=\"first\"]").await.unwrap_or_else(|| panic!("no row"));
    assert!(b.text(&row).await.contains("✓ completed"));
    b.wait_for("the event rail", "document.querySelectorAll('#events li').length > 3", LIMIT).await;

    // A form without this session's CSRF token is refused, as a page, and changes nothing.
    b.script(
        "const f = document.createElement('form'); f.method = 'post'; f.action = '/ui/runs/live/cancel'; \
         const i = document.createElement('input'); i.type = 'hidden'; i.name = 'csrf'; i.value = 'forged'; f.append(i); \
         document.body.append(f); f.submit(); return true",
        vec![],
    )
    .await;
    b.wait_for("refused", "document.body.innerText.includes('not from this dashboard')", LIMIT).await;
    b.goto(&format!("{}/ui/runs/live", s.base)).await;
    let out = b.find("form.logout button").await.unwrap_or_else(|| panic!("no logout"));
    b.click(&out).await;
    b.wait_for("logged out", "location.pathname === '/ui/login'", LIMIT).await;
    b.goto(&format!("{}/ui/runs/live", s.base)).await;
    b.wait_for("refused after logout", "location.pathname === '/ui/login'", LIMIT).await;
}

#[tokio::test]
async fn an_approval_shows_the_diff_is_answered_with_its_button_and_a_repeat_is_refused() {
    let f = must(FakeModel::start().await, "fake");
    // The agent replaces notes.txt (an edit: it asks first), then answers.
    f.push(Reply::tool_call("w1", "write_file", r#"{"path": "notes.txt", "content": "new line\n"}"#));
    f.set_fallback(|_| Reply::text("edited"));
    let s = server(Some(f.base_url())).await;
    must(std::fs::write(s.dir.path().join("notes.txt"), "old line\n"), "notes");
    let plan = "[[tasks]]\nid = \"edit\"\nprompt = \"edit the notes\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "ask"}))).await.0, 201);

    let b = Browser::start("approval").await;
    login(&b, &s.base).await;
    b.goto(&format!("{}/ui/approvals", s.base)).await;
    b.wait_for(
        "the approval",
        "!!document.querySelector('section.approval[data-task=\"edit\"] button[data-kind=\"allow_once\"]')",
        LIMIT,
    )
    .await;
    // The agent's own options, verbatim, and the diff of what it asks to do.
    let options: Vec<String> = serde_json::from_value(
        b.script(
            "return [...document.querySelectorAll('section.approval button.option')].map(b => b.dataset.kind)",
            vec![],
        )
        .await,
    )
    .unwrap_or_default();
    assert_eq!(options, ["allow_once", "allow_always", "reject_once", "reject_always"]);
    assert!(
        b.script("return document.querySelector('.diff .del').textContent", vec![])
            .await
            .as_str()
            .is_some_and(|t| t.contains("-old line"))
    );
    assert!(
        b.script("return document.querySelector('.diff .add').textContent", vec![])
            .await
            .as_str()
            .is_some_and(|t| t.contains("+new line"))
    );
    // Keep the form as the page showed it, to submit it again later.
    let stale = b
        .script(
            "const f = document.querySelector('section.approval button[data-kind=\"allow_once\"]').form; \
             return {action: f.action, fields: Object.fromEntries(new FormData(f))}",
            vec![],
        )
        .await;
    let allow = b.find("section.approval button[data-kind=\"allow_once\"]").await.unwrap_or_else(|| panic!("button"));
    b.click(&allow).await;
    b.wait_for(
        "the answer taken",
        "(document.querySelector('.notice') || {}).textContent?.includes('answered `allow-once`')",
        LIMIT,
    )
    .await;

    // The task goes on and completes; its page shows the tool call with its diff and the choice.
    b.goto(&format!("{}/ui/runs/ask/tasks/edit", s.base)).await;
    b.wait_for("completed", "!!document.querySelector('.facts .state-completed')", LIMIT).await;
    let tool = b.find(".tool[data-tool=\"w1\"]").await.unwrap_or_else(|| panic!("no tool call on the task page"));
    let text = b.text(&tool).await;
    assert!(
        text.contains("edit")
            && text.contains("[completed]")
            && text.contains("-old line")
            && text.contains("+new line"),
        "{text}"
    );
    let permission = b.find(".permission").await.unwrap_or_else(|| panic!("no permission record"));
    assert!(b.text(&permission).await.contains("← chosen"), "{}", b.text(&permission).await);
    assert_eq!(must(std::fs::read_to_string(s.dir.path().join("notes.txt")), "notes"), "new line\n");

    // The same form again: refused, visibly, and nothing is applied twice.
    b.script(
        "const [s] = arguments; const f = document.createElement('form'); f.method = 'post'; f.action = s.action; \
         for (const [k, v] of Object.entries(s.fields)) { const i = document.createElement('input'); i.type = 'hidden'; \
         i.name = k; i.value = v; f.append(i); } document.body.append(f); f.submit(); return true",
        vec![stale],
    )
    .await;
    b.wait_for(
        "the repeat refused",
        "/refused: task `edit` .*already answered: \\S+ by \\S+ at \\d{4}-\\d\\d-\\d\\dT/.test((document.querySelector('.notice.refused') || {}).textContent || '')",
        LIMIT,
    )
    .await;
}

#[tokio::test]
async fn nothing_the_plan_the_agent_or_the_model_wrote_runs_as_markup() {
    const PLANT: &str = "<script>window.pwned=1</script>\"><img src=x onerror=\"window.pwned=2\">";
    let f = must(FakeModel::start().await, "fake");
    // The agent writes the plant into a file (a diff waiting for approval), then says it.
    let args = json!({"path": "x.html", "content": PLANT}).to_string();
    f.push(Reply::tool_call("w1", "write_file", &args));
    f.set_fallback(|_| Reply::text(PLANT));
    let s = server(Some(f.base_url())).await;
    let id = format!("t{PLANT}");
    let plan = format!("[[tasks]]\nid = {id:?}\nprompt = {PLANT:?}\n");
    let run = "r\"><img src=x onerror=\"window.pwned=3\">";
    let (code, v) = s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": run}))).await;
    assert_eq!(code, 201, "{v}");
    s.events_until(None, |e| e["type"] == "transition" && e["to"] == "awaiting_input").await;

    let b = Browser::start("xss").await;
    login(&b, &s.base).await;
    let seg = |t: &str| {
        t.bytes()
            .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
            .collect::<String>()
    };
    for path in [
        "/ui/".to_owned(),
        format!("/ui/runs/{}", seg(run)),
        format!("/ui/runs/{}/tasks/{}", seg(run), seg(&id)),
        "/ui/approvals".into(),
    ] {
        b.goto(&format!("{}{path}", s.base)).await;
        b.wait_for("the page", "document.readyState === 'complete' && !!document.getElementById('main')", LIMIT).await;
        let state = b
            .script("return {pwned: window.pwned === undefined ? null : window.pwned, imgs: document.querySelectorAll('img').length, text: document.body.innerText}", vec![])
            .await;
        assert_eq!(state["pwned"], json!(null), "{path}: a plant ran");
        assert_eq!(state["imgs"], json!(0), "{path}: a plant became an element");
        assert!(
            state["text"].as_str().is_some_and(|t| t.contains("onerror")),
            "{path}: the plant is not shown as text"
        );
    }
}

#[tokio::test]
async fn the_pages_read_at_a_phone_s_width() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"a-task-with-a-rather-long-name\"\nprompt = \"hello\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "narrow"}))).await.0, 201);
    s.events_until(None, |e| e["type"] == "transition" && e["to"] == "completed").await;
    let b = Browser::start("narrow").await;
    login(&b, &s.base).await;
    for (width, path) in [(390, "/ui/"), (390, "/ui/runs/narrow"), (1280, "/ui/runs/narrow")] {
        b.set_window_size(width, 900).await;
        b.goto(&format!("{}{path}", s.base)).await;
        b.wait_for("the page", "document.readyState === 'complete'", LIMIT).await;
        let overflow = b
            .script("return document.documentElement.scrollWidth - document.documentElement.clientWidth", vec![])
            .await;
        assert!(overflow.as_i64().is_some_and(|o| o <= 0), "{path} at {width}px scrolls sideways by {overflow}");
        if width == 390 {
            // Every cell of every table is shown, whole, inside the screen: a card per row.
            let hidden = b
                .script(
                    "return [...document.querySelectorAll('table.cards td')].filter(td => td.textContent.trim() !== '' && (td.getClientRects().length === 0 || td.getBoundingClientRect().right > innerWidth + 1 || td.scrollWidth > td.clientWidth + 1)).map(td => td.parentElement.closest('table').className + ' column ' + td.cellIndex)",
                    vec![],
                )
                .await;
            assert_eq!(hidden, json!([]), "{path} at {width}px hides or cuts these cells");
            let cells = b.script("return document.querySelectorAll('table.cards td').length", vec![]).await;
            assert!(cells.as_u64().is_some_and(|n| n >= 7), "{path}: {cells} cells");
            b.keep_screenshot(&format!("{}-390", if path == "/ui/" { "runs" } else { "run" })).await;
        }
    }
    // Dark mode follows the system's preference, text light on dark.
    b.prefer_dark().await;
    b.set_window_size(390, 900).await;
    b.goto(&format!("{}/ui/runs/narrow", s.base)).await;
    b.wait_for("the page", "document.readyState === 'complete'", LIMIT).await;
    let colours = b
        .script(
            "const s = getComputedStyle(document.body); const t = getComputedStyle(document.querySelector('h1'));              return [s.backgroundColor, t.color]",
            vec![],
        )
        .await;
    assert_eq!(colours, json!(["rgb(13, 17, 23)", "rgb(230, 237, 243)"]), "dark mode");
    b.keep_screenshot("run-390-dark").await;
}

#[tokio::test]
async fn a_busy_run_page_renders_every_state_for_the_readme_screenshot() {
    let f = must(FakeModel::start().await, "fake");
    let gate = Gate::new();
    let g = gate.clone();
    f.set_fallback(move |body| {
        let last = body["messages"].as_array().and_then(|m| m.iter().rev().find(|m| m["role"] == "user")).cloned();
        let said = last.map(|m| m["content"].to_string()).unwrap_or_default();
        if said.contains("Review") {
            Reply::Stream(vec![Step::Gate(g.clone()), Step::Text("ok".into()), Step::Finish("stop".into()), Step::Done])
        } else if said.contains("Lint") {
            Reply::Stream(vec![Step::Finish("content_filter".into()), Step::Done])
        } else {
            echo(body)
        }
    });
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"fetch-docs\"\nprompt = \"Fetch the docs\"\n\n\
                [[tasks]]\nid = \"fetch-code\"\nprompt = \"Fetch the code\"\n\n\
                [[tasks]]\nid = \"review\"\nprompt = \"Review both\"\ndepends_on = [\"fetch-docs\", \"fetch-code\"]\n\n\
                [[tasks]]\nid = \"lint\"\nprompt = \"Lint the code\"\ndepends_on = [\"fetch-code\"]\n\n\
                [[tasks]]\nid = \"fix-lint\"\nprompt = \"Fix what lint found\"\ndepends_on = [\"lint\"]\n\n\
                [[tasks]]\nid = \"report\"\nprompt = \"Write the report\"\ndepends_on = [\"review\"]\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "nightly"}))).await.0, 201);
    let b = Browser::start("busy-run").await;
    login(&b, &s.base).await;
    b.goto(&format!("{}/ui/runs/nightly", s.base)).await;
    for (task, state) in [
        ("review", "running"),
        ("lint", "failed"),
        ("fix-lint", "cancelled"),
        ("fetch-docs", "completed"),
        ("report", "pending"),
    ] {
        b.wait_for(&format!("{task} {state}"), &format!("{} === '{state}'", node_state(task)), LIMIT).await;
    }
    // Each task sits under what it depends on, so no edge crosses another: report under
    // review, fix-lint under lint (in plan order they would swap and cross).
    let x = |task: &str| {
        format!("document.querySelector('svg.graph [data-task=\"{task}\"]').transform.baseVal[0].matrix.e")
    };
    let columns =
        b.script(&format!("return [{}, {}, {}, {}]", x("review"), x("report"), x("lint"), x("fix-lint")), vec![]).await;
    assert!(columns[0] == columns[1] && columns[2] == columns[3] && columns[0] != columns[2], "{columns}");
    b.set_window_size(1280, 860).await;
    let png = b.screenshot().await;
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target"));
    let _ = std::fs::create_dir_all(dir);
    // Copied to docs/dashboard-run.png for the README when the page changes.
    must(std::fs::write(dir.join("dashboard-run.png"), png), "screenshot");
    gate.open();
    b.wait_for("report completed", &format!("{} === 'completed'", node_state("report")), LIMIT).await;
}

#[tokio::test]
async fn an_agent_s_question_is_answered_with_its_form_and_a_bad_answer_is_refused() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/elicit_agent.py");
    let dir = must(tempfile::tempdir(), "record dir");
    let record = dir.path().join("answers.jsonl");
    let toml = format!(
        "[agents.ask]\ncommand = \"python3\"\nargs = [\"{}\"]\nenv = {{ ELICIT_RECORD = \"{}\" }}\n",
        script.display(),
        record.display()
    );
    let (s, _) = support::serve::server_configured(None, &[], Some(&toml)).await;
    // The agent records each answer outside the workspace: the plan lets it write there.
    let plan = format!(
        "[[tasks]]\nid = \"q\"\nagent = \"ask\"\nprompt = \"print the labels\"\nwritable = [\".\", \"{}\"]\n",
        dir.path().display()
    );
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "form"}))).await.0, 201);
    let b = Browser::start("question").await;
    login(&b, &s.base).await;
    b.goto(&format!("{}/ui/runs/form/tasks/q", s.base)).await;
    b.wait_for("the question's form", "!!document.querySelector('form.question-form input[name=\"f.name\"]')", LIMIT)
        .await;
    // On a phone the question and its form are whole, on the task page and on Approvals.
    b.set_window_size(390, 900).await;
    for path in ["/ui/runs/form/tasks/q", "/ui/approvals"] {
        b.goto(&format!("{}{path}", s.base)).await;
        b.wait_for("the form", "!!document.querySelector('form.question-form')", LIMIT).await;
        let cut = b
            .script(
                "return [document.documentElement.scrollWidth - document.documentElement.clientWidth, \
                 [...document.querySelectorAll('.decide p, .decide input, .decide select, .decide button')] \
                 .filter(e => e.getBoundingClientRect().right > innerWidth + 1).length]",
                vec![],
            )
            .await;
        assert_eq!(cut, json!([0, 0]), "{path} at 390 px: sideways scroll, elements cut");
        b.keep_screenshot(&format!("question-390{}", path.replace('/', "-"))).await;
    }
    b.set_window_size(1280, 900).await;
    b.goto(&format!("{}/ui/runs/form/tasks/q", s.base)).await;
    b.wait_for("the form", "!!document.querySelector('form.question-form')", LIMIT).await;
    // A count out of bounds: refused with the reason, nothing answered.
    let name = b.find("form.question-form input[name=\"f.name\"]").await.unwrap_or_else(|| panic!("name"));
    b.type_into(&name, "Ada").await;
    let count = b.find("form.question-form input[name=\"f.count\"]").await.unwrap_or_else(|| panic!("count"));
    b.type_into(&count, "11").await;
    let go = b.find("form.question-form button").await.unwrap_or_else(|| panic!("answer"));
    b.click(&go).await;
    b.wait_for("refused", "(document.querySelector('.notice.refused') || {}).textContent?.includes('count')", LIMIT)
        .await;
    assert!(!record.exists(), "a refused answer reached the agent");
    let name = b.find("form.question-form input[name=\"f.name\"]").await.unwrap_or_else(|| panic!("name"));
    b.type_into(&name, "Ada").await;
    let count = b.find("form.question-form input[name=\"f.count\"]").await.unwrap_or_else(|| panic!("count"));
    b.type_into(&count, "3").await;
    let go = b.find("form.question-form button").await.unwrap_or_else(|| panic!("answer"));
    b.click(&go).await;
    b.wait_for("completed", "!!document.querySelector('.facts .state-completed')", LIMIT).await;
    let answers = must(std::fs::read_to_string(&record), "record");
    let got: serde_json::Value = must(serde_json::from_str(answers.trim()), "one answer");
    assert_eq!(got, json!({"action": "accept", "content": {"name": "Ada", "count": 3}}));
    // The audit trail names who answered: the name given at login.
    s.events_until(Some(0), |e| e["type"] == "answer" && e["by"] == "dashboard:pat").await;
}

/// What a run spent, from the gateway's records: per task and per run with a row per model on
/// the pages, each model request in its attempt's transcript, and the same figures in /metrics.
#[tokio::test]
async fn spend_shows_per_task_and_run_with_a_row_per_model_and_in_metrics() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| {
        Reply::Stream(vec![
            Step::Text("Counted.".into()),
            Step::Finish("stop".into()),
            Step::Usage { prompt: 1_000_000, completion: 500_000 },
            Step::Done,
        ])
    });
    let toml = "[prices.\"fake-model\"]\ninput = 1.0\noutput = 2.0\n";
    let (s, metrics) =
        support::serve::server_configured(Some(f.base_url()), &["--metrics-listen", "127.0.0.1:0"], Some(toml)).await;
    let plan = "[[tasks]]\nid = \"a\"\nprompt = \"one\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"two\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "spent"}))).await.0, 201);
    let mut done = 0;
    s.events_until(None, |e| {
        done += usize::from(e["type"] == "transition" && e["to"] == "completed");
        done == 2
    })
    .await;

    let b = Browser::start("spend").await;
    login(&b, &s.base).await;
    b.wait_for(
        "the run's spend",
        "document.querySelector('tr[data-run=\"spent\"] td.spend')?.textContent.includes('3000000 tok · 4.0000')",
        LIMIT,
    )
    .await;
    b.goto(&format!("{}/ui/runs/spent", s.base)).await;
    b.wait_for("the page", "document.readyState === 'complete'", LIMIT).await;
    let task_cell = |t: &str| format!("document.querySelector('tr[data-task=\"{t}\"] td.spend').textContent");
    for t in ["a", "b"] {
        assert_eq!(b.script(&format!("return {}", task_cell(t)), vec![]).await, "1500000 tok · 2.0000");
    }
    let row = b.find("section.spend tr[data-model=\"fake-model\"]").await.unwrap_or_else(|| panic!("no model row"));
    let text = b.text(&row).await;
    assert!(text.contains("fake-model") && text.contains("4.0000") && text.contains("2000000"), "{text}");
    let summary = b.text(&b.find("section.spend p").await.unwrap_or_else(|| panic!("no sum"))).await;
    assert!(summary.contains("3,000,000 tokens") && summary.contains("cost 4.0000"), "{summary}");

    b.goto(&format!("{}/ui/runs/spent/tasks/a", s.base)).await;
    b.wait_for("the page", "document.readyState === 'complete'", LIMIT).await;
    let summary = b.text(&b.find("section.spend p").await.unwrap_or_else(|| panic!("no sum"))).await;
    assert!(summary.contains("1,500,000 tokens") && summary.contains("over 1 request"), "{summary}");
    let line = b.text(&b.find("section.attempt p.model-request").await.unwrap_or_else(|| panic!("no request"))).await;
    assert!(line.contains("fake-model") && line.contains("1500000 tokens") && line.contains("cost 2.0000"), "{line}");
    // The attempt's times (issue #34): when it started, how long it took, how it ended.
    let when = b.text(&b.find("section.attempt p.when").await.unwrap_or_else(|| panic!("no times"))).await;
    assert!(
        when.starts_with("started 20") && when.contains(" UTC, took ") && when.ends_with(" s, completed"),
        "{when}"
    );
    let at =
        b.script("return document.querySelector('section.attempt p.when time').getAttribute('datetime')", vec![]).await;
    assert!(at.as_str().is_some_and(|t| t.starts_with("20") && t.ends_with('Z')), "{at}");

    let url = metrics.unwrap_or_else(|| panic!("no metrics address"));
    let text = must(must(tokio::time::timeout(LIMIT, s.http.get(url).send()).await, "in time"), "send");
    let text = must(text.text().await, "text");
    let line = |name: &str, labels: &[&str]| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
            .map(|l| l.rsplit(' ').next().unwrap_or("").to_owned())
            .unwrap_or_else(|| panic!("no {name} {labels:?} in:\n{text}"))
    };
    let labels = ["provider=\"pier\"", "model=\"fake-model\""];
    let kind = |k: &'static str| [labels[0], labels[1], k];
    assert_eq!(line("pier_model_tokens_total", &kind("kind=\"input\"")), "2000000");
    assert_eq!(line("pier_model_tokens_total", &kind("kind=\"output\"")), "1000000");
    assert_eq!(line("pier_model_requests_total", &labels), "2");
    assert_eq!(line("pier_model_cost_total", &labels), "4");
    assert_eq!(line("pier_model_request_seconds_count", &[labels[0]]), "2");
}

/// The Nodes page lists the pull workers that asked for work, with what they take.
#[tokio::test]
async fn the_nodes_page_lists_pull_workers() {
    let s = server(None).await;
    let body = json!({"worker": "builder-1", "capabilities": ["build", "gpu"], "wait_ms": 0});
    assert_eq!(s.call(reqwest::Method::POST, "/v1/lease", Some(body)).await.0, 204);
    let b = Browser::start("workers").await;
    login(&b, &s.base).await;
    b.goto(&format!("{}/ui/nodes", s.base)).await;
    b.wait_for("the worker", "!!document.querySelector('table.workers tr[data-worker=\"builder-1\"]')", LIMIT).await;
    let row = b.find("table.workers tr[data-worker=\"builder-1\"]").await.unwrap_or_else(|| panic!("no row"));
    let text = b.text(&row).await;
    assert!(text.contains("build, gpu"), "{text}");
}

/// Issue #32: the Schedules page lists a schedule with when it runs and its next occurrence,
/// and pauses and resumes it from the page, naming who did.
#[tokio::test]
async fn the_schedules_page_shows_a_schedule_and_pauses_and_resumes_it() {
    let s = server(None).await;
    let body = json!({"id": "nightly", "cron": "0 2 * * *", "timezone": "Europe/Paris",
                      "plan": "[[tasks]]\nid = \"a\"\nprompt = \"p\"\n"});
    assert_eq!(s.call(reqwest::Method::POST, "/schedules", Some(body)).await.0, 201);
    let b = Browser::start("schedules").await;
    login(&b, &s.base).await;
    b.goto(&format!("{}/ui/schedules", s.base)).await;
    let row = "table.schedules tr[data-schedule=\"nightly\"]";
    b.wait_for("the schedule", &format!("!!document.querySelector('{row}')"), LIMIT).await;
    let text = b.text(&b.find(row).await.unwrap_or_else(|| panic!("no row"))).await;
    assert!(text.contains("cron 0 2 * * * (Europe/Paris)") && text.contains("UTC") && text.contains("Pause"), "{text}");
    let pause = b.find(&format!("{row} form button")).await.unwrap_or_else(|| panic!("no pause button"));
    b.click(&pause).await;
    b.wait_for("paused", "(document.querySelector('.notice') || {}).textContent?.includes('paused')", LIMIT).await;
    let (_, v) = s.call(reqwest::Method::GET, "/schedules/nightly", None).await;
    let by = v["schedule"]["paused_by"].as_str().unwrap_or_default().to_owned();
    assert_eq!(by, "dashboard:pat", "the name given at login: {v}");
    let text = b.text(&b.find(row).await.unwrap_or_else(|| panic!("no row"))).await;
    assert!(text.contains(&format!("paused by {by}")) && text.contains("Resume"), "{text}");
    let resume = b.find(&format!("{row} form button")).await.unwrap_or_else(|| panic!("no resume button"));
    b.click(&resume).await;
    b.wait_for("running", "(document.querySelector('.notice') || {}).textContent?.includes('runs')", LIMIT).await;
    let (_, v) = s.call(reqwest::Method::GET, "/schedules/nightly", None).await;
    assert_eq!(v["schedule"]["paused_by"], serde_json::Value::Null, "{v}");
}

/// Issue #34: the runs page of a busy server: a page of 100 at a time with the way to older
/// ones, a search by run id (typed, then Enter), and the runs waiting on a person.
#[tokio::test]
async fn the_runs_page_finds_a_run_by_id_filters_the_waiting_ones_and_pages() {
    let f = must(FakeModel::start().await, "fake");
    f.push(Reply::tool_call("w1", "write_file", r#"{"path": "notes.txt", "content": "new\n"}"#));
    f.set_fallback(echo);
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"edit\"\nprompt = \"edit the notes\"\n";
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "needs-you"}))).await.0, 201);
    s.events_until(None, |e| e["type"] == "transition" && e["to"] == "awaiting_input").await;
    let parked = "[[tasks]]\nid = \"t\"\nagent = \"worker:nobody\"\nprompt = \"p\"\n";
    for i in 0..104 {
        let body = json!({"plan": parked, "run_id": format!("batch-{i:03}")});
        assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(body)).await.0, 201);
    }
    let b = Browser::start("runs-page").await;
    login(&b, &s.base).await;
    let rows = "return [...document.querySelectorAll('tr[data-run]')].map(r => r.dataset.run)";
    let shown = b.script(rows, vec![]).await;
    assert_eq!(shown.as_array().map(Vec::len), Some(100), "a page of 100");
    assert_eq!(shown[0], json!("batch-103"), "newest first");
    let older = b.find("nav.pages a[rel=next]").await.unwrap_or_else(|| panic!("no older link"));
    assert!(b.text(&b.find("nav.pages").await.unwrap_or_default()).await.contains("(5 more)"));
    b.click(&older).await;
    b.wait_for("page 2", "location.search === '?page=2'", LIMIT).await;
    assert_eq!(b.script(rows, vec![]).await, json!(["batch-003", "batch-002", "batch-001", "batch-000", "needs-you"]));
    // A search typed in the box, sent with Enter.
    let field = b.find("#q").await.unwrap_or_else(|| panic!("no search box"));
    b.type_into(&field, "BATCH-01\u{E007}").await;
    b.wait_for("the search", "location.search === '?q=BATCH-01'", LIMIT).await;
    let found: Vec<String> = serde_json::from_value(b.script(rows, vec![]).await).unwrap_or_default();
    assert_eq!(found, (10..20).rev().map(|i| format!("batch-0{i}")).collect::<Vec<_>>(), "any case");
    assert!(b.find("nav.pages").await.is_none(), "one page");
    // The runs waiting on a person.
    b.goto(&format!("{}/ui/?state=waiting", s.base)).await;
    assert_eq!(b.script(rows, vec![]).await, json!(["needs-you"]));
    let (_, v) = s.call(reqwest::Method::GET, "/runs?q=batch-10&state=running", None).await;
    let ids: Vec<&str> =
        v["runs"].as_array().map(|r| r.iter().filter_map(|r| r["run"].as_str()).collect()).unwrap_or_default();
    assert_eq!(ids, ["batch-103", "batch-102", "batch-101", "batch-100"], "the API filters the same: {v}");
}

/// Issue #34: a run of thousands of tasks reads as pages of its table (500 at a time, by state)
/// and draws no graph nobody could read.
#[tokio::test]
async fn a_big_run_page_lists_its_tasks_page_by_page_without_a_graph() {
    let s = server(None).await;
    let mut plan = String::new();
    for i in 0..1001 {
        plan.push_str(&format!("[[tasks]]\nid = \"t{i:04}\"\nagent = \"worker:nobody\"\nprompt = \"p\"\n\n"));
    }
    assert_eq!(s.call(reqwest::Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "big"}))).await.0, 201);
    let b = Browser::start("big-run").await;
    login(&b, &s.base).await;
    b.goto(&format!("{}/ui/runs/big", s.base)).await;
    let rows = "return [...document.querySelectorAll('table.tasks tr[data-task]')].map(r => r.dataset.task)";
    let first: Vec<String> = serde_json::from_value(b.script(rows, vec![]).await).unwrap_or_default();
    assert_eq!((first.len(), first.first().map(String::as_str)), (500, Some("t0000")));
    assert!(b.find("svg.graph").await.is_none() && b.find("p.no-graph").await.is_some(), "no graph of 1,001 tasks");
    assert_eq!(
        b.script("return document.querySelector('p.counts').textContent", vec![]).await,
        json!("1001 pending"),
        "the counts are the whole run's"
    );
    for (page, want) in [(2, "t0500"), (3, "t1000")] {
        let next = b.find("nav.pages a[rel=next]").await.unwrap_or_else(|| panic!("no next link"));
        b.click(&next).await;
        b.wait_for(&format!("page {page}"), &format!("location.search === '?page={page}'"), LIMIT).await;
        let got: Vec<String> = serde_json::from_value(b.script(rows, vec![]).await).unwrap_or_default();
        assert_eq!(got.first().map(String::as_str), Some(want), "page {page}");
    }
    assert!(b.find("nav.pages a[rel=next]").await.is_none(), "the last page");
    b.goto(&format!("{}/ui/runs/big?state=failed", s.base)).await;
    assert_eq!(b.script(rows, vec![]).await, json!([]), "none failed");
}
