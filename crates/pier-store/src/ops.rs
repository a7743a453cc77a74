//! The store's operations, written once for every backend. Each is a function over the
//! open transaction ([`Tx`]) that returns its answer and the highest event sequence it
//! wrote (0 for none). Fencing is in the statements themselves: an operation of an
//! attempt reads the task and changes it only if the attempt (number and owner) still
//! holds it. The SQL is the dialect SQLite and PostgreSQL share, with `?N` placeholders
//! (the PostgreSQL backend rewrites them to `$N`); what the dialects do differently (the
//! event sequence, row locks, appending to JSON) is a method of [`Tx`].

use serde_json::{Value, json};

use crate::plan::{Budget, Plan, TaskSpec};
use crate::state::TaskState;
use crate::{Attempt, Ending, Held, Idem, LogEvent, Question, QuestionRequest, StoreError, TaskRow, now_ms};

/// A task row as read, before its JSON columns are decoded by [`decode`]: the row with
/// its plain columns, then `spec`, `usage` and `state` as stored.
pub(crate) type RawTask = (TaskRow, String, Option<String>, String);

/// A statement's argument.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Int(i64),
    OptInt(Option<i64>),
    Text(&'a str),
    OptText(Option<&'a str>),
}

/// A claim of a pending task for `owner`, with a lease until `until`, if it may run at `now`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim<'a> {
    pub run: &'a str,
    pub task: &'a str,
    pub owner: &'a str,
    pub until: i64,
    pub now: i64,
}

/// An ending of the attempt holding a task ([`Tx::end_held`]).
pub(crate) struct EndHeld<'a> {
    pub attempt: &'a Attempt,
    pub columns: &'a Columns,
    pub now: i64,
    pub beside: Beside<'a>,
}

/// An open write transaction of a backend.
pub(crate) trait Tx {
    /// Runs a statement; the number of rows it changed.
    fn exec(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<u64, StoreError>;
    /// The first column of the first row, as an integer; `None` without a row.
    fn int(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Option<i64>, StoreError>;
    /// The first row's columns, as optional text; `None` without a row.
    fn texts(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Option<Vec<Option<String>>>, StoreError>;
    /// A task, read for an update: where the backend has row locks, the row stays locked
    /// until the transaction ends.
    fn task(&mut self, run: &str, task: &str) -> Result<Option<RawTask>, StoreError>;
    /// Claims a task for `owner` until `until` if it is pending and runnable at `now`: its
    /// attempt bumped, the lease set, the attempt's row added. The task as the claim left it;
    /// `None` if it is not claimable, or if another transaction holds its row (a racing
    /// claimer: it is skipped, not waited for).
    fn take(&mut self, c: &Claim<'_>) -> Result<Option<TaskRow>, StoreError>;
    /// Ends attempt `e.attempt` if it holds its task at `e.now` (same attempt and owner, the
    /// task live, the lease not expired), writing `e.columns` and releasing the lease: the
    /// task's state before, and the row after; `None` if the attempt does not hold it.
    /// `e.beside.output`, if any, is kept on the attempt's row whether or not the ending
    /// applies. With `e.beside.unless_messages`, an applied ending fails with
    /// [`StoreError::MessagesWaiting`] if a message waits for the task, looked for after the
    /// row is locked (so a `say` that held the lock is seen); the caller's transaction then
    /// undoes it.
    fn end_held(&mut self, e: &EndHeld<'_>) -> Result<Option<(TaskState, TaskRow)>, StoreError>;
    /// A live attempt of a task with concurrency `keys` stops holding them (its row, locked by
    /// this transaction, is about to lose its lease), written by any operation but
    /// [`Tx::end_held`], which does this itself. PostgreSQL lowers each key's count by the
    /// place given back ([`crate::keys`]); SQLite keeps no count.
    fn gives_back(&mut self, keys: &[crate::plan::ConcurrencyKey]) -> Result<(), StoreError> {
        let _ = keys;
        Ok(())
    }
    /// Appends an event to the log; its sequence number (or, where the backend numbers
    /// events at commit, a number that only says one was written).
    fn event(&mut self, run: &str, task: Option<&str>, kind: &str, data: &Value) -> Result<i64, StoreError>;
    /// Appends a side effect to an attempt's evidence.
    fn add_evidence(&mut self, a: &Attempt, effect: &Value) -> Result<(), StoreError>;
    /// The first column of every row, as text.
    fn strings(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<Vec<String>, StoreError>;
}

/// A task row's plain columns; the JSON ones are filled in by [`decode`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn plain_row(
    run_id: String,
    id: String,
    version: i64,
    attempt: i64,
    failures: i64,
    lease: (Option<String>, Option<i64>),
    not_before_ms: i64,
    result: Option<String>,
    error: Option<String>,
) -> TaskRow {
    TaskRow {
        run_id,
        id,
        state: TaskState::Failed,
        version,
        attempt,
        failures,
        lease_owner: lease.0,
        lease_expires_at_ms: lease.1,
        not_before_ms,
        result,
        usage: None,
        error,
        spec: TaskSpec::default(),
        cancel_requested: None,
    }
}

/// Decodes a row's JSON columns and state; a row that does not decode fails the
/// read with its run and task named, so nothing is written on top of it.
pub(crate) fn decode((mut row, spec, usage, state): RawTask) -> Result<TaskRow, StoreError> {
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

pub(crate) fn load_task(tx: &mut dyn Tx, run: &str, task: &str) -> Result<TaskRow, StoreError> {
    decode(tx.task(run, task)?.ok_or_else(|| StoreError::UnknownTask(task.to_owned()))?)
}

/// Creates run `run` of `plan`: its row, its tasks and their events. With `driver` (a node
/// and a lease expiry) that node takes the run's lease in the same commit, unless another
/// node's live lease is there under that id; whether it did is in the run's event.
pub(crate) fn create_run(
    tx: &mut dyn Tx,
    run: &str,
    plan: &Plan,
    source: &str,
    driver: Option<(&str, i64)>,
) -> Result<(i64, bool), StoreError> {
    let plan_json = serde_json::to_string(plan)?;
    let now = now_ms();
    // The insert is the existence check: no row added, the run was there (in PostgreSQL a
    // unique violation would abort the whole group, so it is not one).
    let added = tx.exec(
        "INSERT INTO runs (id, source, plan, created_at_ms) VALUES (?1, ?2, ?3, ?4) ON CONFLICT (id) DO NOTHING",
        &[Arg::Text(run), Arg::Text(source), Arg::Text(&plan_json), Arg::Int(now)],
    )?;
    if added == 0 {
        return Err(StoreError::RunExists(run.to_owned()));
    }
    let driven_by = match driver {
        Some((node, until)) => take(tx, node, now, until, vec![run.to_owned()], 1)?.pop().map(|_| node.to_owned()),
        None => None,
    };
    let taken = driven_by.is_some();
    let created = LogEvent::RunCreated { tasks: plan.tasks.len(), source: source.to_owned(), driven_by };
    let mut last = log(tx, run, None, &created)?;
    for (i, t) in plan.tasks.iter().enumerate() {
        last = insert_task(tx, run, i as i64, t, None)?;
    }
    Ok((last, taken))
}

/// Inserts `spec` as a pending task of `run` at place `ord` and logs its creation (with the
/// task that added it, for one added as the run ran): the one way a task comes to be.
pub(crate) fn insert_task(
    tx: &mut dyn Tx,
    run: &str,
    ord: i64,
    spec: &TaskSpec,
    added_by: Option<&str>,
) -> Result<i64, StoreError> {
    let text = serde_json::to_string(spec)?;
    let keys = (!spec.concurrency.is_empty()).then(|| serde_json::to_string(&spec.concurrency)).transpose()?;
    tx.exec(
        "INSERT INTO tasks (run_id, id, ord, state, version, spec, keyed, priority, rank_ms, concurrency)
         VALUES (?1, ?2, ?3, 'pending', 1, ?4, ?5, ?6, ?7, ?8)",
        &[
            Arg::Text(run),
            Arg::Text(&spec.id),
            Arg::Int(ord),
            Arg::Text(&text),
            Arg::OptInt(keys.is_some().then_some(1)),
            Arg::Int(spec.priority.into()),
            Arg::Int(crate::queue::rank(spec.priority, crate::now_ms())),
            Arg::OptText(keys.as_deref()),
        ],
    )?;
    let created = LogEvent::TaskCreated {
        depends_on: spec.depends_on.clone(),
        agent: spec.agent.clone(),
        metadata: spec.metadata.clone(),
        to: TaskState::Pending,
        added_by: added_by.map(str::to_owned),
    };
    log(tx, run, Some(&spec.id), &created)
}

/// The attempt holds the task: same attempt and owner, the task live, the lease not expired.
pub(crate) fn holds(row: &TaskRow, attempt: &Attempt, now: i64) -> bool {
    row.attempt == attempt.n
        && row.lease_owner.as_deref() == Some(attempt.owner.as_str())
        && matches!(row.state, TaskState::Running | TaskState::AwaitingInput)
        && row.lease_expires_at_ms.is_some_and(|e| e >= now)
}

pub(crate) fn lease_lost(attempt: &Attempt) -> StoreError {
    StoreError::LeaseLost { task: attempt.task.clone(), attempt: attempt.n, owner: attempt.owner.clone() }
}

/// The optional fields of a transition event.
#[derive(Default)]
struct Extra {
    owner: Option<String>,
    error: Option<String>,
    class: Option<crate::ErrorClass>,
    evidence: Option<Vec<Value>>,
}

/// A task as its transition event names it: where it was, and its version before the move.
struct Was<'a> {
    run: &'a str,
    task: &'a str,
    state: TaskState,
    version: i64,
}

impl<'a> Was<'a> {
    fn of(row: &'a TaskRow) -> Was<'a> {
        Was { run: &row.run_id, task: &row.id, state: row.state, version: row.version }
    }
}

/// Logs a task's move; one back to `pending` also ranks it in the queue from when it is due
/// (now, or the end of a retry's backoff, which the move wrote before), so every way a task
/// can return (a retry, a rerun, a person's retry) does, by construction.
fn transition_event(
    tx: &mut dyn Tx,
    was: Was<'_>,
    to: TaskState,
    attempt: i64,
    reason: &str,
    extra: Extra,
) -> Result<i64, StoreError> {
    if to == TaskState::Pending {
        tx.exec(
            "UPDATE tasks SET rank_ms = CASE WHEN not_before_ms > ?3 THEN not_before_ms ELSE ?3 END - priority * ?4
             WHERE run_id = ?1 AND id = ?2",
            &[Arg::Text(was.run), Arg::Text(was.task), Arg::Int(crate::now_ms()), Arg::Int(crate::queue::AGE_MS)],
        )?;
    }
    let event = LogEvent::Transition {
        from: was.state,
        to,
        attempt,
        reason: reason.to_owned(),
        version: was.version + 1,
        owner: extra.owner,
        error: extra.error,
        class: extra.class,
        evidence: extra.evidence,
    };
    log(tx, was.run, Some(was.task), &event)
}

pub(crate) fn log(tx: &mut dyn Tx, run: &str, task: Option<&str>, event: &LogEvent) -> Result<i64, StoreError> {
    let (kind, data) = event.split();
    tx.event(run, task, &kind, &data)
}

fn void_questions(tx: &mut dyn Tx, run: &str, task: &str, why: &str) -> Result<(), StoreError> {
    let by = format!("void: {why}");
    tx.exec(
        "UPDATE questions SET answer = '', answered_by = ?3 WHERE run_id = ?1 AND task_id = ?2 AND answer IS NULL",
        &[Arg::Text(run), Arg::Text(task), Arg::Text(&by)],
    )?;
    Ok(())
}

pub(crate) fn claim(
    tx: &mut dyn Tx,
    run: &str,
    task: &str,
    owner: &str,
    until: i64,
) -> Result<(Option<(Attempt, TaskRow)>, i64), StoreError> {
    let Some(claimed) = tx.take(&Claim { run, task, owner, until, now: now_ms() })? else { return Ok((None, 0)) };
    let attempt = Attempt { run: run.to_owned(), task: task.to_owned(), n: claimed.attempt, owner: owner.to_owned() };
    let reason = format!("attempt {} started", attempt.n);
    let before = Was { run, task, state: TaskState::Pending, version: claimed.version - 1 };
    let seq = transition_event(
        tx,
        before,
        TaskState::Running,
        attempt.n,
        &reason,
        Extra { owner: Some(owner.to_owned()), ..Extra::default() },
    )?;
    Ok((Some((attempt, claimed)), seq))
}

/// [`Tx::take`] as statements both dialects run: the row read (and locked), the update
/// fenced on the version read, the attempt's row, and the row as the update left it built
/// rather than read back.
pub(crate) fn take_by_statements(tx: &mut dyn Tx, c: &Claim<'_>) -> Result<Option<TaskRow>, StoreError> {
    let Claim { run, task, owner, until, now } = *c;
    let Some(raw) = tx.task(run, task)? else { return Ok(None) };
    let row = decode(raw)?;
    if row.state != TaskState::Pending || row.not_before_ms > now {
        return Ok(None);
    }
    if !crate::keys::free(tx, &row.spec.concurrency)? {
        return Ok(None);
    }
    // Fenced on the version read in this transaction (every change of a task moves it, so the
    // row is still the pending one read above): of racing claimers exactly one moves it. No
    // `state` in the WHERE: PostgreSQL's generic plan would then walk the pending tasks' partial
    // index instead of the primary key.
    let n = tx.exec(
        "UPDATE tasks SET state = 'running', version = version + 1, attempt = attempt + 1, lease_owner = ?4,
             lease_expires_at_ms = ?5
         WHERE run_id = ?1 AND id = ?2 AND version = ?3",
        &[Arg::Text(run), Arg::Text(task), Arg::Int(row.version), Arg::Text(owner), Arg::Int(until)],
    )?;
    if n == 0 {
        return Ok(None);
    }
    tx.exec(
        "INSERT INTO attempts (run_id, task_id, attempt) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
        &[Arg::Text(run), Arg::Text(task), Arg::Int(row.attempt + 1)],
    )?;
    Ok(Some(TaskRow {
        state: TaskState::Running,
        version: row.version + 1,
        attempt: row.attempt + 1,
        lease_owner: Some(owner.to_owned()),
        lease_expires_at_ms: Some(until),
        ..row
    }))
}

pub(crate) fn heartbeat(tx: &mut dyn Tx, a: &Attempt, until: i64) -> Result<(bool, i64), StoreError> {
    let n = tx.exec(
        "UPDATE tasks SET lease_expires_at_ms = ?5
         WHERE run_id = ?1 AND id = ?2 AND state IN ('running', 'awaiting_input') AND attempt = ?3
             AND lease_owner = ?4",
        &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(a.n), Arg::Text(&a.owner), Arg::Int(until)],
    )?;
    Ok((n == 1, 0))
}

pub(crate) fn park(tx: &mut dyn Tx, a: &Attempt, request: &QuestionRequest) -> Result<(i64, i64), StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    if !holds(&row, a, now_ms()) {
        return Err(lease_lost(a));
    }
    if let Some(reason) = &row.cancel_requested {
        return Err(StoreError::CancelRequested { task: a.task.clone(), reason: reason.clone() });
    }
    let mut seq = 0;
    if row.state == TaskState::Running {
        tx.exec(
            "UPDATE tasks SET state = 'awaiting_input', version = version + 1 WHERE run_id = ?1 AND id = ?2",
            &[Arg::Text(&a.run), Arg::Text(&a.task)],
        )?;
        let reason = match request {
            QuestionRequest::Elicitation(_) => "the agent asks the person a question",
            QuestionRequest::Permission(_) => "a permission request waits for a person",
        };
        seq = transition_event(tx, Was::of(&row), TaskState::AwaitingInput, a.n, reason, Extra::default())?;
    }
    let held = [Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(a.n)];
    let n = tx
        .int(
            "SELECT COALESCE(MAX(n), 0) + 1 FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
            &held,
        )?
        .unwrap_or(1);
    let text = request.to_stored().to_string();
    tx.exec(
        "INSERT INTO questions (run_id, task_id, attempt, n, request) VALUES (?1, ?2, ?3, ?4, ?5)",
        &[held[0], held[1], held[2], Arg::Int(n), Arg::Text(&text)],
    )?;
    let question = LogEvent::Question { attempt: a.n, question: n, request: request.clone() };
    seq = seq.max(log(tx, &a.run, Some(&a.task), &question)?);
    Ok((n, seq))
}

pub(crate) fn resume(tx: &mut dyn Tx, a: &Attempt) -> Result<(bool, i64), StoreError> {
    go_on(tx, a, "a person answered")
}

/// The attempt runs again if its task waits on no open question; `why` says what ended the wait.
fn go_on(tx: &mut dyn Tx, a: &Attempt, why: &str) -> Result<(bool, i64), StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    if !holds(&row, a, now_ms()) {
        return Ok((false, 0));
    }
    let open = tx
        .int(
            "SELECT COUNT(*) FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND answer IS NULL",
            &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(a.n)],
        )?
        .unwrap_or(0);
    if row.state != TaskState::AwaitingInput || open > 0 {
        return Ok((true, 0));
    }
    tx.exec(
        "UPDATE tasks SET state = 'running', version = version + 1 WHERE run_id = ?1 AND id = ?2",
        &[Arg::Text(&a.run), Arg::Text(&a.task)],
    )?;
    let seq = transition_event(tx, Was::of(&row), TaskState::Running, a.n, why, Extra::default())?;
    Ok((true, seq))
}

/// The attempt stopped waiting for question `n` (the agent withdrew it, its turn was
/// cancelled): the question is void, so nobody answers it, and the task runs again if it
/// waits on nothing else.
pub(crate) fn withdraw(tx: &mut dyn Tx, a: &Attempt, n: i64) -> Result<(bool, i64), StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    if !holds(&row, a, now_ms()) {
        return Ok((false, 0));
    }
    tx.exec(
        "UPDATE questions SET answer = '', answered_by = 'withdrawn'
         WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4 AND answer IS NULL",
        &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(a.n), Arg::Int(n)],
    )?;
    go_on(tx, a, "its question was withdrawn")
}

/// The columns an ending writes: the state, a failure counted or not, `not_before_ms` (kept
/// when `None`), and the result, usage and error (result and usage kept when `None`).
pub(crate) struct Columns {
    pub to: TaskState,
    pub failure: i64,
    pub not_before: Option<i64>,
    pub result: Option<String>,
    pub usage: Option<Value>,
    pub error: Option<String>,
}

/// What an ending of an attempt writes beside the task ([`Tx::end_held`]).
#[derive(Clone, Copy, Default)]
pub(crate) struct Beside<'a> {
    pub output: Option<&'a str>,
    pub unless_messages: bool,
}

/// Whether a message waits for the task, unsent. Run after the task's row is locked.
pub(crate) const MESSAGE_WAITING: &str = "SELECT COUNT(*) FROM (SELECT 1 FROM messages WHERE run_id = ?1 AND task_id = ?2 AND sent_attempt IS NULL LIMIT 1) m";

pub(crate) fn messages_waiting(a: &Attempt) -> StoreError {
    StoreError::MessagesWaiting { task: a.task.clone() }
}

/// What `ending` writes, and what its transition event says beyond the move.
fn columns(ending: &Ending) -> (Columns, Extra) {
    let mut c = Columns {
        to: ending.state(),
        failure: i64::from(ending.is_failure()),
        not_before: None,
        result: None,
        usage: None,
        error: None,
    };
    let mut extra = Extra::default();
    match ending {
        Ending::Completed { result, usage } => {
            c.result = Some(result.clone());
            c.usage.clone_from(usage);
        }
        Ending::Failed { error, class, .. } => {
            c.error = Some(error.clone());
            extra.class = Some(*class);
        }
        Ending::Cancelled { .. } => {}
        Ending::Retry { error, not_before_ms, .. } => {
            c.error = error.clone();
            c.not_before = Some(*not_before_ms);
        }
        Ending::AskPerson { error, evidence, .. } => {
            c.error = error.clone();
            extra.evidence = Some(evidence.clone());
        }
    }
    extra.error = c.error.clone();
    (c, extra)
}

/// `row` (as read, locked, in this transaction) is about to lose its lease: if it held its
/// concurrency keys (a live attempt: running or waiting for an answer under a lease), they are
/// given back ([`Tx::gives_back`]), once, by the operation that ends its hold.
fn stops_holding(tx: &mut dyn Tx, row: &TaskRow) -> Result<(), StoreError> {
    let live = row.lease_owner.is_some() && matches!(row.state, TaskState::Running | TaskState::AwaitingInput);
    if live && !row.spec.concurrency.is_empty() {
        tx.gives_back(&row.spec.concurrency)?;
    }
    Ok(())
}

/// The ending's columns written to `row` (the caller has checked who may), and the row as
/// the UPDATE left it, built rather than read back.
fn apply(tx: &mut dyn Tx, row: &TaskRow, c: &Columns) -> Result<TaskRow, StoreError> {
    stops_holding(tx, row)?;
    let not_before = c.not_before.unwrap_or(row.not_before_ms);
    let usage = c.usage.as_ref().map(Value::to_string);
    tx.exec(
        "UPDATE tasks SET state = ?3, version = version + 1, failures = failures + ?4, lease_owner = NULL,
             lease_expires_at_ms = NULL, not_before_ms = ?5, result = COALESCE(?6, result),
             usage = COALESCE(?7, usage), error = ?8, cancel_requested = NULL
         WHERE run_id = ?1 AND id = ?2",
        &[
            Arg::Text(&row.run_id),
            Arg::Text(&row.id),
            Arg::Text(c.to.as_str()),
            Arg::Int(c.failure),
            Arg::Int(not_before),
            Arg::OptText(c.result.as_deref()),
            Arg::OptText(usage.as_deref()),
            Arg::OptText(c.error.as_deref()),
        ],
    )?;
    Ok(TaskRow {
        state: c.to,
        version: row.version + 1,
        failures: row.failures + c.failure,
        lease_owner: None,
        lease_expires_at_ms: None,
        not_before_ms: not_before,
        result: c.result.clone().or_else(|| row.result.clone()),
        usage: c.usage.clone().or_else(|| row.usage.clone()),
        error: c.error.clone(),
        cancel_requested: None,
        ..row.clone()
    })
}

/// [`Tx::end_held`] as statements both dialects run: the output kept, the task read (and
/// locked), the fence tested, the ending applied, the inbox looked at.
pub(crate) fn end_held_by_statements(
    tx: &mut dyn Tx,
    e: &EndHeld<'_>,
) -> Result<Option<(TaskState, TaskRow)>, StoreError> {
    let (a, c, now, b) = (e.attempt, e.columns, e.now, e.beside);
    if let Some(output) = b.output {
        keep_output(tx, a, output)?;
    }
    let Some(raw) = tx.task(&a.run, &a.task)? else { return Ok(None) };
    let row = decode(raw)?;
    if !holds(&row, a, now) || row.cancel_requested.is_some() {
        return Ok(None);
    }
    let after = apply(tx, &row, c)?;
    let args = [Arg::Text(&a.run), Arg::Text(&a.task)];
    if b.unless_messages && tx.int(MESSAGE_WAITING, &args)? == Some(1) {
        return Err(messages_waiting(a));
    }
    Ok(Some((row.state, after)))
}

/// What follows an applied ending: its questions void, its transition event.
fn ended(
    tx: &mut dyn Tx,
    from: TaskState,
    row: TaskRow,
    n: i64,
    ending: &Ending,
    extra: Extra,
) -> Result<(TaskRow, i64), StoreError> {
    // Whoever asked is gone: its questions can no longer be answered. Only a task awaiting
    // input has open questions (`park` moves it there with its first, `go_on` out of it only
    // when none is left), so a running task's ending skips the statement.
    if from == TaskState::AwaitingInput {
        void_questions(tx, &row.run_id, &row.id, "the attempt ended")?;
    }
    let before = Was { run: &row.run_id, task: &row.id, state: from, version: row.version - 1 };
    let seq = transition_event(tx, before, row.state, n, ending.reason(), extra)?;
    Ok((row, seq))
}

/// Applies an ending to a task whose attempt `n` ends (the caller has checked who may).
fn end_attempt(tx: &mut dyn Tx, row: &TaskRow, n: i64, ending: &Ending) -> Result<(TaskRow, i64), StoreError> {
    let (c, extra) = columns(ending);
    let after = apply(tx, row, &c)?;
    ended(tx, row.state, after, n, ending, extra)
}

pub(crate) fn finish(
    tx: &mut dyn Tx,
    a: &Attempt,
    ending: &Ending,
    idem: Option<&Idem>,
) -> Result<(TaskRow, i64), StoreError> {
    let Some(idem) = idem else {
        // The fence and the ending in one step where the backend can (`Tx::end_held`).
        let (c, extra) = columns(ending);
        let Some((from, after)) =
            tx.end_held(&EndHeld { attempt: a, columns: &c, now: now_ms(), beside: Beside::default() })?
        else {
            return end_requested(tx, a)?.ok_or_else(|| lease_lost(a));
        };
        return ended(tx, from, after, a.n, ending, extra);
    };
    match report_once(tx, a, ending, idem)? {
        Err(first) => Ok((serde_json::from_str(&first)?, 0)),
        Ok((row, seq)) => {
            remember(tx, a, idem, &serde_json::to_string(&row)?)?;
            Ok((row, seq))
        }
    }
}

/// A worker's report applied (its events, side effects, output and ending, a person's cancel
/// in place of its ending), or — `Err`, with the first answer as stored — a repeat of its key.
fn report_once(
    tx: &mut dyn Tx,
    a: &Attempt,
    ending: &Ending,
    idem: &Idem,
) -> Result<Result<(TaskRow, i64), String>, StoreError> {
    // The task is read (and, where rows lock, locked) first, so of two reports with one key
    // the second waits for the first and then finds its answer.
    let row = load_task(tx, &a.run, &a.task)?;
    if let Some(first) = first_answer(tx, a, idem)? {
        return Ok(Err(first));
    }
    if !holds(&row, a, now_ms()) {
        return Err(lease_lost(a));
    }
    if idem.refuses_with_messages()
        && row.cancel_requested.is_none()
        && tx.int(MESSAGE_WAITING, &[Arg::Text(&a.run), Arg::Text(&a.task)])?.unwrap_or(0) > 0
    {
        return Err(messages_waiting(a));
    }
    record(tx, a, idem.events(), idem.evidence())?;
    if let Some(output) = idem.output() {
        keep_output(tx, a, output)?;
    }
    let requested = requested(&row);
    end_attempt(tx, &row, a.n, requested.as_ref().unwrap_or(ending)).map(Ok)
}

/// The first answer to `idem`'s key, if it was used before; a repeat with another request is
/// refused.
fn first_answer(tx: &mut dyn Tx, a: &Attempt, idem: &Idem) -> Result<Option<String>, StoreError> {
    let first = tx.texts(
        "SELECT answer, request FROM updates WHERE run_id = ?1 AND task_id = ?2 AND key = ?3",
        &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Text(idem.key())],
    )?;
    let Some(first) = first else { return Ok(None) };
    if first.get(1).cloned().flatten().as_deref() != Some(idem.request()) {
        return Err(StoreError::IdempotencyConflict { key: idem.key().to_owned() });
    }
    Ok(Some(first.into_iter().next().flatten().unwrap_or_default()))
}

/// The first answer to a report's key, for its repeats.
fn remember(tx: &mut dyn Tx, a: &Attempt, idem: &Idem, answer: &str) -> Result<(), StoreError> {
    tx.exec(
        "INSERT INTO updates (run_id, task_id, key, answer, request) VALUES (?1, ?2, ?3, ?4, ?5)",
        &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Text(idem.key()), Arg::Text(answer), Arg::Text(idem.request())],
    )?;
    Ok(())
}

/// A worker's report ([`finish`] with its key) and, in the same commit, the claim of the next
/// task for the worker (`next`, found before, if one was): one commit, not two, per task a
/// worker runs. A repeat of the key answers what the first did, the task claimed then included.
pub(crate) fn report_and_claim(
    tx: &mut dyn Tx,
    a: &Attempt,
    ending: &Ending,
    idem: &Idem,
    next: Option<&NextClaim>,
) -> Result<(crate::Reported, i64), StoreError> {
    match report_once(tx, a, ending, idem)? {
        Err(first) => Ok((crate::Reported { repeat: true, ..serde_json::from_str(&first)? }, 0)),
        Ok((row, seq)) => {
            let (mut claimed, mut claimed_seq) = (None, 0);
            for c in next.map_or(&[][..], |n| &n.candidates) {
                if ready(tx, c)? {
                    let owner = next.map_or("", |n| &n.owner);
                    (claimed, claimed_seq) = claim(tx, &c.run, &c.task, owner, next.map_or(0, |n| n.until))?;
                    if claimed.is_some() {
                        break;
                    }
                }
            }
            let reported = crate::Reported { task: row, next: claimed.map(|(_, row)| row), repeat: false };
            remember(tx, a, idem, &serde_json::to_string(&reported)?)?;
            Ok((reported, seq.max(claimed_seq)))
        }
    }
}

/// Whether a candidate's dependencies completed: it was found before this commit, maybe
/// counting on its ending. A completed task never moves again but by a retry, which waits
/// for this commit, so the rows are read without a lock (locking them could deadlock two
/// nodes' reports).
fn ready(tx: &mut dyn Tx, c: &Candidate) -> Result<bool, StoreError> {
    for d in &c.depends_on {
        let done = tx.int(
            "SELECT COUNT(*) FROM tasks WHERE run_id = ?1 AND id = ?2 AND state = 'completed'",
            &[Arg::Text(&c.run), Arg::Text(d)],
        )?;
        if done != Some(1) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What a worker's report claims for it next: the first of `candidates` still pending, due
/// and ready (reports of several workers race for the same first ones), and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextClaim {
    pub candidates: Vec<Candidate>,
    pub owner: String,
    pub until: i64,
}

/// A task a report may claim next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub run: String,
    pub task: String,
    /// Its dependencies, each checked completed in the commit that claims it.
    pub depends_on: Vec<String>,
}

pub(crate) fn release_lost(
    tx: &mut dyn Tx,
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
    let requested = requested(&row);
    let (row, seq) = end_attempt(tx, &row, a.n, requested.as_ref().unwrap_or(ending))?;
    Ok((Some(row), seq))
}

/// The ending a person's cancel asked for, if one waits: it takes the place of whatever
/// ending the attempt (or whoever releases it) would have written.
fn requested(row: &TaskRow) -> Option<Ending> {
    row.cancel_requested.as_ref().map(|reason| Ending::Cancelled { reason: reason.clone() })
}

/// An ending [`Tx::end_held`] did not apply: the attempt lost its task (`None`), or a
/// person's cancel waits for it, which is applied instead.
fn end_requested(tx: &mut dyn Tx, a: &Attempt) -> Result<Option<(TaskRow, i64)>, StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    match requested(&row) {
        Some(ending) if holds(&row, a, now_ms()) => end_attempt(tx, &row, a.n, &ending).map(Some),
        _ => Ok(None),
    }
}

pub(crate) fn record(
    tx: &mut dyn Tx,
    a: &Attempt,
    events: &[(String, Value)],
    evidence: &[Value],
) -> Result<(i64, i64), StoreError> {
    for e in evidence {
        tx.add_evidence(a, e)?;
    }
    let mut last = 0;
    for (kind, data) in events {
        let mut data = data.clone();
        data["attempt"] = json!(a.n);
        last = tx.event(&a.run, Some(&a.task), kind, &data)?;
    }
    Ok((last, last))
}

/// [`record`] of a remote attempt, fenced on its holding the task and written once per key
/// (`idem`'s events, and `evidence`): a repeat of the key with the same request writes
/// nothing. Whether this call wrote them.
pub(crate) fn record_once(
    tx: &mut dyn Tx,
    a: &Attempt,
    idem: &Idem,
    evidence: &[Value],
) -> Result<(bool, i64), StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    if first_answer(tx, a, idem)?.is_some() {
        return Ok((false, 0));
    }
    if !holds(&row, a, now_ms()) {
        return Err(lease_lost(a));
    }
    let (seq, _) = record(tx, a, idem.events(), evidence)?;
    tx.exec(
        "INSERT INTO updates (run_id, task_id, key, answer, request) VALUES (?1, ?2, ?3, ?4, ?5)",
        &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Text(idem.key()), Arg::Text("{}"), Arg::Text(idem.request())],
    )?;
    Ok((true, seq))
}

/// A pull worker was seen (it asked for work): its capabilities and when.
pub(crate) fn seen_worker(tx: &mut dyn Tx, name: &str, capabilities: &[String]) -> Result<((), i64), StoreError> {
    let caps = serde_json::to_string(capabilities)?;
    tx.exec(
        "INSERT INTO workers (name, capabilities, seen_at_ms) VALUES (?1, ?2, ?3)
         ON CONFLICT (name) DO UPDATE SET capabilities = excluded.capabilities, seen_at_ms = excluded.seen_at_ms",
        &[Arg::Text(name), Arg::Text(&caps), Arg::Int(now_ms())],
    )?;
    Ok(((), 0))
}

pub(crate) fn cancel(
    tx: &mut dyn Tx,
    run: &str,
    task: &str,
    reason: &str,
) -> Result<(Option<TaskRow>, i64), StoreError> {
    let row = load_task(tx, run, task)?;
    if row.state.is_terminal() {
        return Ok((None, 0));
    }
    // A live attempt ends its task itself, with what it showed, in one commit: a reader never
    // sees the task ended and its attempt's output still missing. One whose lease has lapsed
    // shows nothing more, and the task ends now.
    if row.held().is_some_and(|h| h.expires_at_ms >= now_ms()) {
        if row.cancel_requested.is_some() {
            return Ok((Some(row), 0));
        }
        tx.exec(
            "UPDATE tasks SET cancel_requested = ?3, version = version + 1 WHERE run_id = ?1 AND id = ?2",
            &[Arg::Text(run), Arg::Text(task), Arg::Text(reason)],
        )?;
        // Nobody answers a question of a task that is ending; its agent hears it was cancelled.
        void_questions(tx, run, task, "the task is being cancelled")?;
        let asked = LogEvent::CancelRequested { attempt: row.attempt, reason: reason.to_owned() };
        let seq = log(tx, run, Some(task), &asked)?;
        return Ok((Some(load_task(tx, run, task)?), seq));
    }
    stops_holding(tx, &row)?;
    tx.exec(
        "UPDATE tasks SET state = 'cancelled', version = version + 1, lease_owner = NULL, lease_expires_at_ms = NULL,
             cancel_requested = NULL
         WHERE run_id = ?1 AND id = ?2",
        &[Arg::Text(run), Arg::Text(task)],
    )?;
    void_questions(tx, run, task, "the task was cancelled")?;
    let seq = transition_event(tx, Was::of(&row), TaskState::Cancelled, row.attempt, reason, Extra::default())?;
    Ok((Some(load_task(tx, run, task)?), seq))
}

pub(crate) fn decide_rerun(
    tx: &mut dyn Tx,
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
    tx.exec(
        "UPDATE tasks SET state = ?3, version = version + 1 WHERE run_id = ?1 AND id = ?2",
        &[Arg::Text(run), Arg::Text(task), Arg::Text(to.as_str())],
    )?;
    let reason = if again {
        format!("a person approved running it again ({by})")
    } else {
        format!("a person denied running it again ({by})")
    };
    let seq = transition_event(tx, Was::of(&row), to, row.attempt, &reason, Extra::default())?;
    Ok((load_task(tx, run, task)?, seq))
}

/// A person's retry of a failed or cancelled task (and, with `dependents`, of the cancelled
/// tasks below it, transitively): each goes back to `pending` with its failures forgotten,
/// so it gets its whole `max_attempts` again; the next claim is a new attempt. Each move
/// is a transition event naming who retried it.
pub(crate) fn retry(
    tx: &mut dyn Tx,
    run: &str,
    task: &str,
    dependents: bool,
    by: &str,
) -> Result<(Vec<TaskRow>, i64), StoreError> {
    let row = load_task(tx, run, task)?;
    if !row.state.retryable() {
        return Err(StoreError::IllegalTransition {
            task: task.to_owned(),
            from: row.state.as_str(),
            to: TaskState::Pending.as_str(),
        });
    }
    let mut chosen = vec![(row, format!("a person retried it ({by})"))];
    if dependents {
        let mut cancelled = Vec::new();
        for id in tx
            .strings("SELECT id FROM tasks WHERE run_id = ?1 AND state = 'cancelled' ORDER BY ord", &[Arg::Text(run)])?
        {
            if id != task {
                cancelled.push(load_task(tx, run, &id)?);
            }
        }
        // Breadth first from the task: a cancelled task whose dependency is being retried.
        let mut frontier = vec![task.to_owned()];
        while let Some(dep) = frontier.pop() {
            let (below, rest): (Vec<TaskRow>, Vec<TaskRow>) =
                cancelled.into_iter().partition(|t| t.spec.depends_on.contains(&dep));
            cancelled = rest;
            for t in below {
                frontier.push(t.id.clone());
                chosen.push((t, format!("retried with {task}, which it depends on ({by})")));
            }
        }
    }
    let mut seq = 0;
    let mut rows = Vec::with_capacity(chosen.len());
    for (t, reason) in chosen {
        tx.exec(
            "UPDATE tasks SET state = 'pending', version = version + 1, failures = 0, not_before_ms = 0,
                 result = NULL, error = NULL, lease_owner = NULL, lease_expires_at_ms = NULL, cancel_requested = NULL
             WHERE run_id = ?1 AND id = ?2",
            &[Arg::Text(run), Arg::Text(&t.id)],
        )?;
        seq = transition_event(tx, Was::of(&t), TaskState::Pending, t.attempt, &reason, Extra::default())?;
        rows.push(load_task(tx, run, &t.id)?);
    }
    Ok((rows, seq))
}

pub(crate) fn answer(
    tx: &mut dyn Tx,
    run: &str,
    task: &str,
    q: &Question,
    option: &str,
    by: &str,
) -> Result<(bool, i64), StoreError> {
    let changed = tx.exec(
        "UPDATE questions SET answer = ?5, answered_by = ?6
         WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4 AND answer IS NULL",
        &[Arg::Text(run), Arg::Text(task), Arg::Int(q.attempt), Arg::Int(q.n), Arg::Text(option), Arg::Text(by)],
    )?;
    if changed != 1 {
        return Ok((false, 0));
    }
    let answer = LogEvent::Answer { attempt: q.attempt, question: q.n, option: option.to_owned(), by: by.to_owned() };
    Ok((true, log(tx, run, Some(task), &answer)?))
}

/// Appends events that belong to no attempt.
pub(crate) fn append_events(
    tx: &mut dyn Tx,
    events: &[(String, Option<String>, String, Value)],
) -> Result<(i64, i64), StoreError> {
    let mut last = 0;
    for (run, task, kind, data) in events {
        last = tx.event(run, task.as_deref(), kind, data)?;
    }
    Ok((last, last))
}

/// How long the row of a node that stopped heart-beating is kept (for `/nodes` history and
/// for a node that comes back) before a live node's lease pass removes it.
pub(crate) const NODE_ROWS_KEPT_MS: i64 = 3_600_000;

/// Renews node `node`'s presence until `until`, and removes the rows of nodes dead for an
/// hour and run leases expired as long (an expired lease is as good as none), so the tables
/// do not grow with every node start.
fn present(tx: &mut dyn Tx, node: &str, now: i64, until: i64) -> Result<(), StoreError> {
    tx.exec(
        "INSERT INTO nodes (id, started_at_ms, heartbeat_at_ms, expires_at_ms) VALUES (?1, ?2, ?2, ?3)
         ON CONFLICT (id) DO UPDATE SET heartbeat_at_ms = ?2, expires_at_ms = ?3",
        &[Arg::Text(node), Arg::Int(now), Arg::Int(until)],
    )?;
    let gone = now - NODE_ROWS_KEPT_MS;
    tx.exec("DELETE FROM nodes WHERE expires_at_ms < ?1", &[Arg::Int(gone)])?;
    tx.exec("DELETE FROM run_leases WHERE expires_at_ms < ?1", &[Arg::Int(gone)])?;
    Ok(())
}

/// Node `node` drives one run only (`pier run`): its presence, and that run's lease, taken
/// when free or expired and renewed while it holds it. Whether it holds it now.
pub(crate) fn lease_run(tx: &mut dyn Tx, node: &str, run: &str, until: i64) -> Result<(bool, i64), StoreError> {
    let now = now_ms();
    present(tx, node, now, until)?;
    tx.exec(
        "INSERT INTO run_leases (run_id, owner, expires_at_ms) VALUES (?1, ?2, ?3)
         ON CONFLICT (run_id) DO UPDATE SET owner = ?2, expires_at_ms = ?3
         WHERE run_leases.owner = ?2 OR run_leases.expires_at_ms < ?4",
        &[Arg::Text(run), Arg::Text(node), Arg::Int(until), Arg::Int(now)],
    )?;
    let owner = tx.texts("SELECT owner FROM run_leases WHERE run_id = ?1", &[Arg::Text(run)])?;
    let owner = owner.and_then(|row| row.into_iter().next().flatten());
    Ok((owner.as_deref() == Some(node), 0))
}

/// Renews node `node` and the run leases it holds until `until`, hands back runs beyond its
/// fair share (the unfinished runs over the live nodes, rounded up) and takes free or
/// expired ones up to it. Returns the runs it holds.
pub(crate) fn lease_runs(tx: &mut dyn Tx, node: &str, until: i64) -> Result<(Vec<String>, i64), StoreError> {
    let now = now_ms();
    present(tx, node, now, until)?;
    tx.exec(
        "DELETE FROM run_leases WHERE owner = ?1 AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.run_id = run_leases.run_id
             AND t.state IN ('pending', 'running', 'awaiting_input'))",
        &[Arg::Text(node)],
    )?;
    tx.exec("UPDATE run_leases SET expires_at_ms = ?2 WHERE owner = ?1", &[Arg::Text(node), Arg::Int(until)])?;
    let share = fair_share(tx, now)?;
    let mine = tx.strings("SELECT run_id FROM run_leases WHERE owner = ?1 ORDER BY run_id", &[Arg::Text(node)])?;
    // Beyond its share: the newest runs go back, for a node that joined to take.
    for run in mine.iter().skip(share) {
        tx.exec("DELETE FROM run_leases WHERE owner = ?1 AND run_id = ?2", &[Arg::Text(node), Arg::Text(run)])?;
    }
    if mine.len() < share {
        let free = free_runs(tx, now)?;
        take(tx, node, now, until, free, share - mine.len())?;
    }
    let held = tx.strings("SELECT run_id FROM run_leases WHERE owner = ?1 ORDER BY run_id", &[Arg::Text(node)])?;
    Ok((held, 0))
}

/// Node `node`, driving `driving` unfinished runs as it sees them, takes free or expired runs
/// between two renewals (a run appeared): up to its fair share less those, and at least its part
/// of the free ones (of `n` and `live` nodes, `n / live` rounded up: a node whose view counts a
/// run that just ended still takes new ones). Its leases are neither renewed nor swept, so a new
/// run costs a few reads, not a rewrite of every lease the node holds (which, in PostgreSQL, left
/// a dead row version of each behind on every pass); the next renewal evens the shares out.
/// Returns the runs it took.
pub(crate) fn take_runs(
    tx: &mut dyn Tx,
    node: &str,
    until: i64,
    driving: usize,
) -> Result<(Vec<String>, i64), StoreError> {
    let now = now_ms();
    let live = tx.int("SELECT COUNT(*) FROM nodes WHERE expires_at_ms >= ?1", &[Arg::Int(now)])?.unwrap_or(1).max(1);
    let free = free_runs(tx, now)?;
    let part = free.len().div_ceil(live as usize);
    let room = fair_share(tx, now)?.saturating_sub(driving).max(part);
    Ok((take(tx, node, now, until, free, room)?, 0))
}

/// A node's fair share of runs at `now`: the unfinished runs over the live nodes, rounded up.
fn fair_share(tx: &mut dyn Tx, now: i64) -> Result<usize, StoreError> {
    let live = tx.int("SELECT COUNT(*) FROM nodes WHERE expires_at_ms >= ?1", &[Arg::Int(now)])?.unwrap_or(1).max(1);
    let active = tx
        .int("SELECT COUNT(DISTINCT run_id) FROM tasks WHERE state IN ('pending', 'running', 'awaiting_input')", &[])?
        .unwrap_or(0);
    Ok(((active + live - 1) / live) as usize)
}

/// The unfinished runs whose lease is free or expired at `now`, by id.
fn free_runs(tx: &mut dyn Tx, now: i64) -> Result<Vec<String>, StoreError> {
    tx.strings(
        "SELECT DISTINCT t.run_id FROM tasks t LEFT JOIN run_leases l ON l.run_id = t.run_id
         WHERE t.state IN ('pending', 'running', 'awaiting_input') AND (l.run_id IS NULL OR l.expires_at_ms < ?1)
         ORDER BY t.run_id",
        &[Arg::Int(now)],
    )
}

/// Node `node` takes up to `room` of the runs `free` (read as free at `now`); those it took.
/// Every candidate is tried, not only the first `room`: a node racing this one takes some of
/// them (its insert wins, this one's then changes nothing), and this one goes on past them.
fn take(
    tx: &mut dyn Tx,
    node: &str,
    now: i64,
    until: i64,
    free: Vec<String>,
    room: usize,
) -> Result<Vec<String>, StoreError> {
    let mut taken = Vec::new();
    for run in free {
        if taken.len() == room {
            break;
        }
        // Fenced on the expiry: of two nodes taking one run, one gets it.
        let took = tx.exec(
            "INSERT INTO run_leases (run_id, owner, expires_at_ms) VALUES (?1, ?2, ?3)
             ON CONFLICT (run_id) DO UPDATE SET owner = ?2, expires_at_ms = ?3 WHERE run_leases.expires_at_ms < ?4",
            &[Arg::Text(&run), Arg::Text(node), Arg::Int(until), Arg::Int(now)],
        )?;
        if took > 0 {
            taken.push(run);
        }
    }
    Ok(taken)
}

/// An attempt's ending with what it writes last ([`crate::Last`]): its events first, then
/// the ending with its output kept beside it. A refused ending (a race: the attempt lost its
/// task) is the answer, not a failure of the write, so the events and output stay.
pub(crate) fn finish_keeping(
    tx: &mut dyn Tx,
    a: &Attempt,
    last: &crate::Last,
    ending: &Ending,
) -> Result<(Result<TaskRow, StoreError>, i64), StoreError> {
    let (_, recorded) = record(tx, a, &last.events, &last.evidence)?;
    let (c, extra) = columns(ending);
    let output = last.output.to_string();
    let beside = Beside { output: Some(&output), unless_messages: last.unless_messages };
    match tx.end_held(&EndHeld { attempt: a, columns: &c, now: now_ms(), beside })? {
        Some((from, after)) => {
            let (row, seq) = ended(tx, from, after, a.n, ending, extra)?;
            Ok((Ok(row), seq))
        }
        None => match end_requested(tx, a)? {
            Some((row, seq)) => Ok((Ok(row), seq)),
            None => Ok((Err(lease_lost(a)), recorded)),
        },
    }
}

/// Keeps what an attempt showed; on its own row, so no fence is needed: a task cancelled
/// under an attempt still keeps that attempt's partial output.
pub(crate) fn keep_output(tx: &mut dyn Tx, a: &Attempt, output: &str) -> Result<((), i64), StoreError> {
    tx.exec(
        "UPDATE attempts SET output = ?4 WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
        &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(a.n), Arg::Text(output)],
    )?;
    Ok(((), 0))
}

/// Messages a task's inbox holds unsent at most (each is bounded in size by its sender).
pub const MAX_WAITING_MESSAGES: i64 = 100;

/// Queues a message for a running task (`None` if it is not running).
pub(crate) fn say(
    tx: &mut dyn Tx,
    run: &str,
    task: &str,
    text: &str,
    interrupt: bool,
    by: &str,
) -> Result<(Option<i64>, i64), StoreError> {
    let row = load_task(tx, run, task)?;
    // A live attempt (running, or parked on a question) takes messages; a task waiting for
    // a re-run decision has none, and a message to it would never be sent.
    if !matches!(row.state, TaskState::Running | TaskState::AwaitingInput)
        || row.lease_owner.is_none()
        || row.cancel_requested.is_some()
    {
        return Ok((None, 0));
    }
    let waiting = tx
        .int(
            "SELECT COUNT(*) FROM messages WHERE run_id = ?1 AND task_id = ?2 AND sent_attempt IS NULL",
            &[Arg::Text(run), Arg::Text(task)],
        )?
        .unwrap_or(0);
    if waiting >= MAX_WAITING_MESSAGES {
        return Err(StoreError::InboxFull { task: task.to_owned(), waiting });
    }
    let n = tx
        .int(
            "SELECT COALESCE(MAX(n), 0) + 1 FROM messages WHERE run_id = ?1 AND task_id = ?2",
            &[Arg::Text(run), Arg::Text(task)],
        )?
        .unwrap_or(1);
    tx.exec(
        "INSERT INTO messages (run_id, task_id, n, text, interrupt, at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        &[
            Arg::Text(run),
            Arg::Text(task),
            Arg::Int(n),
            Arg::Text(text),
            Arg::Int(i64::from(interrupt)),
            Arg::Int(now_ms()),
        ],
    )?;
    let said = LogEvent::Message { n, text: text.to_owned(), interrupt, by: by.to_owned() };
    let seq = log(tx, run, Some(task), &said)?;
    Ok((Some(n), seq))
}

/// A person's new budget for task `task` (its own, raised by `budget`) and for the run
/// (`run_budget`, written into every task of the run): each changed task's spec is rewritten
/// and its version moved, with one `budget` event per task. Limits `None` keep what was.
pub(crate) fn set_budget(
    tx: &mut dyn Tx,
    run: &str,
    task: Option<&str>,
    budget: Option<Budget>,
    run_budget: Option<Budget>,
    by: &str,
) -> Result<(Vec<TaskRow>, i64), StoreError> {
    let ids: Vec<String> = match (task, run_budget) {
        (_, Some(_)) => tx.strings("SELECT id FROM tasks WHERE run_id = ?1 ORDER BY ord", &[Arg::Text(run)])?,
        (Some(t), None) => vec![t.to_owned()],
        (None, None) => Vec::new(),
    };
    if let Some(t) = task
        && !ids.iter().any(|id| id == t)
    {
        return Err(StoreError::UnknownTask(t.to_owned()));
    }
    let (mut rows, mut seq) = (Vec::with_capacity(ids.len()), 0);
    for id in ids {
        let mut row = load_task(tx, run, &id)?;
        let own = (task == Some(id.as_str())).then_some(budget).flatten();
        if let Some(b) = own {
            row.spec.budget = Some(row.spec.budget.unwrap_or_default().raised(b));
        }
        if let Some(b) = run_budget {
            row.spec.run_budget = Some(row.spec.run_budget.unwrap_or_default().raised(b));
        }
        let spec = serde_json::to_string(&row.spec)?;
        tx.exec(
            "UPDATE tasks SET spec = ?3, version = version + 1 WHERE run_id = ?1 AND id = ?2",
            &[Arg::Text(run), Arg::Text(&id), Arg::Text(&spec)],
        )?;
        let said = LogEvent::Budget { budget: own, run_budget, by: by.to_owned() };
        seq = log(tx, run, Some(&id), &said)?;
        rows.push(load_task(tx, run, &id)?);
    }
    Ok((rows, seq))
}

/// The messages the holding attempt has not sent yet, marked sent by it.
pub(crate) fn take_messages(tx: &mut dyn Tx, a: &Attempt) -> Result<(Vec<(i64, String)>, i64), StoreError> {
    let row = load_task(tx, &a.run, &a.task)?;
    if !holds(&row, a, now_ms()) {
        return Err(lease_lost(a));
    }
    let mut out = Vec::new();
    let mut seq = 0;
    let where_ = [Arg::Text(&a.run), Arg::Text(&a.task)];
    while let Some(next) = tx.texts(
        "SELECT CAST(n AS TEXT), text FROM messages WHERE run_id = ?1 AND task_id = ?2 AND sent_attempt IS NULL
         ORDER BY n LIMIT 1",
        &where_,
    )? {
        let n: i64 = next.first().cloned().flatten().and_then(|n| n.parse().ok()).unwrap_or(0);
        let text = next.get(1).cloned().flatten().unwrap_or_default();
        tx.exec(
            "UPDATE messages SET sent_attempt = ?4 WHERE run_id = ?1 AND task_id = ?2 AND n = ?3",
            &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(n), Arg::Int(a.n)],
        )?;
        seq = log(tx, &a.run, Some(&a.task), &LogEvent::MessageSent { n, attempt: a.n })?;
        out.push((n, text));
    }
    Ok((out, seq))
}

/// Keeps an agent spec's latest `initialize` answer.
pub(crate) fn record_agent(tx: &mut dyn Tx, spec: &str, init: &Value) -> Result<((), i64), StoreError> {
    tx.exec(
        "INSERT INTO agents (spec, init, seen_at_ms) VALUES (?1, ?2, ?3)
         ON CONFLICT (spec) DO UPDATE SET init = excluded.init, seen_at_ms = excluded.seen_at_ms",
        &[Arg::Text(spec), Arg::Text(&init.to_string()), Arg::Int(now_ms())],
    )?;
    Ok(((), 0))
}

/// Node `node` leaves: its run leases go back at once, and it is no longer listed.
pub(crate) fn release_runs(tx: &mut dyn Tx, node: &str) -> Result<((), i64), StoreError> {
    tx.exec("DELETE FROM run_leases WHERE owner = ?1", &[Arg::Text(node)])?;
    tx.exec("DELETE FROM nodes WHERE id = ?1", &[Arg::Text(node)])?;
    Ok(((), 0))
}

/// The live nodes, each beside each run it holds a live lease of (or none): `?1` is now.
/// A read, in one statement; [`nodes`] groups its rows.
pub(crate) const NODES: &str = "SELECT n.id, n.started_at_ms, n.heartbeat_at_ms, n.expires_at_ms, l.run_id
     FROM nodes n LEFT JOIN run_leases l ON l.owner = n.id AND l.expires_at_ms >= ?1
     WHERE n.expires_at_ms >= ?1 ORDER BY n.id, l.run_id";

/// One row of [`NODES`].
pub(crate) type NodeLease = (String, i64, i64, i64, Option<String>);

/// [`NODES`]' rows as one [`crate::NodeRow`] per node.
pub(crate) fn nodes(rows: Vec<NodeLease>) -> Vec<crate::NodeRow> {
    let mut out: Vec<crate::NodeRow> = Vec::new();
    for (id, started_at_ms, heartbeat_at_ms, expires_at_ms, run) in rows {
        if out.last().is_none_or(|n| n.id != id) {
            out.push(crate::NodeRow { id, started_at_ms, heartbeat_at_ms, expires_at_ms, runs: Vec::new() });
        }
        if let (Some(node), Some(run)) = (out.last_mut(), run) {
            node.runs.push(run);
        }
    }
    out
}
