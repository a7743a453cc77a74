//! The SQLite store: optimistic concurrency, idempotent updates, checked
//! transitions, lease fencing and the gap-free event log.

use pier_host::plan::parse;
use pier_host::{SqliteStore, StoreError, TaskState, TaskStore, Transition};

fn store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = SqliteStore::open(&dir.path().join("pier.db")).unwrap_or_else(|e| panic!("{e}"));
    let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\n", &|_| Ok(()))
        .unwrap_or_else(|e| panic!("{e}"));
    store.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    (dir, store)
}

fn claim(version: i64, key: &str) -> Transition {
    Transition {
        run: "r".into(),
        task: "a".into(),
        expected_version: version,
        to: Some(TaskState::Running),
        key: key.into(),
        start_attempt: true,
        lease: Some(("owner-1".into(), i64::MAX)),
        ..Transition::default()
    }
}

#[test]
fn a_stale_version_is_refused_and_changes_nothing() {
    let (_d, s) = store();
    let before = s.tasks("r").unwrap_or_default()[0].clone();
    let moved = s.transition(&claim(before.version, "k1")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(moved.version, before.version + 1);
    let stale =
        s.transition(&Transition { to: Some(TaskState::Completed), key: "k2".into(), ..claim(before.version, "k2") });
    match stale {
        Err(e @ StoreError::Conflict { .. }) => assert_eq!(e.code(), "version_conflict"),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.tasks("r").unwrap_or_default()[0], moved);
}

#[test]
fn replaying_an_update_returns_the_first_answer() {
    let (_d, s) = store();
    let v = s.tasks("r").unwrap_or_default()[0].version;
    let first = s.transition(&claim(v, "claim:1")).unwrap_or_else(|e| panic!("{e}"));
    let events_before = s.last_seq().unwrap_or_default();
    let again = s.transition(&claim(v, "claim:1")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first, again);
    assert_eq!(s.last_seq().unwrap_or_default(), events_before, "a replay commits nothing");
    assert_eq!(s.tasks("r").unwrap_or_default()[0].attempt, 1);
}

#[test]
fn an_illegal_transition_is_refused_with_its_code() {
    let (_d, s) = store();
    let v = s.tasks("r").unwrap_or_default()[0].version;
    let jump = Transition { to: Some(TaskState::Completed), start_attempt: false, lease: None, ..claim(v, "jump") };
    match s.transition(&jump) {
        Err(e @ StoreError::IllegalTransition { .. }) => {
            assert_eq!(e.code(), "bad_transition");
            assert!(e.to_string().contains("pending -> completed"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.tasks("r").unwrap_or_default()[0].state, TaskState::Pending);
    let unknown = Transition { task: "zzz".into(), ..claim(1, "u") };
    assert!(matches!(s.transition(&unknown), Err(e) if e.code() == "unknown_task"));
}

#[test]
fn heartbeats_are_fenced_by_attempt_and_owner() {
    let (_d, s) = store();
    let v = s.tasks("r").unwrap_or_default()[0].version;
    s.transition(&claim(v, "c")).unwrap_or_else(|e| panic!("{e}"));
    assert!(s.heartbeat("r", "a", 1, "owner-1", 123).unwrap_or(false));
    assert!(!s.heartbeat("r", "a", 2, "owner-1", 123).unwrap_or(true), "a stale attempt");
    assert!(!s.heartbeat("r", "a", 1, "owner-2", 123).unwrap_or(true), "another owner");
    assert!(!s.heartbeat("r", "b", 0, "owner-1", 123).unwrap_or(true), "a pending task");
    assert_eq!(s.tasks("r").unwrap_or_default()[0].lease_expires_at_ms, Some(123));
}

#[test]
fn the_event_log_is_gap_free_and_survives_reopening() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("pier.db");
    {
        let s = SqliteStore::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        s.create_run("r", &plan, "t").unwrap_or_else(|e| panic!("{e}"));
        let batch: Vec<_> = (0..50)
            .map(|i| ("r".to_owned(), Some("a".to_owned()), "note".to_owned(), serde_json::json!({"i": i})))
            .collect();
        s.append_events(&batch).unwrap_or_else(|e| panic!("{e}"));
        // A refused update in between commits no event.
        let _ = s.transition(&Transition {
            run: "r".into(),
            task: "a".into(),
            expected_version: 99,
            to: Some(TaskState::Running),
            key: "x".into(),
            ..Transition::default()
        });
        s.append_events(&batch[..5]).unwrap_or_else(|e| panic!("{e}"));
    }
    let s = SqliteStore::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let seqs: Vec<i64> = s.events_after(None, 0, 1000).unwrap_or_default().iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=57).collect::<Vec<_>>());
    assert_eq!(s.events_after(Some("r"), 55, 10).unwrap_or_default().len(), 2);
    assert!(matches!(
        s.create_run(
            "r",
            &parse("[[tasks]]\nid=\"q\"\nprompt=\"p\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}")),
            "t"
        ),
        Err(StoreError::RunExists(_))
    ));
}

#[test]
fn concurrent_writers_each_get_their_own_answer_and_a_refused_one_leaves_nothing() {
    let (_d, s) = store();
    let s = std::sync::Arc::new(s);
    let v = s.tasks("r").unwrap_or_default()[0].version;
    let start = s.last_seq().unwrap_or_default();
    // Sixteen writers at once: each appends events, and all race to claim task a at
    // the same version. Whatever lands in one group commit, exactly one claim wins
    // and the losers' work is undone without touching the winners'.
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || {
                for j in 0..20 {
                    let event = ("r".to_owned(), None, "note".to_owned(), serde_json::json!({"writer": i, "n": j}));
                    s.append_events(&[event]).unwrap_or_else(|e| panic!("{e}"));
                }
                s.transition(&claim(v, &format!("claim-{i}")))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap_or_else(|_| panic!("writer panicked"))).collect();
    let won = results.iter().filter(|r| r.is_ok()).count();
    let conflicts = results.iter().filter(|r| matches!(r, Err(StoreError::Conflict { .. }))).count();
    assert_eq!((won, conflicts), (1, 15), "{results:?}");
    let events = s.events_after(Some("r"), start, 10_000).unwrap_or_default();
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (start + 1..=start + 16 * 20 + 1).collect::<Vec<_>>(), "gap-free, one transition event");
    assert_eq!(events.iter().filter(|e| e.kind == "transition").count(), 1);
    assert_eq!(s.tasks("r").unwrap_or_default()[0].attempt, 1);
}

#[test]
fn tasks_changed_reports_only_the_tasks_an_event_touched() {
    let (_d, s) = store();
    let (all, seq) = s.tasks_changed("r", 0).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(all.len(), 2, "every task was created by an event");
    assert_eq!(s.tasks_changed("r", seq).unwrap_or_else(|e| panic!("{e}")), (vec![], seq), "nothing since");
    let v = all[0].version;
    s.transition(&claim(v, "c")).unwrap_or_else(|e| panic!("{e}"));
    let (changed, later) = s.tasks_changed("r", seq).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(changed.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(), ["a"]);
    assert_eq!(changed[0].state, TaskState::Running);
    assert!(later > seq);
}

#[test]
fn pending_tasks_come_from_every_run_in_order_and_leave_when_claimed() {
    let (_d, s) = store();
    let plan = parse("[[tasks]]\nid = \"z\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    s.create_run("r2", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    let ids = |s: &SqliteStore| -> Vec<(String, String)> {
        s.pending_tasks().unwrap_or_else(|e| panic!("{e}")).into_iter().map(|t| (t.run_id, t.id)).collect()
    };
    let pair = |r: &str, t: &str| (r.to_owned(), t.to_owned());
    assert_eq!(ids(&s), [pair("r", "a"), pair("r", "b"), pair("r2", "z")]);
    let v = s.tasks("r").unwrap_or_default()[0].version;
    s.transition(&claim(v, "c")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ids(&s), [pair("r", "b"), pair("r2", "z")]);
}
