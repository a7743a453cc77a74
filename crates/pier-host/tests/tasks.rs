//! The host's API ([`pier_host::Tasks`]) against a real store: what people do through it
//! is refused or applied as the rules say, whichever face calls it.

use std::sync::Arc;

use pier_host::{Answered, HostConfig, TaskStore, Tasks};
use serde_json::json;

fn must<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// A SQLite store with run `r` of task `a`, and the host's API over it.
fn tasks(dir: &tempfile::TempDir) -> (Arc<dyn TaskStore>, Tasks) {
    let store = must(pier_host::store::open(&dir.path().join("pier.db").display().to_string()), "open");
    let plan = must(pier_host::plan::parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())), "plan");
    must(store.create_run("r", &plan, "test"), "create");
    let config = HostConfig::new("pier".into(), Default::default(), dir.path().to_path_buf());
    (store.clone(), Tasks::new(store, config))
}

#[tokio::test]
async fn an_answer_names_its_question_so_a_repeat_or_a_stale_one_applies_nothing() {
    let dir = must(tempfile::tempdir(), "tempdir");
    let (s, tasks) = tasks(&dir);
    let (a, _) = must(s.claim("r", "a", "owner-1", i64::MAX / 2), "claim").unwrap_or_else(|| panic!("not claimed"));
    let ask = json!({"sessionId": "s", "toolCall": {"toolCallId": "t"},
        "options": [{"optionId": "ok", "name": "OK", "kind": "allow_once"}]});
    let ask = must(pier_host::QuestionRequest::from_stored(ask), "request");
    let first = must(s.park(&a, &ask), "park");
    // A form showing another question (or the re-run decision) is refused.
    for stale in [first + 1, 0] {
        let refused = tasks.answer("r", "a", Some(stale), true, None, "me").await;
        assert!(refused.is_err_and(|e| e.to_string().contains("no longer waits")), "{stale}");
    }
    let answered = tasks.answer("r", "a", Some(first), true, None, "me").await;
    assert!(matches!(answered, Ok(Answered::Option(ref o)) if o == "ok"), "{answered:?}");
    // The same form again, before and after the agent asks its next question.
    assert!(tasks.answer("r", "a", Some(first), true, None, "me").await.is_err(), "a repeat");
    assert!(s.resume(&a).unwrap_or(false));
    let second = must(s.park(&a, &ask), "park again");
    let repeat = tasks.answer("r", "a", Some(first), true, None, "me").await;
    let said = repeat.map(|_| ()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(said.contains("no longer waits") && said.contains("already answered: ok by me at "), "{said}");
    assert_eq!(must(s.answer_of(&a, second), "answer_of"), None, "the new question is still open");
}

#[tokio::test]
async fn a_person_s_action_on_an_unknown_run_or_task_names_which() {
    let dir = must(tempfile::tempdir(), "tempdir");
    let (_, tasks) = tasks(&dir);
    let unknown_run = tasks.cancel_task("nope", "a", "test", pier_host::CANCEL_WAIT).await;
    assert!(unknown_run.is_err_and(|e| e.code() == pier_host::ErrorCode::UnknownRun));
    let unknown_task = tasks.say("r", "nope", "hi", false, "me").await;
    assert!(unknown_task.is_err_and(|e| e.code() == pier_host::ErrorCode::UnknownTask));
    // A task that has not started takes no message, and says why.
    let not_running = tasks.say("r", "a", "hi", false, "me").await;
    assert!(not_running.is_err_and(|e| e.code() == pier_host::ErrorCode::NotRunning));
    assert_eq!(must(tasks.cancel_run("r", "test", pier_host::CANCEL_WAIT).await, "cancel run").cancelled, 1);
    assert_eq!(must(tasks.run("r").await, "run").counts().get("cancelled"), Some(&1));
}

/// Issue #32: a pull worker leases in queue order, and a task is ranked from when it became
/// ready: one whose dependency completed after another task was already waiting goes behind
/// it, though it was created first.
#[tokio::test]
async fn a_worker_leases_a_task_whose_dependency_completed_late_behind_those_already_waiting() {
    let dir = must(tempfile::tempdir(), "tempdir");
    let (s, tasks) = tasks(&dir);
    must(s.claim("r", "a", "host", i64::MAX / 2), "claim a");
    let chain =
        "[[tasks]]\nid = \"dep\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"late\"\nprompt = \"y\"\ndepends_on = [\"dep\"]\n";
    must(s.create_run("d-run", &must(pier_host::plan::parse(chain, &|_| Ok(())), "plan"), "test"), "create d-run");
    let one = must(pier_host::plan::parse("[[tasks]]\nid = \"other\"\nprompt = \"z\"\n", &|_| Ok(())), "plan");
    must(s.create_run("o-run", &one, "test"), "create o-run");
    // `dep` completes a millisecond after `other` was created at the latest, so `late` became
    // ready after `other` did (the store alone ranks it from its creation, before `other`).
    let created = pier_host::store::now_ms();
    while pier_host::store::now_ms() <= created {
        std::hint::spin_loop();
    }
    let (dep, _) = must(s.claim("d-run", "dep", "host", i64::MAX / 2), "claim dep").unwrap_or_else(|| panic!("dep"));
    let done = pier_host::store::Ending::Completed { result: "ok".into(), usage: None };
    must(s.finish(&dep, &done, None), "complete dep");
    let agents = ["pier".to_owned()];
    let mut order = Vec::new();
    while let Some(l) = must(tasks.lease("w", &[], &agents, None).await, "lease") {
        order.push(l.task.id);
    }
    assert_eq!(order, ["other", "late"]);
}
