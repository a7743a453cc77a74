//! End-to-end tests of `pier run` and `pier events`: real `pier agent` processes
//! (and misbehaving ones) with a local fake model, on the embedded SQLite store.

mod support;

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;

use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::Value;
use support::host::{Host, dead_owner, lines, stderr};
use support::{LIMIT, echo, must, sdk_agent};

/// The seq of the first event matching (task, to-state).
fn seq_of(events: &[Value], task: &str, to: &str) -> i64 {
    events
        .iter()
        .find(|e| e["type"] == "transition" && e["task"] == task && e["to"] == to)
        .and_then(|e| e["seq"].as_i64())
        .unwrap_or_else(|| panic!("no {task} -> {to} in {events:#?}"))
}

#[tokio::test]
async fn a_diamond_runs_in_dependency_order_and_results_flow_through_the_host() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let plan = h.write(
        "plan.toml",
        r#"
[defaults]
agent = "pier"

[[tasks]]
id = "a"
prompt = "root"

[[tasks]]
id = "b"
depends_on = ["a"]
prompt = "left of {{tasks.a.result}}"

[[tasks]]
id = "c"
depends_on = ["a"]
prompt = "right"
metadata = { team = "docs" }

[[tasks]]
id = "d"
depends_on = ["b", "c"]
prompt = "join [{{tasks.b.result}}] [{{tasks.c.result}}]"
"#,
    );
    let o = h
        .run(&[
            "run",
            plan.to_str().unwrap_or_default(),
            "--format",
            "json",
            "--concurrency",
            "4",
            "--run-id",
            "diamond",
        ])
        .await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let events = lines(&o);
    let last = events.last().cloned().unwrap_or_default();
    assert_eq!(last["type"], "summary");
    assert_eq!(last["run"], "diamond");
    assert_eq!(last["counts"]["completed"], 4);
    assert!(seq_of(&events, "a", "completed") < seq_of(&events, "b", "running"));
    assert!(seq_of(&events, "a", "completed") < seq_of(&events, "c", "running"));
    assert!(seq_of(&events, "b", "completed") < seq_of(&events, "d", "running"));
    assert!(seq_of(&events, "c", "completed") < seq_of(&events, "d", "running"));
    let created = events.iter().find(|e| e["type"] == "task_created" && e["task"] == "c").cloned().unwrap_or_default();
    assert_eq!(created["metadata"]["team"], "docs");
    // The gap-free sequence and the session updates of each task are in the log.
    let seqs: Vec<i64> = events.iter().filter_map(|e| e["seq"].as_i64()).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    assert!(events.iter().any(|e| e["type"] == "session_update" && e["task"] == "d"));
    let prompts: Vec<String> = f.requests().iter().map(|r| r.body.to_string()).collect();
    assert!(prompts.iter().any(|p| p.contains("join [done: left of done: root] [done: right]")), "{prompts:#?}");
    // pier events prints the same log.
    let ev = h.run(&["events", "--run", "diamond", "--format", "json"]).await;
    assert_eq!(lines(&ev).len(), events.len() - 1);
}

#[tokio::test]
async fn bad_plans_are_refused_with_every_problem() {
    let h = Host::new(None);
    let plan = h.write(
        "bad.toml",
        "[[tasks]]\nid = \"a\"\nprompt = \"x\"\ndepends_on = [\"b\"]\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\ndepends_on = [\"a\", \"zzz\"]\nagent = \"no-such-agent-here\"\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default()]).await;
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("line 6: task `b` depends on unknown task `zzz`"), "{err}");
    assert!(err.contains("dependency cycle"), "{err}");
    assert!(err.contains("no-such-agent-here"), "{err}");
    assert!(!h.path("data/pier.db").exists(), "nothing was stored for a refused plan");
}

#[tokio::test]
async fn failed_attempts_are_retried_with_backoff_then_complete() {
    let f = must(FakeModel::start().await, "fake");
    f.push(Reply::status(401, "bad key once"));
    f.push(Reply::status(401, "bad key twice"));
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nprompt = \"hi\"\nmax_attempts = 3\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "20"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let moves: Vec<(String, String)> = lines(&o)
        .iter()
        .filter(|e| e["type"] == "transition")
        .map(|e| (e["to"].as_str().unwrap_or("").to_owned(), e["reason"].as_str().unwrap_or("").to_owned()))
        .collect();
    let states: Vec<&str> = moves.iter().map(|m| m.0.as_str()).collect();
    assert_eq!(states, ["running", "pending", "running", "pending", "running", "completed"]);
    assert!(moves[1].1.contains("retrying in"), "{moves:?}");
    let task = &h.store().tasks(&run_of(&o))[0];
    assert_eq!((task.attempt, task.failures), (3, 2));
    assert_eq!(task.result.as_deref(), Some("done: hi"));
}

fn run_of(o: &Output) -> String {
    lines(o).last().and_then(|l| l["run"].as_str().map(str::to_owned)).unwrap_or_default()
}

trait Tasks {
    fn tasks(&self, run: &str) -> Vec<pier_host::TaskRow>;
}

impl Tasks for pier_host::SqliteStore {
    fn tasks(&self, run: &str) -> Vec<pier_host::TaskRow> {
        must(pier_host::TaskStore::tasks(self, run), "tasks")
    }
}

/// After `pier run` ends the database file alone holds the store (nothing only in its -wal),
/// and `pier store backup` copies it whole to a new file, never over an existing one.
#[tokio::test]
async fn the_store_file_alone_holds_the_run_and_backs_up_whole() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nprompt = \"hi\"\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let run = run_of(&o);
    // What a user who copies pier.db (and only it) has.
    let copied = h.path("copied.db");
    must(std::fs::copy(h.path("data/pier.db"), &copied), "copy");
    let copy = must(pier_host::SqliteStore::open(&copied), "open the copy");
    let task = copy.tasks(&run).first().cloned();
    assert_eq!(task.and_then(|t| t.result), Some("done: hi".to_owned()), "pier.db alone holds the run");

    let backup = h.path("backup.db");
    let o = h.run(&["store", "backup", backup.to_str().unwrap_or_default()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let restored = must(pier_host::SqliteStore::open(&backup), "open the backup");
    assert_eq!(restored.tasks(&run).len(), 1, "the backup holds the run");
    let o = h.run(&["store", "backup", backup.to_str().unwrap_or_default()]).await;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("exists; a backup goes to a new file"), "{}", stderr(&o));
}

#[tokio::test]
async fn retries_stop_at_max_attempts_and_dependents_are_cancelled() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| Reply::status(401, "always bad"));
    let h = Host::new(Some(f.base_url()));
    let plan = h.write(
        "p.toml",
        "[[tasks]]\nid = \"a\"\nprompt = \"x\"\nmax_attempts = 2\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\ndepends_on = [\"a\"]\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "10"]).await;
    assert_eq!(o.status.code(), Some(1));
    let last = lines(&o).last().cloned().unwrap_or_default();
    assert_eq!((last["counts"]["failed"].as_u64(), last["counts"]["cancelled"].as_u64()), (Some(1), Some(1)));
    let b = lines(&o).into_iter().find(|e| e["task"] == "b" && e["to"] == "cancelled").unwrap_or_default();
    assert!(b["reason"].as_str().is_some_and(|r| r.contains("dependency `a` ended failed")), "{b}");
    assert_eq!(f.requests().len(), 2);
}

#[tokio::test]
async fn a_hanging_agent_times_out_is_cancelled_and_retried() {
    let f = must(FakeModel::start().await, "fake");
    f.push(Reply::Stream(vec![Step::Text("thinking".into()), Step::Hang]));
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nprompt = \"hi\"\ntimeout = 0.5\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "10"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let retry = lines(&o).into_iter().find(|e| e["to"] == "pending" && e["type"] == "transition").unwrap_or_default();
    assert!(retry["error"].as_str().is_some_and(|e| e.contains("timed out")), "{retry}");
    must(tokio::time::timeout(LIMIT, f.wait_for_disconnects(1)).await, "the hung stream was dropped");
}

fn agents_toml(h: &Host, name: &str, marker: &Path, report_effect: bool) {
    agents_toml_asking(h, name, marker, report_effect, false);
}

fn agents_toml_asking(h: &Host, name: &str, marker: &Path, report_effect: bool, ask: bool) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/crash_once_agent.py");
    let text = format!(
        "[agents.{name}]\ncommand = \"python3\"\nargs = [\"{}\"]\n\
         env = {{ CRASH_MARKER = \"{}\", REPORT_EFFECT = \"{}\", ASK = \"{}\" }}\n",
        script.display(),
        marker.display(),
        u8::from(report_effect),
        u8::from(ask)
    );
    h.write("pier.toml", &text);
}

#[tokio::test]
async fn a_warm_agent_serves_the_next_task_in_a_new_session_until_a_turn_ends_badly() {
    let h = Host::new(None);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pid_agent.py");
    h.write("pier.toml", &format!("[agents.pid]\ncommand = \"python3\"\nargs = [\"{}\"]\n", script.display()));
    // One at a time, in plan order: a and b share a process (and a stray update for a's
    // session, sent while b's session opens, is not b's); c hangs and times out, so
    // its process is not reused; d gets a fresh one; e asks for a process of its own;
    // f is served by d's, which waited in the pool.
    let plan = h.write(
        "p.toml",
        // The agent reports its pid, which a jail's PID namespace renumbers: unconfined here
        // (confine.rs holds the jail's own teardown).
        "[defaults]\nagent = \"pid\"\nsandbox = \"off\"\n\n[[tasks]]\nid = \"a\"\nprompt = \"late\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"x\"\n\n\
         [[tasks]]\nid = \"c\"\nprompt = \"hang\"\ntimeout = 0.3\nmax_attempts = 1\n\n\
         [[tasks]]\nid = \"d\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"e\"\nprompt = \"x\"\nfresh_agent = true\n\n\
         [[tasks]]\nid = \"f\"\nprompt = \"x\"\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--concurrency", "1"]).await;
    assert_eq!(o.status.code(), Some(1), "c failed, so the run did: {}", stderr(&o));
    let tasks: HashMap<String, pier_host::TaskRow> =
        h.store().tasks(&run_of(&o)).into_iter().map(|t| (t.id.clone(), t)).collect();
    let answer = |id: &str| -> (i32, String) {
        let text = tasks[id].result.clone().unwrap_or_default();
        let (pid, session) = text.split_once(' ').unwrap_or_default();
        (pid.trim_start_matches("pid=").parse().unwrap_or(0), session.to_owned())
    };
    let (a, b, d, e, f) = (answer("a"), answer("b"), answer("d"), answer("e"), answer("f"));
    assert_eq!(tasks["c"].state, pier_host::TaskState::Failed);
    assert!(a.0 > 0 && a.0 == b.0, "a and b ran on one warm agent: {a:?} {b:?}");
    assert_eq!((a.1.as_str(), b.1.as_str()), ("session=s1", "session=s2"), "each task has a session of its own");
    assert_ne!(d.0, a.0, "the agent whose turn timed out was not reused");
    assert_eq!(d.1, "session=s1");
    assert!(e.0 > 0 && e.0 != d.0, "fresh_agent got a process of its own: {e:?}");
    assert_eq!(f, (d.0, "session=s2".to_owned()), "the warm agent served the next task");
    for pid in [a.0, d.0, e.0] {
        assert!(!support::group_alive(pid), "agent {pid} outlived the run");
    }
}

#[tokio::test]
async fn an_agent_killed_mid_turn_is_retried_when_it_did_nothing() {
    let h = Host::new(None);
    agents_toml(&h, "flaky", &h.path("crashed"), false);
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nagent = \"flaky\"\nprompt = \"go\"\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "10"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = &h.store().tasks(&run_of(&o))[0];
    assert_eq!((t.attempt, t.result.as_deref()), (2, Some("survived")));
}

#[tokio::test]
async fn a_lost_attempt_with_side_effects_waits_for_a_person_unless_idempotent() {
    let h = Host::new(None);
    agents_toml(&h, "risky", &h.path("crashed"), true);
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nagent = \"risky\"\nprompt = \"go\"\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "10"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stdout));
    let waiting = lines(&o).into_iter().find(|e| e["to"] == "awaiting_input").unwrap_or_default();
    assert!(waiting["reason"].as_str().is_some_and(|r| r.contains("side effects")), "{waiting}");
    assert_eq!(waiting["evidence"][0]["kind"], "execute", "{waiting}");
    assert_eq!(lines(&o).last().map(|l| l["counts"]["awaiting_input"].clone()), Some(1.into()));
    // The summary, `pier show` and `pier events` say what it waits for and the command that answers.
    let run = run_of(&o);
    let asks = lines(&o).last().map(|l| l["waiting"][0]["asks"].clone()).unwrap_or_default();
    let answer = format!("`pier approve --run {run} t` runs it, `pier deny --run {run} t` cancels it");
    assert!(asks.as_str().is_some_and(|a| a.contains(&answer)), "{asks}");
    let shown = String::from_utf8_lossy(&h.run(&["show", &run]).await.stdout).into_owned();
    assert!(shown.contains(&format!("? t a person decides whether it runs again — {answer}")), "{shown}");
    let events = String::from_utf8_lossy(&h.run(&["events", "--run", &run]).await.stdout).into_owned();
    assert!(events.lines().any(|l| l.contains("-> awaiting_input") && l.contains(&answer)), "{events}");
    // A person approves running it again; the resumed run completes it.
    let approved = h.run(&["approve", "t"]).await;
    assert_eq!(approved.status.code(), Some(0), "{}", stderr(&approved));
    let resumed = h.run(&["run", "--resume", &run_of(&o), "--format", "json"]).await;
    assert_eq!(resumed.status.code(), Some(0), "{}", stderr(&resumed));
    let t = &h.store().tasks(&run_of(&o))[0];
    assert_eq!((t.state, t.result.as_deref()), (pier_host::TaskState::Completed, Some("survived")));

    // The same with `idempotent = true` runs again and completes.
    let h = Host::new(None);
    agents_toml(&h, "risky", &h.path("crashed"), true);
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nagent = \"risky\"\nprompt = \"go\"\nidempotent = true\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "10"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[tokio::test]
async fn an_expired_lease_of_a_dead_host_is_reclaimed_on_resume() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    h.claimed_elsewhere("r1", dead_owner(), i64::MAX);
    let o = h.run(&["run", "--resume", "r1", "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lost = lines(&o).into_iter().find(|e| e["type"] == "transition" && e["to"] == "pending").unwrap_or_default();
    assert!(
        lost["reason"].as_str().is_some_and(|r| r.contains("its host died") && r.contains("no side effects")),
        "{lost}"
    );
    let t = &h.store().tasks("r1")[0];
    assert_eq!((t.state, t.attempt), (pier_host::TaskState::Completed, 2));
}

#[tokio::test]
async fn a_question_of_a_dead_host_is_void_and_a_person_decides_the_rerun() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    {
        // A host (long dead) claimed t, its agent edited a file, then asked a person.
        let attempt = h.claimed_elsewhere("r1", dead_owner(), i64::MAX);
        let store = h.store();
        let effect = serde_json::json!({"toolCallId": "e1", "kind": "edit", "status": "completed"});
        must(pier_host::TaskStore::record(&store, &attempt, &[], &[effect]), "evidence");
        let ask = serde_json::json!({"sessionId": "s", "toolCall": {"toolCallId": "t1"},
            "options": [{"optionId": "allow_once", "kind": "allow_once", "name": "Allow"}]});
        let ask = must(pier_host::QuestionRequest::from_stored(ask), "a permission request");
        must(pier_host::TaskStore::park(&store, &attempt, &ask), "ask, waiting for a person");
    }
    let o = h.run(&["run", "--resume", "r1", "--format", "json"]).await;
    assert_ne!(o.status.code(), Some(0), "the task still waits for a person");
    let lost = lines(&o).into_iter().find(|e| e["type"] == "transition" && e["task"] == "t").unwrap_or_default();
    assert!(
        lost["reason"].as_str().is_some_and(|r| r.contains("its host died") && r.contains("a person must decide")),
        "{lost}"
    );
    let t = h.store().tasks("r1")[0].clone();
    assert_eq!((t.state, t.lease_owner.as_deref()), (pier_host::TaskState::AwaitingInput, None));
    assert_eq!(must(pier_host::TaskStore::open_question(&h.store(), "r1", "t"), "question"), None);
    // pier approve now decides the re-run, not the dead agent's question.
    let approved = h.run(&["approve", "t"]).await;
    assert_eq!(approved.status.code(), Some(0), "{}", stderr(&approved));
    assert!(String::from_utf8_lossy(&approved.stdout).contains("is now pending"));
    let o = h.run(&["run", "--resume", "r1", "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = &h.store().tasks("r1")[0];
    assert_eq!((t.state, t.attempt), (pier_host::TaskState::Completed, 2));
}

#[tokio::test]
async fn an_agent_that_dies_while_a_person_is_asked_after_side_effects_leaves_the_rerun_to_a_person() {
    let h = Host::new(None);
    agents_toml_asking(&h, "risky", &h.path("crashed"), true, true);
    let plan = h.write(
        "p.toml",
        "[[tasks]]\nid = \"t\"\nagent = \"risky\"\nprompt = \"go\"\npermissions = { execute = \"ask\" }\n",
    );
    let mut first = h.command(&["run", plan.to_str().unwrap_or_default(), "--run-id", "r", "--format", "json"]);
    first.env("RUST_LOG", "warn");
    let o = must(
        must(tokio::time::timeout(LIMIT, must(first.spawn(), "spawn").wait_with_output()).await, "in time"),
        "wait",
    );
    assert_eq!(o.status.code(), Some(1), "the task waits for a person: {}", stderr(&o));
    // The question dies with the agent that asked it: nothing waits on it until a timeout.
    assert!(!stderr(&o).contains("settle timeout"), "{}", stderr(&o));
    let events = lines(&o);
    let last = events.iter().rev().find(|e| e["type"] == "transition" && e["task"] == "t").cloned().unwrap_or_default();
    assert_eq!(last["to"], "awaiting_input", "{events:#?}");
    assert!(last["reason"].as_str().is_some_and(|r| r.contains("a person must decide")), "{last}");
    // A person decides the re-run (the dead agent's question is void), and it completes.
    let approved = h.run(&["approve", "t"]).await;
    assert_eq!(approved.status.code(), Some(0), "{}", stderr(&approved));
    let said = String::from_utf8_lossy(&approved.stdout).into_owned();
    assert!(said.contains("is now pending"), "{said}");
    let o = h.run(&["run", "--resume", "r", "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = &h.store().tasks("r")[0];
    assert_eq!((t.state, t.attempt, t.result.as_deref()), (pier_host::TaskState::Completed, 2, Some("survived")));
}

#[tokio::test]
async fn a_lease_that_expired_in_time_is_reclaimed() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    // A host on another machine, silent past its lease.
    h.claimed_elsewhere("r2", "elsewhere:1:x".into(), pier_host::store::now_ms() - 1);
    let o = h.run(&["run", "--resume", "r2", "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lost = lines(&o).into_iter().find(|e| e["type"] == "transition" && e["to"] == "pending").unwrap_or_default();
    assert!(lost["reason"].as_str().is_some_and(|r| r.contains("its lease expired")), "{lost}");
}

#[tokio::test]
async fn an_agent_that_ignores_the_cancel_is_killed_and_the_attempt_retried() {
    let h = Host::new(None);
    let script = h.write(
        "deaf.sh",
        "#!/bin/sh\nread l; echo '{\"jsonrpc\":\"2.0\",\"id\":0,\"result\":{\"protocolVersion\":1}}'\nread l; echo '{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"sessionId\":\"s\"}}'\nexec sleep 300\n",
    );
    must(std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)), "chmod");
    let plan = h.write(
        "p.toml",
        &format!(
            "[[tasks]]\nid = \"t\"\nagent = \"{}\"\nprompt = \"x\"\ntimeout = 0.3\nmax_attempts = 2\n",
            script.display()
        ),
    );
    let o = h
        .run(&[
            "run",
            plan.to_str().unwrap_or_default(),
            "--format",
            "json",
            "--retry-base-ms",
            "5",
            "--cancel-grace-ms",
            "300",
        ])
        .await;
    assert_eq!(o.status.code(), Some(1));
    let moves: Vec<String> = lines(&o)
        .iter()
        .filter(|e| e["type"] == "transition")
        .filter_map(|e| e["to"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(moves, ["running", "pending", "running", "failed"]);
    let failed = lines(&o).into_iter().find(|e| e["to"] == "failed").unwrap_or_default();
    assert!(failed["error"].as_str().is_some_and(|e| e.contains("did not confirm the cancel")), "{failed}");
}

#[tokio::test]
async fn sigkill_at_random_points_then_resume_completes_every_task_exactly_once() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let mut plan = String::from("[defaults]\nagent = \"pier\"\n");
    for i in 0..200 {
        plan.push_str(&format!("\n[[tasks]]\nid = \"t{i:03}\"\nprompt = \"task {i}\"\n"));
        if i % 10 != 0 {
            plan.push_str(&format!("depends_on = [\"t{:03}\"]\n", i - i % 10));
        }
    }
    let plan_path = h.write("big.toml", &plan);
    let mut rng_state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        rng_state % n
    };
    let base = ["--format", "json", "--concurrency", "8", "--lease-ttl-ms", "3000"];
    let mut kills = 0;
    let mut first = true;
    loop {
        let mut args: Vec<&str> = if first {
            vec!["run", plan_path.to_str().unwrap_or_default(), "--run-id", "big"]
        } else {
            vec!["run", "--resume", "big"]
        };
        args.extend(base);
        first = false;
        let mut child = must(h.command(&args).spawn(), "spawn");
        if kills >= 20 {
            let o = must(
                must(tokio::time::timeout(LIMIT * 12, child.wait_with_output()).await, "final run in time"),
                "wait",
            );
            assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
            break;
        }
        // Kill after a random number of committed events has been printed.
        let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
        let mut reader = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let target = 1 + next(60);
        let mut seen = 0;
        let mut finished = false;
        while seen < target {
            match tokio::time::timeout(LIMIT, reader.next_line()).await {
                Ok(Ok(Some(line))) => {
                    seen += 1;
                    if line.contains("\"summary\"") {
                        finished = true;
                        break;
                    }
                }
                _ => {
                    finished = true;
                    break;
                }
            }
        }
        assert!(!finished, "the run ended before the kill; the plan is too small for the test");
        let alive = matches!(child.try_wait(), Ok(None));
        assert!(alive, "pier run exited on its own");
        if let Some(pid) = child.id() {
            must(
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL),
                "SIGKILL",
            );
        }
        let _ = child.wait().await;
        kills += 1;
    }
    eprintln!("killed pier run {kills} times");
    let store = h.store();
    let tasks = store.tasks("big");
    assert_eq!(tasks.len(), 200);
    let attempts: i64 = tasks.iter().map(|t| t.attempt).sum();
    assert!(attempts > 200, "some attempts were cut short by the kills ({attempts} attempts)");
    assert!(
        tasks.iter().all(|t| t.state == pier_host::TaskState::Completed),
        "{:?}",
        tasks
            .iter()
            .filter(|t| t.state != pier_host::TaskState::Completed)
            .map(|t| (&t.id, t.state))
            .collect::<Vec<_>>()
    );
    let events = must(pier_host::TaskStore::events_after(&store, None, 0, 10_000_000), "events");
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>(), "the sequence has a gap");
    let mut completions: HashMap<String, usize> = HashMap::new();
    for e in events.iter().filter(|e| e.kind == "transition" && e.data["to"] == "completed") {
        *completions.entry(e.task.clone().unwrap_or_default()).or_default() += 1;
    }
    assert_eq!(completions.len(), 200);
    assert!(completions.values().all(|&n| n == 1), "a task completed twice");
}

#[tokio::test]
async fn tasks_run_on_the_typescript_sdk_example_agent_under_host_side_policy() {
    let h = Host::new(None);
    let agent = sdk_agent();
    let plan = h.write(
        "p.toml",
        &format!(
            "[defaults]\nagent = \"{agent}\"\n\n[[tasks]]\nid = \"allowed\"\nprompt = \"fix the config\"\npermissions = {{ edit = \"allow\" }}\n\n[[tasks]]\nid = \"denied\"\nprompt = \"fix the config\"\npermissions = {{ edit = \"deny\" }}\n\n[[tasks]]\nid = \"fenced\"\nprompt = \"fix the config\"\npermissions = {{ edit = \"allow\" }}\nwritable = [\".\"]\n"
        ),
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--concurrency", "2"]).await;
    assert_eq!(o.status.code(), Some(0), "{}\n{}", stderr(&o), String::from_utf8_lossy(&o.stdout));
    let tasks = h.store().tasks(&run_of(&o));
    assert!(
        tasks[0].result.as_deref().is_some_and(|r| r.contains("successfully updated the configuration")),
        "{tasks:?}"
    );
    assert!(tasks[1].result.as_deref().is_some_and(|r| r.contains("skip the configuration update")), "{tasks:?}");
    let decisions: Vec<(String, String)> = lines(&o)
        .iter()
        .filter(|e| e["type"] == "permission")
        .map(|e| {
            (e["task"].as_str().unwrap_or("").to_owned(), e["outcome"]["optionId"].as_str().unwrap_or("").to_owned())
        })
        .collect();
    assert!(decisions.contains(&("allowed".into(), "allow".into())), "{decisions:?}");
    assert!(decisions.contains(&("denied".into(), "reject".into())), "{decisions:?}");
    // The edit targets /home/user/project/config.json: outside `writable`, so never granted.
    assert!(decisions.contains(&("fenced".into(), "reject".into())), "{decisions:?}");
    assert!(tasks[2].result.as_deref().is_some_and(|r| r.contains("skip the configuration update")), "{tasks:?}");
}

async fn answer_while_waiting(verb: &str, expect: &str) {
    let h = Host::new(None);
    let agent = sdk_agent();
    // A denial under `on_deny = "continue"`: the agent hears it and its turn goes on.
    let plan = h.write(
        "p.toml",
        &format!("[[tasks]]\nid = \"cfg\"\nagent = \"{agent}\"\nprompt = \"fix the config\"\non_deny = \"continue\"\n"),
    );
    let mut child = must(h.command(&["run", plan.to_str().unwrap_or_default(), "--format", "json"]).spawn(), "spawn");
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut reader = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let mut saw_waiting = false;
    loop {
        let line = must(tokio::time::timeout(LIMIT, reader.next_line()).await, "events in time");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier run ended before asking"));
        let v: Value = must(serde_json::from_str(&line), "json");
        if v["type"] == "transition" && v["to"] == "awaiting_input" {
            saw_waiting = true;
        }
        if v["type"] == "question" {
            assert_eq!(v["request"]["toolCall"]["kind"], "edit");
            break;
        }
    }
    assert!(saw_waiting, "the task showed awaiting_input before the question");
    // Who answers: the name given with --as, else the OS user (issue #34).
    let answered =
        if verb == "approve" { h.run(&[verb, "cfg", "--as", "alice"]).await } else { h.run(&[verb, "cfg"]).await };
    assert_eq!(answered.status.code(), Some(0), "{}", stderr(&answered));
    let (rest, status) = the_rest(&mut reader, &mut child).await;
    assert_eq!(status.code(), Some(0), "{rest:#?}");
    assert!(rest.iter().any(|l| l.contains("\"to\":\"running\"") && l.contains("a person answered")), "{rest:#?}");
    let runs = must(pier_host::TaskStore::runs_with_task(&h.store(), "cfg"), "runs");
    let t = &h.store().tasks(&runs[0])[0];
    assert!(t.result.as_deref().is_some_and(|r| r.contains(expect)), "{t:?}");
    // Issue #34: answering again says what was answered, by whom and when.
    let again = h.run(&[verb, "cfg"]).await;
    assert_eq!(again.status.code(), Some(1), "{}", stderr(&again));
    let said = stderr(&again);
    let chosen = if verb == "approve" { "already answered: allow" } else { "already answered: reject" };
    assert!(said.contains(chosen) && said.contains(" by cli:") && said.contains(" at 20"), "{said}");
    let os_user = nix_user();
    let who = if verb == "approve" { "by cli:alice at".to_owned() } else { format!("by cli:{os_user} at") };
    assert!(said.contains(&who), "{said} (expected `{who}`)");
    assert!(!said.contains("cli:unknown"), "{said}");
}

/// Reads `pier run --format json` events up to the first question.
async fn until_question(reader: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>) {
    loop {
        let line = must(tokio::time::timeout(LIMIT, reader.next_line()).await, "events in time");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier run ended before asking"));
        let v: Value = must(serde_json::from_str(&line), "json");
        if v["type"] == "question" {
            return;
        }
    }
}

/// The rest of `pier run`'s events and how it exited.
async fn the_rest(
    reader: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    child: &mut tokio::process::Child,
) -> (Vec<String>, std::process::ExitStatus) {
    let mut rest = Vec::new();
    while let Ok(Ok(Some(line))) = tokio::time::timeout(LIMIT, reader.next_line()).await {
        rest.push(line);
    }
    let status = must(must(tokio::time::timeout(LIMIT, child.wait()).await, "exit in time"), "wait");
    (rest, status)
}

/// Under the host a denial fails the task by default (`on_deny = "fail"`): its turn is
/// cancelled, the task fails with what was denied, and its dependents are cancelled.
#[tokio::test]
async fn a_denial_fails_the_task_and_cancels_its_dependents_by_default() {
    let h = Host::new(None);
    let agent = sdk_agent();
    let plan = h.write(
        "p.toml",
        &format!(
            "[[tasks]]\nid = \"cfg\"\nagent = \"{agent}\"\nprompt = \"fix the config\"\n\n\
             [[tasks]]\nid = \"after\"\nagent = \"{agent}\"\nprompt = \"x\"\ndepends_on = [\"cfg\"]\n"
        ),
    );
    let mut child = must(
        h.command(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "d"]).spawn(),
        "spawn",
    );
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut reader = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    until_question(&mut reader).await;
    let denied = h.run(&["deny", "cfg"]).await;
    assert_eq!(denied.status.code(), Some(0), "{}", stderr(&denied));
    let (rest, status) = the_rest(&mut reader, &mut child).await;
    assert_ne!(status.code(), Some(0), "{rest:#?}");
    let tasks = h.store().tasks("d");
    let state = |id: &str| tasks.iter().find(|t| t.id == id).map(|t| (t.state, t.error.clone()));
    let (cfg, error) = state("cfg").unwrap_or_else(|| panic!("no cfg"));
    assert_eq!(cfg, pier_host::TaskState::Failed, "{rest:#?}");
    assert!(error.as_deref().is_some_and(|e| e.contains("a person denied") && e.contains("on_deny")), "{error:?}");
    assert_eq!(state("after").map(|s| s.0), Some(pier_host::TaskState::Cancelled), "{rest:#?}");
    // One attempt: a denial is not retried.
    assert_eq!(tasks.iter().find(|t| t.id == "cfg").map(|t| t.attempt), Some(1));
}

#[tokio::test]
async fn an_ask_waits_in_awaiting_input_until_pier_approve() {
    answer_while_waiting("approve", "successfully updated the configuration").await;
}

#[tokio::test]
async fn an_ask_waits_in_awaiting_input_until_pier_deny() {
    answer_while_waiting("deny", "skip the configuration update").await;
}

#[tokio::test]
async fn ctrl_c_cancels_running_tasks_through_the_handshake_and_resume_finishes() {
    let f = must(FakeModel::start().await, "fake");
    f.push(Reply::Stream(vec![Step::Text("slow".into()), Step::Hang]));
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nprompt = \"hi\"\nretry_on = [\"max_tokens\"]\n");
    let child = must(
        h.command(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "cc"]).spawn(),
        "spawn",
    );
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "the task started");
    let pid = child.id().map_or(0, |p| p as i32);
    must(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGINT), "SIGINT");
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
    assert_eq!(o.status.code(), Some(130), "interrupted: {}", stderr(&o));
    let back = lines(&o).into_iter().find(|e| e["type"] == "transition" && e["to"] == "pending").unwrap_or_default();
    assert!(back["reason"].as_str().is_some_and(|r| r.contains("the host stopped the attempt")), "{back}");
    must(tokio::time::timeout(LIMIT, f.wait_for_disconnects(1)).await, "the agent's model stream was dropped");
    let t = &h.store().tasks("cc")[0];
    assert_eq!((t.state, t.failures), (pier_host::TaskState::Pending, 0), "a host stop is not a failure");
    let o = h.run(&["run", "--resume", "cc", "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[tokio::test]
async fn max_tokens_is_retried_only_when_the_plan_says_so() {
    let f = must(FakeModel::start().await, "fake");
    let cut = || Reply::Stream(vec![Step::Text("cut".into()), Step::Finish("length".into()), Step::Done]);
    f.push(cut());
    f.push(cut());
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let plan = h.write(
        "p.toml",
        "[[tasks]]\nid = \"strict\"\nprompt = \"a\"\n\n[[tasks]]\nid = \"lenient\"\nprompt = \"b\"\nretry_on = [\"max_tokens\"]\ndepends_on = [\"strict\"]\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "5"]).await;
    let tasks = h.store().tasks(&run_of(&o));
    assert_eq!(tasks[0].state, pier_host::TaskState::Failed);
    assert_eq!(tasks[0].error.as_deref(), Some("max_tokens"));
    assert_eq!(tasks[1].state, pier_host::TaskState::Cancelled, "its dependency failed");
    // Now the lenient one alone.
    let f2 = must(FakeModel::start().await, "fake");
    f2.push(cut());
    f2.set_fallback(echo);
    let h2 = Host::new(Some(f2.base_url()));
    let plan = h2.write("p.toml", "[[tasks]]\nid = \"lenient\"\nprompt = \"b\"\nretry_on = [\"max_tokens\"]\n");
    let o = h2.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--retry-base-ms", "5"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = &h2.store().tasks(&run_of(&o))[0];
    assert_eq!((t.attempt, t.failures), (2, 1));
}

#[tokio::test]
async fn pier_s_own_agent_reports_its_tool_calls_and_diffs_to_the_host() {
    let f = must(FakeModel::start().await, "fake");
    f.push(Reply::tool_call("w1", "write_file", r#"{"path": "out.txt", "content": "written by the task\n"}"#));
    f.push(Reply::text("wrote it"));
    let h = Host::new(Some(f.base_url()));
    let work = h.path("work");
    must(std::fs::create_dir(&work), "work dir");
    let plan = h.write(
        "plan.toml",
        &format!(
            "[[tasks]]\nid = \"w\"\nagent = \"pier\"\ncwd = \"{}\"\nprompt = \"write the file\"\npermissions = {{ edit = \"allow\" }}\n",
            work.display()
        ),
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "tools"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let events = lines(&o);
    let call = events
        .iter()
        .find(|e| e["type"] == "session_update" && e["update"]["sessionUpdate"] == "tool_call" && e["task"] == "w");
    let call = must(call.ok_or("no tool_call in the host's log"), "tool call event");
    assert_eq!(call["update"]["kind"], "edit");
    assert_eq!(call["update"]["content"][0]["newText"], "written by the task\n", "{call}");
    let completed = events.iter().any(|e| {
        e["type"] == "session_update" && e["update"]["toolCallId"] == "w1" && e["update"]["status"] == "completed"
    });
    assert!(completed, "the call's completion reached the log");
    assert_eq!(must(std::fs::read_to_string(work.join("out.txt")), "out.txt"), "written by the task\n");
    // The attempt's side effects are on record for a re-run decision.
    use pier_host::TaskStore;
    let evidence = must(h.store().evidence("tools", "w", 1), "evidence");
    assert!(evidence.iter().any(|e| e["kind"] == "edit"), "{evidence:?}");
}

/// Starts `pier run` on one task of the SDK example agent, which asks before its edit, and
/// reads events until the question: (the child, its event reader).
async fn run_until_question(
    h: &Host,
    extra: &str,
) -> (tokio::process::Child, tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>) {
    let agent = sdk_agent();
    let plan = h.write(
        "p.toml",
        &format!("[[tasks]]\nid = \"cfg\"\nagent = \"{agent}\"\nprompt = \"fix the config\"\n{extra}"),
    );
    let mut child = must(
        h.command(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "q"]).spawn(),
        "spawn",
    );
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut reader = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    loop {
        let line = must(tokio::time::timeout(LIMIT, reader.next_line()).await, "events in time");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier run ended before asking"));
        let v: Value = must(serde_json::from_str(&line), "json");
        if v["type"] == "question" {
            return (child, reader);
        }
    }
}

#[tokio::test]
async fn waiting_for_a_person_is_not_idleness() {
    let h = Host::new(None);
    // An idle timeout of two seconds (the agent pauses one second between its steps); the
    // person takes five.
    let (child, mut reader) = run_until_question(&h, "timeout = 2\n").await;
    // The time that must pass without a timeout is what this test is about.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let answered = h.run(&["approve", "cfg"]).await;
    assert_eq!(answered.status.code(), Some(0), "{}", stderr(&answered));
    let mut rest = Vec::new();
    while let Ok(Ok(Some(line))) = tokio::time::timeout(LIMIT, reader.next_line()).await {
        rest.push(line);
    }
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}\n{rest:#?}", stderr(&o));
    let t = &h.store().tasks("q")[0];
    assert_eq!((t.state, t.failures), (pier_host::TaskState::Completed, 0), "{rest:#?}");
}

#[tokio::test]
async fn a_question_open_when_the_host_stops_is_answered_cancelled() {
    let h = Host::new(None);
    let (child, mut reader) = run_until_question(&h, "").await;
    let pid = child.id().map_or(0, |p| p as i32);
    must(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGINT), "SIGINT");
    let mut rest = Vec::new();
    while let Ok(Ok(Some(line))) = tokio::time::timeout(LIMIT, reader.next_line()).await {
        rest.push(must(serde_json::from_str::<Value>(&line), "json"));
    }
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
    assert_eq!(o.status.code(), Some(130), "interrupted: {}", stderr(&o));
    let answer =
        rest.iter().find(|e| e["type"] == "permission").unwrap_or_else(|| panic!("no permission in {rest:#?}"));
    assert_eq!(answer["outcome"]["outcome"], "cancelled", "R088: {answer}");
}

/// User plus system CPU time of a process so far, in milliseconds.
fn cpu_ms(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let ticks: u64 = fields.get(11..13).map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum()).unwrap_or(0);
    // /proc counts in USER_HZ, which the kernel's ABI fixes at 100 on x86-64 and arm64.
    ticks * 10
}

#[tokio::test]
async fn a_host_waiting_on_a_lease_held_elsewhere_uses_no_cpu() {
    let (f, gate) = gated_echo().await;
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nprompt = \"hi\"\n");
    // Leases of one second, renewed by the live host that holds the task every third of it:
    // the waiting host sees the expiry it first read pass many times while it waits.
    let args =
        ["run", plan.to_str().unwrap_or_default(), "--run-id", "w", "--format", "json", "--lease-ttl-ms", "1000"];
    let holder = must(h.command(&args).spawn(), "spawn the holding host");
    tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await.unwrap_or_else(|_| panic!("the task never started"));
    let waiting = must(h.command(&args).spawn(), "spawn the waiting host");
    let pid = waiting.id().unwrap_or(0);
    // Past start-up and the first expiry (two seconds), then five seconds of waiting are measured.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let before = cpu_ms(pid);
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let used = cpu_ms(pid) - before;
    gate.open();
    for child in [holder, waiting] {
        let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    }
    assert_eq!(f.requests().iter().filter(|r| !r.auxiliary).count(), 1, "the task ran once");
    // A host that spun would use seconds; this one's lease tries (every third of a second, each
    // a write) and its watcher's looks at the file (every 100 ms) cost 10-50 ms, more on a
    // machine busy with other tests (50 once in CI).
    assert!(used < 150, "the waiting host used {used} ms of CPU in 5 s");
}

/// The `tool` messages the model was sent, in order.
fn tool_results(f: &FakeModel) -> Vec<String> {
    f.requests()
        .iter()
        .filter(|r| !r.auxiliary)
        .flat_map(|r| r.body["messages"].as_array().cloned().unwrap_or_default())
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[tokio::test]
async fn a_plans_deny_and_roots_hold_for_pier_s_own_agent() {
    let f = must(FakeModel::start().await, "fake");
    let h = Host::new(Some(f.base_url()));
    let (work, extra, outside) = (h.path("work"), h.path("extra"), h.path("outside"));
    for (dir, file, text) in [
        (&work, "secret.txt", "SECRET-IN-CWD"),
        (&extra, "in.txt", "IN-A-ROOT"),
        (&outside, "out.txt", "OUTSIDE-EVERY-ROOT"),
    ] {
        must(std::fs::create_dir(dir), "dir");
        must(std::fs::write(dir.join(file), text), "file");
    }
    let read =
        |id: &str, path: String| Reply::tool_call(id, "read_file", &serde_json::json!({"path": path}).to_string());
    // Concurrency 1: the tasks meet the script in plan order.
    f.push(read("r1", work.join("secret.txt").display().to_string()));
    f.push(Reply::text("done"));
    f.push(read("r2", extra.join("in.txt").display().to_string()));
    f.push(read("r3", outside.join("out.txt").display().to_string()));
    f.push(Reply::text("done"));
    let plan = h.write(
        "plan.toml",
        &format!(
            "[defaults]\nagent = \"pier\"\ncwd = \"{work}\"\n\n[[tasks]]\nid = \"denied\"\nprompt = \"read\"\npermissions = {{ read = \"deny\" }}\n\n\
             [[tasks]]\nid = \"rooted\"\nprompt = \"read\"\nroots = [\"{extra}\"]\ndepends_on = [\"denied\"]\n",
            work = work.display(),
            extra = extra.display()
        ),
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--concurrency", "1"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // Each request carries the turn's earlier results again: the last one has them all.
    let results = tool_results(&f);
    assert!(results.first().is_some_and(|r| r.contains("denies read")), "the plan denies reads: {results:#?}");
    assert!(results.iter().any(|r| r.contains("IN-A-ROOT")), "the plan's root is readable: {results:#?}");
    assert!(results.last().is_some_and(|r| r.contains("outside the session's roots")), "{results:#?}");
    let leaked = results.iter().any(|r| r.contains("SECRET-IN-CWD") || r.contains("OUTSIDE-EVERY-ROOT"));
    assert!(!leaked, "{results:#?}");
}

#[tokio::test]
async fn a_plans_writable_holds_for_pier_s_own_agent_s_tools_and_commands() {
    let f = must(FakeModel::start().await, "fake");
    let h = Host::new(Some(f.base_url()));
    // Outside the temp directory, where commands may always write.
    let outside_tmp = must(tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")), "dir");
    let work = outside_tmp.path().join("work");
    must(std::fs::create_dir_all(work.join("out")), "dirs");
    let landlock = pier_tools::contain::init().landlock_abi.is_some();
    f.push(Reply::tool_call("w1", "write_file", r#"{"path": "escaped.txt", "content": "x"}"#));
    f.push(Reply::tool_call("w2", "write_file", r#"{"path": "out/kept.txt", "content": "x"}"#));
    let command = "echo in > out/ran.txt; echo esc > escaped-by-shell.txt";
    f.push(Reply::tool_call("c1", "run_command", &serde_json::json!({"command": command}).to_string()));
    f.push(Reply::text("done"));
    let plan = h.write(
        "plan.toml",
        &format!(
            "[[tasks]]\nid = \"w\"\nagent = \"pier\"\ncwd = \"{}\"\nprompt = \"write\"\nwritable = [\"{}\"]\n\
             permissions = {{ edit = \"allow\", execute = \"allow\" }}\n",
            work.display(),
            work.join("out").display()
        ),
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = tool_results(&f);
    assert!(!work.join("escaped.txt").exists(), "a tool wrote outside `writable`: {results:#?}");
    assert!(work.join("out/kept.txt").exists(), "{results:#?}");
    if landlock {
        assert!(!work.join("escaped-by-shell.txt").exists(), "a command wrote outside `writable`: {results:#?}");
        assert!(work.join("out/ran.txt").exists(), "{results:#?}");
    } else {
        eprintln!("this kernel has no Landlock: the command half is not checked");
    }
}

#[tokio::test]
async fn ctrl_c_while_an_agent_is_stuck_in_its_handshake_stops_the_host_at_once() {
    let mut h = Host::new(None);
    let fifo = h.path("mute.fifo");
    must(nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU), "mkfifo");
    h.vars.push(("PIER_TEST_FIFO".into(), fifo.display().to_string()));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mute_agent.py");
    let plan = h.write(
        "p.toml",
        // The agent reports its process group, which a jail's PID namespace renumbers: unconfined
        // here (confine.rs holds the jail's own teardown).
        &format!(
            "[[tasks]]\nid = \"t\"\nagent = \"python3 {} initialize\"\nprompt = \"hi\"\nsandbox = \"off\"\n",
            script.display()
        ),
    );
    let child = must(
        h.command(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "stuck"]).spawn(),
        "spawn",
    );
    // The agent got `initialize` and will never answer it (the setup timeout is 60 s).
    let reader = tokio::task::spawn_blocking(move || std::fs::read_to_string(&fifo).unwrap_or_default());
    let report = must(must(tokio::time::timeout(LIMIT, reader).await, "the agent reported"), "join");
    let pgid: i32 = report.trim().split_once(' ').map_or(0, |(_, g)| g.parse().unwrap_or(0));
    let pid = child.id().map_or(0, |p| p as i32);
    must(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGINT), "SIGINT");
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "pier run stopped at once"), "wait");
    assert_eq!(o.status.code(), Some(130), "interrupted: {}", stderr(&o));
    assert!(!support::group_alive(pgid), "the stuck agent's group survived");
    let t = &h.store().tasks("stuck")[0];
    assert_eq!((t.state, t.failures), (pier_host::TaskState::Pending, 0), "a host stop is not a failure");
}

/// The live processes `pid` started directly, from any of its threads.
fn children(pid: u32) -> Vec<u32> {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    threads
        .flatten()
        .flat_map(|t| {
            let text = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            text.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>()
        })
        .collect()
}

fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Resident memory of a process, in KiB.
fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn one_warm_agent_serves_ten_thousand_tasks_closing_each_session() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let plan: String =
        (0..10_000).map(|i| format!("[[tasks]]\nid = \"t{i}\"\nagent = \"pier\"\nprompt = \"task {i}\"\n\n")).collect();
    let plan = h.write("p.toml", &plan);
    let mut child = must(
        h.command(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--concurrency", "1"]).spawn(),
        "spawn",
    );
    let pid = child.id().unwrap_or(0);
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut reader = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let (mut done, mut early, mut late, mut agents) = (0, None, None, std::collections::HashSet::new());
    while let Ok(Ok(Some(line))) = tokio::time::timeout(LIMIT, reader.next_line()).await {
        let v: Value = must(serde_json::from_str(&line), "json");
        if v["type"] == "transition" && v["to"] == "completed" {
            done += 1;
            agents.extend(children(pid));
            if done == 1_000 {
                early = children(pid).first().map(|&a| (descriptors(a), rss_kb(a)));
            }
            if done == 9_900 {
                late = children(pid).first().map(|&a| (descriptors(a), rss_kb(a)));
            }
        }
    }
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(done, 10_000);
    assert_eq!(agents.len(), 1, "one warm agent served every task: {agents:?}");
    let (Some((fds_early, rss_early)), Some((fds_late, rss_late))) = (early, late) else {
        panic!("no agent to measure")
    };
    eprintln!("agent: {fds_early} -> {fds_late} descriptors, {rss_early} -> {rss_late} KiB");
    assert!(fds_late <= fds_early + 2, "the agent's descriptors grew from {fds_early} to {fds_late} over 8,900 tasks");
    // Each session the host does not close keeps about 4.6 KiB in the agent (about 40 MB here).
    assert!(rss_late < rss_early + 8192, "the agent grew from {rss_early} to {rss_late} KiB: sessions are kept");
}

/// Model requests per task prompt (each task's prompt is "task N").
fn requests_per_prompt(f: &FakeModel) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in f.requests().iter().filter(|r| !r.auxiliary) {
        let user = r.body["messages"].as_array().and_then(|m| m.iter().find(|m| m["role"] == "user")).cloned();
        if let Some(text) = user.and_then(|m| m["content"].as_str().map(str::to_owned)) {
            *counts.entry(text).or_default() += 1;
        }
    }
    counts
}

#[tokio::test]
async fn two_hosts_driving_one_run_never_run_one_attempt_twice() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let h = Host::new(Some(f.base_url()));
    let text: String = (0..60).map(|i| format!("[[tasks]]\nid = \"t{i:02}\"\nprompt = \"task {i}\"\n\n")).collect();
    let plan = h.write("p.toml", &text);
    let args = ["run", plan.to_str().unwrap_or_default(), "--run-id", "both", "--format", "json"];
    let mut first = must(h.command(&args).spawn(), "spawn the first host");
    // The second host starts once the first has stored the run, and resumes it: both race
    // for every pending task from then on.
    let stdout = first.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut reader = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = must(tokio::time::timeout(LIMIT, reader.next_line()).await, "the first event in time");
    assert!(must(line, "read").is_some(), "the first host ended before its first event");
    let second = must(h.command(&args).spawn(), "spawn the second host");
    tokio::spawn(async move { while let Ok(Some(_)) = reader.next_line().await {} });
    for child in [first, second] {
        let o = must(must(tokio::time::timeout(LIMIT * 6, child.wait_with_output()).await, "exit in time"), "wait");
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    }
    let per_prompt = requests_per_prompt(&f);
    assert_eq!(per_prompt.len(), 60, "{per_prompt:?}");
    let twice: Vec<_> = per_prompt.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "prompts that reached the model more than once: {twice:?}");
}

/// A plan's MCP server reaches the task's agent: pier's own agent (automation profile, under
/// the host and its sandbox) offers its tools to the model and runs them; a server the plan
/// describes wrongly is refused at submit, naming it.
#[tokio::test]
async fn a_plans_mcp_server_is_used_by_the_tasks_agent() {
    use pier_fake_model::body::{tool_names, tool_results};
    use pier_host::TaskStore;
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|body| match tool_results(body).pop() {
        None => Reply::tool_call("m1", "notes__echo", r#"{"text": "from the plan's server"}"#),
        Some(result) => Reply::text(&format!("got: {result}")),
    });
    let h = Host::new(Some(f.base_url()));
    // Inside the task's directory: the strict sandbox shows the agent (and the servers it
    // starts) that directory, not this repository.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../pier-mcp/tests/fixtures/mcp_server.py");
    let script = h.write("mcp_server.py", &must(std::fs::read_to_string(fixture), "read the MCP fixture"));
    let server = format!("{{ name = \"notes\", command = \"python3\", args = [\"{}\"] }}", script.display());
    let plan = h.write("plan.toml", &format!("[[tasks]]\nid = \"t\"\nprompt = \"use it\"\nmcp_servers = [{server}]\n"));
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--run-id", "m"]).await;
    let shown = h.run(&["show", "m", "t"]).await;
    assert_eq!(o.status.code(), Some(0), "{}\n{}", stderr(&o), String::from_utf8_lossy(&shown.stdout));
    let t = must(h.store().task("m", "t"), "task").unwrap_or_else(|| panic!("no task"));
    assert_eq!(t.result.as_deref(), Some("got: from the plan's server"), "{}", stderr(&o));
    assert!(tool_names(&f.requests()[0].body).contains(&"notes__echo".to_owned()));

    // The same server from pier.toml, for every task of the host.
    h.write(
        "pier.toml",
        &format!("[[mcp_servers]]\nname = \"notes\"\ncommand = \"python3\"\nargs = [\"{}\"]\n", script.display()),
    );
    let plain = h.write("plain.toml", "[[tasks]]\nid = \"t\"\nprompt = \"use it\"\n");
    let o = h.run(&["run", plain.to_str().unwrap_or_default(), "--run-id", "m2"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = must(h.store().task("m2", "t"), "task").unwrap_or_else(|| panic!("no task"));
    assert_eq!(t.result.as_deref(), Some("got: from the plan's server"), "{}", stderr(&o));
    std::fs::remove_file(h.path("pier.toml")).unwrap_or_else(|e| panic!("{e}"));

    let bad = "[[tasks]]\nid = \"b\"\nprompt = \"x\"\nmcp_servers = [{ name = \"both\", command = \"x\", url = \"http://127.0.0.1:1/mcp\" }]\n";
    let bad = h.write("bad.toml", bad);
    let o = h.run(&["run", bad.to_str().unwrap_or_default(), "--run-id", "b"]).await;
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("MCP server `both` gives both `command` and `url`"), "{}", stderr(&o));
}

/// The name of this process's user, as `id -un` prints it (the tests run with no `$USER`).
fn nix_user() -> String {
    let out = std::process::Command::new("id").arg("-un").output();
    String::from_utf8_lossy(&must(out, "id -un").stdout).trim().to_owned()
}

/// `pier show RUN TASK --watch` shows the task again at each change and ends when it ends
/// (issue #34).
#[tokio::test]
async fn pier_show_watch_follows_the_task_and_ends_with_it() {
    use tokio::io::AsyncBufReadExt;
    let (f, gate) = gated_echo().await;
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("p.toml", "[[tasks]]\nid = \"t\"\nprompt = \"hi\"\n");
    let runner = must(h.command(&["run", plan.to_str().unwrap_or_default(), "--run-id", "w"]).spawn(), "pier run");
    tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await.unwrap_or_else(|_| panic!("the task never started"));
    let mut watch = h.command(&["show", "w", "t", "--watch"]);
    watch.stdout(std::process::Stdio::piped());
    let mut watch = must(watch.spawn(), "pier show --watch");
    let stdout = watch.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut seen = Vec::new();
    loop {
        let line = must(tokio::time::timeout(LIMIT, lines.next_line()).await, "a render in time");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier show ended while the task ran: {seen:#?}"));
        let running = line.starts_with("task t of run w: running");
        seen.push(line);
        if running {
            break;
        }
    }
    gate.open();
    while let Some(line) = must(must(tokio::time::timeout(LIMIT, lines.next_line()).await, "in time"), "read") {
        seen.push(line);
    }
    let status = must(must(tokio::time::timeout(LIMIT, watch.wait()).await, "pier show ends"), "wait");
    assert_eq!(status.code(), Some(0), "{seen:#?}");
    assert!(seen.iter().any(|l| l.starts_with("task t of run w: completed")), "{seen:#?}");
    let o = must(must(tokio::time::timeout(LIMIT, runner.wait_with_output()).await, "pier run ends"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // Each attempt's times (issue #34): when it started, how long it took, how it ended.
    let shown = String::from_utf8_lossy(&h.run(&["show", "w", "t"]).await.stdout).into_owned();
    assert!(shown.lines().any(|l| l.starts_with("attempt 1: started 20") && l.contains(" s, completed; ")), "{shown}");
    let json: Value =
        must(serde_json::from_slice(&h.run(&["show", "w", "t", "--format", "json"]).await.stdout), "json");
    // The result is shown once, not again as what the attempt said.
    let result = json["task"]["result"].as_str().unwrap_or_default().to_owned();
    assert!(!result.is_empty() && shown.matches(result.as_str()).count() == 1, "{shown}");
    assert!(shown.contains("said: the result above"), "{shown}");
    let t = &json["times"][0];
    let (started, ended) = (t["started_at_ms"].as_i64().unwrap_or(0), t["ended_at_ms"].as_i64().unwrap_or(0));
    assert!(started > 0 && ended >= started && t["ended"] == "completed" && t["attempt"] == 1, "{json}");
}

/// A fake model that echoes, each answer held until `gate` opens once for it.
async fn gated_echo() -> (FakeModel, pier_fake_model::Gate) {
    let f = must(FakeModel::start().await, "fake");
    let gate = pier_fake_model::Gate::new();
    let held = gate.clone();
    f.set_fallback(move |body| {
        let mut reply = echo(body);
        if let Reply::Stream(steps) = &mut reply {
            steps.insert(0, Step::Gate(held.clone()));
        }
        reply
    });
    (f, gate)
}
