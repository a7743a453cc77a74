//! The host and its agents in conversation (seed 001 §2.4, §3): what the host tells an
//! agent about the task it runs, through real `pier run` processes and a scripted agent
//! that records what it receives.

mod support;

use std::path::Path;

use pier_fake_model::body::{tool_names, tool_results};
use pier_fake_model::{FakeModel, Reply};
use serde_json::{Value, json};
use support::host::{Host, lines, stderr};
use support::must;

fn record_agent(h: &Host) -> std::path::PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/record_agent.py");
    let record = h.path("record.jsonl");
    h.write(
        "pier.toml",
        &format!(
            "[agents.rec]\ncommand = \"python3\"\nargs = [\"{}\"]\nenv = {{ RECORD_FILE = \"{}\" }}\n",
            script.display(),
            record.display()
        ),
    );
    record
}

fn recorded(path: &Path) -> Vec<Value> {
    let text = must(std::fs::read_to_string(path), "the agent's record");
    text.lines().map(|l| must(serde_json::from_str(l), "a recorded line")).collect()
}

#[tokio::test]
async fn the_tasks_identity_and_metadata_reach_the_agent_in_meta() {
    let h = Host::new(None);
    let record = record_agent(&h);
    let plan = h.write(
        "plan.toml",
        "[defaults]\nagent = \"rec\"\n\n[[tasks]]\nid = \"a\"\nprompt = \"first\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"second\"\n\
         depends_on = [\"a\"]\nmetadata = { owner = \"docs\", priority = 2 }\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "meta"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let seen = recorded(&record);
    let expected = json!({
        "run": "meta",
        "task": "b",
        "attempt": 1,
        "idempotencyKey": "pier:meta:b",
        "dependsOn": ["a"],
        "metadata": {"owner": "docs", "priority": 2},
    });
    for method in ["session/new", "session/prompt"] {
        let of_b: Vec<&Value> = seen
            .iter()
            .filter(|m| m["method"] == method && m["params"]["_meta"]["pier.dev/task"]["task"] == "b")
            .collect();
        assert_eq!(of_b.len(), 1, "{method}: {seen:#?}");
        assert_eq!(of_b[0]["params"]["_meta"]["pier.dev/task"], expected, "{method}");
    }
    // Task a has no dependencies and no metadata, and says so.
    let a = seen.iter().find(|m| m["method"] == "session/new" && m["params"]["_meta"]["pier.dev/task"]["task"] == "a");
    let a = must(a.ok_or("no session/new for a"), "a");
    assert_eq!(a["params"]["_meta"]["pier.dev/task"]["dependsOn"], json!([]));
    assert_eq!(a["params"]["_meta"]["pier.dev/task"]["metadata"], json!({}));
    // `pier show` lists the run, and shows one task whole.
    let listed = String::from_utf8_lossy(&h.run(&["show", "meta"]).await.stdout).into_owned();
    assert!(
        listed.lines().any(|l| l.starts_with("b ") && l.contains("completed") && l.contains("recorded")),
        "{listed}"
    );
    let one = h.run(&["show", "meta", "b", "--format", "json"]).await;
    let one: Value = must(serde_json::from_slice(&one.stdout), "show json");
    assert_eq!(one["task"]["spec"]["metadata"], json!({"owner": "docs", "priority": 2}));
    assert_eq!(one["attempts"][0]["output"]["text"], "recorded");
    assert_eq!(one["agent"]["init"]["agentInfo"]["name"], "record");
    let text = String::from_utf8_lossy(&h.run(&["show", "meta", "b"]).await.stdout).into_owned();
    assert!(text.contains("metadata: owner = \"docs\"; priority = 2") && text.contains("depends on: a"), "{text}");
}

/// The system message of the model requests made for a prompt.
fn system_of(f: &FakeModel) -> Vec<String> {
    f.requests()
        .iter()
        .filter_map(|r| r.body["messages"].as_array().and_then(|m| m.first()).cloned())
        .filter(|m| m["role"] == "system")
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect()
}

async fn own_agent_run(extra_toml: &str) -> Vec<String> {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| Reply::text("done"));
    let h = Host::new(Some(f.base_url()));
    h.write("pier.toml", extra_toml);
    let plan = h.write(
        "plan.toml",
        "[[tasks]]\nid = \"doc\"\nagent = \"pier\"\nprompt = \"write the docs\"\nmetadata = { owner = \"docs\", ticket = \"PIER-7\" }\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "own"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(lines(&o).iter().any(|e| e["type"] == "transition" && e["to"] == "completed"), "{}", stderr(&o));
    system_of(&f)
}

#[tokio::test]
async fn pier_s_own_agent_tells_its_model_the_tasks_metadata() {
    let systems = own_agent_run("").await;
    assert_eq!(systems.len(), 1, "{systems:?}");
    let system = &systems[0];
    assert!(system.contains("task `doc` of run `own`"), "{system}");
    assert!(system.contains("owner = docs") && system.contains("ticket = PIER-7"), "{system}");
}

#[tokio::test]
async fn the_task_paragraph_can_be_turned_off() {
    let systems = own_agent_run("task_context = false\n").await;
    assert!(systems.iter().all(|s| !s.contains("owner")), "{systems:?}");
}

#[tokio::test]
async fn a_plan_whose_agent_lacks_a_required_capability_is_refused_with_the_line() {
    let h = Host::new(None);
    record_agent(&h);
    let plan = h.write(
        "plan.toml",
        "[[tasks]]\nid = \"fine\"\nagent = \"rec\"\nprompt = \"hi\"\n\n[[tasks]]\nid = \"look\"\nagent = \"rec\"\n\
         prompt = \"describe the picture\"\nrequires = [\"image\", \"load_session\"]\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--run-id", "caps"]).await;
    assert_ne!(o.status.code(), Some(0));
    let err = stderr(&o);
    assert!(err.contains("line 6: task `look` requires `image`, which agent `rec` does not offer"), "{err}");
    assert!(err.contains("line 6: task `look` requires `load_session`"), "{err}");
    // Nothing was stored: the plan was refused as a whole.
    use pier_host::TaskStore;
    assert!(!must(h.store().run_exists("caps"), "run_exists"), "{err}");
    // The probe's answer is kept for the next plan.
    let agents = must(h.store().agents(), "agents");
    assert_eq!(agents.len(), 1, "{agents:?}");
    assert_eq!(agents[0].spec, "rec");
    assert_eq!(agents[0].init["agentInfo"]["name"], "record");
}

#[tokio::test]
async fn a_plan_whose_agent_offers_what_it_requires_runs_and_the_answer_is_recorded() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| Reply::text("done"));
    let h = Host::new(Some(f.base_url()));
    let plan = h.write(
        "plan.toml",
        "[[tasks]]\nid = \"t\"\nagent = \"pier\"\nprompt = \"go\"\nrequires = [\"load_session\", \"embedded_context\", \"mcp_http\"]\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "ok"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    use pier_host::TaskStore;
    let agents = must(h.store().agents(), "agents");
    let pier = agents.iter().find(|a| a.spec == "pier").unwrap_or_else(|| panic!("{agents:?}"));
    assert_eq!(pier.init["agentCapabilities"]["loadSession"], true, "{:?}", pier.init);
    assert_eq!(pier.init["agentInfo"]["name"], "pier");
}

#[tokio::test]
async fn an_unknown_requirement_is_refused_before_any_agent_is_asked() {
    let h = Host::new(None);
    let plan =
        h.write("plan.toml", "[[tasks]]\nid = \"t\"\nagent = \"pier\"\nprompt = \"go\"\nrequires = [\"telepathy\"]\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default()]).await;
    assert_ne!(o.status.code(), Some(0));
    let err = stderr(&o);
    assert!(err.contains("line 1: task `t`: unknown requirement `telepathy`"), "{err}");
    use pier_host::TaskStore;
    assert!(must(h.store().agents(), "agents").is_empty(), "no agent was started");
}

#[tokio::test]
async fn pier_say_reaches_a_task_that_another_process_runs() {
    use pier_fake_model::{Gate, Step};
    let f = must(FakeModel::start().await, "fake");
    let gate = Gate::new();
    let g = gate.clone();
    f.set_fallback(move |body| {
        let last = body["messages"]
            .as_array()
            .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
            .and_then(|m| m["content"].as_str())
            .unwrap_or_default()
            .to_owned();
        match last.as_str() {
            "draft the notes" => Reply::Stream(vec![
                Step::Text("draft".into()),
                Step::Gate(g.clone()),
                Step::Finish("stop".into()),
                Step::Done,
            ]),
            _ => Reply::text(&format!("revised: {last}")),
        }
    });
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("plan.toml", "[[tasks]]\nid = \"notes\"\nprompt = \"draft the notes\"\n");
    let host = must(h.command(&["run", plan.to_str().unwrap_or_default(), "--run-id", "say"]).spawn(), "pier run");
    must(tokio::time::timeout(support::LIMIT, f.wait_for_requests(1)).await, "the task runs");
    let said = h.run(&["say", "notes", "add a summary"]).await;
    assert_eq!(said.status.code(), Some(0), "{}", stderr(&said));
    assert!(String::from_utf8_lossy(&said.stdout).contains("message 1 for task `notes` of run `say`"));
    gate.open();
    let o = must(must(tokio::time::timeout(support::LIMIT, host.wait_with_output()).await, "pier run ends"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    use pier_host::TaskStore;
    let t = must(h.store().task("say", "notes"), "task").unwrap_or_else(|| panic!("no task"));
    assert_eq!(t.result.as_deref(), Some("revised: add a summary"));
    // `pier show` gives a block per turn: the task's prompt, then the message that opened the next.
    let shown = h.run(&["show", "say", "notes"]).await;
    let text = String::from_utf8_lossy(&shown.stdout).into_owned();
    let first = text.find("  turn 1, the task's prompt\n    said:\n      draft\n");
    let second = text.find("  turn 2, message 1 from cli:");
    assert!(first.is_some() && second.is_some() && first < second, "{text}");
    assert!(text.contains(": add a summary\n    said: the result above\n"), "{text}");
    assert_eq!(text.matches("revised: add a summary").count(), 1, "the result once: {text}");
    // A task that has ended takes no message, and says why.
    let late = h.run(&["say", "notes", "one more thing"]).await;
    assert_ne!(late.status.code(), Some(0));
    assert!(stderr(&late).contains("is completed: a message goes to a running task"), "{}", stderr(&late));
}

/// A host whose agent `ask` is the question-asking fixture; the answers it got go to a file.
fn elicit_host(f: Option<&FakeModel>) -> (Host, std::path::PathBuf) {
    let h = Host::new(f.map(FakeModel::base_url));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/elicit_agent.py");
    let record = h.path("answers.jsonl");
    h.write(
        "pier.toml",
        &format!(
            "[agents.ask]\ncommand = \"python3\"\nargs = [\"{}\"]\nenv = {{ ELICIT_RECORD = \"{}\" }}\n",
            script.display(),
            record.display()
        ),
    );
    (h, record)
}

/// Starts `pier run` of one task on the asking agent and waits until it waits for the person.
async fn parked(h: &Host, run: &str) -> tokio::process::Child {
    let plan = h.write("plan.toml", "[[tasks]]\nid = \"q\"\nagent = \"ask\"\nprompt = \"print the labels\"\n");
    let mut child = must(h.command(&["run", plan.to_str().unwrap_or_default(), "--run-id", run]).spawn(), "pier run");
    let until = std::time::Instant::now() + support::LIMIT;
    use pier_host::TaskStore;
    loop {
        let state = match h.store().task(run, "q") {
            Ok(t) => t.map(|t| t.state),
            Err(e) => panic!("{e}"),
        };
        if state == Some(pier_host::TaskState::AwaitingInput) {
            return child;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let out = must(child.wait_with_output().await, "output");
            panic!("pier run ended ({status}) before its task waited: {}", stderr(&out));
        }
        assert!(std::time::Instant::now() < until, "the task never waited for input: {state:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn an_agents_question_parks_the_task_until_pier_answer() {
    let (h, record) = elicit_host(None);
    let host = parked(&h, "q1").await;
    // The question is on record, with its message and fields.
    let events = lines(&h.run(&["events", "--run", "q1", "--format", "json"]).await);
    let question = events.iter().find(|e| e["type"] == "question").cloned().unwrap_or_default();
    assert_eq!(question["request"]["elicitation"]["message"], "Who is this for, and how many copies?", "{events:?}");
    // `pier show` says what the task waits for, and what its agent is.
    let shown = h.run(&["show", "q1", "q"]).await;
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(shown.contains("task q of run q1: awaiting_input"), "{shown}");
    assert!(
        shown.contains("waits: asks: Who is this for, and how many copies? — answer with `pier answer --run q1 q"),
        "{shown}"
    );
    assert!(shown.contains("agent: ask (elicit 1; offers: none of the requirement words)"), "{shown}");
    // Each field with its type and whether it is required (issue #34).
    assert!(shown.contains("fields: count (a whole number), name (text, required)"), "{shown}");
    // An answer that does not fit the fields is refused, and nothing is answered.
    let bad = h.run(&["answer", "q", "name=Ada", "count=eleven"]).await;
    assert_ne!(bad.status.code(), Some(0));
    assert!(stderr(&bad).contains("`count` must be a whole number"), "{}", stderr(&bad));
    let bad = h.run(&["answer", "q", "count=3"]).await;
    assert!(stderr(&bad).contains("required fields are missing: name"), "{}", stderr(&bad));
    let ok = h.run(&["answer", "q", "name=Ada", "count=3"]).await;
    assert_eq!(ok.status.code(), Some(0), "{}", stderr(&ok));
    let o = must(must(tokio::time::timeout(support::LIMIT, host.wait_with_output()).await, "pier run ends"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // The progress lines say what the task waits for and how to answer it.
    let shown = String::from_utf8_lossy(&o.stdout);
    assert!(
        shown.contains(
            "q: asks: Who is this for, and how many copies? — answer with `pier answer --run q1 q count=… name=…`"
        ),
        "{shown}"
    );
    let got: Vec<Value> = recorded(&record);
    assert_eq!(got, vec![json!({"action": "accept", "content": {"name": "Ada", "count": 3}})]);
    use pier_host::TaskStore;
    let t = must(h.store().task("q1", "q"), "task").unwrap_or_else(|| panic!("no task"));
    assert_eq!(t.state, pier_host::TaskState::Completed);
    assert!(t.result.as_deref().is_some_and(|r| r.contains("\"Ada\"")), "{:?}", t.result);
}

#[tokio::test]
async fn a_question_open_when_its_task_is_cancelled_is_answered_cancel() {
    let (h, record) = elicit_host(None);
    let mut host = parked(&h, "q2").await;
    use pier_host::TaskStore;
    must(h.store().cancel("q2", "q", "a person stopped it"), "cancel");
    let until = std::time::Instant::now() + support::LIMIT;
    while recorded_if_any(&record).is_empty() {
        assert!(std::time::Instant::now() < until, "the agent was never answered");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(recorded(&record), vec![json!({"action": "cancel"})]);
    // The attempt keeps what it showed, and `pier show` shows it.
    while h.store().attempts("q2", "q").ok().and_then(|a| a.first().and_then(|a| a.output.clone())).is_none() {
        assert!(std::time::Instant::now() < until, "the attempt's output was never kept");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let shown = h.run(&["show", "q2", "q"]).await;
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(shown.contains("task q of run q2: cancelled"), "{shown}");
    assert!(shown.contains("said:") && shown.contains(r#"got: {"action": "cancel"}"#), "{shown}");
    let _ = host.kill().await;
}

fn recorded_if_any(path: &Path) -> Vec<Value> {
    if path.exists() { recorded(path) } else { Vec::new() }
}

#[tokio::test]
async fn pier_exec_unattended_declines_a_question_at_once_and_says_so() {
    let (h, record) = elicit_host(None);
    let o = h.run(&["exec", "--agent", "ask", "print the labels"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(recorded(&record), vec![json!({"action": "decline"})]);
    assert!(stderr(&o).contains("the agent asked: Who is this for, and how many copies? — decline"), "{}", stderr(&o));
}

/// pier's own agent asks the person through the host: `ask_user` → `elicitation/create` →
/// the task waits → `pier answer` → the model reads the answer.
#[tokio::test]
async fn pier_s_own_agent_asks_the_person_through_the_host() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|body| match tool_results(body).pop() {
        None => Reply::tool_call(
            "a1",
            "ask_user",
            &json!({"message": "Which colour?", "fields": [{"name": "colour", "options": ["red", "blue"]}]})
                .to_string(),
        ),
        Some(answer) => Reply::text(&format!("noted: {}", answer.replace('\n', " "))),
    });
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("plan.toml", "[[tasks]]\nid = \"q\"\nagent = \"pier\"\nprompt = \"paint the shed\"\n");
    let mut host = must(h.command(&["run", plan.to_str().unwrap_or_default(), "--run-id", "own"]).spawn(), "pier run");
    let until = std::time::Instant::now() + support::LIMIT;
    use pier_host::TaskStore;
    while h.store().open_question("own", "q").ok().flatten().is_none() {
        if let Ok(Some(status)) = host.try_wait() {
            panic!("pier run ended ({status}) before the question");
        }
        assert!(std::time::Instant::now() < until, "the agent never asked");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(tool_names(&f.requests()[0].body).contains(&"ask_user".to_owned()), "offered under a client that answers");
    let bad = h.run(&["answer", "q", "colour=green"]).await;
    assert!(stderr(&bad).contains("`colour` must be one of: red, blue"), "{}", stderr(&bad));
    let ok = h.run(&["answer", "q", "colour=blue"]).await;
    assert_eq!(ok.status.code(), Some(0), "{}", stderr(&ok));
    let o = must(must(tokio::time::timeout(support::LIMIT, host.wait_with_output()).await, "pier run ends"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = must(h.store().task("own", "q"), "task").unwrap_or_else(|| panic!("no task"));
    assert_eq!(t.result.as_deref(), Some("noted: The user answered: - colour: blue"));
}

#[tokio::test]
async fn ask_user_is_not_offered_to_a_client_that_cannot_answer() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| Reply::text("ok"));
    let (mut p, sid) =
        support::PierProcess::start(support::Options::model(f.base_url()).arg("--profile").arg("editor")).await;
    let id = p.prompt(&sid, "hello").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(support::stop_reason(&resp), "end_turn");
    let names = tool_names(&f.requests()[0].body);
    assert!(!names.contains(&"ask_user".to_owned()) && names.contains(&"read_file".to_owned()), "{names:?}");
}

/// The automation profile asks nobody of its own accord (seed 003, S3-14): under a client that
/// answers form questions it offers `ask_user` only when the session's `_meta` asks for it; the
/// editor profile offers it to such a client.
#[tokio::test]
async fn ask_user_is_offered_in_automation_only_when_the_client_asks_for_it() {
    let offered = |profile: &'static str, meta: Value| async move {
        let f = must(FakeModel::start().await, "fake");
        f.set_fallback(|_| Reply::text("ok"));
        let mut p =
            support::PierProcess::spawn(support::Options::model(f.base_url()).arg("--profile").arg(profile)).await;
        let init = p
            .call("initialize", json!({"protocolVersion": 1, "clientCapabilities": {"elicitation": {"form": {}}}}))
            .await;
        assert!(init.get("result").is_some(), "{init}");
        let cwd = p.cwd();
        let new = p.call("session/new", json!({"cwd": cwd, "mcpServers": [], "_meta": meta})).await;
        let sid = new.pointer("/result/sessionId").and_then(Value::as_str).unwrap_or_default().to_owned();
        let id = p.prompt(&sid, "hello").await;
        let (_, resp) = p.read_until_response(id).await;
        assert_eq!(support::stop_reason(&resp), "end_turn", "{resp}");
        tool_names(&f.requests()[0].body).contains(&"ask_user".to_owned())
    };
    assert!(!offered("automation", json!({})).await, "automation offered ask_user unasked");
    assert!(offered("automation", json!({"pier.dev/askPerson": true})).await, "not offered when asked for");
    assert!(!offered("automation", json!({"pier.dev/askPerson": "yes"})).await, "only `true` asks for it");
    assert!(offered("editor", json!({})).await, "the editor profile offers it");
}

/// `pier exec` on a terminal (a pty from `script`) asks field by field, re-asking a bad answer.
#[tokio::test]
async fn pier_exec_on_a_terminal_asks_the_person_field_by_field() {
    use tokio::io::AsyncWriteExt;
    let (h, record) = elicit_host(None);
    let pier = support::pier_exe();
    let mut cmd = tokio::process::Command::new("script");
    cmd.args(["-q", "-e", "-c", &format!("{pier} exec --agent ask 'print the labels'"), "/dev/null"])
        .current_dir(h.path(""))
        .env_clear()
        .envs(h.vars.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = must(cmd.spawn(), "script");
    let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("stdin"));
    // Fields in order: count (a whole number, asked again after a bad answer), then name.
    must(stdin.write_all(b"eleven\n3\nAda\n").await, "answers");
    let o = must(must(tokio::time::timeout(support::LIMIT, child.wait_with_output()).await, "exec ends"), "wait");
    let screen = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{screen}");
    assert!(screen.contains("the agent asks: Who is this for, and how many copies?"), "{screen}");
    assert!(screen.contains("`count` must be a whole number"), "{screen}");
    assert_eq!(recorded(&record), vec![json!({"action": "accept", "content": {"count": 3, "name": "Ada"}})]);
}

/// An interrupting message while the task waits on its agent's question: the question is
/// withdrawn (the agent gets `cancel`), the message goes on the same session, and the
/// agent's next question is the one a person answers.
#[tokio::test]
async fn an_interrupting_message_withdraws_the_open_question() {
    let (h, record) = elicit_host(None);
    let host = parked(&h, "q3").await;
    let said = h.run(&["say", "--interrupt", "q", "use the blue labels"]).await;
    assert_eq!(said.status.code(), Some(0), "{}", stderr(&said));
    use pier_host::TaskStore;
    let until = std::time::Instant::now() + support::LIMIT;
    // The first question is withdrawn; the agent, prompted again, asks a second one.
    while h.store().open_question("q3", "q").ok().flatten().is_none_or(|q| q.n < 2) {
        assert!(std::time::Instant::now() < until, "no second question: {:?}", recorded_if_any(&record));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(recorded(&record), vec![json!({"action": "cancel"})]);
    let t = must(h.store().task("q3", "q"), "task").unwrap_or_else(|| panic!("no task"));
    assert_eq!(t.state, pier_host::TaskState::AwaitingInput);
    let ok = h.run(&["answer", "q", "name=Bo"]).await;
    assert_eq!(ok.status.code(), Some(0), "{}", stderr(&ok));
    let o = must(must(tokio::time::timeout(support::LIMIT, host.wait_with_output()).await, "pier run ends"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = must(h.store().task("q3", "q"), "task").unwrap_or_else(|| panic!("no task"));
    assert_eq!(t.attempt, 1, "the same attempt went on");
    assert!(t.result.as_deref().is_some_and(|r| r.contains("\"Bo\"")), "{:?}", t.result);
    // The withdrawn question let the task run again before the second one parked it.
    let events = lines(&h.run(&["events", "--run", "q3", "--format", "json"]).await);
    let kinds: Vec<String> = events
        .iter()
        .filter(|e| e["type"] == "question" || (e["type"] == "transition" && e["to"] == "running"))
        .map(|e| format!("{} {}", e["type"].as_str().unwrap_or(""), e["reason"].as_str().unwrap_or("")))
        .collect();
    let withdrawn = kinds.iter().position(|k| k.contains("its question was withdrawn"));
    let second = kinds.iter().enumerate().filter(|(_, k)| k.starts_with("question")).nth(1).map(|(i, _)| i);
    assert!(withdrawn.is_some() && withdrawn < second, "{kinds:?}");
    // No question is left open behind the task: a late answer reaches nobody and is refused.
    let late = h.run(&["answer", "q", "name=Late"]).await;
    assert_ne!(late.status.code(), Some(0), "a withdrawn question took an answer");
    assert!(stderr(&late).contains("asks no question"), "{}", stderr(&late));
    assert!(stderr(&late).contains("already answered: accept by cli:"), "who answered, and when: {}", stderr(&late));
}
