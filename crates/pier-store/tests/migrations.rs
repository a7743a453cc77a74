//! A store's schema after its migrations: every migration applied (one once written into
//! neither backend's list never ran), and a store from before a migration brought up to date.

use pier_store::plan::parse;

fn sqlite(path: &std::path::Path) -> rusqlite::Connection {
    rusqlite::Connection::open(path).unwrap_or_else(|e| panic!("{e}"))
}

/// What undoes the migrations after the newest one a test goes back to (the key counts and the
/// tasks' keys beside them): run first by [`older_store`], which sets the version one further
/// back for them.
const NEWER: &str = "DROP TABLE key_counts; ALTER TABLE tasks DROP COLUMN concurrency; DROP INDEX tasks_holding;
    CREATE TABLE key_holders (key TEXT NOT NULL, run_id TEXT NOT NULL, task_id TEXT NOT NULL, attempt INTEGER NOT NULL,
        PRIMARY KEY (key, run_id, task_id));";

/// A SQLite store with run `r` of `plan`, made older: `sql` run on it and its schema version
/// set back `back` migrations (they run again at the next open), before the newest (`NEWER`).
fn older_store(plan: &str, sql: &str, back: i64) -> (tempfile::TempDir, std::path::PathBuf) {
    older_store_than_now(plan, &format!("{NEWER} {sql}"), back + 1)
}

/// [`older_store`] counting back from the newest migration.
fn older_store_than_now(plan: &str, sql: &str, back: i64) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("pier.db");
    let plan = parse(plan, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    {
        let store = pier_store::open(&path.display().to_string()).unwrap_or_else(|e| panic!("{e}"));
        store.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    }
    let c = sqlite(&path);
    let version: i64 = c.pragma_query_value(None, "user_version", |r| r.get(0)).unwrap_or_else(|e| panic!("{e}"));
    c.execute_batch(sql).unwrap_or_else(|e| panic!("{e}"));
    c.pragma_update(None, "user_version", version - back).unwrap_or_else(|e| panic!("{e}"));
    (dir, path)
}

#[test]
fn a_new_store_has_every_index_of_the_schema() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("pier.db");
    drop(pier_store::open(&path.display().to_string()).unwrap_or_else(|e| panic!("{e}")));
    let c = sqlite(&path);
    let indexes: Vec<String> = c
        .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND name NOT LIKE 'sqlite_%' ORDER BY name")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .unwrap_or_else(|e| panic!("{e}"));
    for wanted in ["events_transitions", "tasks_queue", "tasks_pending", "events_model_requests"] {
        assert!(indexes.iter().any(|i| i == wanted), "{wanted} missing: {indexes:?}");
    }
    assert!(!indexes.iter().any(|i| i == "tasks_urgent"), "the queue's index replaced it: {indexes:?}");
}

#[test]
fn a_pending_task_stored_before_its_priority_had_a_column_gets_its_spec_s() {
    // As a store written before the column: the priority reads 0, the backfill not yet run,
    // and no queue rank yet (the migrations after it).
    let (_dir, path) = older_store(
        "[[tasks]]\nid = \"plain\"\nprompt = \"y\"\n\n[[tasks]]\nid = \"urgent\"\nprompt = \"x\"\npriority = 7\n",
        "UPDATE tasks SET priority = 0; DROP INDEX tasks_queue; ALTER TABLE tasks DROP COLUMN rank_ms;
         CREATE INDEX tasks_urgent ON tasks(priority, run_id, ord) WHERE state = 'pending' AND priority > 0",
        3,
    );
    let store = pier_store::open(&path.display().to_string()).unwrap_or_else(|e| panic!("{e}"));
    let mut first = None;
    store
        .visit_pending(&mut |t, _| {
            first = Some(t.id);
            Ok(true)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.as_deref(), Some("urgent"), "claimed first again, before the task above it in the plan");
    drop(store);
    let priorities: Vec<(String, i64)> = sqlite(&path)
        .prepare("SELECT id, priority FROM tasks ORDER BY id")
        .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(priorities, [("plain".to_owned(), 0), ("urgent".to_owned(), 7)]);
    // Ranked from their creation as the log says, seven minutes apart (less the moment between
    // the two creations: `urgent` comes second in the plan).
    let ranks: Vec<i64> = sqlite(&path)
        .prepare("SELECT rank_ms FROM tasks ORDER BY id")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .unwrap_or_else(|e| panic!("{e}"));
    let apart = ranks[0] - ranks[1];
    assert!((7 * 60_000 - 1_000..=7 * 60_000).contains(&apart), "{ranks:?}");
    assert!(ranks[0] > 1_700_000_000_000, "from the log's times: {ranks:?}");
}

/// A task stored before `priority` had a column that was not pending then (failed, here) gets
/// its spec's priority too: retried, it goes back ahead of the tasks above it, as its priority
/// says. A completed one is left as it is.
#[test]
fn a_task_stored_before_its_priority_had_a_column_comes_back_with_its_spec_s() {
    // As a store written before the column, with `urgent` failed and `done` completed then; the
    // last migration not yet run.
    let (_dir, path) = older_store(
        "[[tasks]]\nid = \"plain\"\nprompt = \"y\"\n\n[[tasks]]\nid = \"urgent\"\nprompt = \"x\"\npriority = 7\n\n\
         [[tasks]]\nid = \"done\"\nprompt = \"z\"\npriority = 5\n",
        "UPDATE tasks SET priority = 0; UPDATE tasks SET state = 'failed' WHERE id = 'urgent';
         UPDATE tasks SET state = 'completed' WHERE id = 'done'",
        1,
    );
    let store = pier_store::open(&path.display().to_string()).unwrap_or_else(|e| panic!("{e}"));
    store.retry("r", "urgent", false, "me").unwrap_or_else(|e| panic!("{e}"));
    let queue: Vec<String> =
        store.pending_tasks().unwrap_or_else(|e| panic!("{e}")).into_iter().map(|t| t.id).collect();
    assert_eq!(queue, ["urgent", "plain"], "retried ahead of the task waiting, as its priority says");
    drop(store);
    let priorities: Vec<(String, i64)> = sqlite(&path)
        .prepare("SELECT id, priority FROM tasks ORDER BY id")
        .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(priorities, [("done".to_owned(), 0), ("plain".to_owned(), 0), ("urgent".to_owned(), 7)]);
}

#[test]
fn a_keyed_task_stored_before_its_keys_had_a_column_gets_them_beside_it_and_holds_them() {
    // `keyed` runs, as a store from before the column would have it.
    let (_dir, path) = older_store_than_now(
        "[[tasks]]\nid = \"plain\"\nprompt = \"y\"\n\n[[tasks]]\nid = \"keyed\"\nprompt = \"x\"\n\
         concurrency = [{ key = \"repo:a\", limit = 2 }, { key = \"gpu\", limit = 1 }]\n",
        &format!("{NEWER} UPDATE tasks SET state = 'running', attempt = 1, lease_owner = 'o', lease_expires_at_ms = 1"),
        1,
    );
    let store = pier_store::open(&path.display().to_string()).unwrap_or_else(|e| panic!("{e}"));
    for key in ["gpu", "repo:a"] {
        assert_eq!(store.key_holders(key).unwrap_or_else(|e| panic!("{e}")), 1, "{key}");
    }
    drop(store);
    let keys: Vec<(String, Option<String>)> = sqlite(&path)
        .prepare("SELECT id, concurrency FROM tasks ORDER BY id")
        .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
        .unwrap_or_else(|e| panic!("{e}"));
    let keyed = r#"[{"key":"gpu","limit":1},{"key":"repo:a","limit":2}]"#;
    assert_eq!(keys, [("keyed".to_owned(), Some(keyed.to_owned())), ("plain".to_owned(), None)]);
}
