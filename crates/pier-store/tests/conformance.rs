//! The store conformance suite: written against the `TaskStore` trait only, run for
//! every backend (SQLite, and PostgreSQL on the server `PIER_TEST_PG` names, which
//! `scripts/test` starts). Claim races, the fencing of every attempt operation, idempotent
//! replays and conflicts, the state machine of endings, a gap-free event log under
//! concurrent writers, other handles' commits reaching the watch, and writers killed at
//! any point.

use std::sync::Arc;

use pier_store::plan::parse;
use pier_store::{Attempt, Ending, ErrorClass, Idem, Last, StoreError, TaskState, TaskStore, Waiting};
use serde_json::json;

/// A permission request offering `options`, as an agent would send it.
fn question(options: serde_json::Value) -> pier_store::QuestionRequest {
    let request = json!({"sessionId": "s", "toolCall": {"toolCallId": "t"}, "options": options});
    pier_store::QuestionRequest::from_stored(request).unwrap_or_else(|e| panic!("{e}"))
}

/// A fresh, empty store: its address (what `pier_store::open` takes) and what
/// keeps it (a directory, a database) until dropped.
struct Fresh {
    spec: String,
    _keep: Box<dyn std::any::Any>,
}

type Factory = fn() -> Fresh;

fn sqlite() -> Fresh {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    Fresh { spec: dir.path().join("pier.db").display().to_string(), _keep: Box::new(dir) }
}

fn postgres() -> Fresh {
    let server = std::env::var("PIER_TEST_PG").unwrap_or_else(|_| {
        panic!("PIER_TEST_PG is not set: the PostgreSQL tests need a server (scripts/test starts one with scripts/pg)")
    });
    let db = pier_store::ScratchDatabase::create(&server, "pier_conf")
        .unwrap_or_else(|e| panic!("PostgreSQL at PIER_TEST_PG: {e}"));
    Fresh { spec: db.url().to_owned(), _keep: Box::new(db) }
}

fn backends() -> Vec<(&'static str, Factory)> {
    vec![("sqlite", sqlite as Factory), ("postgres", postgres as Factory)]
}

fn open(spec: &str) -> Arc<dyn TaskStore> {
    pier_store::open(spec).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `check` on a fresh store of every backend, with run `r` of tasks a and b.
fn each(check: impl Fn(&str, &Arc<dyn TaskStore>)) {
    for (name, make) in backends() {
        let fresh = make();
        let store = open(&fresh.spec);
        let plan =
            parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\n", &|_| Ok(()))
                .unwrap_or_else(|e| panic!("{e}"));
        store.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        check(name, &store);
    }
}

const FAR: i64 = i64::MAX / 2;

fn claim(s: &Arc<dyn TaskStore>, task: &str, owner: &str) -> Attempt {
    match s.claim("r", task, owner, FAR) {
        Ok(Some((a, row))) => {
            assert_eq!((row.state, row.lease_owner.as_deref()), (TaskState::Running, Some(owner)));
            // The row a claim answers is the row the store now holds.
            assert_eq!(Some(&row), s.task("r", task).ok().flatten().as_ref(), "the claimed row");
            a
        }
        other => panic!("claim of {task} by {owner}: {other:?}"),
    }
}

fn state(s: &Arc<dyn TaskStore>, task: &str) -> TaskState {
    s.task("r", task).ok().flatten().map(|t| t.state).unwrap_or_else(|| panic!("no task {task}"))
}

fn done() -> Ending {
    Ending::Completed { result: "ok".into(), usage: None }
}

/// The row every ending answers is the row the store then holds (the stores build it from
/// what the update changed rather than reading it back).
#[test]
fn the_row_an_ending_answers_is_the_row_the_store_holds() {
    let endings = || {
        vec![
            Ending::Completed { result: "ok".into(), usage: Some(json!({"input_tokens": 3, "cost": 0.25})) },
            Ending::Completed { result: "ok".into(), usage: None },
            Ending::Failed {
                error: "boom".into(),
                class: ErrorClass::Business,
                reason: "crashed".into(),
                failure: true,
            },
            Ending::Cancelled { reason: "by a person".into() },
            Ending::Retry { error: Some("later".into()), reason: "retry".into(), not_before_ms: 12_345, failure: true },
            Ending::AskPerson {
                error: None,
                reason: "side effects".into(),
                failure: false,
                evidence: vec![json!({"wrote": "x"})],
            },
        ]
    };
    each(|name, s| {
        for (i, ending) in endings().into_iter().enumerate() {
            for parked in [false, true] {
                let run = format!("r{i}{parked}");
                let plan =
                    parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
                s.create_run(&run, &plan, "test").unwrap_or_else(|e| panic!("{e}"));
                let Ok(Some((a, _))) = s.claim(&run, "a", "o", FAR) else { panic!("{name}: claim {run}") };
                if parked {
                    s.park(&a, &question(json!([]))).unwrap_or_else(|e| panic!("{name}: {e}"));
                }
                let row = s.finish(&a, &ending, None).unwrap_or_else(|e| panic!("{name}: {ending:?}: {e}"));
                let held = s.task(&run, "a").ok().flatten();
                assert_eq!(Some(&row), held.as_ref(), "{name}: {ending:?} (parked: {parked})");
                assert_eq!(s.open_question(&run, "a").ok().flatten(), None, "{name}: questions void after {ending:?}");
            }
        }
    });
}

#[test]
fn of_many_racing_claimers_exactly_one_wins() {
    each(|name, s| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let s = s.clone();
                std::thread::spawn(move || s.claim("r", "a", &format!("host-{i}"), FAR))
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("panicked"))).collect();
        let winners: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok().and_then(Option::as_ref)).collect();
        assert_eq!(winners.len(), 1, "{name}: {results:?}");
        assert!(results.iter().all(Result::is_ok), "{name}: losers are told, not failed: {results:?}");
        let row = s.task("r", "a").ok().flatten().unwrap_or_else(|| panic!("a"));
        assert_eq!((row.attempt, row.lease_owner.as_ref()), (1, Some(&winners[0].0.owner)), "{name}");
    });
}

#[test]
fn every_attempt_operation_is_fenced_on_attempt_and_owner() {
    each(|name, s| {
        let a = claim(s, "a", "owner-1");
        let foreign = Attempt { owner: "owner-2".into(), ..a.clone() };
        let stale = Attempt { n: a.n + 1, ..a.clone() };
        for other in [&foreign, &stale] {
            assert!(!s.heartbeat(other, FAR).unwrap_or(true), "{name}: heartbeat of {other:?}");
            assert!(matches!(s.park(other, &question(json!([]))), Err(StoreError::LeaseLost { .. })), "{name}: park");
            assert!(!s.resume(other).unwrap_or(true), "{name}: resume");
            let refused = s.finish(other, &done(), None);
            assert!(matches!(&refused, Err(e) if e.code() == "lease_lost"), "{name}: finish {refused:?}");
        }
        assert_eq!(state(s, "a"), TaskState::Running, "{name}: nothing moved");
        assert!(s.heartbeat(&a, FAR - 1).unwrap_or(false), "{name}");
        let row = s.finish(&a, &done(), None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((row.state, row.lease_owner, row.result.as_deref()), (TaskState::Completed, None, Some("ok")));
        // Once ended, even the holder is refused.
        assert!(matches!(s.finish(&a, &done(), None), Err(StoreError::LeaseLost { .. })), "{name}");
        assert!(!s.heartbeat(&a, FAR).unwrap_or(true), "{name}");
    });
}

#[test]
fn an_expired_lease_ends_nothing_and_is_released_only_as_seen() {
    each(|name, s| {
        let (a, _) = s.claim("r", "a", "owner-1", 1).ok().flatten().unwrap_or_else(|| panic!("claim"));
        assert!(matches!(s.finish(&a, &done(), None), Err(StoreError::LeaseLost { .. })), "{name}: expired");
        let seen = s.task("r", "a").ok().flatten().and_then(|t| t.held()).unwrap_or_else(|| panic!("held"));
        // The holder renews before the release lands: the release changes nothing.
        assert!(s.heartbeat(&a, 2).unwrap_or(false), "{name}");
        let retry = Ending::Retry { error: None, reason: "lost".into(), not_before_ms: 0, failure: false };
        assert_eq!(s.release_lost(&seen, &retry).unwrap_or_else(|e| panic!("{e}")), None, "{name}");
        let seen = s.task("r", "a").ok().flatten().and_then(|t| t.held()).unwrap_or_else(|| panic!("held"));
        let row = s.release_lost(&seen, &retry).unwrap_or_else(|e| panic!("{e}")).unwrap_or_else(|| panic!("released"));
        assert_eq!((row.state, row.lease_owner, row.failures), (TaskState::Pending, None, 0), "{name}");
        let again = claim(s, "a", "owner-2");
        assert_eq!(again.n, 2, "{name}");
    });
}

#[test]
fn a_question_parks_and_resumes_and_an_ending_voids_it() {
    each(|name, s| {
        let a = claim(s, "a", "owner-1");
        let n = s.park(&a, &question(json!([]))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((n, state(s, "a")), (1, TaskState::AwaitingInput), "{name}");
        let q = s.open_question("r", "a").ok().flatten().unwrap_or_else(|| panic!("open"));
        assert!(s.resume(&a).unwrap_or(false));
        assert_eq!(state(s, "a"), TaskState::AwaitingInput, "{name}: still open, still waiting");
        assert!(s.answer("r", "a", &q, "allow_once", "me").unwrap_or(false));
        assert!(!s.answer("r", "a", &q, "reject_once", "me").unwrap_or(true), "{name}: answered once");
        assert_eq!(s.answer_of(&a, n).ok().flatten().as_deref(), Some("allow_once"));
        assert!(s.resume(&a).unwrap_or(false));
        assert_eq!(state(s, "a"), TaskState::Running, "{name}");
        // A second question, then the attempt ends while it waits (with side effects):
        // awaiting_input -> awaiting_input for a person's re-run decision, the question void.
        s.park(&a, &question(json!([]))).unwrap_or_else(|e| panic!("{e}"));
        let ask = Ending::AskPerson { error: None, reason: "stopped".into(), failure: false, evidence: vec![json!(1)] };
        let row = s.finish(&a, &ask, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((row.state, row.lease_owner), (TaskState::AwaitingInput, None), "{name}");
        assert_eq!(s.open_question("r", "a").unwrap_or_else(|e| panic!("{e}")), None, "{name}: void");
        let row = s.decide_rerun("r", "a", true, "me").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(row.state, TaskState::Pending, "{name}");
        assert!(s.decide_rerun("r", "a", true, "me").is_err(), "{name}: only a waiting task");
    });
}

#[test]
fn a_report_replays_with_the_same_body_and_is_refused_with_another() {
    each(|name, s| {
        let a = claim(s, "a", "worker-1");
        let body = json!({"status": "completed", "result": "one"});
        let idem = Idem::worker_report(&a, "k1", &body);
        let first = s.finish(&a, &Ending::Completed { result: "one".into(), usage: None }, Some(&idem));
        let first = first.unwrap_or_else(|e| panic!("{e}"));
        let seq = s.last_seq().unwrap_or_default();
        let again = s.finish(&a, &Ending::Completed { result: "one".into(), usage: None }, Some(&idem));
        assert_eq!(again.unwrap_or_else(|e| panic!("{e}")), first, "{name}");
        assert_eq!(s.last_seq().unwrap_or_default(), seq, "{name}: a replay commits nothing");
        let other = Idem::worker_report(&a, "k1", &json!({"status": "completed", "result": "two"}));
        let refused = s.finish(&a, &Ending::Completed { result: "two".into(), usage: None }, Some(&other));
        assert!(matches!(&refused, Err(e) if e.code() == "idempotency_conflict"), "{name}: {refused:?}");
    });
}

#[test]
fn endings_move_the_task_as_they_say() {
    each(|name, s| {
        let a = claim(s, "a", "o");
        let failed = Ending::Failed {
            error: "garbage".into(),
            class: ErrorClass::Protocol,
            reason: "bug".into(),
            failure: true,
        };
        let row = s.finish(&a, &failed, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((row.state, row.failures, row.error.as_deref()), (TaskState::Failed, 1, Some("garbage")), "{name}");
        let b = claim(s, "b", "o");
        let retry =
            Ending::Retry { error: Some("down".into()), reason: "again".into(), not_before_ms: FAR, failure: true };
        let row = s.finish(&b, &retry, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((row.state, row.failures, row.not_before_ms), (TaskState::Pending, 1, FAR), "{name}");
        assert_eq!(s.claim("r", "b", "o", FAR).unwrap_or_else(|e| panic!("{e}")), None, "{name}: not before its time");
        let cancelled = s.cancel("r", "b", "by hand").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cancelled.map(|t| t.state), Some(TaskState::Cancelled), "{name}");
        assert_eq!(s.cancel("r", "b", "again").unwrap_or_else(|e| panic!("{e}")), None, "{name}: ended already");
        let transitions: Vec<(String, String)> = s
            .events_after(Some("r"), 0, 1000)
            .unwrap_or_default()
            .iter()
            .filter(|e| e.kind == "transition")
            .map(|e| (e.data["from"].as_str().unwrap_or("").to_owned(), e.data["to"].as_str().unwrap_or("").to_owned()))
            .collect();
        let t = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            transitions,
            [
                t("pending", "running"),
                t("running", "failed"),
                t("pending", "running"),
                t("running", "pending"),
                t("pending", "cancelled")
            ],
            "{name}"
        );
    });
}

#[test]
fn concurrent_writers_leave_a_gap_free_log() {
    each(|name, s| {
        let start = s.last_seq().unwrap_or_default();
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for j in 0..25 {
                        let e = ("r".to_owned(), None, "note".to_owned(), json!({"writer": i, "n": j}));
                        s.append_events(&[e]).unwrap_or_else(|e| panic!("{e}"));
                    }
                    s.claim("r", "a", &format!("w{i}"), FAR)
                })
            })
            .collect();
        let won = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| panic!("panicked")))
            .filter(|r| matches!(r, Ok(Some(_))))
            .count();
        assert_eq!(won, 1, "{name}");
        let seqs: Vec<i64> = s.events_after(None, start, 10_000).unwrap_or_default().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (start + 1..=start + 8 * 25 + 1).collect::<Vec<_>>(), "{name}: gap-free");
    });
}

#[test]
fn tasks_changed_reports_what_events_touched_in_every_run() {
    each(|name, s| {
        let (all, seq) = s.tasks_changed(0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(all.len(), 2, "{name}");
        assert_eq!(s.tasks_changed(seq).unwrap_or_else(|e| panic!("{e}")), (vec![], seq), "{name}");
        claim(s, "a", "o");
        let (changed, later) = s.tasks_changed(seq).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(changed.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(), ["a"], "{name}");
        assert!(later > seq);
        let unfinished: Vec<String> = s.unfinished_tasks().unwrap_or_default().into_iter().map(|t| t.id).collect();
        assert_eq!(unfinished, ["a", "b"], "{name}");
        let pending: Vec<String> = s.pending_tasks().unwrap_or_default().into_iter().map(|t| t.id).collect();
        assert_eq!(pending, ["b"], "{name}");
    });
}

/// A worker's lease walks the pending tasks oldest run first, in plan order (as
/// `pending_tasks` lists them), run by run and page by page, and stops where its visitor does.
#[test]
fn visiting_pending_tasks_follows_their_order_across_runs_and_pages() {
    each(|name, s| {
        let mut source = String::new();
        for i in 0..70 {
            source.push_str(&format!("[[tasks]]\nid = \"t{i:02}\"\nprompt = \"x\"\n\n"));
        }
        let plan = parse(&source, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        // After `r` in time and, should both be created in one millisecond, by id.
        s.create_run("z", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        claim(s, "a", "o");
        let held = s.claim("z", "t05", "o", FAR).unwrap_or_else(|e| panic!("{e}"));
        assert!(held.is_some(), "{name}");
        let listed: Vec<(String, String)> =
            s.pending_tasks().unwrap_or_else(|e| panic!("{e}")).into_iter().map(|t| (t.run_id, t.id)).collect();
        assert_eq!(listed.len(), 70, "{name}: b and 69 of z");
        let mut expected = vec![("r".to_owned(), "b".to_owned())];
        expected.extend((0..70).filter(|i| *i != 5).map(|i| ("z".to_owned(), format!("t{i:02}"))));
        assert_eq!(listed, expected, "{name}: oldest run first, in plan order");
        let mut visited = Vec::new();
        s.visit_pending(&mut |t, _| {
            visited.push((t.run_id, t.id));
            Ok(false)
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(visited, listed, "{name}");
        let mut first = Vec::new();
        s.visit_pending(&mut |t, _| {
            first.push(t.id);
            Ok(first.len() == 3)
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(first.len(), 3, "{name}: stops where the visitor does");
    });
}

/// A task's latest events, oldest first, picked out of its run's log (other tasks' passed over).
#[test]
fn a_tasks_latest_events_come_oldest_first() {
    each(|name, s| {
        let a = claim(s, "a", "o");
        for n in 0..5 {
            s.record(&a, &[("note".into(), json!({"n": n}))], &[]).unwrap_or_else(|e| panic!("{e}"));
            let other = ("r".to_owned(), Some("b".to_owned()), "note".to_owned(), json!({"n": n}));
            s.append_events(&[other]).unwrap_or_else(|e| panic!("{e}"));
        }
        let last = s.task_events("r", "a", 3).unwrap_or_else(|e| panic!("{e}"));
        let ns: Vec<_> = last.iter().map(|e| e.data["n"].as_i64()).collect();
        assert_eq!(ns, [Some(2), Some(3), Some(4)], "{name}");
        assert!(last.iter().all(|e| e.task.as_deref() == Some("a")), "{name}");
        let all = s.task_events("r", "a", 1000).unwrap_or_else(|e| panic!("{e}"));
        let logged: Vec<i64> = s
            .events_after(Some("r"), 0, 1000)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.task.as_deref() == Some("a"))
            .map(|e| e.seq)
            .collect();
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), logged, "{name}: every one, in order");
        assert!(s.task_events("r", "nobody", 10).unwrap_or_default().is_empty(), "{name}");
    });
}

/// Each commit of a handle comes to its own followers with the rows a read of the log would
/// give, current from where the previous one left off; another handle's commits (another
/// process) are not among them and show as a gap.
#[test]
fn own_commits_carry_what_a_read_would_and_others_show_as_gaps() {
    for (name, make) in backends() {
        let fresh = make();
        let (one, two) = (open(&fresh.spec), open(&fresh.spec));
        let mut own = one.own_commits();
        let mut at = one.last_seq().unwrap_or_else(|e| panic!("{e}"));
        let mut next = |after: i64, ids: &[&str]| {
            let c = own.try_recv().unwrap_or_else(|e| panic!("{name}: no commit of its own: {e}"));
            assert_eq!(c.after, after, "{name}: where the commit starts");
            let mut carried = c.tasks.clone();
            carried.sort_by(|x, y| x.id.cmp(&y.id));
            let (mut read, upto) = one.tasks_changed(c.after).unwrap_or_else(|e| panic!("{e}"));
            read.sort_by(|x, y| x.id.cmp(&y.id));
            assert_eq!(carried.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(), ids, "{name}: the tasks it moved");
            assert_eq!((carried, c.upto), (read, upto), "{name}: the commit and a read of it");
            let events: Vec<_> = c.events.iter().cloned().map(|e| e.into_event()).collect();
            let logged = one.events_after(None, c.after, 1000).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(serde_json::to_value(&events).ok(), serde_json::to_value(&logged).ok(), "{name}: its events");
            assert_eq!(events.len() as i64, c.upto - c.after, "{name}: every event of the range");
            assert!(own.try_recv().is_err(), "{name}: one write, one commit");
            c.upto
        };
        let plan =
            parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\n", &|_| Ok(()))
                .unwrap_or_else(|e| panic!("{e}"));
        one.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        at = next(at, &["a", "b"]);
        let a = claim(&one, "a", "o");
        at = next(at, &["a"]);
        one.record(&a, &[("note".into(), json!({"n": 1}))], &[]).unwrap_or_else(|e| panic!("{e}"));
        at = next(at, &["a"]);
        // Another process moves b: not one's own commit, so one's next commit starts past a gap.
        claim(&two, "b", "p");
        let theirs = two.last_seq().unwrap_or_else(|e| panic!("{e}"));
        assert!(theirs > at, "{name}");
        let row = one.finish(&a, &done(), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(row.state, TaskState::Completed, "{name}");
        next(theirs, &["a"]);
    }
}

#[tokio::test]
async fn another_handles_commits_reach_the_watch() {
    for (name, make) in backends() {
        // Two handles on one store stand for two processes: the second sees the first's commits.
        let fresh = make();
        let one = open(&fresh.spec);
        let two = open(&fresh.spec);
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        // A commit between the second handle's opening and its subscription is seen too.
        one.create_run("r0", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let first = one.last_seq().unwrap_or_default();
        let mut watch = two.subscribe();
        let early = tokio::time::timeout(std::time::Duration::from_secs(10), watch.wait_for(|s| *s >= first))
            .await
            .is_ok_and(|r| r.is_ok());
        assert!(early, "{name}: a commit before the subscription was not published");
        one.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let last = one.last_seq().unwrap_or_default();
        let seen = tokio::time::timeout(std::time::Duration::from_secs(10), watch.wait_for(|s| *s >= last)).await;
        assert!(matches!(seen, Ok(Ok(_))), "{name}: the other handle's commit was not published");
    }
}

/// The child half of the crash test: when `PIER_CRASH_STORE` names a store, claims, records
/// and finishes its tasks as fast as it can until it is killed. Otherwise does nothing.
#[test]
fn crash_writer_child() {
    let Ok(spec) = std::env::var("PIER_CRASH_STORE") else { return };
    let store = open(&spec);
    let owner = format!("child-{}", std::process::id());
    loop {
        let pending = store.pending_tasks().unwrap_or_else(|e| panic!("{e}"));
        let Some(t) = pending.first() else { return };
        let Ok(Some((a, _))) = store.claim(&t.run_id, &t.id, &owner, FAR) else { continue };
        let note = ("note".to_owned(), json!({"n": a.n}));
        store.record(&a, &[note], &[json!({"effect": "tool_call", "kind": "edit"})]).unwrap_or_else(|e| panic!("{e}"));
        let ending = if a.task.ends_with('0') {
            Ending::Retry { error: None, reason: "again".into(), not_before_ms: 0, failure: true }
        } else {
            Ending::Completed { result: a.task.clone(), usage: None }
        };
        let _ = store.finish(&a, &ending, None);
    }
}

/// Kills a writer at arbitrary points of its work, again and again, and checks after each
/// kill that the store is whole: the log gap-free, every task's state the `to` of its last
/// transition, its version one more than its transitions, every started attempt on record,
/// and a task held only by a live lease.
#[test]
fn a_writer_killed_at_any_point_leaves_a_whole_store() {
    for (name, make) in backends() {
        let fresh = make();
        writer_killed_at_any_point(name, &fresh.spec);
    }
}

fn writer_killed_at_any_point(name: &str, path: &str) {
    {
        let store = open(path);
        let plan: String = (0..400).map(|i| format!("[[tasks]]\nid = \"t{i}\"\nprompt = \"p\"\n\n")).collect();
        let plan = parse(&plan, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        store.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    for round in 0..8i64 {
        let store = open(path);
        let start = store.last_seq().unwrap_or_default();
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "crash_writer_child", "--nocapture", "--test-threads", "1"])
            .env("PIER_CRASH_STORE", path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        // Kill after a different amount of committed work each round.
        let mut watch = store.subscribe();
        let target = start + 5 + round * 7;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| panic!("{e}"));
        let reached = rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(20), watch.wait_for(|s| *s >= target)).await
        });
        let _ = child.kill();
        let _ = child.wait();
        assert!(matches!(reached, Ok(Ok(_))), "{name} round {round}: the writer made no progress");
        drop(store);
        check_whole(path, round);
    }
}

fn check_whole(path: &str, round: i64) {
    let store = open(path);
    // On PostgreSQL the killed writer's last commit may still land after its process is gone
    // (its backend runs the `COMMIT` the writer had sent), and the log and the tasks are two
    // reads: taken again until the tasks read the same on both sides of the log's read, so no
    // transition committed between them.
    let (log, tasks) = (0..50)
        .find_map(|_| {
            let before = store.tasks("r").unwrap_or_default();
            let log = store.events_after(None, 0, 10_000_000).unwrap_or_default();
            let after = store.tasks("r").unwrap_or_default();
            (before == after).then_some((log, after))
        })
        .unwrap_or_else(|| panic!("round {round}: the store kept changing after its writer was killed"));
    let seqs: Vec<i64> = log.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>(), "round {round}: the log has a gap");
    for t in tasks {
        let moves: Vec<&pier_store::Event> =
            log.iter().filter(|e| e.kind == "transition" && e.task.as_deref() == Some(&t.id)).collect();
        assert_eq!(t.version, 1 + moves.len() as i64, "round {round}: {} version vs its transitions", t.id);
        let last_to = moves.last().map_or("pending", |e| e.data["to"].as_str().unwrap_or(""));
        assert_eq!(t.state.as_str(), last_to, "round {round}: {} state vs its last transition", t.id);
        let started = moves.iter().filter(|e| e.data["to"] == "running").count() as i64;
        assert_eq!(t.attempt, started, "round {round}: {} attempts vs its claims", t.id);
        if t.attempt > 0 {
            assert!(store.evidence("r", &t.id, t.attempt).is_ok(), "round {round}: {} attempt row", t.id);
        }
        let live = matches!(t.state, TaskState::Running | TaskState::AwaitingInput);
        assert_eq!(live, t.lease_owner.is_some(), "round {round}: {} lease vs state {:?}", t.id, t.state);
    }
}

#[test]
fn a_run_is_driven_by_one_live_node_and_handed_back_when_it_leaves() {
    each(|name, s| {
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        s.create_run("r2", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let now = pier_store::now_ms();
        // Alone, a node drives every unfinished run.
        let one = s.lease_runs("one", now + 60_000).unwrap_or_default();
        assert_eq!(one, ["r", "r2"], "{name}");
        // A second node gets nothing held by a live node; the first hands back beyond its
        // share on its next renewal, which the second then takes.
        assert_eq!(s.lease_runs("two", now + 60_000).unwrap_or_default(), Vec::<String>::new(), "{name}");
        let nodes = s.nodes().unwrap_or_default();
        let runs: Vec<(&str, Vec<String>)> = nodes.iter().map(|n| (n.id.as_str(), n.runs.clone())).collect();
        assert_eq!(runs, [("one", vec!["r".to_owned(), "r2".to_owned()]), ("two", vec![])], "{name}: a node with none");
        assert!(
            nodes.iter().all(|n| n.heartbeat_at_ms > 0 && n.expires_at_ms > n.heartbeat_at_ms),
            "{name}: {nodes:?}"
        );
        assert_eq!(s.lease_runs("one", now + 60_000).unwrap_or_default(), ["r"], "{name}");
        assert_eq!(s.lease_runs("two", now + 60_000).unwrap_or_default(), ["r2"], "{name}");
        let nodes = s.nodes().unwrap_or_default();
        let runs: Vec<(&str, Vec<String>)> = nodes.iter().map(|n| (n.id.as_str(), n.runs.clone())).collect();
        assert_eq!(runs, [("one", vec!["r".to_owned()]), ("two", vec!["r2".to_owned()])], "{name}");
        // A node that leaves hands its runs back at once; one that dies, when its lease expires.
        s.release_runs("one").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.lease_runs("two", now - 1).unwrap_or_default(), ["r", "r2"], "{name}");
        // Two's renewal came too late (its lease had passed): a third node takes both.
        assert_eq!(s.lease_runs("three", now + 60_000).unwrap_or_default(), ["r", "r2"], "{name}");
        // A finished run is nobody's.
        let a = claim(s, "a", "w");
        s.finish(&a, &done(), None).unwrap_or_else(|e| panic!("{e}"));
        let b = claim(s, "b", "w");
        s.finish(&b, &done(), None).unwrap_or_else(|e| panic!("{e}"));
        assert!(!s.lease_runs("three", now + 60_000).unwrap_or_default().contains(&"r".to_owned()), "{name}");
    });
}

#[test]
fn nodes_starting_together_migrate_a_new_database_once() {
    // Several processes may open a new store at once: `pier serve` nodes on one database,
    // `pier run` beside `pier answer` on one file. Each migration must run once.
    for (name, make) in backends() {
        let fresh = make();
        let openers: Vec<_> = (0..6)
            .map(|_| {
                let spec = fresh.spec.clone();
                std::thread::spawn(move || pier_store::open(&spec).map(|s| s.last_seq()))
            })
            .collect();
        for o in openers {
            let opened = o.join().unwrap_or_else(|_| panic!("an opener panicked"));
            assert!(matches!(opened, Ok(Ok(0))), "{name}: {opened:?}");
        }
        let store = open(&fresh.spec);
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        store.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(store.last_seq().unwrap_or_default(), 2, "{name}");
    }
}

#[test]
fn an_attempts_output_is_kept_even_after_its_task_was_cancelled() {
    each(|name, s| {
        // Its lease lapsed (its worker is cut off): the cancel ends the task at once, and what
        // the attempt showed is kept when it comes.
        let Ok(Some((a, _))) = s.claim("r", "a", "owner-1", 1) else { panic!("{name}: claim") };
        s.cancel("r", "a", "a person stopped it").unwrap_or_else(|e| panic!("{name}: {e}"));
        let output =
            serde_json::json!({"text": "half done", "toolCalls": [{"toolCallId": "t1", "status": "completed"}]});
        s.keep_output(&a, &output).unwrap_or_else(|e| panic!("{name}: {e}"));
        let attempts = s.attempts("r", "a").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(attempts.len(), 1, "{name}");
        assert_eq!((attempts[0].attempt, attempts[0].output.as_ref()), (1, Some(&output)), "{name}");
        assert_eq!(state(s, "a"), TaskState::Cancelled, "{name}");
        assert!(s.attempts("r", "b").unwrap_or_else(|e| panic!("{name}: {e}")).is_empty(), "{name}");
    });
}

/// What an attempt writes last: its unwritten events, then its ending, with its output.
fn last(output: &serde_json::Value, unless_messages: bool) -> Last {
    let events = vec![("text".to_owned(), json!({"text": "the last words"}))];
    Last { events, evidence: vec![json!({"wrote": "x"})], output: output.clone(), unless_messages }
}

/// The kinds of task `task`'s events in the log, oldest first.
fn kinds(s: &Arc<dyn TaskStore>, task: &str) -> Vec<String> {
    let events = s.events_after(Some("r"), 0, 1000).unwrap_or_else(|e| panic!("{e}"));
    events.into_iter().filter(|e| e.task.as_deref() == Some(task)).map(|e| e.kind).collect()
}

#[test]
fn an_ending_with_its_output_is_one_write_and_a_refused_ending_keeps_the_output() {
    each(|name, s| {
        let output = json!({"text": "done", "toolCalls": []});
        let a = claim(s, "a", "owner-1");
        let row = s.finish_keeping(&a, &last(&output, false), &done()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(Some(&row), s.task("r", "a").ok().flatten().as_ref(), "{name}: the answered row is the stored one");
        let attempts = s.attempts("r", "a").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((row.state, attempts[0].output.as_ref()), (TaskState::Completed, Some(&output)), "{name}");
        assert_eq!(attempts[0].evidence, vec![json!({"wrote": "x"})], "{name}");
        assert_eq!(
            kinds(s, "a"),
            ["task_created", "transition", "text", "transition"],
            "{name}: the last events before the ending"
        );
        // An attempt whose task was taken from it (its lease lapsed and it was released): the
        // ending is refused, events and output kept.
        let Ok(Some((b, _))) = s.claim("r", "b", "owner-1", 1) else { panic!("{name}: claim") };
        s.cancel("r", "b", "a person stopped it").unwrap_or_else(|e| panic!("{name}: {e}"));
        let refused = s.finish_keeping(&b, &last(&output, true), &done());
        assert!(matches!(&refused, Err(e) if e.is_race()), "{name}: {refused:?}");
        let attempts = s.attempts("r", "b").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(attempts[0].output.as_ref(), Some(&output), "{name}: kept though refused");
        assert_eq!(kinds(s, "b"), ["task_created", "transition", "transition", "text"], "{name}");
        assert_eq!(state(s, "b"), TaskState::Cancelled, "{name}");
    });
}

/// Issue #35.1: a person's cancel of a task a live attempt holds is asked of the attempt,
/// which ends the task with its output in one commit; until then the task is live, so no
/// reader sees it ended without its output. Whatever ending the attempt (or whoever
/// releases it) writes, the task ends cancelled, for the reason the person gave.
#[test]
fn a_cancel_of_a_held_task_is_ended_by_its_attempt_with_its_output() {
    each(|name, s| {
        let output = json!({"text": "half done", "toolCalls": []});
        let a = claim(s, "a", "owner-1");
        let asked = s.cancel("r", "a", "a person stopped it").unwrap_or_else(|e| panic!("{name}: {e}"));
        let asked = asked.unwrap_or_else(|| panic!("{name}: the cancel was not taken"));
        assert_eq!((asked.state, asked.cancel_requested.as_deref()), (TaskState::Running, Some("a person stopped it")));
        assert_eq!(Some(&asked), s.task("r", "a").ok().flatten().as_ref(), "{name}: the answered row is stored");
        let again = s.cancel("r", "a", "twice").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(again.and_then(|t| t.cancel_requested).as_deref(), Some("a person stopped it"), "{name}");
        assert!(s.attempts("r", "a").unwrap_or_else(|e| panic!("{name}: {e}"))[0].output.is_none(), "{name}");
        // It asks nothing more and takes no message.
        let parked = s.park(&a, &question(json!([])));
        assert!(matches!(parked, Err(StoreError::CancelRequested { .. })), "{name}: {parked:?}");
        assert_eq!(s.say("r", "a", "more", false, "me").unwrap_or_else(|e| panic!("{name}: {e}")), None, "{name}");
        // Its ending (here: completed, with messages asked for) is the cancel, with its output.
        let row = s.finish_keeping(&a, &last(&output, true), &done()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            (row.state, row.result.as_deref(), row.cancel_requested.as_deref()),
            (TaskState::Cancelled, None, None)
        );
        assert_eq!(Some(&row), s.task("r", "a").ok().flatten().as_ref(), "{name}: the answered row is stored");
        let attempts = s.attempts("r", "a").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(attempts[0].output.as_ref(), Some(&output), "{name}");
        assert_eq!(kinds(s, "a"), ["task_created", "transition", "cancel_requested", "text", "transition"], "{name}");
        let events = s.events_after(Some("r"), 0, 1000).unwrap_or_else(|e| panic!("{e}"));
        let last_move =
            events.iter().rev().find(|e| e.kind == "transition").map(|e| e.data.clone()).unwrap_or_default();
        assert_eq!(
            (last_move["to"].as_str(), last_move["reason"].as_str()),
            (Some("cancelled"), Some("a person stopped it"))
        );
        // An ending without output (a worker's plain report), and one by whoever releases a lost
        // attempt, are the cancel too.
        let b = claim(s, "b", "owner-1");
        s.cancel("r", "b", "stop b").unwrap_or_else(|e| panic!("{name}: {e}"));
        let retry = Ending::Retry { error: None, reason: "again".into(), not_before_ms: 0, failure: false };
        let held = s.task("r", "b").ok().flatten().and_then(|t| t.held()).unwrap_or_else(|| panic!("{name}: held"));
        let released = s.release_lost(&held, &retry).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(released.map(|t| t.state), Some(TaskState::Cancelled), "{name}");
        let late = s.finish(&b, &done(), None);
        assert!(matches!(&late, Err(e) if e.is_race()), "{name}: {late:?}");
        // A retried task starts clean.
        s.retry("r", "b", false, "me").unwrap_or_else(|e| panic!("{name}: {e}"));
        let c = claim(s, "b", "owner-2");
        let row = s.finish(&c, &done(), None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(row.state, TaskState::Completed, "{name}");
    });
}

/// A worker's report and the claim of its next task are one commit (the first candidate still
/// free); a repeat of the report answers the same claim; a next task whose dependency has not
/// completed is not claimed.
#[test]
fn a_report_claims_the_workers_next_task_in_its_commit() {
    each(|name, s| {
        let a = claim(s, "a", "wk");
        let candidate = |run: &str, task: &str, deps: &[&str]| pier_store::Candidate {
            run: run.into(),
            task: task.into(),
            depends_on: deps.iter().map(|d| d.to_string()).collect(),
        };
        let next = |candidates| pier_store::NextClaim { candidates, owner: "wk".into(), until: FAR };
        let body = json!({"status": "completed", "result": "ok", "next": {}});
        let idem = Idem::worker_report(&a, "k1", &body);
        let reported = s
            .report_and_claim(
                &a,
                &done(),
                &idem,
                Some(&next(vec![candidate("r", "a", &[]), candidate("r", "b", &["a"])])),
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(reported.task.state, TaskState::Completed, "{name}");
        let b = reported.next.clone().unwrap_or_else(|| panic!("{name}: b was not claimed"));
        assert_eq!((b.id.as_str(), b.state, b.lease_owner.as_deref()), ("b", TaskState::Running, Some("wk")));
        assert_eq!(Some(&b), s.task("r", "b").ok().flatten().as_ref(), "{name}");
        let events = s.events_after(Some("r"), 0, 1000).unwrap_or_else(|e| panic!("{e}"));
        let moves: Vec<(Option<String>, i64)> =
            events.iter().filter(|e| e.kind == "transition").map(|e| (e.task.clone(), e.seq)).collect();
        let tail = &moves[moves.len() - 2..];
        assert_eq!((tail[0].0.as_deref(), tail[1].0.as_deref(), tail[1].1 - tail[0].1), (Some("a"), Some("b"), 1));
        let again = s.report_and_claim(&a, &done(), &idem, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(again.repeat && !reported.repeat, "{name}");
        assert_eq!(
            (again.task, again.next),
            (reported.task, reported.next),
            "{name}: a repeat answers the first answer"
        );
        // A task whose dependency has not completed is not claimed, whatever was counted on.
        let plan =
            "[[tasks]]\nid = \"d\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"c\"\nprompt = \"y\"\ndepends_on = [\"d\"]\n";
        let plan = parse(plan, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        s.create_run("q", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let c = next(vec![candidate("q", "c", &["d"])]);
        let b = Attempt { run: "r".into(), task: "b".into(), n: b.attempt, owner: "wk".into() };
        let idem = Idem::worker_report(&b, "k2", &body);
        let reported = s.report_and_claim(&b, &done(), &idem, Some(&c)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((reported.task.state, reported.next), (TaskState::Completed, None), "{name}");
        assert_eq!(s.task("q", "c").ok().flatten().map(|t| t.state), Some(TaskState::Pending), "{name}");
    });
}

#[test]
fn an_agents_latest_initialize_answer_is_kept() {
    each(|name, s| {
        assert!(s.agents().unwrap_or_else(|e| panic!("{name}: {e}")).is_empty(), "{name}");
        let first = serde_json::json!({"agentCapabilities": {"loadSession": false}});
        let second = serde_json::json!({"agentCapabilities": {"loadSession": true}});
        s.record_agent("pier", &first).unwrap_or_else(|e| panic!("{name}: {e}"));
        s.record_agent("pier", &second).unwrap_or_else(|e| panic!("{name}: {e}"));
        s.record_agent("codex", &first).unwrap_or_else(|e| panic!("{name}: {e}"));
        let pier = s.agent("pier").unwrap_or_else(|e| panic!("{name}: {e}")).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(pier.init, second, "{name}: the latest wins");
        let specs: Vec<String> =
            s.agents().unwrap_or_else(|e| panic!("{name}: {e}")).into_iter().map(|a| a.spec).collect();
        assert_eq!(specs, vec!["codex", "pier"], "{name}");
        assert!(s.agent("gemini").unwrap_or_else(|e| panic!("{name}: {e}")).is_none(), "{name}");
    });
}

#[test]
fn messages_go_to_running_tasks_and_are_taken_once_by_the_holder() {
    each(|name, s| {
        let ok = |r: Result<Option<i64>, pier_store::StoreError>| r.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(ok(s.say("r", "a", "too early", false, "me")), None, "{name}: a pending task takes none");
        let a = claim(s, "a", "owner-1");
        assert_eq!(ok(s.say("r", "a", "first", false, "me")), Some(1), "{name}");
        let waiting = || s.waiting("r", "a").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(waiting(), Waiting { messages: true, interrupt: false }, "{name}");
        assert_eq!(ok(s.say("r", "a", "second", true, "me")), Some(2), "{name}");
        assert_eq!(waiting(), Waiting { messages: true, interrupt: true }, "{name}");
        let foreign = Attempt { owner: "owner-2".into(), ..a.clone() };
        assert!(s.take_messages(&foreign).is_err(), "{name}: fenced on the holder");
        let taken = s.take_messages(&a).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(taken, vec![(1, "first".to_owned()), (2, "second".to_owned())], "{name}");
        assert_eq!(waiting(), Waiting::default(), "{name}");
        assert!(s.take_messages(&a).unwrap_or_else(|e| panic!("{name}: {e}")).is_empty(), "{name}: taken once");
    });
}

/// A turn answered; a message came before the attempt's ending: the ending waiting for the
/// inbox is refused and writes nothing, the message is taken, and the next ending applies.
/// After it, the inbox is closed: a message is refused, never accepted and left unsent.
#[test]
fn an_ending_waiting_for_the_inbox_is_refused_while_a_message_waits_and_closes_it() {
    each(|name, s| {
        let ok = |r: Result<Option<i64>, StoreError>| r.unwrap_or_else(|e| panic!("{name}: {e}"));
        let output = json!({"text": "done", "toolCalls": []});
        let a = claim(s, "a", "owner-1");
        assert_eq!(ok(s.say("r", "a", "one more thing", false, "me")), Some(1), "{name}");
        let refused = s.finish_keeping(&a, &last(&output, true), &done());
        assert!(matches!(refused, Err(StoreError::MessagesWaiting { .. })), "{name}: {refused:?}");
        assert_eq!(state(s, "a"), TaskState::Running, "{name}: nothing ended");
        assert_eq!(kinds(s, "a"), ["task_created", "transition", "message"], "{name}: nothing recorded");
        let attempts = s.attempts("r", "a").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((attempts[0].output.as_ref(), attempts[0].evidence.len()), (None, 0), "{name}: nothing kept");
        let taken = s.take_messages(&a).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(taken, vec![(1, "one more thing".to_owned())], "{name}");
        let row = s.finish_keeping(&a, &last(&output, true), &done()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(row.state, TaskState::Completed, "{name}");
        assert_eq!(ok(s.say("r", "a", "too late", false, "me")), None, "{name}: the attempt ended");
        // Without waiting for the inbox (an ending no agent could hear more), a message does not stop it.
        let b = claim(s, "b", "owner-1");
        assert_eq!(ok(s.say("r", "b", "unheard", false, "me")), Some(1), "{name}");
        let row = s.finish_keeping(&b, &last(&output, false), &done()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(row.state, TaskState::Completed, "{name}");
    });
}

/// On PostgreSQL a `say` on another connection may hold the task's row when the ending
/// comes: the ending waits for it, and must then see the message `say` committed (a look
/// taken with the ending's own snapshot, from before the wait, would not).
#[test]
fn an_ending_that_waited_for_a_say_holding_the_task_sees_its_message() {
    let fresh = postgres();
    let s = open(&fresh.spec);
    let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    s.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    let a = claim(&s, "a", "owner-1");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| panic!("{e}"));
    let (client, connection) =
        rt.block_on(tokio_postgres::connect(&fresh.spec, tokio_postgres::NoTls)).unwrap_or_else(|e| panic!("{e}"));
    rt.spawn(connection);
    // What `say` does, held open: the task's row locked, the message written, not committed.
    rt.block_on(client.batch_execute(
        "BEGIN; SELECT 1 FROM tasks WHERE run_id = 'r' AND id = 'a' FOR UPDATE;
         INSERT INTO messages (run_id, task_id, n, text, interrupt, at_ms) VALUES ('r', 'a', 1, 'wait', 0, 0)",
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let ending = {
        let (s, a) = (s.clone(), a.clone());
        std::thread::spawn(move || s.finish_keeping(&a, &last(&json!(null), true), &done()))
    };
    // Until the ending waits for the row's lock (it is then past taking its snapshot).
    let waiting =
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while rt.block_on(client.query_one(waiting, &[])).map(|r| r.get::<_, i64>(0)).unwrap_or(0) == 0 {
        assert!(std::time::Instant::now() < deadline, "the ending never waited for the row");
        std::thread::yield_now();
    }
    rt.block_on(client.batch_execute("COMMIT")).unwrap_or_else(|e| panic!("{e}"));
    let ended = ending.join().unwrap_or_else(|_| panic!("the ending panicked"));
    assert!(matches!(ended, Err(StoreError::MessagesWaiting { .. })), "{ended:?}");
    assert_eq!(state(&s, "a"), TaskState::Running);
    assert_eq!(s.take_messages(&a).unwrap_or_else(|e| panic!("{e}")), vec![(1, "wait".to_owned())]);
}

#[test]
fn of_two_writers_creating_one_run_one_wins_and_the_other_is_told_it_exists() {
    for (name, make) in backends() {
        let fresh = make();
        let store = open(&fresh.spec);
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        let racers: Vec<_> = (0..4)
            .map(|_| {
                let (spec, plan) = (fresh.spec.clone(), plan.clone());
                std::thread::spawn(move || open(&spec).create_run("same", &plan, "test"))
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("panicked"))).collect();
        assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1, "{name}: {results:?}");
        assert!(
            results.iter().filter_map(|r| r.as_ref().err()).all(|e| matches!(e, pier_store::StoreError::RunExists(_))),
            "{name}: {results:?}"
        );
        assert_eq!(store.tasks("same").unwrap_or_else(|e| panic!("{e}")).len(), 1, "{name}");
    }
}

#[test]
fn a_person_retries_a_failed_task_and_with_dependents_the_cancelled_ones_below_it() {
    each(|name, s| {
        let plan = "[[tasks]]\nid = \"a\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\ndepends_on = [\"a\"]\n\n\
                    [[tasks]]\nid = \"c\"\nprompt = \"z\"\ndepends_on = [\"b\"]\n\n[[tasks]]\nid = \"d\"\nprompt = \"w\"\n";
        let plan = parse(plan, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        s.create_run("q", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let fail = |task: &str| {
            let (a, _) = s.claim("q", task, "o", FAR).ok().flatten().unwrap_or_else(|| panic!("{name}: claim {task}"));
            let failed = Ending::Failed {
                error: "boom".into(),
                class: ErrorClass::Business,
                reason: "gave up".into(),
                failure: true,
            };
            s.finish(&a, &failed, None).unwrap_or_else(|e| panic!("{e}"));
        };
        fail("a");
        for t in ["b", "c"] {
            s.cancel("q", t, "a dependency failed").unwrap_or_else(|e| panic!("{e}"));
        }
        let st = |t: &str| s.task("q", t).ok().flatten().map(|t| t.state).unwrap_or_else(|| panic!("no {t}"));
        // Only failed and cancelled tasks can be retried.
        let refused = s.retry("q", "d", false, "tester");
        assert!(matches!(refused, Err(StoreError::IllegalTransition { .. })), "{name}: a pending task {refused:?}");
        // Alone: the task, its failures forgotten; what is below it stays cancelled.
        let rows = s.retry("q", "a", false, "tester").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            rows.iter().map(|r| (r.id.as_str(), r.state, r.failures)).collect::<Vec<_>>(),
            [("a", TaskState::Pending, 0)],
            "{name}"
        );
        assert_eq!(
            (rows[0].error.as_deref(), st("b"), st("c")),
            (None, TaskState::Cancelled, TaskState::Cancelled),
            "{name}"
        );
        fail("a");
        assert_eq!(s.task("q", "a").ok().flatten().map(|t| t.attempt), Some(2), "{name}: a new attempt");
        // With its dependents: the cancelled tasks below it, transitively, and nothing else.
        let rows = s.retry("q", "a", true, "tester").unwrap_or_else(|e| panic!("{e}"));
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c"], "{name}");
        assert!(rows.iter().all(|r| r.state == TaskState::Pending), "{name}");
        let reasons: Vec<String> = s
            .events_after(Some("q"), 0, 1000)
            .unwrap_or_default()
            .iter()
            .filter(|e| e.kind == "transition" && e.data["to"] == "pending")
            .filter_map(|e| e.data["reason"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(
            reasons,
            [
                "a person retried it (tester)",
                "a person retried it (tester)",
                "retried with a, which it depends on (tester)",
                "retried with a, which it depends on (tester)"
            ],
            "{name}"
        );
    });
}

#[test]
fn rows_of_nodes_dead_for_an_hour_are_removed_by_a_live_node_s_pass() {
    let fresh = sqlite();
    let s = open(&fresh.spec);
    let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    s.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    let now = pier_store::now_ms();
    // A node whose heartbeat ran out two hours ago, holding the run's lease, and a recent one.
    assert_eq!(s.lease_runs("ghost", now - 7_200_000).unwrap_or_default(), ["r"]);
    s.lease_runs("recent", now - 60_000).unwrap_or_else(|e| panic!("{e}"));
    let rows = |table: &str| -> Vec<String> {
        let db = rusqlite::Connection::open(&fresh.spec).unwrap_or_else(|e| panic!("{e}"));
        let sql = format!("SELECT {} FROM {table} ORDER BY 1", if table == "nodes" { "id" } else { "owner" });
        let mut stmt = db.prepare(&sql).unwrap_or_else(|e| panic!("{e}"));
        stmt.query_map([], |r| r.get::<_, String>(0)).unwrap_or_else(|e| panic!("{e}")).filter_map(Result::ok).collect()
    };
    // The recent node's pass took the run over (the ghost's lease had expired).
    assert_eq!(rows("run_leases"), ["recent"]);
    s.lease_runs("live", now + 60_000).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows("nodes"), ["live", "recent"], "the ghost's row is gone; a node dead for a minute is kept");
}

#[test]
fn a_single_run_lease_is_taken_only_when_free_and_never_from_a_live_holder() {
    each(|name, s| {
        let now = pier_store::now_ms();
        assert!(s.lease_run("run-a", "r", now + 60_000).unwrap_or(false), "{name}: free, taken");
        assert!(!s.lease_run("run-b", "r", now + 60_000).unwrap_or(true), "{name}: held by a live node");
        assert!(s.lease_run("run-a", "r", now + 60_000).unwrap_or(false), "{name}: renewed by its holder");
        // A serving node takes its fair share of free runs, never a live `pier run`'s.
        assert!(!s.lease_runs("serve", now + 60_000).unwrap_or_default().contains(&"r".to_owned()), "{name}");
        // The holder's lease runs out: another takes it, and the old holder does not get it back.
        assert!(s.lease_run("run-a", "r", now - 1).unwrap_or(false), "{name}");
        assert!(s.lease_run("run-b", "r", now + 60_000).unwrap_or(false), "{name}: expired, taken over");
        assert!(!s.lease_run("run-a", "r", now + 60_000).unwrap_or(true), "{name}");
        s.release_runs("run-b").unwrap_or_else(|e| panic!("{e}"));
        assert!(s.lease_run("run-a", "r", now + 60_000).unwrap_or(false), "{name}: handed back at once");
    });
}

/// Issue #28: a stored permission rule that does not parse (an edited or damaged store) fails
/// the read of its task with a message naming the run, the task and the rule; it was dropped
/// silently, so a stored `deny` could vanish and the tool run unasked.
#[test]
fn a_stored_permission_rule_that_does_not_parse_is_refused_naming_it() {
    let fresh = sqlite();
    let s = open(&fresh.spec);
    let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\npermissions = { edit = \"deny\" }\n", &|_| Ok(()))
        .unwrap_or_else(|e| panic!("{e}"));
    s.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    let db = rusqlite::Connection::open(&fresh.spec).unwrap_or_else(|e| panic!("{e}"));
    let changed = db
        .execute("UPDATE tasks SET spec = replace(spec, '\"deny\"', '\"dney\"') WHERE id = 'a'", [])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(changed, 1);
    for read in [s.task("r", "a").map(|_| ()), s.tasks("r").map(|_| ()), s.pending_tasks().map(|_| ())] {
        let Err(e) = read else { panic!("a task whose rule does not parse was read as if it had none") };
        let text = e.to_string();
        assert!(matches!(e, StoreError::Corrupt { .. }), "{text}");
        assert!(text.contains("`a`") && text.contains("`r`") && text.contains("dney"), "{text}");
    }
}

/// Model requests are picked out of a run's log by kind (and task), and budgets are raised on
/// the task, or on every task of the run, each with its event; other limits stay as they were.
#[test]
fn model_requests_are_picked_out_and_budgets_raised_with_their_events() {
    each(|name, s| {
        let a = claim(s, "a", "o");
        let request = json!({"provider": "p", "status": 200, "latency_ms": 1, "streamed": true, "complete": true,
                             "tokens": {"input": 10, "cached_input": 0, "output": 5, "reasoning": 0}});
        s.record(&a, &[("model_request".into(), request), ("note".into(), json!({}))], &[])
            .unwrap_or_else(|e| panic!("{e}"));
        let picked = s.events_of_kind("r", None, "model_request").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(picked.len(), 1, "{name}");
        assert_eq!(pier_store::Spend::from_events(&picked).total.tokens.total(), 15, "{name}");
        assert!(s.events_of_kind("r", Some("b"), "model_request").unwrap_or_default().is_empty(), "{name}");
        let tokens = |n| Some(pier_store::Budget { tokens: Some(n), cost: None });
        let rows = s.set_budget("r", Some("a"), tokens(100), None, "me").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((rows.len(), rows[0].spec.budget), (1, tokens(100)), "{name}");
        let cost = Some(pier_store::Budget { tokens: None, cost: Some(2.5) });
        let rows = s.set_budget("r", Some("a"), cost, tokens(1000), "me").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rows.len(), 2, "{name}: the run's budget is on every task");
        let a = s.task("r", "a").ok().flatten().map(|t| t.spec).unwrap_or_default();
        assert_eq!(
            a.budget,
            Some(pier_store::Budget { tokens: Some(100), cost: Some(2.5) }),
            "{name}: raised, not replaced"
        );
        assert_eq!(s.task("r", "b").ok().flatten().and_then(|t| t.spec.run_budget), tokens(1000), "{name}");
        assert_eq!(s.events_of_kind("r", None, "budget").unwrap_or_default().len(), 3, "{name}");
        assert!(s.set_budget("r", Some("nobody"), tokens(1), None, "me").is_err(), "{name}");
    });
}

/// Issue #32: a concurrency key's limit holds across handles (nodes) and racing claimers; an
/// attempt parked on a question still holds its key, an ended or retried one frees it, and a
/// task whose attempt ended waiting for a person's decision holds none.
#[test]
fn a_concurrency_keys_limit_holds_across_claimers_and_frees_as_attempts_end() {
    for (name, make) in backends() {
        let fresh = make();
        let (s, other) = (open(&fresh.spec), open(&fresh.spec));
        let mut text = String::new();
        for i in 0..12 {
            text.push_str(&format!(
                "[[tasks]]\nid = \"t{i:02}\"\nprompt = \"x\"\nconcurrency = [{{ key = \"k\", limit = 2 }}]\n\n"
            ));
        }
        text.push_str("[[tasks]]\nid = \"solo\"\nprompt = \"x\"\nconcurrency = [{ key = \"k2\", limit = 1 }]\n\n");
        text.push_str("[[tasks]]\nid = \"free\"\nprompt = \"x\"\n");
        let plan = parse(&text, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        s.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let a = claim(&s, "t00", "o1");
        let b = claim(&other, "t01", "o2");
        assert_eq!(s.claim("r", "t02", "o1", FAR).unwrap_or_else(|e| panic!("{e}")), None, "{name}: k is full");
        assert_eq!(other.claim("r", "t02", "o2", FAR).unwrap_or_else(|e| panic!("{e}")), None, "{name}: on any node");
        assert_eq!(state(&s, "t02"), TaskState::Pending, "{name}: a refused claim changes nothing");
        claim(&s, "solo", "o1");
        claim(&s, "free", "o1");
        // Parked on a question, the attempt still runs: the key stays held.
        s.park(&a, &question(json!([]))).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(s.claim("r", "t02", "o1", FAR).unwrap_or_else(|e| panic!("{e}")), None, "{name}: parked holds");
        // An ending frees its place.
        s.finish(&b, &done(), None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let c = claim(&other, "t02", "o2");
        // A retry frees it too; so does an ending that waits for a person's decision.
        let retry = Ending::Retry { error: None, reason: "again".into(), not_before_ms: 0, failure: true };
        s.finish(&c, &retry, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let d = claim(&s, "t03", "o1");
        let ask = Ending::AskPerson { error: None, reason: "decide".into(), failure: true, evidence: vec![] };
        s.finish(&d, &ask, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        // One place is free (a holds the other): of 16 racing claimers on two handles, over the
        // remaining tasks, exactly one wins.
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let s = if i % 2 == 0 { s.clone() } else { other.clone() };
                std::thread::spawn(move || s.claim("r", &format!("t{:02}", 4 + i % 8), &format!("racer-{i}"), FAR))
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("panicked"))).collect();
        assert!(results.iter().all(Result::is_ok), "{name}: losers are told, not failed: {results:?}");
        let winners = results.iter().filter(|r| matches!(r, Ok(Some(_)))).count();
        assert_eq!(winners, 1, "{name}: {results:?}");
        let live = s
            .tasks("r")
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .filter(|t| t.spec.concurrency.iter().any(|k| k.key == "k") && t.lease_owner.is_some())
            .count();
        assert_eq!(live, 2, "{name}: the key's holders");
    }
}

/// A worker's report claims a next task with concurrency keys as any claim does: not past the
/// key's limit, and as a holder of it once claimed.
#[test]
fn a_reports_next_claim_holds_a_keys_limit() {
    for (name, make) in backends() {
        let fresh = make();
        let s = open(&fresh.spec);
        let text: String = ["a", "b", "c"]
            .iter()
            .map(|id| {
                format!("[[tasks]]\nid = \"{id}\"\nprompt = \"x\"\nconcurrency = [{{ key = \"k\", limit = 1 }}]\n\n")
            })
            .chain(std::iter::once("[[tasks]]\nid = \"d\"\nprompt = \"x\"\n".to_owned()))
            .collect();
        s.create_run("r", &parse(&text, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}")), "test")
            .unwrap_or_else(|e| panic!("{e}"));
        let candidate = |task: &str| pier_store::Candidate { run: "r".into(), task: task.into(), depends_on: vec![] };
        let next = |tasks: &[&str]| pier_store::NextClaim {
            candidates: tasks.iter().map(|t| candidate(t)).collect(),
            owner: "wk".into(),
            until: FAR,
        };
        let d = claim(&s, "d", "wk");
        let b_holds = claim(&s, "b", "other");
        // k is full (b holds it): the report passes c over.
        let idem = Idem::worker_report(&d, "k1", &json!({"status": "completed", "next": {}}));
        let reported = s.report_and_claim(&d, &done(), &idem, Some(&next(&["c"]))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reported.next, None, "{name}: claimed past the key's limit");
        assert_eq!(state(&s, "c"), TaskState::Pending, "{name}");
        // b ends; a's report claims c, which then holds k.
        s.finish(&b_holds, &done(), None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let a = claim(&s, "a", "wk");
        let idem = Idem::worker_report(&a, "k2", &json!({"status": "completed", "next": {}}));
        let reported = s.report_and_claim(&a, &done(), &idem, Some(&next(&["c"]))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reported.next.map(|t| t.id), Some("c".to_owned()), "{name}");
        assert_eq!(s.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 1, "{name}: c holds k");
    }
}

fn schedule_spec(id: &str, every: &str) -> pier_store::schedule::ScheduleSpec {
    let spec = json!({"id": id, "every": every, "plan": "[[tasks]]\nid = \"a\"\nprompt = \"x\"\n"});
    pier_store::schedule::ScheduleSpec::from_value(spec).unwrap_or_else(|e| panic!("{e:?}"))
}

/// The move of schedule `id` from occurrence `from`, decided on the schedule as `s` holds it now.
fn advance(s: &Arc<dyn TaskStore>, id: &str, from: i64, run: Option<&str>, exclusive: bool) -> pier_store::Advance {
    let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    pier_store::Advance {
        id: id.into(),
        from,
        spec: serde_json::to_string(&schedule_row(s, id).spec).unwrap_or_default(),
        next: Some(from + 1000),
        fire: run.map(|r| pier_store::Fire { at: from, run: r.into(), plan, source: "test".into() }),
        note: "n".into(),
        exclusive,
    }
}

fn schedule_row(s: &Arc<dyn TaskStore>, id: &str) -> pier_store::ScheduleRow {
    s.schedules(Some(id)).unwrap_or_else(|e| panic!("{e}")).pop().unwrap_or_else(|| panic!("no schedule {id}"))
}

/// Issue #32: a schedule is declared once (the same spec again changes nothing, another is
/// refused unless replacing), and of many nodes moving it on from one occurrence exactly one
/// does, creating that occurrence's run in the same commit; a pause fences every move.
#[test]
fn a_schedules_occurrence_is_moved_on_and_run_by_exactly_one_of_many_nodes() {
    use pier_store::Put;
    for (name, make) in backends() {
        let fresh = make();
        let s = open(&fresh.spec);
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        s.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        let spec = schedule_spec("tick", "1s");
        assert_eq!(s.put_schedule(&spec, "api", Some(1000), false).ok(), Some(Put::Created), "{name}");
        assert_eq!(s.put_schedule(&spec, "api", Some(5000), false).ok(), Some(Put::Unchanged), "{name}");
        let other = schedule_spec("tick", "2s");
        let refused = s.put_schedule(&other, "api", Some(1000), false);
        assert!(matches!(refused, Err(StoreError::ScheduleExists(_))), "{name}: {refused:?}");
        assert_eq!(schedule_row(&s, "tick").next_at_ms, Some(1000), "{name}: nothing changed");

        let first = advance(&s, "tick", 1000, Some("tick-1"), true);
        let racers: Vec<_> = (0..8)
            .map(|_| {
                let (spec, first) = (fresh.spec.clone(), first.clone());
                std::thread::spawn(move || open(&spec).advance_schedule(&first))
            })
            .collect();
        let won: Vec<_> = racers.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("panicked"))).collect();
        assert_eq!(won.iter().filter(|r| matches!(r, Ok(true))).count(), 1, "{name}: {won:?}");
        assert!(won.iter().all(Result::is_ok), "{name}: {won:?}");
        let row = schedule_row(&s, "tick");
        assert_eq!((row.next_at_ms, row.last_run.as_deref(), row.last_open), (Some(2000), Some("tick-1"), true));
        assert_eq!(s.tasks("tick-1").unwrap_or_else(|e| panic!("{e}")).len(), 1, "{name}: the run, once");

        // While its last run is open, an exclusive occurrence does not run; a skip moves on.
        assert_eq!(s.advance_schedule(&advance(&s, "tick", 2000, Some("tick-2"), true)).ok(), Some(false), "{name}");
        assert_eq!(s.advance_schedule(&advance(&s, "tick", 2000, None, false)).ok(), Some(true), "{name}");
        assert_eq!(s.advance_schedule(&advance(&s, "tick", 3000, Some("tick-3"), false)).ok(), Some(true), "{name}");
        s.cancel("tick-3", "a", "test").unwrap_or_else(|e| panic!("{e}"));
        s.cancel("tick-1", "a", "test").unwrap_or_else(|e| panic!("{e}"));
        assert!(!schedule_row(&s, "tick").last_open, "{name}");

        // A pause fences every move; a resume starts at the occurrence it is given.
        assert_eq!(s.pause_schedule("tick", true, "ann", None).ok(), Some(Some(true)), "{name}");
        assert_eq!(s.pause_schedule("tick", true, "ann", None).ok(), Some(Some(false)), "{name}");
        assert_eq!(s.advance_schedule(&advance(&s, "tick", 4000, Some("tick-4"), true)).ok(), Some(false), "{name}");
        assert_eq!(schedule_row(&s, "tick").paused_by.as_deref(), Some("ann"), "{name}");
        assert_eq!(s.pause_schedule("tick", false, "bob", Some(9000)).ok(), Some(Some(true)), "{name}");
        let row = schedule_row(&s, "tick");
        assert_eq!((row.paused_by, row.next_at_ms), (None, Some(9000)), "{name}");
        assert_eq!(s.advance_schedule(&advance(&s, "tick", 9000, Some("tick-9"), true)).ok(), Some(true), "{name}");

        // A run id taken by another run is noted, not run twice, and the schedule moves on.
        assert_eq!(s.advance_schedule(&advance(&s, "tick", 10_000, Some("r"), false)).ok(), Some(true), "{name}");
        let row = schedule_row(&s, "tick");
        assert!(row.last_note.as_deref().is_some_and(|n| n.contains("was taken")), "{name}: {row:?}");
        assert_eq!(row.last_run.as_deref(), Some("tick-9"), "{name}: the taken run is not the schedule's");

        // A move decided on the schedule before pier.toml replaced it does not apply to the new one.
        let stale = advance(&s, "tick", 11_000, Some("tick-old"), false);
        assert_eq!(s.put_schedule(&other, "pier.toml", Some(11_000), true).ok(), Some(Put::Replaced), "{name}");
        assert_eq!(s.advance_schedule(&stale).ok(), Some(false), "{name}: decided on the old spec");
        assert_eq!(schedule_row(&s, "tick").next_at_ms, Some(11_000), "{name}");
        assert_eq!(s.pause_schedule("nope", true, "ann", None).ok(), Some(None), "{name}");
        assert_eq!(s.delete_schedule("tick").ok(), Some(true), "{name}");
        assert_eq!(s.delete_schedule("tick").ok(), Some(false), "{name}");
        assert!(s.schedules(None).unwrap_or_else(|e| panic!("{e}")).is_empty(), "{name}");
        assert_eq!(s.tasks("tick-9").unwrap_or_else(|e| panic!("{e}")).len(), 1, "{name}: runs stay");
    }
}

/// Issue #32: pending tasks are handed out (a pull worker's lease, a report's next claim)
/// with a priority first, highest first and first come within one, then the rest in run
/// order; each once.
#[test]
fn pending_tasks_come_highest_priority_first_then_in_run_order() {
    for (name, make) in backends() {
        let fresh = make();
        let s = open(&fresh.spec);
        let plan = |tasks: &[(&str, u8)]| {
            let text: String = tasks
                .iter()
                .map(|(id, p)| format!("[[tasks]]\nid = \"{id}\"\nprompt = \"x\"\npriority = {p}\n\n"))
                .collect();
            parse(&text, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"))
        };
        // Named in creation order: two runs created in one millisecond are ordered by id.
        s.create_run("r1-old", &plan(&[("o1", 0), ("o2", 5), ("o3", 0)]), "test").unwrap_or_else(|e| panic!("{e}"));
        s.create_run("r2-new", &plan(&[("n1", 9), ("n2", 0), ("n3", 5)]), "test").unwrap_or_else(|e| panic!("{e}"));
        let order: Vec<String> =
            s.pending_tasks().unwrap_or_else(|e| panic!("{e}")).into_iter().map(|t| t.id).collect();
        assert_eq!(order, ["n1", "o2", "n3", "o1", "o3", "n2"], "{name}");
        claim_of(&s, "r2-new", "n1");
        let order: Vec<String> =
            s.pending_tasks().unwrap_or_else(|e| panic!("{e}")).into_iter().map(|t| t.id).collect();
        assert_eq!(order, ["o2", "n3", "o1", "o3", "n2"], "{name}: a claimed task is no longer pending");
    }
}

/// When a dependency completed is read in one go, and only of a completed task: a pull
/// worker's queue ranks a dependent from then.
#[test]
fn a_task_s_completion_time_is_read_only_once_it_has_completed() {
    each(|name, s| {
        assert_eq!(s.completed_at("r", "a").unwrap_or(Some(0)), None, "{name}: pending");
        let a = claim(s, "a", "o");
        assert_eq!(s.completed_at("r", "a").unwrap_or(Some(0)), None, "{name}: running");
        let before = pier_store::now_ms();
        s.finish(&a, &done(), None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let at = s.completed_at("r", "a").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(at.is_some_and(|at| at >= before && at <= pier_store::now_ms()), "{name}: {at:?}");
        assert_eq!(s.completed_at("r", "nobody").unwrap_or(Some(0)), None, "{name}");
    });
}

/// Issue #32: a task back in the queue (an attempt's retry, a person's) waits from then (or from
/// the end of its backoff), behind those already waiting, and the rank its visit reports is its
/// place: a minute earlier a level.
#[test]
fn a_task_back_in_the_queue_waits_behind_those_already_waiting() {
    each(|name, s| {
        let first = claim(s, "a", "o");
        // The retry comes a millisecond after `b` was created at the latest.
        let moved_at = |task: &str| {
            let moved = s.tasks_moved_at("r").unwrap_or_default();
            moved.into_iter().find(|(t, _)| t == task).map(|(_, at)| at)
        };
        let created = moved_at("b").unwrap_or_else(pier_store::now_ms);
        while pier_store::now_ms() <= created {
            std::hint::spin_loop();
        }
        let retry = Ending::Retry { error: None, reason: "again".into(), not_before_ms: 0, failure: true };
        s.finish(&first, &retry, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ranks = queue_of(s);
        let order: Vec<&str> = ranks.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(order, ["b", "a"], "{name}: the retried task goes behind the one waiting");
        let moved = moved_at("a").unwrap_or_default();
        assert!(
            ranks[1].1 >= moved - 1 && ranks[1].1 <= pier_store::now_ms(),
            "{name}: ranked from its retry {ranks:?}"
        );
        // A retry after a backoff waits from when it is due, not from when it failed.
        let due = pier_store::now_ms() + 3_600_000;
        let second = claim(s, "b", "o");
        let later = Ending::Retry { error: None, reason: "later".into(), not_before_ms: due, failure: true };
        s.finish(&second, &later, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ranks = queue_of(s);
        assert_eq!(ranks.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), ["a", "b"], "{name}");
        assert_eq!(ranks[1].1, due, "{name}: ranked from the end of its backoff");
    });
}

/// Every pending task's id and rank, in queue order.
fn queue_of(s: &Arc<dyn TaskStore>) -> Vec<(String, i64)> {
    let mut ranks = Vec::new();
    s.visit_pending(&mut |t, rank| {
        ranks.push((t.id, rank));
        Ok(false)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    ranks
}

fn claim_of(s: &Arc<dyn TaskStore>, run: &str, task: &str) {
    assert!(s.claim(run, task, "w", FAR).unwrap_or_else(|e| panic!("{e}")).is_some(), "claim {run}/{task}");
}

/// Between renewals a node takes the new runs (its part of those free, over the live nodes)
/// without renewing or sweeping the leases it holds, and never a run a live node holds.
#[test]
fn between_renewals_a_node_takes_its_part_of_new_runs_and_renews_nothing() {
    each(|name, s| {
        let now = pier_store::now_ms();
        assert_eq!(s.lease_runs("one", now + 60_000).unwrap_or_default(), ["r"], "{name}");
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        for run in ["n1", "n2", "n3", "n4"] {
            s.create_run(run, &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        }
        let expiry = |s: &Arc<dyn TaskStore>, run: &str| {
            s.nodes().unwrap_or_default().iter().find(|n| n.runs.iter().any(|r| r == run)).map(|n| n.expires_at_ms)
        };
        let before = expiry(s, "r");
        // Alone: every free run.
        let taken = s.take_runs("one", now + 90_000, 1).unwrap_or_default();
        assert_eq!(taken, ["n1", "n2", "n3", "n4"], "{name}");
        assert_eq!(expiry(s, "r"), before, "{name}: the node's presence and leases were not renewed");
        assert_eq!(s.take_runs("one", now + 90_000, 1).unwrap_or_default(), Vec::<String>::new(), "{name}: none left");
        // Two live nodes, two new runs, none of one's held runs taken by two.
        assert!(s.lease_runs("two", now + 60_000).is_ok(), "{name}");
        for run in ["m1", "m2"] {
            s.create_run(run, &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        }
        // One, past its share (it drives five), still takes its part of the free ones; two, with
        // none, takes up to its share.
        assert_eq!(s.take_runs("one", now + 90_000, 5).unwrap_or_default(), ["m1"], "{name}");
        assert_eq!(s.take_runs("two", now + 90_000, 0).unwrap_or_default(), ["m2"], "{name}");
        assert_eq!(s.take_runs("two", now + 90_000, 1).unwrap_or_default(), Vec::<String>::new(), "{name}");
    });
}

/// The node a run is submitted to may take its lease in the commit that creates it: no other
/// node finds it free, the run's event names the node, and a live lease under that id (a
/// `pier run` creating the same run) is left alone. Small runs' creations, run side by side
/// in one group (PostgreSQL), each come out whole.
#[test]
fn a_run_created_driven_is_held_by_its_creator_from_its_creation() {
    each(|name, s| {
        let now = pier_store::now_ms();
        assert!(s.lease_runs("one", now + 60_000).is_ok(), "{name}");
        assert!(s.lease_runs("two", now + 60_000).is_ok(), "{name}");
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        let created: Vec<bool> = std::thread::scope(|scope| {
            let racers: Vec<_> = (0..8)
                .map(|i| {
                    let plan = &plan;
                    scope.spawn(move || s.create_run_driven(&format!("d{i}"), plan, "test", "one", now + 60_000))
                })
                .collect();
            racers.into_iter().map(|r| r.join().ok().and_then(Result::ok).unwrap_or(false)).collect()
        });
        assert_eq!(created, [true; 8], "{name}");
        assert_eq!(s.take_runs("two", now + 90_000, 0).unwrap_or_default(), Vec::<String>::new(), "{name}: none free");
        let one = s.nodes().unwrap_or_default().into_iter().find(|n| n.id == "one").map(|n| n.runs);
        let mut one = one.unwrap_or_default();
        one.sort();
        let driven: Vec<String> = (0..8).map(|i| format!("d{i}")).chain(["r".to_owned()]).collect();
        assert_eq!(one, driven, "{name}: its renewal took r; the rest it took as it created them");
        for i in 0..8 {
            let run = format!("d{i}");
            assert_eq!(s.tasks(&run).unwrap_or_default().len(), 1, "{name}: {run} whole");
            let events = s.events_after(Some(&run), 0, 10).unwrap_or_default();
            let created = events.iter().find(|e| e.kind == "run_created").map(|e| e.data["driven_by"].clone());
            assert_eq!(created, Some(json!("one")), "{name}: {run}'s event names its driver");
        }
        assert_eq!(s.run_driver("d3").unwrap_or_default().as_deref(), Some("one"), "{name}");
        assert_eq!(s.run_driver("nothing").unwrap_or_default(), None, "{name}");
        // A run another node holds live under the id: created, its lease left where it is.
        assert!(s.lease_run("run", "p", now + 60_000).unwrap_or(false), "{name}");
        assert!(!s.create_run_driven("p", &plan, "test", "one", now + 60_000).unwrap_or(true), "{name}");
        assert!(!s.lease_run("one", "p", now + 60_000).unwrap_or(true), "{name}: still the other's");
        let events = s.events_after(Some("p"), 0, 10).unwrap_or_default();
        assert!(events.iter().any(|e| e.kind == "run_created" && e.data.get("driven_by").is_none()), "{name}");
        assert_eq!(s.run_driver("p").unwrap_or_default().as_deref(), Some("run"), "{name}");
        assert!(s.lease_run("run", "p", now - 1).unwrap_or(false), "{name}");
        assert_eq!(s.run_driver("p").unwrap_or_default(), None, "{name}: an expired lease drives nothing");
        // Created twice: refused as any run is, nothing taken.
        assert!(
            matches!(s.create_run_driven("d0", &plan, "test", "two", now), Err(StoreError::RunExists(_))),
            "{name}"
        );
    });
}

/// Nodes starting together with one new pier.toml schedule all declare it: one creates it, the
/// others find it there (no duplicate-key failure stops a node's start).
#[test]
fn nodes_declaring_one_new_schedule_at_once_all_succeed() {
    for (name, make) in backends() {
        let fresh = make();
        let racers: Vec<_> = (0..6)
            .map(|_| {
                let spec = fresh.spec.clone();
                std::thread::spawn(move || {
                    open(&spec).put_schedule(&schedule_spec("boot", "1m"), "pier.toml", Some(60_000), true)
                })
            })
            .collect();
        let puts: Vec<_> = racers.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("panicked"))).collect();
        assert!(puts.iter().all(Result::is_ok), "{name}: {puts:?}");
        let created = puts.iter().filter(|p| matches!(p, Ok(pier_store::Put::Created))).count();
        assert_eq!(created, 1, "{name}: {puts:?}");
    }
}

/// Two nodes taking new runs at once take them all between them, none twice, though both
/// start from the same candidates.
#[test]
fn two_nodes_taking_new_runs_at_once_take_every_one_once() {
    for (name, make) in backends() {
        let fresh = make();
        let s = open(&fresh.spec);
        let now = pier_store::now_ms();
        for node in ["one", "two"] {
            assert!(s.lease_runs(node, now + 60_000).is_ok(), "{name}");
        }
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        let runs: Vec<String> = (0..10).map(|i| format!("n{i:02}")).collect();
        for run in &runs {
            s.create_run(run, &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        }
        let takers: Vec<_> = ["one", "two"]
            .map(|node| {
                let spec = fresh.spec.clone();
                std::thread::spawn(move || open(&spec).take_runs(node, now + 60_000, 0))
            })
            .into_iter()
            .collect();
        let mut taken: Vec<String> = takers
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|_| panic!("panicked")).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        taken.sort();
        assert_eq!(taken, runs, "{name}: each new run taken once");
    }
}

/// Pending tasks are visited once each in claim order across every page: priority first
/// (then the run's age, then plan order) over more than a page of urgent tasks, each run's
/// others after them in plan order over pages that grow (4, 16, 64, 256).
#[test]
fn every_pending_task_is_visited_once_in_claim_order_across_pages() {
    each(|name, s| {
        let plan_of = |urgent: usize, plain: usize| {
            let mut source = String::new();
            for i in 0..urgent {
                source.push_str(&format!("[[tasks]]\nid = \"u{i:03}\"\nprompt = \"x\"\npriority = {}\n\n", 5 + i % 2));
            }
            for i in 0..plain {
                source.push_str(&format!("[[tasks]]\nid = \"p{i:03}\"\nprompt = \"x\"\n\n"));
            }
            parse(&source, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"))
        };
        // After `r` in time (or by id within one millisecond): y, then z.
        s.create_run("y", &plan_of(300, 10), "test").unwrap_or_else(|e| panic!("{e}"));
        s.create_run("z", &plan_of(300, 400), "test").unwrap_or_else(|e| panic!("{e}"));
        let mut visited = Vec::new();
        s.visit_pending(&mut |t, _| {
            visited.push((t.run_id, t.id));
            Ok(false)
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let mut expected = Vec::new();
        for priority in [6, 5] {
            for run in ["y", "z"] {
                expected
                    .extend((0..300).filter(|i| 5 + i % 2 == priority).map(|i| (run.to_owned(), format!("u{i:03}"))));
            }
        }
        expected.extend(["a", "b"].map(|t| ("r".to_owned(), t.to_owned())));
        expected.extend((0..10).map(|i| ("y".to_owned(), format!("p{i:03}"))));
        expected.extend((0..400).map(|i| ("z".to_owned(), format!("p{i:03}"))));
        assert_eq!(visited.len(), expected.len(), "{name}: each once");
        assert!(visited == expected, "{name}: in claim order");
    });
}

/// A running attempt adds a task to its run (issue #33, the host's MCP `submit_task`): after
/// the run's others, pending, its adder named in the log; the same call again adds nothing; an
/// id taken with another spec, an unknown dependency or one that failed, and an attempt that
/// no longer holds its task are refused with nothing written.
#[test]
fn an_attempt_adds_a_task_to_its_run_once_and_only_while_it_holds_its_own() {
    each(|name, s| {
        let a = claim(s, "a", "o");
        let spec = |id: &str, deps: &[&str]| pier_store::TaskSpec {
            id: id.into(),
            prompt: format!("follow up {id}"),
            agent: "pier".into(),
            depends_on: deps.iter().map(|d| (*d).to_owned()).collect(),
            max_attempts: 3,
            added_by: Some("a".into()),
            ..Default::default()
        };
        let added = s.add_task(&a, &spec("f", &["a"])).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(added, pier_store::Added::Added, "{name}");
        assert_eq!(s.add_task(&a, &spec("f", &["a"])).ok(), Some(pier_store::Added::AlreadyThere), "{name}: again");
        let ids: Vec<String> = s.tasks("r").unwrap_or_default().into_iter().map(|t| t.id).collect();
        assert_eq!(ids, ["a", "b", "f"], "{name}: after the run's others");
        assert_eq!(state(s, "f"), TaskState::Pending, "{name}");
        let created = s.events_of_kind("r", Some("f"), "task_created").unwrap_or_default();
        assert_eq!(created.len(), 1, "{name}: one creation");
        assert_eq!(created[0].data["added_by"], "a", "{name}: {:?}", created[0].data);

        let refused = |e: Result<pier_store::Added, StoreError>, what: &str| match e {
            Err(StoreError::NotAdded { why, .. }) => assert!(why.contains(what), "{name}: {why}"),
            other => panic!("{name}: {what}: {other:?}"),
        };
        refused(s.add_task(&a, &spec("f", &[])), "has a task `f` already");
        refused(s.add_task(&a, &spec("b", &[])), "has a task `b` already");
        refused(s.add_task(&a, &spec("g", &["nope"])), "`nope`, which is not a task of run `r`");
        let mut forged = spec("g", &[]);
        forged.added_by = Some("b".into());
        refused(s.add_task(&a, &forged), "must name task `a`");
        let b = claim(s, "b", "o");
        let failed =
            Ending::Failed { error: "x".into(), class: ErrorClass::Business, reason: "x".into(), failure: true };
        s.finish(&b, &failed, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        refused(s.add_task(&a, &spec("g", &["b"])), "`b`, which ended failed");

        // A task a person is cancelling adds nothing.
        s.cancel("r", "a", "by a person").unwrap_or_else(|e| panic!("{name}: {e}"));
        let cancelling = s.add_task(&a, &spec("h", &[]));
        assert!(matches!(cancelling, Err(StoreError::CancelRequested { .. })), "{name}: {cancelling:?}");
        s.finish(&a, &done(), None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let late = s.add_task(&a, &spec("h", &[]));
        assert!(matches!(late, Err(StoreError::LeaseLost { .. })), "{name}: {late:?}");
        assert_eq!(s.tasks("r").unwrap_or_default().len(), 3, "{name}: nothing else was added");
    });
}

/// Issue #32: when each task last moved, from the log: a created task at its creation, a
/// claimed one at its claim (ageing survives a host's restart).
#[test]
fn each_task_last_moved_when_its_last_transition_was_written() {
    each(|name, s| {
        let before: std::collections::HashMap<String, i64> =
            s.tasks_moved_at("r").unwrap_or_else(|e| panic!("{name}: {e}")).into_iter().collect();
        assert_eq!(before.len(), 2, "{name}: {before:?}");
        let _a = claim(s, "a", "o");
        let after: std::collections::HashMap<String, i64> =
            s.tasks_moved_at("r").unwrap_or_else(|e| panic!("{name}: {e}")).into_iter().collect();
        let at = |m: &std::collections::HashMap<String, i64>, t: &str| m.get(t).copied().unwrap_or(-1);
        assert!(at(&after, "a") >= at(&before, "a") && at(&before, "a") > 0, "{name}: {before:?} {after:?}");
        assert_eq!(at(&after, "b"), at(&before, "b"), "{name}: b did not move");
        assert!(s.tasks_moved_at("nope").unwrap_or_default().is_empty(), "{name}");
    });
}
