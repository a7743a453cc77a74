//! Subagents over ACP, end to end through real processes: a parent `pier agent`
//! delegates to child agent processes (pier's own, and the TypeScript SDK's example
//! agent) over pipes, all models played by one fake endpoint that routes each request
//! by the first user message of its conversation.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pier_fake_model::body::{first_user, tool_names, tool_results};
use pier_fake_model::{FakeModel, Gate, Reply, Step};
use serde_json::{Value, json};
use support::{LIMIT, Options, PierProcess, must, stop_reason};

async fn fake() -> FakeModel {
    must(FakeModel::start().await, "start the fake model")
}

/// A model message calling `delegate` once per prompt, in one message.
fn delegate_calls(calls: &[(&str, Value)]) -> Reply {
    let mut steps = Vec::new();
    for (i, (id, args)) in calls.iter().enumerate() {
        steps.push(Step::ToolCallStart { index: i as u32, id: (*id).into(), name: "delegate".into() });
        steps.push(Step::ToolCallArgs { index: i as u32, fragment: args.to_string() });
    }
    steps.push(Step::Finish("tool_calls".into()));
    steps.push(Step::Done);
    Reply::Stream(steps)
}

fn delegate(id: &str, prompt: &str) -> Reply {
    delegate_calls(&[(id, json!({"prompt": prompt}))])
}

/// The parent: pier's automation profile with subagents on, allowed to delegate.
fn parent(f: &FakeModel) -> Options {
    Options::model(f.base_url()).arg("--subagents").arg("--allow").arg("other").capture_stderr()
}

trait Capture {
    fn capture_stderr(self) -> Self;
}

impl Capture for Options {
    fn capture_stderr(mut self) -> Self {
        self.capture_stderr = true;
        self
    }
}

/// Processes other than `except` whose working directory is `dir`: the children a
/// delegation started there (they all run in the parent's directory).
fn processes_in(dir: &Path, except: i32) -> Vec<(i32, String)> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if pid == except {
            continue;
        }
        if std::fs::read_link(entry.path().join("cwd")).is_ok_and(|cwd| cwd == dir) {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // A zombie has no cwd link; a live one with an empty cmdline is a kernel thread.
            found.push((pid, cmdline));
        }
    }
    found
}

/// Waits (bounded) until no process but `except` works in `dir`.
async fn none_left_in(dir: &Path, except: i32) {
    let until = Instant::now() + LIMIT;
    loop {
        let left = processes_in(dir, except);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "processes left behind: {left:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn workdir(p: &PierProcess) -> PathBuf {
    p.cwd()
}

#[tokio::test]
async fn a_parent_delegates_to_a_child_pier_and_gets_its_answer() {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("plan the work", None) => delegate("d1", "child: name a colour"),
        ("plan the work", Some(result)) => Reply::text(&format!("the child said: {result}")),
        ("child: name a colour", _) => Reply::text("teal"),
        (other, _) => Reply::text(&format!("unexpected conversation {other}")),
    });
    let (mut p, sid) = PierProcess::start(parent(&f)).await;
    let id = p.prompt(&sid, "plan the work").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}\n{}", p.stderr());
    assert_eq!(support::agent_texts(&notes, &sid), vec!["the child said: teal"]);
    let bodies: Vec<Value> = f.requests().into_iter().map(|r| r.body).collect();
    let child: Vec<&Value> = bodies.iter().filter(|b| first_user(b) == "child: name a colour").collect();
    assert_eq!(child.len(), 1, "one child request");
    // The child is pier's own agent at depth 1: it may delegate once more.
    assert!(tool_names(child[0]).contains(&"delegate".to_owned()), "{:?}", tool_names(child[0]));
    // The child ended with the call: nothing of it is left.
    none_left_in(&workdir(&p), p.pid).await;
}

#[tokio::test]
async fn two_delegations_in_one_message_run_at_the_same_time() {
    let f = fake().await;
    let gate = Gate::new();
    let g = gate.clone();
    f.set_fallback(move |body| match (first_user(body).as_str(), tool_results(body).len()) {
        ("split it", 0) => {
            delegate_calls(&[("a", json!({"prompt": "child: A"})), ("b", json!({"prompt": "child: B"}))])
        }
        ("split it", _) => Reply::text(&tool_results(body).join(" + ")),
        (who, _) => Reply::Stream(vec![
            Step::Gate(g.clone()),
            Step::Text(format!("{} done", who.trim_start_matches("child: "))),
            Step::Finish("stop".into()),
            Step::Done,
        ]),
    });
    let (mut p, sid) = PierProcess::start(parent(&f)).await;
    let id = p.prompt(&sid, "split it").await;
    // Both children reach the model while neither has answered: they run concurrently.
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(3)).await, "both children's model requests");
    gate.open();
    gate.open();
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    // The answers go back in the calls' order, whatever order they finished in.
    assert_eq!(support::agent_texts(&notes, &sid), vec!["A done + B done"]);
    none_left_in(&workdir(&p), p.pid).await;
}

/// A child that runs one command and then reports the tool's result.
fn command_child(body: &Value, command: &str) -> Reply {
    match tool_results(body).pop() {
        None => Reply::tool_call("c1", "run_command", &json!({"command": command}).to_string()),
        Some(result) => Reply::text(&format!("child saw: {}", result.lines().next().unwrap_or_default())),
    }
}

/// The parent's text, whether the child's file exists, and the parent's stderr.
async fn run_command_delegation(extra: &[&str]) -> (String, bool, String) {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("make the file", None) => delegate("d1", "child: touch it"),
        ("make the file", Some(result)) => Reply::text(&result),
        (_, _) => command_child(body, "touch made-by-child"),
    });
    let mut opts = parent(&f);
    for a in extra {
        opts = opts.arg(a);
    }
    let (mut p, sid) = PierProcess::start(opts).await;
    let id = p.prompt(&sid, "make the file").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    let said = support::agent_texts(&notes, &sid).join("");
    assert!(
        !notes.iter().any(|n| n["method"] == "session/request_permission"),
        "the parent's policy decided; nobody was asked: {notes:?}"
    );
    none_left_in(&workdir(&p), p.pid).await;
    (said, workdir(&p).join("made-by-child").is_file(), p.stderr())
}

#[tokio::test]
async fn a_childs_command_runs_when_the_parents_policy_allows_it() {
    let (said, made, stderr) = run_command_delegation(&["--allow", "execute"]).await;
    assert!(made, "the child ran its command: {said}\n{stderr}");
    assert!(said.contains("child saw"), "{said}");
}

#[tokio::test]
async fn a_childs_command_is_refused_when_the_parents_policy_denies_it() {
    let (said, made, _) = run_command_delegation(&["--deny", "execute"]).await;
    assert!(!made, "the command did not run");
    assert!(said.contains("child saw: error"), "the child was told: {said}");
}

/// A child that asks about `touch asked` with all four options and reports which came back.
struct AskingChild {
    spec: String,
    record: PathBuf,
    _dir: tempfile::TempDir,
}

impl AskingChild {
    fn new() -> AskingChild {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/asking_agent.py");
        let dir = must(tempfile::tempdir(), "record dir");
        let record = dir.path().join("answers");
        AskingChild { spec: format!("python3 {}", script.display()), record, _dir: dir }
    }

    fn env(&self, opts: &mut Options) {
        opts.env.push(("ASK_RECORD".into(), self.record.display().to_string()));
    }

    /// The answers the child received, in order.
    fn answers(&self) -> Vec<String> {
        std::fs::read_to_string(&self.record).unwrap_or_default().lines().map(str::to_owned).collect()
    }
}

/// An editor-profile parent allowed to delegate, its model delegating to `spec` once per
/// prompt of the form "ask N" (N delegations in a row), then answering with the results.
fn asking_parent(f: &FakeModel, child: &AskingChild, toml_extra: &str) -> Options {
    let spec = child.spec.clone();
    f.set_fallback(move |body| {
        let wanted: usize = first_user(body).trim_start_matches("ask ").parse().unwrap_or(1);
        let done = tool_results(body);
        if done.len() < wanted {
            delegate_calls(&[(&format!("d{}", done.len() + 1), json!({"prompt": "do it", "agent": spec}))])
        } else {
            Reply::text(&done.join(" | "))
        }
    });
    let mut opts = Options {
        pier_toml: Some(format!(
            "profile = \"editor\"\nprovider = \"fake\"\n[providers.fake]\nbase_url = \"{}\"\nmodel = \"fake-model\"\nmax_retries = 0\n[permissions]\nother = \"allow\"\n{toml_extra}",
            f.base_url()
        )),
        capture_stderr: true,
        ..Options::default()
    };
    child.env(&mut opts);
    opts
}

#[tokio::test]
async fn in_ask_a_childs_tool_call_reaches_the_parents_client_and_comes_back_once_only() {
    let f = fake().await;
    let child = AskingChild::new();
    let (mut p, sid) = PierProcess::start(asking_parent(&f, &child, "")).await;
    let id = p.prompt(&sid, "ask 2").await;
    let mut asked = Vec::new();
    let resp = loop {
        let frame = p.next_frame().await;
        if frame["method"] == "session/request_permission" {
            asked.push(frame.clone());
            let always = frame["params"]["options"]
                .as_array()
                .and_then(|o| o.iter().find(|o| o["kind"] == "allow_always"))
                .map(|o| o["optionId"].clone())
                .unwrap_or_else(|| panic!("no allow_always offered: {frame}"));
            p.send(&json!({"jsonrpc": "2.0", "id": frame["id"], "result": {"outcome": {"outcome": "selected", "optionId": always}}}))
                .await;
        } else if frame.get("method").is_none() && frame["id"] == id {
            break frame;
        }
    };
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    // Asked once, about the child's command, on the parent's delegate call.
    assert_eq!(asked.len(), 1, "the second child's command was covered by the remembered answer: {asked:?}");
    let call = &asked[0]["params"]["toolCall"];
    assert_eq!(call["toolCallId"], "d1", "{call}");
    assert_eq!(call["kind"], "execute", "{call}");
    assert!(call["title"].as_str().is_some_and(|t| t.ends_with(": touch asked")), "{call}");
    // The person said "always"; each child, offered all four options, got a once-answer.
    assert_eq!(child.answers(), vec!["once", "once"]);
    none_left_in(&workdir(&p), p.pid).await;
}

#[tokio::test]
async fn the_parents_policy_answers_a_childs_question_allow_once_or_reject_once() {
    for (rule, expected) in [("allow", "once"), ("deny", "no")] {
        let f = fake().await;
        let child = AskingChild::new();
        let (mut p, sid) = PierProcess::start(asking_parent(&f, &child, &format!("execute = \"{rule}\"\n"))).await;
        let id = p.prompt(&sid, "ask 1").await;
        let (notes, resp) = p.read_until_response(id).await;
        assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
        assert!(!notes.iter().any(|n| n["method"] == "session/request_permission"), "the policy decided: {notes:?}");
        assert_eq!(child.answers(), vec![expected], "{rule}");
        none_left_in(&workdir(&p), p.pid).await;
    }
}

#[tokio::test]
async fn cancelling_the_parent_answers_a_childs_open_question_cancelled() {
    let f = fake().await;
    let child = AskingChild::new();
    let (mut p, sid) = PierProcess::start(asking_parent(&f, &child, "")).await;
    let id = p.prompt(&sid, "ask 1").await;
    // The question reaches the parent's client, which does not answer it.
    frames_until(&mut p, |fr| fr["method"] == "session/request_permission").await;
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "cancelled", "{resp}");
    assert_eq!(child.answers(), vec!["cancelled"], "the child's question was answered cancelled (R088)");
    none_left_in(&workdir(&p), p.pid).await;
}

#[tokio::test]
async fn cancelling_one_child_withdraws_its_open_question_and_the_parent_goes_on() {
    let f = fake().await;
    let child = AskingChild::new();
    let opts = asking_parent(&f, &child, "");
    let mut p = PierProcess::spawn(opts).await;
    let r = p.call("initialize", json!({"protocolVersion": 1, "clientCapabilities": {"subagents": {}}})).await;
    assert!(r.get("result").is_some(), "{r}");
    let sid = p.new_session().await;
    let id = p.prompt(&sid, "ask 1").await;
    let frames = frames_until(&mut p, |fr| fr["method"] == "session/request_permission").await;
    let announced = frames.iter().map(update).find(|u| u["sessionUpdate"] == "subagent_update");
    let child_sid = announced.and_then(|u| u["sessionId"].as_str()).unwrap_or_else(|| panic!("{frames:?}")).to_owned();
    // The editor cancels the child alone while its question waits for the person.
    p.notify("session/cancel", json!({"sessionId": child_sid})).await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "only the child was cancelled: {resp}");
    assert_eq!(child.answers(), vec!["cancelled"]);
    let said: String = notes
        .iter()
        .map(update)
        .filter(|u| u["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|u| u["content"]["text"].as_str())
        .collect();
    assert!(said.contains("`cancelled`"), "{said}");
    // The delegate call shows itself again after the question showed the child's call.
    let restated = notes.iter().map(update).any(|u| {
        u["toolCallId"] == "d1"
            && u["kind"] == "other"
            && u["title"].as_str().is_some_and(|t| t.starts_with("Delegate to"))
    });
    assert!(restated, "{notes:?}");
    none_left_in(&workdir(&p), p.pid).await;
}

/// A pier child runs a long command; the parent is SIGKILLed: the child's guard tells it
/// (SIGTERM), it cancels its turn, which ends the command (its own session and cgroup).
#[tokio::test]
async fn a_sigkilled_parent_leaves_no_command_of_a_child_pier() {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("sleepy", None) => delegate("d1", "child: sleep"),
        ("child: sleep", None) => Reply::tool_call("c1", "run_command", &json!({"command": "sleep 600"}).to_string()),
        (_, _) => Reply::Hang,
    });
    let (mut p, sid) = PierProcess::start(parent(&f).arg("--allow").arg("execute")).await;
    let _ = p.prompt(&sid, "sleepy").await;
    let dir = workdir(&p);
    let until = Instant::now() + LIMIT;
    while !processes_in(&dir, p.pid).iter().any(|(_, cmd)| cmd.starts_with("sleep 600")) {
        assert!(
            Instant::now() < until,
            "the child's command never started: {:?}\n{}",
            processes_in(&dir, p.pid),
            p.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    must(nix_kill(p.pid), "SIGKILL the parent");
    p.wait_exit().await;
    none_left_in(&dir, -1).await;
}

async fn child_stops_with(finish: &str, wire: &str) {
    let f = fake().await;
    let finish = finish.to_owned();
    f.set_fallback(move |body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("try", None) => delegate("d1", "child: go"),
        ("try", Some(result)) => Reply::text(&result),
        (_, _) => Reply::Stream(vec![Step::Text("partial".into()), Step::Finish(finish.clone()), Step::Done]),
    });
    let (mut p, sid) = PierProcess::start(parent(&f)).await;
    let id = p.prompt(&sid, "try").await;
    let (notes, resp) = p.read_until_response(id).await;
    // The parent's turn goes on after the failed call.
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    let said = support::agent_texts(&notes, &sid).join("");
    assert!(said.starts_with("error: ") && said.contains(wire) && said.contains("partial"), "{said}");
}

#[tokio::test]
async fn a_childs_refusal_fails_the_call_with_the_reason() {
    child_stops_with("content_filter", "`refusal`").await;
}

#[tokio::test]
async fn a_childs_max_tokens_fails_the_call_with_the_reason() {
    child_stops_with("length", "`max_tokens`").await;
}

#[tokio::test]
async fn a_grandchild_is_not_offered_delegate_at_the_default_depth() {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("top", None) => delegate("d1", "child: middle"),
        ("child: middle", None) => delegate("d2", "grandchild: bottom"),
        ("grandchild: bottom", _) => Reply::text("from the bottom"),
        (_, Some(result)) => Reply::text(&result),
        (_, None) => Reply::text("unexpected"),
    });
    let (mut p, sid) = PierProcess::start(parent(&f)).await;
    let id = p.prompt(&sid, "top").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    assert_eq!(support::agent_texts(&notes, &sid), vec!["from the bottom"]);
    let bodies: Vec<Value> = f.requests().into_iter().map(|r| r.body).collect();
    for b in &bodies {
        let has = tool_names(b).contains(&"delegate".to_owned());
        match first_user(b).as_str() {
            "grandchild: bottom" => assert!(!has, "depth 2 is not offered delegate"),
            _ => assert!(has, "depths 0 and 1 are"),
        }
    }
    none_left_in(&workdir(&p), p.pid).await;
}

/// A child whose parent cannot answer its questions is not told it may ask (S3-14): even an
/// editor-profile child, which offers `ask_user` to any client that answers form questions, is
/// not offered it under a delegation.
#[tokio::test]
async fn a_delegated_child_is_never_offered_questions_its_parent_must_decline() {
    let f = fake().await;
    let child = format!("{} agent --profile editor", support::pier_exe());
    f.set_fallback(move |body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("top", None) => delegate_calls(&[("d1", json!({"prompt": "child: hello", "agent": child}))]),
        (_, Some(result)) => Reply::text(&result),
        (_, None) => Reply::text("hi"),
    });
    // The parent's client answers form questions.
    let mut p = PierProcess::spawn(parent(&f)).await;
    let init =
        p.call("initialize", json!({"protocolVersion": 1, "clientCapabilities": {"elicitation": {"form": {}}}})).await;
    assert!(init.get("result").is_some(), "{init}");
    let sid = p.new_session().await;
    let id = p.prompt(&sid, "top").await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}\n{}", p.stderr());
    let bodies: Vec<Value> = f.requests().into_iter().map(|r| r.body).collect();
    let child: Vec<&Value> = bodies.iter().filter(|b| first_user(b) == "child: hello").collect();
    assert_eq!(child.len(), 1, "one child request\n{}", p.stderr());
    assert!(!tool_names(child[0]).contains(&"ask_user".to_owned()), "{:?}", tool_names(child[0]));
    assert!(tool_names(child[0]).contains(&"read_file".to_owned()), "{:?}", tool_names(child[0]));
    none_left_in(&workdir(&p), p.pid).await;
}

/// A parent whose turn delegated twice, both children waiting on the model for good.
async fn fanned_out(f: &FakeModel) -> (PierProcess, String, i64) {
    f.set_fallback(|body| match first_user(body).as_str() {
        "fan out" => delegate_calls(&[("a", json!({"prompt": "child: A"})), ("b", json!({"prompt": "child: B"}))]),
        _ => Reply::Hang,
    });
    let (mut p, sid) = PierProcess::start(parent(f)).await;
    let id = p.prompt(&sid, "fan out").await;
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(3)).await, "both children working");
    (p, sid, id)
}

#[tokio::test]
async fn cancelling_the_parent_mid_delegation_ends_every_child() {
    let f = fake().await;
    let (mut p, sid, id) = fanned_out(&f).await;
    assert_eq!(processes_in(&workdir(&p), p.pid).len(), 4, "two children run, each under its guard");
    let started = Instant::now();
    p.notify("session/cancel", json!({"sessionId": sid})).await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "cancelled", "{resp}");
    assert!(started.elapsed() < Duration::from_secs(5), "the children confirmed the cancel: {:?}", started.elapsed());
    for call in ["a", "b"] {
        let last = notes
            .iter()
            .filter(|n| n["params"]["update"]["toolCallId"] == call)
            .filter_map(|n| n["params"]["update"]["status"].as_str())
            .next_back();
        // The automation profile shows no tool calls; the log has them.
        assert!(last.is_none() || last == Some("failed"), "{call}: {last:?}");
    }
    // Every child is gone by the time the prompt answered.
    assert!(processes_in(&workdir(&p), p.pid).is_empty(), "{:?}", processes_in(&workdir(&p), p.pid));
    // The delegate calls ended failed, cancelled, in the parent's log.
    let log = support::read_log(&p.data_dir(), &sid);
    for call in ["a", "b"] {
        let last =
            log.iter().rfind(|r| r["call"]["id"] == call).unwrap_or_else(|| panic!("no record of {call}: {log:?}"));
        assert!(last.to_string().contains("\"failed\"") && last.to_string().contains("cancelled"), "{last}");
    }
}

#[tokio::test]
async fn a_sigkilled_parent_leaves_no_child() {
    let f = fake().await;
    let (mut p, _, _) = fanned_out(&f).await;
    let dir = workdir(&p);
    assert!(!processes_in(&dir, p.pid).is_empty(), "the children run");
    must(nix_kill(p.pid), "SIGKILL the parent");
    p.wait_exit().await;
    none_left_in(&dir, -1).await;
}

/// A child that ignores the end of its input and left a grandchild in its group: only the
/// guard leading the child's group, told by the kernel that the parent died, ends them.
#[tokio::test]
async fn a_sigkilled_parent_leaves_no_grandchild_of_a_child_that_ignores_it() {
    let f = fake().await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lingering_agent.py");
    let spec = format!("python3 {}", script.display());
    f.set_fallback(move |_| delegate_calls(&[("d1", json!({"prompt": "linger", "agent": spec}))]));
    let marker = must(tempfile::tempdir(), "marker dir");
    let marker_file = marker.path().join("started");
    let mut opts = parent(&f);
    opts.env.push(("LINGER_MARKER".into(), marker_file.display().to_string()));
    let (mut p, sid) = PierProcess::start(opts).await;
    let _ = p.prompt(&sid, "go").await;
    let until = Instant::now() + LIMIT;
    while !marker_file.exists() {
        assert!(Instant::now() < until, "the child never started its grandchild: {}", p.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dir = workdir(&p);
    let running = processes_in(&dir, p.pid);
    assert!(running.iter().any(|(_, cmd)| cmd.starts_with("sleep")), "{running:?}");
    must(nix_kill(p.pid), "SIGKILL the parent");
    p.wait_exit().await;
    none_left_in(&dir, -1).await;
}

#[allow(unsafe_code)]
fn nix_kill(pid: i32) -> Result<(), String> {
    // SAFETY: kill(2) with a pid we started; no memory is touched.
    if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 { Ok(()) } else { Err("kill failed".into()) }
}

#[tokio::test]
async fn a_parent_delegates_to_the_typescript_sdk_example_agent() {
    let f = fake().await;
    let sdk = support::sdk_agent();
    let spec = sdk.clone();
    f.set_fallback(move |body| match tool_results(body).pop() {
        None => delegate_calls(&[("d1", json!({"prompt": "hello", "agent": spec}))]),
        Some(result) => Reply::text(&format!("sdk said: {result}")),
    });
    // Its edit asks; the parent's policy allows edits here.
    let (mut p, sid) = PierProcess::start(parent(&f).arg("--allow").arg("edit")).await;
    let id = p.prompt(&sid, "ask the sdk agent").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}\n{}", p.stderr());
    let said = support::agent_texts(&notes, &sid).join("");
    assert!(said.starts_with("sdk said: ") && !said.contains("error:"), "{said}\n{}", p.stderr());
    none_left_in(&workdir(&p), p.pid).await;
}

/// An editor-profile parent whose client may or may not advertise `subagents`.
async fn editor_parent(f: &FakeModel, subagents: bool) -> (PierProcess, String) {
    let opts = Options {
        pier_toml: Some(format!(
            "profile = \"editor\"\nprovider = \"fake\"\n[providers.fake]\nbase_url = \"{}\"\nmodel = \"fake-model\"\nmax_retries = 0\n[permissions]\nother = \"allow\"\n",
            f.base_url()
        )),
        capture_stderr: true,
        ..Options::default()
    };
    let mut p = PierProcess::spawn(opts).await;
    let caps = if subagents { json!({"subagents": {}}) } else { json!({}) };
    let r = p.call("initialize", json!({"protocolVersion": 1, "clientCapabilities": caps})).await;
    assert!(r.get("result").is_some(), "{r}");
    let sid = p.new_session().await;
    (p, sid)
}

fn update(frame: &Value) -> &Value {
    &frame["params"]["update"]
}

/// Frames until `stop` holds for one; returns them all, that one last.
async fn frames_until(p: &mut PierProcess, stop: impl Fn(&Value) -> bool) -> Vec<Value> {
    let mut seen = Vec::new();
    loop {
        let frame = p.next_frame().await;
        let done = stop(&frame);
        seen.push(frame);
        if done {
            return seen;
        }
    }
}

#[tokio::test]
async fn an_editor_sees_the_child_session_its_progress_and_its_end() {
    let f = fake().await;
    let gate = Gate::new();
    let g = gate.clone();
    f.set_fallback(move |body| match (first_user(body).as_str(), tool_results(body).len()) {
        ("look", 0) => delegate("d1", "child: look around"),
        ("look", _) => Reply::text("done"),
        (_, 0) => Reply::Stream(vec![
            Step::Text("looking around".into()),
            Step::ToolCallStart { index: 0, id: "c1".into(), name: "list_dir".into() },
            Step::ToolCallArgs { index: 0, fragment: "{\"path\": \".\"}".into() },
            Step::Finish("tool_calls".into()),
            Step::Done,
        ]),
        (_, _) => Reply::Stream(vec![
            Step::Gate(g.clone()),
            Step::Text("it is empty".into()),
            Step::Finish("stop".into()),
            Step::Done,
        ]),
    });
    let (mut p, sid) = editor_parent(&f, true).await;
    let id = p.prompt(&sid, "look").await;
    // The child's first message shows on the delegate call while it still runs.
    let mut frames = frames_until(&mut p, |fr| {
        let u = update(fr);
        u["toolCallId"] == "d1"
            && u["content"].as_array().is_some_and(|c| {
                c.iter().any(|c| c["content"]["text"].as_str().is_some_and(|t| t.contains("looking around")))
            })
    })
    .await;
    assert_eq!(
        f.requests().iter().filter(|r| first_user(&r.body) == "child: look around").count(),
        2,
        "the child waits at its gate"
    );
    gate.open();
    let (rest, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    frames.extend(rest);
    let subs: Vec<(usize, &Value)> = frames
        .iter()
        .enumerate()
        .filter(|(_, fr)| update(fr)["sessionUpdate"] == "subagent_update")
        .map(|(i, fr)| (i, update(fr)))
        .collect();
    assert_eq!(subs.len(), 2, "announced, then idle: {subs:?}");
    let child = subs[0].1["sessionId"].as_str().unwrap_or_else(|| panic!("{subs:?}")).to_owned();
    assert_eq!(subs[0].1["state"]["state"], "running", "{subs:?}");
    assert_eq!(subs[0].1["capabilities"]["cancel"], json!({}), "{subs:?}");
    assert!(subs[0].1["title"].as_str().is_some_and(|t| t.contains("Delegate to pier")), "{subs:?}");
    assert_eq!(subs[1].1["sessionId"], child.as_str());
    assert_eq!(subs[1].1["state"], json!({"state": "idle", "stopReason": "end_turn"}), "{subs:?}");
    // The call links the child's session, after the child was announced.
    let linked = frames
        .iter()
        .position(|fr| {
            update(fr)["toolCallId"] == "d1"
                && update(fr)["content"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| c["type"] == "session" && c["sessionId"] == child.as_str()))
        })
        .unwrap_or_else(|| panic!("no session reference: {frames:?}"));
    assert!(subs[0].0 < linked, "announced before it is referenced");
    let last =
        frames.iter().rev().find(|fr| update(fr)["toolCallId"] == "d1" && update(fr)["status"].is_string()).map(update);
    assert_eq!(last.map(|u| &u["status"]), Some(&json!("completed")));
    assert_ne!(child, sid, "the child has a session of its own");
    none_left_in(&workdir(&p), p.pid).await;
}

#[tokio::test]
async fn an_editor_cancels_one_child_and_the_parents_turn_goes_on() {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("work", None) => delegate("d1", "child: forever"),
        ("work", Some(result)) => Reply::text(&format!("after the child: {result}")),
        (_, _) => Reply::Hang,
    });
    let (mut p, sid) = editor_parent(&f, true).await;
    let id = p.prompt(&sid, "work").await;
    let frames = frames_until(&mut p, |fr| update(fr)["sessionUpdate"] == "subagent_update").await;
    let child =
        frames.last().map(|fr| update(fr)["sessionId"].as_str().unwrap_or_default().to_owned()).unwrap_or_default();
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(2)).await, "the child is working");
    p.notify("session/cancel", json!({"sessionId": child})).await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "only the child was cancelled: {resp}");
    let idle =
        notes.iter().map(update).find(|u| u["sessionUpdate"] == "subagent_update" && u["state"]["state"] == "idle");
    assert_eq!(idle.map(|u| &u["state"]["stopReason"]), Some(&json!("cancelled")), "{notes:?}");
    let said: String = notes
        .iter()
        .map(update)
        .filter(|u| u["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|u| u["content"]["text"].as_str())
        .collect();
    assert!(said.starts_with("after the child: error") && said.contains("`cancelled`"), "{said}");
    none_left_in(&workdir(&p), p.pid).await;
}

#[tokio::test]
async fn a_client_without_subagents_sees_no_child_session() {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("plain", None) => delegate("d1", "child: hello"),
        ("plain", Some(result)) => Reply::text(&result),
        (_, _) => Reply::text("hello back"),
    });
    let (mut p, sid) = editor_parent(&f, false).await;
    let id = p.prompt(&sid, "plain").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    assert!(!notes.iter().any(|n| update(n)["sessionUpdate"] == "subagent_update"), "{notes:?}");
    assert!(!notes.iter().any(|n| n.to_string().contains("\"type\":\"session\"")), "{notes:?}");
    let done = notes.iter().map(update).rfind(|u| u["toolCallId"] == "d1" && u["status"] == "completed");
    assert!(done.is_some_and(|u| u.to_string().contains("hello back")), "{notes:?}");
}

/// A parent delegates to a third-party agent whose model traffic goes to the fake in its
/// provider's API (as `scripts/interop.sh` sets them up); its answer comes back, and
/// nothing of it is left running.
async fn delegates_to_a_third_party(name: &str) {
    let f = fake().await;
    let scratch = must(tempfile::tempdir(), "scratch");
    let peer =
        must(pier_fake_model::peers::setup(name, &support::interop_bin(), scratch.path(), &f.base_url()), "peer setup");
    let spec = peer.command.clone();
    f.set_fallback(move |body| match (first_user(body).as_str(), tool_results(body).pop()) {
        ("ask the peer", None) => delegate_calls(&[("d1", json!({"prompt": "Say hello.", "agent": spec}))]),
        ("ask the peer", Some(result)) => Reply::text(&format!("the peer said: {result}")),
        _ => Reply::text("Hello from the peer."),
    });
    let mut opts = parent(&f);
    opts.env.extend(peer.env);
    let (mut p, sid) = PierProcess::start(opts).await;
    let id = p.prompt(&sid, "ask the peer").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}\n{}", p.stderr());
    let said = support::agent_texts(&notes, &sid).join("");
    // codex says a word of its own first (its model metadata warning).
    assert!(said.starts_with("the peer said: ") && said.ends_with("Hello from the peer."), "{said}\n{}", p.stderr());
    none_left_in(&workdir(&p), p.pid).await;
}

#[tokio::test]
async fn a_parent_delegates_to_codex_acp() {
    delegates_to_a_third_party("codex").await;
}

#[tokio::test]
async fn a_parent_delegates_to_claude_agent_acp() {
    delegates_to_a_third_party("claude").await;
}

#[tokio::test]
async fn a_parent_delegates_to_gemini_cli() {
    delegates_to_a_third_party("gemini").await;
}

#[tokio::test]
async fn max_subagents_bounds_the_delegations_running_at_once() {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).len()) {
        ("three", 0) => delegate_calls(&[
            ("a", json!({"prompt": "child: A"})),
            ("b", json!({"prompt": "child: B"})),
            ("c", json!({"prompt": "child: C"})),
        ]),
        ("three", _) => Reply::text(&tool_results(body).join(" + ")),
        (who, _) => Reply::text(&format!("{} done", who.trim_start_matches("child: "))),
    });
    let (mut p, sid) = PierProcess::start(parent(&f).arg("--max-subagents").arg("2")).await;
    let id = p.prompt(&sid, "three").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    assert_eq!(support::agent_texts(&notes, &sid), vec!["A done + B done + C done"]);
    // In the log: c started only once a or b had ended.
    let log = support::read_log(&p.data_dir(), &sid);
    let at = |call: &str, status: &str| {
        log.iter()
            .position(|r| r["call"]["id"] == call && r["call"]["status"] == status)
            .unwrap_or_else(|| panic!("no {call} {status}: {log:?}"))
    };
    let first_end = at("a", "completed").min(at("b", "completed"));
    assert!(at("c", "in_progress") > first_end, "c ran beside a and b");
    assert!(at("b", "in_progress") < at("a", "completed"), "a and b ran at once");
}

#[tokio::test]
async fn a_failed_question_to_the_parents_client_is_a_rejection_for_the_child() {
    let f = fake().await;
    let child = AskingChild::new();
    let (mut p, sid) = PierProcess::start(asking_parent(&f, &child, "")).await;
    let id = p.prompt(&sid, "ask 1").await;
    let frames = frames_until(&mut p, |fr| fr["method"] == "session/request_permission").await;
    let question = frames.last().map(|fr| fr["id"].clone()).unwrap_or_default();
    // The parent's client fails the request instead of answering it.
    p.send(&json!({"jsonrpc": "2.0", "id": question, "error": {"code": -32603, "message": "the editor crashed"}}))
        .await;
    let (_, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    assert_eq!(child.answers(), vec!["no"], "unavailable is a rejection, once");
    none_left_in(&workdir(&p), p.pid).await;
}

#[tokio::test]
async fn a_child_gets_no_directory_outside_the_parents_roots_and_stops_at_its_timeout() {
    let f = fake().await;
    f.set_fallback(|body| match (first_user(body).as_str(), tool_results(body).len()) {
        ("limits", 0) => delegate_calls(&[
            ("out", json!({"prompt": "child: escape", "cwd": "/"})),
            ("slow", json!({"prompt": "child: forever", "timeout_s": 0.5})),
        ]),
        ("limits", _) => Reply::text(&tool_results(body).join(" | ")),
        _ => Reply::Hang,
    });
    let (mut p, sid) = PierProcess::start(parent(&f)).await;
    let id = p.prompt(&sid, "limits").await;
    let (notes, resp) = p.read_until_response(id).await;
    assert_eq!(stop_reason(&resp), "end_turn", "{resp}");
    let said = support::agent_texts(&notes, &sid).join("");
    let (out, slow) = said.split_once(" | ").unwrap_or_else(|| panic!("{said}"));
    assert!(out.starts_with("error: ") && out.contains("outside"), "{out}");
    assert!(slow.contains("timed out"), "{slow}");
    assert_eq!(
        f.requests().iter().filter(|r| first_user(&r.body) == "child: escape").count(),
        0,
        "no child ran outside"
    );
    none_left_in(&workdir(&p), p.pid).await;
}
