use super::job::Job;
use super::rounds::{self, Rounds};
use super::tx::PgTx;
use super::*;
use crate::state::TaskState;
use crate::{Attempt, Ending, Last, QuestionRequest, TaskStore};
use serde_json::json;

#[test]
fn placeholders_become_dollars() {
    assert_eq!(dialect("a = ?1 AND b = ?12 AND c = '?'"), "a = $1 AND b = $12 AND c = '?'");
}

// Jobs side by side (`rounds`), against the server `PIER_TEST_PG` names.

const FAR: i64 = i64::MAX / 2;
type Reply = std::sync::mpsc::Receiver<Result<(String, i64), StoreError>>;

/// A store with run `r` of `tasks` (no dependencies), and a connection of the test's own.
fn store(tasks: &[&str]) -> (PgStore, Conn, ScratchDatabase) {
    store_of(&tasks.iter().map(|t| format!("[[tasks]]\nid = \"{t}\"\nprompt = \"x\"\n\n")).collect::<String>())
}

/// A store with run `r` of the plan `toml`, and a connection of the test's own.
fn store_of(toml: &str) -> (PgStore, Conn, ScratchDatabase) {
    let server = std::env::var("PIER_TEST_PG").unwrap_or_else(|_| {
        panic!("PIER_TEST_PG is not set: the PostgreSQL tests need a server (scripts/test starts one)")
    });
    let db = ScratchDatabase::create(&server, "pier_rounds").unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::open(db.url()).unwrap_or_else(|e| panic!("{e}"));
    let plan = crate::plan::parse(toml, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    store.create_run("r", &plan, "test").unwrap_or_else(|e| panic!("{e}"));
    let conn = store.db.pool.connect().unwrap_or_else(|e| panic!("{e}"));
    (store, conn, db)
}

/// A store with run `r` of `tasks`, each holding key `k` with `limit`, and a connection.
fn keyed_store(tasks: &[&str], limit: u32) -> (PgStore, Conn, ScratchDatabase) {
    let keyed = |t: &&str| {
        format!("[[tasks]]\nid = \"{t}\"\nprompt = \"x\"\nconcurrency = [{{ key = \"k\", limit = {limit} }}]\n\n")
    };
    store_of(&tasks.iter().map(keyed).collect::<String>())
}

/// Claims `task` in a group of its own on `conn`: its answer.
fn claim_alone(conn: &mut Conn, task: &'static str) -> Result<String, String> {
    let (j, r) = claim(task);
    commit_group(conn, vec![j]);
    answers(&[r]).remove(0)
}

fn job(
    task: Option<&str>,
    work: impl FnMut(&mut dyn Tx) -> Result<(String, i64), StoreError> + Send + 'static,
) -> (Box<dyn Job>, Reply) {
    let (reply, answer) = std::sync::mpsc::sync_channel(1);
    let task = task.map(|t| ("r".to_owned(), t.to_owned()));
    (Box::new(Op { work, task, answer: None, tries: 0, reply }), answer)
}

fn claim(task: &'static str) -> (Box<dyn Job>, Reply) {
    job(Some(task), move |tx| {
        let (claimed, seq) = ops::claim(tx, "r", task, "o", FAR)?;
        Ok((format!("{:?}", claimed.map(|(a, row)| (a.n, row.state))), seq))
    })
}

fn attempt(task: &str) -> Attempt {
    Attempt { run: "r".into(), task: task.into(), n: 1, owner: "o".into() }
}

/// Each job's answer, an error as its `Debug` text.
fn answers(replies: &[Reply]) -> Vec<Result<String, String>> {
    let answer = |r: &Reply| r.try_recv().unwrap_or_else(|e| panic!("no answer: {e}"));
    replies.iter().map(|r| answer(r).map(|(a, _)| a).map_err(|e| format!("{e:?}"))).collect()
}

/// Runs `jobs` as one group the usual way (in rounds, then job by job if sent back) and
/// answers them; whether the group was sent back.
fn commit_group(conn: &mut Conn, jobs: Vec<Box<dyn Job>>) -> bool {
    let mut outcome = run_group(conn, jobs, false, false, false);
    let redone = matches!(outcome, Group::Redo { .. });
    if let Group::Redo { jobs } = outcome {
        outcome = run_group(conn, jobs, true, false, false);
    }
    let Group::Committed { done, failed, again, .. } = outcome else { panic!("the group did not commit") };
    assert!(again.is_empty());
    for (job, seq) in done {
        job.finish(Ok(seq));
    }
    for (job, e) in failed {
        job.finish(Err(e));
    }
    redone
}

/// Runs claim jobs side by side in one group and commits it: the rounds it took and the
/// sequences of its events; each job is told its last.
fn claims_in_rounds(conn: &mut Conn, jobs: Vec<Box<dyn Job>>) -> (usize, (i64, i64)) {
    let mut t = PgTx::begin(conn, false);
    let Rounds::Ended(ended, rounds) = rounds::run(&mut t, jobs) else { panic!("the claims were sent back") };
    let mut done = Vec::new();
    for (job, ended) in ended {
        let Ok(events) = ended else { panic!("a claim failed") };
        t.events.extend(events);
        done.push(job);
    }
    let (numbered, committed) = number_and_commit(&mut t, false, false);
    assert!(committed.is_ok());
    let (seqs, _) = numbered.unwrap_or_else(|e| panic!("{e}"));
    for job in done {
        job.finish(Ok(seqs.1));
    }
    (rounds, seqs)
}

#[test]
fn jobs_of_different_tasks_take_one_round_trip_per_step_between_them() {
    let (store, mut conn, _db) = store(&["a", "b", "c", "d"]);
    let (jobs, replies): (Vec<_>, Vec<_>) = ["a", "b", "c", "d"].into_iter().map(claim).unzip();
    let (rounds, (first, last)) = claims_in_rounds(&mut conn, jobs);
    // One statement each, all four in one round trip.
    assert_eq!(rounds, 1);
    assert_eq!(last - first + 1, 4, "one transition each");
    for (reply, _) in replies.iter().zip(0..) {
        assert_eq!(answers(std::slice::from_ref(reply)), [Ok("Some((1, Running))".to_owned())]);
    }
    // Operations of several statements, side by side: the longest sets the rounds.
    let (park, parked) = job(Some("d"), |tx| {
        ops::park(
            tx,
            &attempt("d"),
            &QuestionRequest::from_stored(json!({"sessionId": "s", "toolCall": {"toolCallId": "t"}, "options": []}))
                .unwrap_or_else(|e| panic!("{e}")),
        )
        .map(|(n, s)| (n.to_string(), s))
    });
    let (beat, beaten) =
        job(Some("a"), |tx| ops::heartbeat(tx, &attempt("a"), FAR + 1).map(|(b, s)| (b.to_string(), s)));
    let ending = Ending::Completed { result: "fine".into(), usage: None };
    let (end, ended) = job(Some("b"), move |tx| {
        ops::finish(tx, &attempt("b"), &ending, None).map(|(r, s)| (r.state.as_str().to_owned(), s))
    });
    let evidence = [json!({"wrote": "x"}), json!({"wrote": "y"})];
    let (note, noted) = job(Some("c"), move |tx| {
        ops::record(tx, &attempt("c"), &[("note".into(), json!({}))], &evidence).map(|(l, s)| (l.to_string(), s))
    });
    assert!(!commit_group(&mut conn, vec![park, beat, end, note]));
    let got = answers(&[parked, beaten, ended, noted]);
    assert_eq!(got[..3], [Ok("1".to_owned()), Ok("true".to_owned()), Ok("completed".to_owned())]);
    assert!(got[3].is_ok());
    let state = |t: &str| store.task("r", t).ok().flatten().map(|r| r.state);
    assert_eq!(
        [state("a"), state("b"), state("d")],
        [Some(TaskState::Running), Some(TaskState::Completed), Some(TaskState::AwaitingInput)]
    );
    assert_eq!(store.task("r", "a").ok().flatten().and_then(|r| r.lease_expires_at_ms), Some(FAR + 1));
    assert_eq!(store.evidence("r", "c", 1).unwrap_or_default().len(), 2);
    assert!(store.open_question("r", "d").ok().flatten().is_some());
}

#[test]
fn a_job_failing_after_a_write_sends_the_group_back_and_fails_alone() {
    let (store, mut conn, _db) = store(&["a", "b"]);
    let _ = claim_alone(&mut conn, "a");
    store.say("r", "a", "one more thing", false, "p").unwrap_or_else(|e| panic!("{e}"));
    // The ending writes, then finds the message: it must be undone, and only a savepoint
    // undoes one job of a group.
    let last = Last { events: Vec::new(), evidence: Vec::new(), output: json!("out"), unless_messages: true };
    let ending = Ending::Completed { result: "fine".into(), usage: None };
    let (end, ended) = job(Some("a"), move |tx| {
        let (row, seq) = ops::finish_keeping(tx, &attempt("a"), &last, &ending)?;
        Ok((format!("{:?}", row.map(|r| r.state)), seq))
    });
    let (take, took) = claim("b");
    assert!(commit_group(&mut conn, vec![end, take]), "the group was not sent back");
    let got = answers(&[ended, took]);
    assert!(got[0].as_ref().is_err_and(|e| e.starts_with("MessagesWaiting")), "{:?}", got[0]);
    assert_eq!(got[1], Ok("Some((1, Running))".to_owned()));
    assert_eq!(store.task("r", "a").ok().flatten().map(|r| r.state), Some(TaskState::Running));
}

#[test]
fn a_failing_statement_or_a_diverging_job_sends_the_group_back() {
    let (store, mut conn, _db) = store(&["a", "b", "c"]);
    let (bad, failed) = job(Some("a"), |tx| tx.exec("UPDATE nowhere SET x = 1", &[]).map(|n| (n.to_string(), 0)));
    let (take, took) = claim("b");
    assert!(commit_group(&mut conn, vec![bad, take]));
    let got = answers(&[failed, took]);
    assert!(got[0].as_ref().is_err_and(|e| e.contains("nowhere")), "{:?}", got[0]);
    assert_eq!(got[1], Ok("Some((1, Running))".to_owned()));
    // A job that asks for another statement when run again (it read the clock on an edge).
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = runs.clone();
    let (odd, oddly) = job(Some("a"), move |tx| {
        let sql = match seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => "SELECT 1::BIGINT",
            _ => "SELECT 2::BIGINT",
        };
        tx.int(sql, &[])?;
        Ok((tx.int("SELECT 3::BIGINT", &[])?.unwrap_or_default().to_string(), 0))
    });
    let (take, took) = claim("c");
    assert!(commit_group(&mut conn, vec![odd, take]));
    assert_eq!(answers(&[oddly, took]), [Ok("3".to_owned()), Ok("Some((1, Running))".to_owned())]);
    assert_eq!(store.task("r", "c").ok().flatten().map(|r| r.state), Some(TaskState::Running));
}

#[test]
fn only_the_first_job_of_a_task_goes_side_by_side() {
    let (a1, _r1) = claim("a");
    let (a2, _r2) = claim("a");
    let (b, _r3) = claim("b");
    let (none, _r4) = job(None, |_| Ok((String::new(), 0)));
    let (together, rest) = rounds::side_by_side(vec![a1, a2, b, none]);
    let tasks = |jobs: &[Box<dyn Job>]| jobs.iter().map(|j| j.task().map(|(_, t)| t.clone())).collect::<Vec<_>>();
    assert_eq!(tasks(&together), [Some("a".to_owned()), Some("b".to_owned())]);
    assert_eq!(tasks(&rest), [Some("a".to_owned()), None]);
    // One job alone gains nothing from rounds.
    let (a, _r5) = claim("a");
    let (together, rest) = rounds::side_by_side(vec![a]);
    assert_eq!((together.len(), rest.len()), (0, 1));
}

#[test]
fn keyed_claims_side_by_side_keep_the_limit_and_come_after_the_endings_they_counted_on() {
    let keyed =
        |t: &str| format!("[[tasks]]\nid = \"{t}\"\nprompt = \"x\"\nconcurrency = [{{ key = \"k\", limit = 1 }}]\n\n");
    let toml = format!("{}{}{}[[tasks]]\nid = \"p\"\nprompt = \"x\"\n", keyed("x"), keyed("y"), keyed("z"));
    let (store, mut conn, _db) = store_of(&toml);
    assert_eq!(claim_alone(&mut conn, "x"), Ok("Some((1, Running))".to_owned()));
    // In one group: a claim of the key before the ending of its holder (in queue order), a
    // second claim of the key, and a claim without keys.
    let (take_y, took_y) = claim("y");
    let ending = Ending::Completed { result: "fine".into(), usage: None };
    let (end, ended) = job(Some("x"), move |tx| {
        ops::finish(tx, &attempt("x"), &ending, None).map(|(r, s)| (r.state.as_str().to_owned(), s))
    });
    let (take_z, took_z) = claim("z");
    let (take_p, took_p) = claim("p");
    assert!(!commit_group(&mut conn, vec![take_y, end, take_z, take_p]), "the group was sent back");
    let got = answers(&[took_y, ended, took_z, took_p]);
    assert_eq!(got[1..], [Ok("completed".to_owned()), Ok("None".to_owned()), Ok("Some((1, Running))".to_owned())]);
    // The key's claims counted the ending (one place), and the log shows them after it.
    assert_eq!(got[0], Ok("Some((1, Running))".to_owned()));
    let events = store.events_after(Some("r"), 0, 1000).unwrap_or_else(|e| panic!("{e}"));
    let mut running = 0;
    let mut most = 0;
    for e in events.iter().filter(|e| e.kind == "transition" && e.task.as_deref() != Some("p")) {
        match (e.data["from"].as_str(), e.data["to"].as_str()) {
            (Some("pending"), Some("running")) => running += 1,
            (Some("running"), Some(_)) => running -= 1,
            _ => {}
        }
        most = most.max(running);
    }
    assert_eq!(most, 1, "the log shows the key held by more than its limit: {events:#?}");
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 1);
}

/// Claims of keyed tasks take an extra round trip until the connection knows their run holds
/// keyed tasks, then one while their key's count has room, and two (the holders counted) when
/// it has none or the key has no count yet; the limit holds either way.
#[test]
fn keyed_claims_take_one_round_trip_once_their_run_is_known_and_their_key_counted() {
    let (store, mut conn, _db) = keyed_store(&["a", "b", "c", "d", "e", "f", "g"], 3);
    let (claimed, declined) = ("Some((1, Running))", "None");
    let groups: [(&[&'static str], usize, &[&str]); 3] = [
        // `CLAIM` finds them keyed, `CLAIM_HELD` finds no count, `CLAIM_KEYED` counts.
        (&["a", "b"], 3, &[claimed, claimed]),
        (&["c"], 1, &[claimed]),
        // The count is at the limit: the holders are counted, and fill it.
        (&["d"], 2, &[declined]),
    ];
    for (tasks, expected, got) in groups {
        let (jobs, replies): (Vec<_>, Vec<_>) = tasks.iter().copied().map(claim).unzip();
        let (rounds, _) = claims_in_rounds(&mut conn, jobs);
        assert_eq!(rounds, expected, "{tasks:?}");
        let answered: Vec<Result<String, String>> = got.iter().map(|g| Ok((*g).to_owned())).collect();
        assert_eq!(answers(&replies), answered, "{tasks:?}");
    }
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 3);
    assert_eq!(held(&mut conn, "k"), 3);
    // `a` ends, on a connection that knows the run holds keyed tasks: its place is given back.
    finish(&mut conn, "a");
    assert_eq!(held(&mut conn, "k"), 2);
    // An ending that does not apply (the attempt has ended) gives nothing back.
    let (end, ended) = job(Some("a"), |tx| {
        let done = Ending::Completed { result: String::new(), usage: None };
        ops::finish(tx, &attempt("a"), &done, None).map(|(row, seq)| (format!("{:?}", row.state), seq))
    });
    commit_group(&mut conn, vec![end]);
    assert!(answers(&[ended])[0].is_err());
    assert_eq!(held(&mut conn, "k"), 2);
    let (jobs, replies): (Vec<_>, Vec<_>) = ["e"].into_iter().map(claim).unzip();
    assert_eq!(claims_in_rounds(&mut conn, jobs).0, 1);
    assert_eq!(answers(&replies), [Ok("Some((1, Running))".to_owned())]);
    // `b` ends through the store's own connection, which does not know the run holds keyed
    // tasks: its `END` finds the task keyed, and the place is given back all the same.
    let done = Ending::Completed { result: String::new(), usage: None };
    store.finish(&attempt("b"), &done, None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(held(&mut conn, "k"), 2);
    let (jobs, replies): (Vec<_>, Vec<_>) = ["f"].into_iter().map(claim).unzip();
    assert_eq!(claims_in_rounds(&mut conn, jobs).0, 1);
    assert_eq!(answers(&replies), [Ok("Some((1, Running))".to_owned())]);
    // A count above the holders (as a claim of several keys refused on one leaves the others):
    // `g` finds room only by counting them, and the count is set to them.
    store.finish(&attempt("c"), &done, None).unwrap_or_else(|e| panic!("{e}"));
    block_on(conn.client.batch_execute("UPDATE key_counts SET held = 3")).unwrap_or_else(|e| panic!("{e}"));
    let (jobs, replies): (Vec<_>, Vec<_>) = ["g"].into_iter().map(claim).unzip();
    assert_eq!(claims_in_rounds(&mut conn, jobs).0, 2);
    assert_eq!(answers(&replies), [Ok("Some((1, Running))".to_owned())]);
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 3);
    assert_eq!(held(&mut conn, "k"), 3, "the count was not set to the holders");
}

/// Keyed tasks written without their keys' column (by a pier from before it, still running
/// beside a newer one) are held to their limit all the same: their keys are read from the spec.
#[test]
fn a_keyed_task_without_its_keys_column_is_held_to_its_limit() {
    let (store, mut conn, _db) = keyed_store(&["a", "b"], 1);
    block_on(conn.client.batch_execute("UPDATE tasks SET concurrency = NULL")).unwrap_or_else(|e| panic!("{e}"));
    for (task, got) in [("a", "Some((1, Running))"), ("b", "None")] {
        assert_eq!(claim_alone(&mut conn, task), Ok(got.to_owned()), "{task}");
    }
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 1);
}

/// Every operation that ends a live attempt's hold gives its keys' places back, not only the
/// attempt's own ending: a lost lease taken back, and a pull worker's report.
#[test]
fn a_hold_ended_by_any_operation_gives_the_key_s_place_back() {
    let (store, mut conn, _db) = keyed_store(&["a", "b", "c"], 2);
    for task in ["a", "b"] {
        assert_eq!(claim_alone(&mut conn, task), Ok("Some((1, Running))".to_owned()));
    }
    assert_eq!(held(&mut conn, "k"), 2);
    let lost = crate::Held { attempt: attempt("a"), expires_at_ms: FAR };
    let failed = Ending::Retry { error: Some("lost".into()), reason: "lost".into(), not_before_ms: 0, failure: true };
    let taken_back = store.release_lost(&lost, &failed).unwrap_or_else(|e| panic!("{e}"));
    assert!(taken_back.is_some());
    assert_eq!(held(&mut conn, "k"), 1);
    let done = Ending::Completed { result: String::new(), usage: None };
    let idem = crate::Idem::worker_report(&attempt("b"), "report-b", &json!({"done": true}));
    store.finish(&attempt("b"), &done, Some(&idem)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(held(&mut conn, "k"), 0);
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 0);
}

/// Key `key`'s count, as claims keep it.
fn held(conn: &mut Conn, key: &str) -> i64 {
    let row = block_on(conn.client.query_one("SELECT held FROM key_counts WHERE key = $1", &[&key]));
    row.and_then(|r| r.try_get(0)).unwrap_or_else(|e| panic!("{e}"))
}

/// Ends `task`'s first attempt, completed, in a group of its own.
fn finish(conn: &mut Conn, task: &'static str) {
    let (end, ended) = job(Some(task), move |tx| {
        let done = Ending::Completed { result: String::new(), usage: None };
        ops::finish(tx, &attempt(task), &done, None).map(|(row, seq)| (format!("{:?}", row.state), seq))
    });
    commit_group(conn, vec![end]);
    assert_eq!(answers(&[ended]), [Ok("Completed".to_owned())]);
}

/// A task's keys are locked once per transaction: a second claim of it in the group (two
/// claimers racing for it) that finds the key full again counts its holders without locking
/// the keys again, and loses, the limit held.
#[test]
fn a_second_claim_of_a_keyed_task_in_one_group_does_not_lock_its_keys_again() {
    let (store, mut conn, _db) = keyed_store(&["a", "b", "c"], 1);
    // A first group learns that the run holds keyed tasks; `a` holds the key.
    let (jobs, _replies): (Vec<_>, Vec<_>) = ["a", "b"].into_iter().map(claim).unzip();
    claims_in_rounds(&mut conn, jobs);
    // Two claims of `c` one after the other in one transaction, as after the rounds.
    let mut t = PgTx::begin(&mut conn, false);
    let (mut first, first_reply) = claim("c");
    let (mut second, second_reply) = claim("c");
    assert!(first.run(&mut t).is_ok() && second.run(&mut t).is_ok());
    assert_eq!(t.locks_sent, 1, "the second claim locked the keys again");
    let (numbered, committed) = number_and_commit(&mut t, false, false);
    assert!(committed.is_ok() && numbered.is_ok());
    first.finish(Ok(0));
    second.finish(Ok(0));
    let got = answers(&[first_reply, second_reply]);
    assert_eq!(got, [Ok("None".to_owned()), Ok("None".to_owned())]);
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 1);
}

/// A store whose keys have holders and no counts (written before `key_counts`, or a count
/// lost): the first claim of a key counts its holders, so the limit holds from the first claim.
#[test]
fn a_key_without_a_count_is_counted_from_its_holders() {
    let (store, mut conn, _db) = keyed_store(&["a", "b", "c"], 2);
    for task in ["a", "b"] {
        assert_eq!(claim_alone(&mut conn, task), Ok("Some((1, Running))".to_owned()));
    }
    block_on(conn.client.batch_execute("DELETE FROM key_counts")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(claim_alone(&mut conn, "c"), Ok("None".to_owned()));
    assert_eq!(held(&mut conn, "k"), 2);
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 2);
}

/// Two transactions claiming one key at once: the second waits for the first's lock on the
/// key's count, then reads the count the first committed (not the one its statement began
/// with, which has room), and is refused.
#[test]
fn a_claim_waiting_for_a_key_reads_the_count_the_holder_committed() {
    let (store, mut conn, _db) = keyed_store(&["a", "b", "c"], 2);
    // The key gets its count, one place taken.
    assert_eq!(claim_alone(&mut conn, "a"), Ok("Some((1, Running))".to_owned()));
    // `b` takes the second place in a transaction held open.
    let mut t = PgTx::begin(&mut conn, false);
    let (mut first, first_reply) = claim("b");
    assert!(first.run(&mut t).is_ok());
    let mut other = store.db.pool.connect().unwrap_or_else(|e| panic!("{e}"));
    let waiting = std::thread::spawn(move || {
        let (j, r) = claim("c");
        commit_group(&mut other, vec![j]);
        answers(&[r])
    });
    // Until the other claim waits for the lock `b`'s claim holds.
    let mut watch = store.db.pool.connect().unwrap_or_else(|e| panic!("{e}"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waits = block_on(watch.client.query_one(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            &[],
        ));
        if waits.and_then(|r| r.try_get::<_, i64>(0)).unwrap_or_else(|e| panic!("{e}")) > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the other claim never waited for the key");
        std::thread::yield_now();
    }
    let (numbered, committed) = number_and_commit(&mut t, false, false);
    assert!(committed.is_ok() && numbered.is_ok());
    first.finish(Ok(0));
    assert_eq!(answers(&[first_reply]), [Ok("Some((1, Running))".to_owned())]);
    let got = waiting.join().unwrap_or_else(|_| panic!("the other claim panicked"));
    assert_eq!(got, [Ok("None".to_owned())]);
    assert_eq!(store.key_holders("k").unwrap_or_else(|e| panic!("{e}")), 2);
    assert_eq!(held(&mut watch, "k"), 2);
}

/// The statements that read back the tasks a commit or the log names look each one up by its
/// key, whatever the table's statistics: the generic plan a connection keeps from when the
/// table was small (here empty, never analyzed) must not scan every task.
#[test]
fn tasks_named_by_events_are_read_by_key_whatever_the_statistics() {
    let (_store, conn, _db) = store(&["a"]);
    let cases = [
        (
            "number",
            super::commit::NUMBER,
            "bigint, text[], text[], text[], bigint[], text[], bool, bool",
            "1, ARRAY['r'], ARRAY['a'], ARRAY['x'], ARRAY[1::bigint], ARRAY['{}'], false, true",
        ),
        ("changed", CHANGED, "bigint", "0"),
    ];
    for (name, sql, types, args) in cases {
        let prepare = format!("SET plan_cache_mode = force_generic_plan; PREPARE {name}({types}) AS {}", dialect(sql));
        block_on(conn.client.batch_execute(&prepare)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let rows = block_on(conn.client.query(&format!("EXPLAIN EXECUTE {name}({args})"), &[]))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let plan: Vec<String> = rows.iter().map(|r| r.get::<_, String>(0)).collect();
        let plan = plan.join("\n");
        assert!(!plan.contains("Seq Scan on tasks"), "{name} scans the tasks:\n{plan}");
        assert!(plan.contains("tasks_pkey"), "{name} reads the tasks by key:\n{plan}");
    }
}

/// A key's count row and its live holders are read through their indexes whatever the
/// statistics (here an empty table, never analyzed, under a generic plan): the count through
/// its primary key (a join chose a sequential scan of every key there), the holders through
/// `tasks_holding` (neither every task nor every unfinished one walked), by the count `pier
/// show` reads, the claim, the claim that counts a full key and the ending that gives a place
/// back.
#[test]
fn a_key_s_count_and_holders_are_read_through_their_indexes_whatever_the_statistics() {
    let (_store, conn, _db) = store(&["a"]);
    let claim = ("text, text, text, bigint, bigint", "'r', 'a', 'o', 1, 1");
    let cases = [
        ("holders", crate::keys::PG_HOLDERS, ("text", "'k'"), "tasks_holding"),
        ("claim_keyed", super::tx::CLAIM_KEYED, claim, "tasks_holding"),
        ("claim_held", super::tx::CLAIM_HELD, claim, "key_counts_pkey"),
        ("give_back", super::tx::GIVE_BACK, ("text", "'k'"), "key_counts_pkey"),
        (
            "end_keyed",
            super::tx::END_KEYED,
            (
                "text, text, text, bigint, bigint, text, text, text, bigint, text, bigint",
                "'r', 'a', 'completed', 0, NULL, NULL, NULL, NULL, 1, 'o', 1",
            ),
            "key_counts_pkey",
        ),
    ];
    for (name, sql, (types, args), index) in cases {
        let prepare = format!("SET plan_cache_mode = force_generic_plan; PREPARE {name}({types}) AS {}", dialect(sql));
        block_on(conn.client.batch_execute(&prepare)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let rows = block_on(conn.client.query(&format!("EXPLAIN EXECUTE {name}({args})"), &[]))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let plan = rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n");
        assert!(plan.contains(index), "{name} does not read {index}:\n{plan}");
        for scan in ["Seq Scan on tasks", "Seq Scan on key_counts", "tasks_unfinished"] {
            assert!(!plan.contains(scan), "{name}: {scan}:\n{plan}");
        }
    }
}
