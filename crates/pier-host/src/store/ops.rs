//! The SQL of the store's operations, each a function over the open transaction that
//! returns its answer and the highest event sequence it wrote (0 for none). Fencing is in
//! the statements themselves: an operation of an attempt reads the task and changes it
//! only if the attempt (number and owner) still holds it.

use std::collections::BTreeMap;

use rusqlite::{Connection, OptionalExtension, params};
use serde_json::{Value, json};

use super::{Attempt, Ending, Held, Idem, LogEvent, Question, StoreError, TaskRow, now_ms};
use crate::plan::{Plan, TaskSpec};
use crate::state::TaskState;

/// The columns [`row_to_task`] reads, in its order (by index: looking columns up
/// by name was a tenth of the host's time in the B5 profile).
pub(super) const TASK_COLUMNS: &str = "run_id, id, state, version, attempt, failures, lease_owner, lease_expires_at_ms, \
                            not_before_ms, result, usage, error, spec";

/// A task row as read, before its JSON columns are decoded by [`decode`].
pub(super) type RawTask = (TaskRow, String, Option<String>, String);

pub(super) fn row_to_task(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawTask> {
    let state: String = r.get(2)?;
    let spec: String = r.get(12)?;
    let usage: Option<String> = r.get(10)?;
    Ok((
        TaskRow {
            run_id: r.get(0)?,
            id: r.get(1)?,
            state: TaskState::parse(&state).unwrap_or(TaskState::Failed),
            version: r.get(3)?,
            attempt: r.get(4)?,
            failures: r.get(5)?,
            lease_owner: r.get(6)?,
            lease_expires_at_ms: r.get(7)?,
            not_before_ms: r.get(8)?,
            result: r.get(9)?,
            usage: None,
            error: r.get(11)?,
            spec: TaskSpec {
                id: String::new(),
                prompt: String::new(),
                agent: String::new(),
                depends_on: vec![],
                cwd: None,
                timeout: None,
                max_time: None,
                max_attempts: 1,
                retry_on: vec![],
                idempotent: false,
                metadata: BTreeMap::new(),
                permissions: BTreeMap::new(),
                roots: vec![],
                writable: None,
                fresh_agent: false,
            },
        },
        spec,
        usage,
        state,
    ))
}

/// Decodes a row's JSON columns and state; a row that does not decode fails the
/// read with its run and task named, so nothing is written on top of it.
fn decode((mut row, spec, usage, state): RawTask) -> Result<TaskRow, StoreError> {
    let corrupt = |what: String| StoreError::Corrupt { run: row.run_id.clone(), task: row.id.clone(), what };
    row.spec = serde_json::from_str(&spec).map_err(|e| corrupt(format!("its spec is not a valid task ({e})")))?;
    row.usage = usage
        .map(|u| serde_json::from_str(&u))
        .transpose()
        .map_err(|e| corrupt(format!("its usage is not valid JSON ({e})")))?;
    row.state = TaskState::parse(&state).ok_or_else(|| corrupt(format!("unknown state `{state}`")))?;
    if row.spec.id != row.id {
        return Err(corrupt(format!("its spec names task `{}`", row.spec.id)));
    }
    Ok(row)
}

pub(super) fn load_task(c: &Connection, run: &str, task: &str) -> Result<TaskRow, StoreError> {
    let found = c
        .prepare_cached(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE run_id = ?1 AND id = ?2"))?
        .query_row(params![run, task], row_to_task)
        .optional()?;
    decode(found.ok_or_else(|| StoreError::UnknownTask(task.to_owned()))?)
}

pub(super) fn insert_event(
    c: &Connection,
    run: &str,
    task: Option<&str>,
    kind: &str,
    data: &Value,
) -> Result<i64, StoreError> {
    c.prepare_cached("INSERT INTO events (run_id, task_id, type, at_ms, data) VALUES (?1, ?2, ?3, ?4, ?5)")?
        .execute(params![run, task, kind, now_ms(), data.to_string()])?;
    Ok(c.last_insert_rowid())
}

pub(super) fn collect_tasks(rows: impl Iterator<Item = rusqlite::Result<RawTask>>) -> Result<Vec<TaskRow>, StoreError> {
    rows.map(|r| decode(r?)).collect()
}

pub(super) fn create_run(tx: &Connection, run: &str, plan: &Plan, source: &str) -> Result<i64, StoreError> {
    let exists: bool =
        tx.query_row("SELECT COUNT(*) FROM runs WHERE id = ?1", params![run], |r| r.get::<_, i64>(0))? > 0;
    if exists {
        return Err(StoreError::RunExists(run.to_owned()));
    }
    tx.execute(
        "INSERT INTO runs (id, source, plan, created_at_ms) VALUES (?1, ?2, ?3, ?4)",
        params![run, source, serde_json::to_string(plan)?, now_ms()],
    )?;
    let created = LogEvent::RunCreated { tasks: plan.tasks.len(), source: source.to_owned() };
    let mut last = log(tx, run, None, &created)?;
    for (i, t) in plan.tasks.iter().enumerate() {
        tx.execute(
            "INSERT INTO tasks (run_id, id, ord, state, version, spec) VALUES (?1, ?2, ?3, 'pending', 1, ?4)",
            params![run, t.id, i as i64, serde_json::to_string(t)?],
        )?;
        let created = LogEvent::TaskCreated {
            depends_on: t.depends_on.clone(),
            agent: t.agent.clone(),
            metadata: t.metadata.clone(),
            to: TaskState::Pending,
        };
        last = log(tx, run, Some(&t.id), &created)?;
    }
    Ok(last)
}

/// The attempt holds the task: same attempt and owner, the task live, the lease not expired.
fn holds(row: &TaskRow, attempt: &Attempt, now: i64) -> bool {
    row.attempt == attempt.n
        && row.lease_owner.as_deref() == Some(attempt.owner.as_str())
        && matches!(row.state, TaskState::Running | TaskState::AwaitingInput)
        && row.lease_expires_at_ms.is_some_and(|e| e >= now)
}

fn lease_lost(attempt: &Attempt) -> StoreError {
    StoreError::LeaseLost { task: attempt.task.clone(), attempt: attempt.n, owner: attempt.owner.clone() }
}

/// The optional fields of a transition event.
#[derive(Default)]
struct Extra {
    owner: Option<String>,
    error: Option<String>,
    class: Option<super::ErrorClass>,
    evidence: Option<Vec<Value>>,
}

fn transition_event(
    tx: &Connection,
    row: &TaskRow,
    to: TaskState,
    attempt: i64,
    reason: &str,
    extra: Extra,
) -> Result<i64, StoreError> {
    let event = LogEvent::Transition {
        from: row.state,
        to,
        attempt,
        reason: reason.to_owned(),
        version: row.version + 1,
        owner: extra.owner,
        error: extra.error,
        class: extra.class,
        evidence: extra.evidence,
    };
    log(tx, &row.run_id, Some(&row.id), &event)
}

fn log(tx: &Connection, run: &str, task: Option<&str>, event: &LogEvent) -> Result<i64, StoreError> {
    let (kind, data) = event.split();
    insert_event(tx, run, task, &kind, &data)
}

fn void_questions(tx: &Connection, run: &str, task: &str, why: &str) -> Result<(), StoreError> {
    tx.prepare_cached(
        "UPDATE questions SET answer = '', answered_by = ?3 WHERE run_id = ?1 AND task_id = ?2 AND answer IS NULL",
    )?
    .execute(params![run, task, format!("void: {why}")])?;
    Ok(())
}

pub(super) fn claim(
    tx: &Connection,
    run: &str,
    task: &str,
    owner: &str,
    until: i64,
) -> Result<(Option<(Attempt, TaskRow)>, i64), StoreError> {
    let row = load_task(tx, run, task)?;
    if row.state != TaskState::Pending || row.not_before_ms > now_ms() {
        return Ok((None, 0));
    }
    // Fenced on the version read in this transaction: of racing claimers exactly one moves it.
    let n = tx
        .prepare_cached(
            "UPDATE tasks SET state = 'running', version = version + 1, attempt = attempt + 1, lease_owner = ?4,
                 lease_expires_at_ms = ?5
             WHERE run_id = ?1 AND id = ?2 AND version = ?3 AND state = 'pending'",
        )?
        .execute(params![run, task, row.version, owner, until])?;
    if n == 0 {
        return Ok((None, 0));
    }
    let attempt = Attempt { run: run.to_owned(), task: task.to_owned(), n: row.attempt + 1, owner: owner.to_owned() };
    tx.prepare_cached("INSERT OR IGNORE INTO attempts (run_id, task_id, attempt) VALUES (?1, ?2, ?3)")?
        .execute(params![run, task, attempt.n])?;
    let reason = format!("attempt {} started", attempt.n);
    let seq = transition_event(
        tx,
        &row,
        TaskState::Running,
        attempt.n,
        &reason,
        Extra { owner: Some(owner.to_owned()), ..Extra::default() },
    )?;
    Ok((Some((attempt, load_task(tx, run, task)?)), seq))
}

pub(super) fn heartbeat(tx: &Connection, a: &Attempt, until: i64) -> Result<(bool, i64), StoreError> {
    let n = tx
        .prepare_cached(
            "UPDATE tasks SET lease_expires_at_ms = ?5
             WHERE run_id = ?1 AND id = ?2 AND state IN ('running', 'awaiting_input') AND attempt = ?3
                 AND lease_owner = ?4",
        )?
        .execute(params![a.run, a.task, a.n, a.owner, until])?;
    Ok((n == 1, 0))
}

pub(super) fn park(tx: &Connection, a: &Attempt, request: &Value) -> Result<(i64, i64), StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    if !holds(&row, a, now_ms()) {
        return Err(lease_lost(a));
    }
    let mut seq = 0;
    if row.state == TaskState::Running {
        tx.prepare_cached(
            "UPDATE tasks SET state = 'awaiting_input', version = version + 1 WHERE run_id = ?1 AND id = ?2",
        )?
        .execute(params![a.run, a.task])?;
        let reason = "a permission request waits for a person";
        seq = transition_event(tx, &row, TaskState::AwaitingInput, a.n, reason, Extra::default())?;
    }
    let n: i64 = tx.query_row(
        "SELECT COALESCE(MAX(n), 0) + 1 FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
        params![a.run, a.task, a.n],
        |r| r.get(0),
    )?;
    tx.execute(
        "INSERT INTO questions (run_id, task_id, attempt, n, request) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![a.run, a.task, a.n, n, request.to_string()],
    )?;
    let question = LogEvent::Question { attempt: a.n, question: n, request: request.clone() };
    seq = seq.max(log(tx, &a.run, Some(&a.task), &question)?);
    Ok((n, seq))
}

pub(super) fn resume(tx: &Connection, a: &Attempt) -> Result<(bool, i64), StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    if !holds(&row, a, now_ms()) {
        return Ok((false, 0));
    }
    let open: i64 = tx.query_row(
        "SELECT COUNT(*) FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND answer IS NULL",
        params![a.run, a.task, a.n],
        |r| r.get(0),
    )?;
    if row.state != TaskState::AwaitingInput || open > 0 {
        return Ok((true, 0));
    }
    tx.prepare_cached("UPDATE tasks SET state = 'running', version = version + 1 WHERE run_id = ?1 AND id = ?2")?
        .execute(params![a.run, a.task])?;
    let seq = transition_event(
        tx,
        &row,
        TaskState::Running,
        a.n,
        "a person answered the permission request",
        Extra::default(),
    )?;
    Ok((true, seq))
}

/// Applies an ending to a task whose attempt `n` ends (the caller has checked who may).
fn end_attempt(tx: &Connection, row: &TaskRow, n: i64, ending: &Ending) -> Result<(TaskRow, i64), StoreError> {
    let to = ending.state();
    let (mut result, mut usage, mut error, mut not_before) = (None, None, None, row.not_before_ms);
    let mut extra = Extra::default();
    match ending {
        Ending::Completed { result: r, usage: u } => {
            result = Some(r.clone());
            usage = u.as_ref().map(Value::to_string);
        }
        Ending::Failed { error: e, class, .. } => {
            error = Some(e.clone());
            extra.class = Some(*class);
        }
        Ending::Cancelled { .. } => {}
        Ending::Retry { error: e, not_before_ms, .. } => {
            error = e.clone();
            not_before = *not_before_ms;
        }
        Ending::AskPerson { error: e, evidence, .. } => {
            error = e.clone();
            extra.evidence = Some(evidence.clone());
        }
    }
    extra.error = error.clone();
    tx.prepare_cached(
        "UPDATE tasks SET state = ?3, version = version + 1, failures = failures + ?4, lease_owner = NULL,
             lease_expires_at_ms = NULL, not_before_ms = ?5, result = COALESCE(?6, result),
             usage = COALESCE(?7, usage), error = ?8
         WHERE run_id = ?1 AND id = ?2",
    )?
    .execute(params![
        row.run_id,
        row.id,
        to.as_str(),
        i64::from(ending.is_failure()),
        not_before,
        result,
        usage,
        error
    ])?;
    // Whoever asked is gone: its questions can no longer be answered.
    void_questions(tx, &row.run_id, &row.id, "the attempt ended")?;
    let seq = transition_event(tx, row, to, n, ending.reason(), extra)?;
    Ok((load_task(tx, &row.run_id, &row.id)?, seq))
}

pub(super) fn finish(
    tx: &Connection,
    a: &Attempt,
    ending: &Ending,
    idem: Option<&Idem>,
) -> Result<(TaskRow, i64), StoreError> {
    if let Some(idem) = idem {
        let first: Option<(String, Option<String>)> = tx
            .prepare_cached("SELECT answer, request FROM updates WHERE run_id = ?1 AND task_id = ?2 AND key = ?3")?
            .query_row(params![a.run, a.task, idem.key()], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        if let Some((answer, request)) = first {
            if request.as_deref() != Some(idem.request()) {
                return Err(StoreError::IdempotencyConflict { key: idem.key().to_owned() });
            }
            return Ok((serde_json::from_str(&answer)?, 0));
        }
    }
    let row = load_task(tx, &a.run, &a.task)?;
    if !holds(&row, a, now_ms()) {
        return Err(lease_lost(a));
    }
    let (row, seq) = end_attempt(tx, &row, a.n, ending)?;
    if let Some(idem) = idem {
        tx.prepare_cached("INSERT INTO updates (run_id, task_id, key, answer, request) VALUES (?1, ?2, ?3, ?4, ?5)")?
            .execute(params![a.run, a.task, idem.key(), serde_json::to_string(&row)?, idem.request()])?;
    }
    Ok((row, seq))
}

pub(super) fn release_lost(
    tx: &Connection,
    held: &Held,
    ending: &Ending,
) -> Result<(Option<TaskRow>, i64), StoreError> {
    let a = &held.attempt;
    let row = load_task(tx, &a.run, &a.task)?;
    let same = row.attempt == a.n
        && row.lease_owner.as_deref() == Some(a.owner.as_str())
        && row.lease_expires_at_ms == Some(held.expires_at_ms)
        && matches!(row.state, TaskState::Running | TaskState::AwaitingInput);
    if !same {
        return Ok((None, 0));
    }
    let (row, seq) = end_attempt(tx, &row, a.n, ending)?;
    Ok((Some(row), seq))
}

pub(super) fn record(
    tx: &Connection,
    a: &Attempt,
    events: &[(String, Value)],
    evidence: &[Value],
) -> Result<(i64, i64), StoreError> {
    for e in evidence {
        tx.prepare_cached(
            "UPDATE attempts SET evidence = json_insert(evidence, '$[#]', json(?4))
             WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
        )?
        .execute(params![a.run, a.task, a.n, e.to_string()])?;
    }
    let mut last = 0;
    for (kind, data) in events {
        let mut data = data.clone();
        data["attempt"] = json!(a.n);
        last = insert_event(tx, &a.run, Some(&a.task), kind, &data)?;
    }
    Ok((last, last))
}

pub(super) fn cancel(
    tx: &Connection,
    run: &str,
    task: &str,
    reason: &str,
) -> Result<(Option<TaskRow>, i64), StoreError> {
    let row = load_task(tx, run, task)?;
    if row.state.is_terminal() {
        return Ok((None, 0));
    }
    tx.prepare_cached(
        "UPDATE tasks SET state = 'cancelled', version = version + 1, lease_owner = NULL, lease_expires_at_ms = NULL
         WHERE run_id = ?1 AND id = ?2",
    )?
    .execute(params![run, task])?;
    void_questions(tx, run, task, "the task was cancelled")?;
    let seq = transition_event(tx, &row, TaskState::Cancelled, row.attempt, reason, Extra::default())?;
    Ok((Some(load_task(tx, run, task)?), seq))
}

pub(super) fn decide_rerun(
    tx: &Connection,
    run: &str,
    task: &str,
    again: bool,
    by: &str,
) -> Result<(TaskRow, i64), StoreError> {
    let row = load_task(tx, run, task)?;
    let to = if again { TaskState::Pending } else { TaskState::Cancelled };
    // A task waiting with a live attempt waits for an answer to its question, not for this.
    if row.state != TaskState::AwaitingInput || row.lease_owner.is_some() {
        return Err(StoreError::IllegalTransition { task: task.to_owned(), from: row.state.as_str(), to: to.as_str() });
    }
    tx.prepare_cached("UPDATE tasks SET state = ?3, version = version + 1 WHERE run_id = ?1 AND id = ?2")?
        .execute(params![run, task, to.as_str()])?;
    let reason = if again {
        format!("a person approved running it again ({by})")
    } else {
        format!("a person denied running it again ({by})")
    };
    let seq = transition_event(tx, &row, to, row.attempt, &reason, Extra::default())?;
    Ok((load_task(tx, run, task)?, seq))
}

pub(super) fn answer(
    tx: &Connection,
    run: &str,
    task: &str,
    q: &Question,
    option: &str,
    by: &str,
) -> Result<(bool, i64), StoreError> {
    let changed = tx.execute(
        "UPDATE questions SET answer = ?5, answered_by = ?6
         WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4 AND answer IS NULL",
        params![run, task, q.attempt, q.n, option, by],
    )?;
    if changed != 1 {
        return Ok((false, 0));
    }
    let answer = LogEvent::Answer { attempt: q.attempt, question: q.n, option: option.to_owned(), by: by.to_owned() };
    Ok((true, log(tx, run, Some(task), &answer)?))
}
