//! [`TaskStore`] written once, over any [`Backend`]: each write is a named operation of
//! [`crate::ops`] handed to the backend's group commit, each read one statement in the
//! dialect both databases share, decoded here.

use std::sync::Arc;

use serde_json::Value;
use tokio::sync::{broadcast, watch};

use crate::backend::{Backend, Query, Row, TASK_COLUMN_COUNT};
use crate::log::{Event, OwnCommit, RawEvent};
use crate::ops::{self, Arg, Tx, decode};
use crate::plan::{Plan, TaskSpec};
use crate::rows::{
    AgentRow, Attempt, AttemptRow, Ending, Held, Idem, Last, NodeRow, Question, QuestionRequest, TaskRow, Waiting,
};
use crate::{StoreError, TaskStore, task_columns};

/// The store over backend `B` (`SqliteStore`, `PgStore`).
pub struct Store<B> {
    pub(crate) db: B,
}

const TASKS_OF_RUN: &str = concat!("SELECT ", task_columns!(), " FROM tasks WHERE run_id = ?1 ORDER BY ord");
/// The largest page of the queue read at once; the first is small, as a lease usually takes one
/// of the first tasks.
const QUEUE_PAGES: (i64, i64) = (4, 256);
const TASK: &str = concat!("SELECT ", task_columns!(), " FROM tasks WHERE run_id = ?1 AND id = ?2");

/// An event row of `seq, run_id, task_id, type, at_ms, data`, its data still text.
pub(crate) fn raw_event(mut r: Row) -> Result<RawEvent, StoreError> {
    Ok(RawEvent {
        seq: r.int(0)?,
        run: r.text(1)?,
        task: r.opt_text(2)?,
        kind: r.text(3)?,
        at_ms: r.int(4)?,
        data: r.text(5)?,
    })
}

fn events(rows: Vec<Row>) -> Result<Vec<Event>, StoreError> {
    rows.into_iter().map(|r| raw_event(r).map(RawEvent::into_event)).collect()
}

pub(crate) fn tasks(rows: Vec<Row>) -> Result<Vec<TaskRow>, StoreError> {
    rows.into_iter().map(|r| decode(r.raw_task()?)).collect()
}

fn strings(rows: Vec<Row>) -> Result<Vec<String>, StoreError> {
    rows.into_iter().map(|mut r| r.text(0)).collect()
}

/// The first column of the first row, as an integer (0 without a row).
fn count(rows: Vec<Row>) -> Result<i64, StoreError> {
    rows.into_iter().next().map_or(Ok(0), |mut r| r.int(0))
}

// `Backend` is sealed (the crate's two databases): these helpers are private all the same.
/// The most tasks a run's creation may insert side by side with its group's other jobs.
const SIDE_BY_SIDE_TASKS: usize = 4;

#[allow(private_bounds)]
impl<B: Backend> Store<B> {
    /// Runs operation `work` in the next group commit; its answer once durable.
    fn op<T: Send + 'static>(
        &self,
        work: impl FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.db.write(None, Box::new(work)).map(|(answer, _)| answer)
    }

    /// [`Store::op`] for an operation that touches attempt `a`'s task's rows only.
    fn op_on<T: Send + 'static>(
        &self,
        a: &Attempt,
        work: impl FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.db.write(Some((&a.run, &a.task)), Box::new(work)).map(|(answer, _)| answer)
    }

    fn rows(&self, sql: &'static str, args: &[Arg<'_>]) -> Result<Vec<Row>, StoreError> {
        self.db.read(|q: &mut dyn Query| q.rows(sql, args))
    }

    /// Creates a run, its lease taken by `driver` if given ([`ops::create_run`]).
    ///
    /// A small run's creation touches rows no other job of its group can (the run is new),
    /// so it runs side by side with the group's other jobs (`pg::rounds`, keyed by the run
    /// alone): a round for the run, one for its lease if taken, one per task. A bigger plan's would hold every
    /// other job of its group for a round per task, so it runs on its own after them.
    fn create(&self, run: &str, plan: &Plan, source: &str, driver: Option<(String, i64)>) -> Result<bool, StoreError> {
        let key = (plan.tasks.len() <= SIDE_BY_SIDE_TASKS).then_some((run, ""));
        let (r, plan, source) = (run.to_owned(), plan.clone(), source.to_owned());
        let work = move |tx: &mut dyn Tx| {
            let driver = driver.as_ref().map(|(node, until)| (node.as_str(), *until));
            ops::create_run(tx, &r, &plan, &source, driver).map(|(seq, taken)| (taken, seq))
        };
        match self.db.write(key, Box::new(work)) {
            Ok((taken, _)) => Ok(taken),
            // Two nodes creating one run: the loser's insert meets the winner's row.
            Err(StoreError::Duplicate(_)) => Err(StoreError::RunExists(run.to_owned())),
            // The run's one commit did not happen: there is nothing to resume.
            Err(StoreError::Full { path }) => Err(StoreError::FullBeforeRun { path }),
            Err(e) => Err(e),
        }
    }

    /// The agents' answers, all or `spec`'s.
    fn agents_where(&self, spec: Option<&str>) -> Result<Vec<AgentRow>, StoreError> {
        let rows = self.rows(
            "SELECT spec, init, seen_at_ms FROM agents WHERE CAST(?1 AS TEXT) IS NULL OR spec = ?1 ORDER BY spec",
            &[Arg::OptText(spec)],
        )?;
        rows.into_iter()
            .map(|mut r| {
                Ok(AgentRow { spec: r.text(0)?, init: serde_json::from_str(&r.text(1)?)?, seen_at_ms: r.int(2)? })
            })
            .collect()
    }
}

impl<B: Backend> TaskStore for Store<B> {
    fn create_run(&self, run: &str, plan: &Plan, source: &str) -> Result<(), StoreError> {
        self.create(run, plan, source, None).map(|_| ())
    }

    fn create_run_driven(
        &self,
        run: &str,
        plan: &Plan,
        source: &str,
        node: &str,
        until_ms: i64,
    ) -> Result<bool, StoreError> {
        self.create(run, plan, source, Some((node.to_owned(), until_ms)))
    }

    fn run_exists(&self, run: &str) -> Result<bool, StoreError> {
        Ok(count(self.rows("SELECT COUNT(*) FROM runs WHERE id = ?1", &[Arg::Text(run)])?)? > 0)
    }

    fn tasks(&self, run: &str) -> Result<Vec<TaskRow>, StoreError> {
        tasks(self.rows(TASKS_OF_RUN, &[Arg::Text(run)])?)
    }

    fn task(&self, run: &str, task: &str) -> Result<Option<TaskRow>, StoreError> {
        Ok(tasks(self.rows(TASK, &[Arg::Text(run), Arg::Text(task)])?)?.pop())
    }

    fn pending_tasks(&self) -> Result<Vec<TaskRow>, StoreError> {
        let mut all = Vec::new();
        self.visit_pending(&mut |t, _| {
            all.push(t);
            Ok(false)
        })?;
        Ok(all)
    }

    fn backup(&self, to: &std::path::Path) -> Result<(), StoreError> {
        self.db.backup(to)
    }

    fn visit_pending(&self, visit: &mut dyn FnMut(TaskRow, i64) -> Result<bool, StoreError>) -> Result<(), StoreError> {
        let (mut rank, mut run, mut ord) = (i64::MIN, String::new(), i64::MIN);
        let mut page = QUEUE_PAGES.0;
        loop {
            let key = [Arg::Int(page), Arg::Int(rank), Arg::Text(&run), Arg::Int(ord)];
            let rows = self.rows(B::QUEUE_PAGE, &key)?;
            let full = rows.len() as i64 == page;
            for mut r in rows {
                (rank, ord) = (r.int(TASK_COLUMN_COUNT)?, r.int(TASK_COLUMN_COUNT + 1)?);
                let t = decode(r.raw_task()?)?;
                run.clone_from(&t.run_id);
                if visit(t, rank)? {
                    return Ok(());
                }
            }
            if !full {
                return Ok(());
            }
            page = (page * 4).min(QUEUE_PAGES.1);
        }
    }

    fn unfinished_tasks(&self) -> Result<Vec<TaskRow>, StoreError> {
        tasks(self.rows(B::UNFINISHED_TASKS, &[])?)
    }

    fn tasks_changed(&self, after: i64) -> Result<(Vec<TaskRow>, i64), StoreError> {
        self.db.tasks_changed(after)
    }

    fn claim(
        &self,
        run: &str,
        task: &str,
        owner: &str,
        lease_until_ms: i64,
    ) -> Result<Option<(Attempt, TaskRow)>, StoreError> {
        let (r, t, owner) = (run.to_owned(), task.to_owned(), owner.to_owned());
        let work = move |tx: &mut dyn Tx| ops::claim(tx, &r, &t, &owner, lease_until_ms);
        self.db.write(Some((run, task)), Box::new(work)).map(|(answer, _)| answer)
    }

    fn heartbeat(&self, attempt: &Attempt, lease_until_ms: i64) -> Result<bool, StoreError> {
        let a = attempt.clone();
        self.op_on(attempt, move |tx| ops::heartbeat(tx, &a, lease_until_ms))
    }

    fn park(&self, attempt: &Attempt, request: &QuestionRequest) -> Result<i64, StoreError> {
        let (a, request) = (attempt.clone(), request.clone());
        self.op_on(attempt, move |tx| ops::park(tx, &a, &request))
    }

    fn resume(&self, attempt: &Attempt) -> Result<bool, StoreError> {
        let a = attempt.clone();
        self.op_on(attempt, move |tx| ops::resume(tx, &a))
    }

    fn finish(&self, attempt: &Attempt, ending: &Ending, idem: Option<&Idem>) -> Result<TaskRow, StoreError> {
        let (a, ending, idem) = (attempt.clone(), ending.clone(), idem.cloned());
        self.op_on(attempt, move |tx| ops::finish(tx, &a, &ending, idem.as_ref()))
    }

    fn report_and_claim(
        &self,
        attempt: &Attempt,
        ending: &Ending,
        idem: &Idem,
        next: Option<&crate::NextClaim>,
    ) -> Result<crate::Reported, StoreError> {
        let (a, ending, idem, next) = (attempt.clone(), ending.clone(), idem.clone(), next.cloned());
        // Two tasks' rows: not a job of one task, so it never runs beside another job of either.
        self.op(move |tx| ops::report_and_claim(tx, &a, &ending, &idem, next.as_ref()))
    }

    fn release_lost(&self, held: &Held, ending: &Ending) -> Result<Option<TaskRow>, StoreError> {
        let (h, ending) = (held.clone(), ending.clone());
        self.op_on(&held.attempt, move |tx| ops::release_lost(tx, &h, &ending))
    }

    fn record(&self, attempt: &Attempt, events: &[(String, Value)], evidence: &[Value]) -> Result<i64, StoreError> {
        let (a, events, evidence) = (attempt.clone(), events.to_vec(), evidence.to_vec());
        self.op_on(attempt, move |tx| ops::record(tx, &a, &events, &evidence))
    }

    fn record_once(&self, attempt: &Attempt, idem: &Idem, evidence: &[Value]) -> Result<bool, StoreError> {
        let (a, idem, evidence) = (attempt.clone(), idem.clone(), evidence.to_vec());
        self.op_on(attempt, move |tx| ops::record_once(tx, &a, &idem, &evidence))
    }

    fn seen_worker(&self, name: &str, capabilities: &[String]) -> Result<(), StoreError> {
        let (name, caps) = (name.to_owned(), capabilities.to_vec());
        self.op(move |tx| ops::seen_worker(tx, &name, &caps))
    }

    fn key_holders(&self, key: &str) -> Result<i64, StoreError> {
        let mut rows = self.rows(B::KEY_HOLDERS, &[Arg::Text(key)])?;
        rows.first_mut().map_or(Ok(0), |r| r.int(0))
    }

    fn put_schedule(
        &self,
        spec: &crate::schedule::ScheduleSpec,
        source: &str,
        next: Option<i64>,
        replace: bool,
    ) -> Result<crate::Put, StoreError> {
        let (spec, source) = (spec.clone(), source.to_owned());
        self.op(move |tx| crate::schedules::put(tx, &spec, &source, next, replace))
    }

    fn advance_schedule(&self, advance: &crate::Advance) -> Result<bool, StoreError> {
        let a = advance.clone();
        match self.op(move |tx| crate::schedules::advance(tx, &a)) {
            // Another writer created the run between the check and the insert: it moved first.
            Err(StoreError::Duplicate(_) | StoreError::RunExists(_)) => Ok(false),
            other => other,
        }
    }

    fn pause_schedule(&self, id: &str, paused: bool, by: &str, next: Option<i64>) -> Result<Option<bool>, StoreError> {
        let (id, by) = (id.to_owned(), by.to_owned());
        self.op(move |tx| crate::schedules::pause(tx, &id, paused, &by, next))
    }

    fn delete_schedule(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.op(move |tx| crate::schedules::delete(tx, &id))
    }

    fn schedules(&self, id: Option<&str>) -> Result<Vec<crate::ScheduleRow>, StoreError> {
        self.rows(crate::schedules::SCHEDULES, &[Arg::OptText(id)])?.into_iter().map(crate::schedules::row).collect()
    }

    fn workers(&self) -> Result<Vec<crate::WorkerRow>, StoreError> {
        let rows = self.rows("SELECT name, capabilities, seen_at_ms FROM workers ORDER BY name", &[])?;
        let mut workers = rows
            .into_iter()
            .map(|mut r| {
                Ok(crate::WorkerRow {
                    name: r.text(0)?,
                    capabilities: serde_json::from_str(&r.text(1)?)?,
                    seen_at_ms: r.int(2)?,
                    running: Vec::new(),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let held = self.rows(
            "SELECT lease_owner, run_id, id, attempt FROM tasks
             WHERE state IN ('running', 'awaiting_input') AND lease_owner IS NOT NULL ORDER BY run_id, ord",
            &[],
        )?;
        for mut r in held {
            let owner = r.text(0)?;
            if let Some(w) = workers.iter_mut().find(|w| w.name == owner) {
                w.running.push((r.text(1)?, r.text(2)?, r.int(3)?));
            }
        }
        Ok(workers)
    }

    fn cancel(&self, run: &str, task: &str, reason: &str) -> Result<Option<TaskRow>, StoreError> {
        let (run, task, reason) = (run.to_owned(), task.to_owned(), reason.to_owned());
        self.op(move |tx| ops::cancel(tx, &run, &task, &reason))
    }

    fn decide_rerun(&self, run: &str, task: &str, again: bool, by: &str) -> Result<TaskRow, StoreError> {
        let (run, task, by) = (run.to_owned(), task.to_owned(), by.to_owned());
        self.op(move |tx| ops::decide_rerun(tx, &run, &task, again, &by))
    }

    fn set_budget(
        &self,
        run: &str,
        task: Option<&str>,
        budget: Option<crate::plan::Budget>,
        run_budget: Option<crate::plan::Budget>,
        by: &str,
    ) -> Result<Vec<TaskRow>, StoreError> {
        let (run, task, by) = (run.to_owned(), task.map(str::to_owned), by.to_owned());
        self.op(move |tx| ops::set_budget(tx, &run, task.as_deref(), budget, run_budget, &by))
    }

    fn add_task(&self, attempt: &Attempt, spec: &TaskSpec) -> Result<crate::Added, StoreError> {
        let (a, t) = (attempt.clone(), spec.clone());
        match self.op(move |tx| crate::follow_up::add_task(tx, &a, &t)) {
            // Two calls adding the one task at once: the loser meets the winner's row.
            Err(StoreError::Duplicate(_)) => match self.task(&attempt.run, &spec.id)? {
                Some(there) if there.spec == *spec => Ok(crate::Added::AlreadyThere),
                _ => Err(StoreError::NotAdded {
                    task: spec.id.clone(),
                    why: format!(
                        "run `{}` has a task `{}` already; give the new task another id",
                        attempt.run, spec.id
                    ),
                }),
            },
            other => other,
        }
    }

    fn retry(&self, run: &str, task: &str, dependents: bool, by: &str) -> Result<Vec<TaskRow>, StoreError> {
        let (run, task, by) = (run.to_owned(), task.to_owned(), by.to_owned());
        self.op(move |tx| ops::retry(tx, &run, &task, dependents, &by))
    }

    fn answer(&self, run: &str, task: &str, question: &Question, option: &str, by: &str) -> Result<bool, StoreError> {
        let (run, task, q, option, by) =
            (run.to_owned(), task.to_owned(), question.clone(), option.to_owned(), by.to_owned());
        self.op(move |tx| ops::answer(tx, &run, &task, &q, &option, &by))
    }

    fn answer_of(&self, a: &Attempt, n: i64) -> Result<Option<String>, StoreError> {
        let rows = self.rows(
            "SELECT answer FROM questions WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3 AND n = ?4",
            &[Arg::Text(&a.run), Arg::Text(&a.task), Arg::Int(a.n), Arg::Int(n)],
        )?;
        rows.into_iter().next().map_or(Ok(None), |mut r| r.opt_text(0))
    }

    fn open_question(&self, run: &str, task: &str) -> Result<Option<Question>, StoreError> {
        let rows = self.rows(
            "SELECT attempt, n, request FROM questions WHERE run_id = ?1 AND task_id = ?2 AND answer IS NULL
             ORDER BY attempt DESC, n DESC LIMIT 1",
            &[Arg::Text(run), Arg::Text(task)],
        )?;
        let Some(mut r) = rows.into_iter().next() else { return Ok(None) };
        let corrupt = |what: String| StoreError::Corrupt { run: run.to_owned(), task: task.to_owned(), what };
        let stored =
            serde_json::from_str(&r.text(2)?).map_err(|e| corrupt(format!("its question is not JSON ({e})")))?;
        let request = QuestionRequest::from_stored(stored).map_err(corrupt)?;
        Ok(Some(Question { attempt: r.int(0)?, n: r.int(1)?, request }))
    }

    fn append_events(&self, events: &[(String, Option<String>, String, Value)]) -> Result<i64, StoreError> {
        if events.is_empty() {
            return self.last_seq();
        }
        let events = events.to_vec();
        self.db.write(None, Box::new(move |tx| ops::append_events(tx, &events))).map(|(_, last)| last)
    }

    fn evidence(&self, run: &str, task: &str, attempt: i64) -> Result<Vec<Value>, StoreError> {
        let rows = self.rows(
            "SELECT evidence FROM attempts WHERE run_id = ?1 AND task_id = ?2 AND attempt = ?3",
            &[Arg::Text(run), Arg::Text(task), Arg::Int(attempt)],
        )?;
        match rows.into_iter().next() {
            Some(mut r) => Ok(serde_json::from_str(&r.text(0)?)?),
            None => Ok(Vec::new()),
        }
    }

    fn keep_output(&self, attempt: &Attempt, output: &Value) -> Result<(), StoreError> {
        let (a, output) = (attempt.clone(), output.to_string());
        self.op_on(attempt, move |tx| ops::keep_output(tx, &a, &output))
    }

    fn finish_keeping(&self, attempt: &Attempt, last: &Last, ending: &Ending) -> Result<TaskRow, StoreError> {
        let (a, last, ending) = (attempt.clone(), last.clone(), ending.clone());
        self.op_on(attempt, move |tx| ops::finish_keeping(tx, &a, &last, &ending))?
    }

    fn attempts(&self, run: &str, task: &str) -> Result<Vec<AttemptRow>, StoreError> {
        let rows = self.rows(
            "SELECT attempt, evidence, output FROM attempts WHERE run_id = ?1 AND task_id = ?2 ORDER BY attempt",
            &[Arg::Text(run), Arg::Text(task)],
        )?;
        rows.into_iter().map(|mut r| AttemptRow::decode(r.int(0)?, &r.text(1)?, r.opt_text(2)?.as_deref())).collect()
    }

    fn withdraw(&self, attempt: &Attempt, question: i64) -> Result<(), StoreError> {
        let a = attempt.clone();
        self.op_on(attempt, move |tx| ops::withdraw(tx, &a, question)).map(|_| ())
    }

    fn say(&self, run: &str, task: &str, text: &str, interrupt: bool, by: &str) -> Result<Option<i64>, StoreError> {
        let (run, task, text, by) = (run.to_owned(), task.to_owned(), text.to_owned(), by.to_owned());
        self.op(move |tx| ops::say(tx, &run, &task, &text, interrupt, &by))
    }

    fn take_messages(&self, attempt: &Attempt) -> Result<Vec<(i64, String)>, StoreError> {
        let a = attempt.clone();
        self.op_on(attempt, move |tx| ops::take_messages(tx, &a))
    }

    fn waiting(&self, run: &str, task: &str) -> Result<Waiting, StoreError> {
        // One statement, so the two answers come from one snapshot: read apart, a message said
        // between them showed as waiting but not as interrupting.
        let rows = self.rows(
            "SELECT COUNT(*), COALESCE(MAX(interrupt), 0) FROM messages
             WHERE run_id = ?1 AND task_id = ?2 AND sent_attempt IS NULL",
            &[Arg::Text(run), Arg::Text(task)],
        )?;
        let Some(mut row) = rows.into_iter().next() else { return Ok(Waiting::default()) };
        Ok(Waiting { messages: row.int(0)? > 0, interrupt: row.int(1)? > 0 })
    }

    fn record_agent(&self, spec: &str, init: &Value) -> Result<(), StoreError> {
        let (spec, init) = (spec.to_owned(), init.clone());
        self.op(move |tx| ops::record_agent(tx, &spec, &init))
    }

    fn agent(&self, spec: &str) -> Result<Option<AgentRow>, StoreError> {
        Ok(self.agents_where(Some(spec))?.pop())
    }

    fn agents(&self) -> Result<Vec<AgentRow>, StoreError> {
        self.agents_where(None)
    }

    fn events_after(&self, run: Option<&str>, after: i64, limit: usize) -> Result<Vec<Event>, StoreError> {
        events(self.rows(
            "SELECT seq, run_id, task_id, type, at_ms, data FROM events
             WHERE seq > ?1 AND (CAST(?2 AS TEXT) IS NULL OR run_id = ?2) ORDER BY seq LIMIT ?3",
            &[Arg::Int(after), Arg::OptText(run), Arg::Int(limit as i64)],
        )?)
    }

    fn task_events(&self, run: &str, task: &str, last: usize) -> Result<Vec<Event>, StoreError> {
        let mut out = events(self.rows(
            "SELECT seq, run_id, task_id, type, at_ms, data FROM events
             WHERE run_id = ?1 AND task_id = ?2 ORDER BY seq DESC LIMIT ?3",
            &[Arg::Text(run), Arg::Text(task), Arg::Int(last as i64)],
        )?)?;
        out.reverse();
        Ok(out)
    }

    fn events_of_kind(&self, run: &str, task: Option<&str>, kind: &str) -> Result<Vec<Event>, StoreError> {
        // Model requests and transitions have indexes of their own, which a planner uses only
        // for the literal.
        let sql = if kind == crate::MODEL_REQUEST {
            "SELECT seq, run_id, task_id, type, at_ms, data FROM events
             WHERE type = 'model_request' AND run_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR task_id = ?2) AND type = ?3
             ORDER BY seq"
        } else if kind == crate::TRANSITION {
            "SELECT seq, run_id, task_id, type, at_ms, data FROM events
             WHERE type = 'transition' AND run_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR task_id = ?2) AND type = ?3
             ORDER BY seq"
        } else {
            "SELECT seq, run_id, task_id, type, at_ms, data FROM events
             WHERE run_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR task_id = ?2) AND type = ?3 ORDER BY seq"
        };
        events(self.rows(sql, &[Arg::Text(run), Arg::OptText(task), Arg::Text(kind)])?)
    }

    fn last_seq(&self) -> Result<i64, StoreError> {
        count(self.rows(B::LAST_SEQ, &[])?)
    }

    fn runs_with_task(&self, task: &str) -> Result<Vec<String>, StoreError> {
        strings(self.rows(B::RUNS_WITH_TASK, &[Arg::Text(task)])?)
    }

    fn run_ids(&self) -> Result<Vec<String>, StoreError> {
        strings(self.rows("SELECT id FROM runs ORDER BY created_at_ms, id", &[])?)
    }

    fn run_times(&self) -> Result<Vec<(String, i64, i64)>, StoreError> {
        let rows = self.rows(
            "SELECT r.id, r.created_at_ms, COALESCE((SELECT e.at_ms FROM events e WHERE e.run_id = r.id
                 ORDER BY e.seq DESC LIMIT 1), r.created_at_ms)
             FROM runs r ORDER BY r.created_at_ms, r.id",
            &[],
        )?;
        rows.into_iter().map(|mut r| Ok((r.text(0)?, r.int(1)?, r.int(2)?))).collect()
    }

    fn tasks_moved_at(&self, run: &str) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = self.rows(
            "SELECT task_id, MAX(at_ms) FROM events
             WHERE run_id = ?1 AND task_id IS NOT NULL AND type IN ('task_created', 'transition')
             GROUP BY task_id",
            &[Arg::Text(run)],
        )?;
        rows.into_iter().map(|mut r| Ok((r.text(0)?, r.int(1)?))).collect()
    }

    fn completed_at(&self, run: &str, task: &str) -> Result<Option<i64>, StoreError> {
        // The type named as a literal: both planners take `events_transitions`.
        let rows = self.rows(
            "SELECT COALESCE((SELECT at_ms FROM events WHERE run_id = ?1 AND task_id = ?2 AND type = 'transition'
                 ORDER BY seq DESC LIMIT 1), 0)
             FROM tasks WHERE run_id = ?1 AND id = ?2 AND state = 'completed'",
            &[Arg::Text(run), Arg::Text(task)],
        )?;
        rows.into_iter().next().map(|mut r| r.int(0)).transpose()
    }

    fn task_counts(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = self.rows("SELECT state, COUNT(*) FROM tasks GROUP BY state ORDER BY state", &[])?;
        rows.into_iter().map(|mut r| Ok((r.text(0)?, r.int(1)?))).collect()
    }

    fn run_task_states(&self) -> Result<Vec<(String, String, i64, i64)>, StoreError> {
        let rows = self.rows("SELECT run_id, state, COUNT(*), SUM(attempt) FROM tasks GROUP BY run_id, state", &[])?;
        rows.into_iter().map(|mut r| Ok((r.text(0)?, r.text(1)?, r.int(2)?, r.int(3)?))).collect()
    }

    fn lease_runs(&self, node: &str, until_ms: i64) -> Result<Vec<String>, StoreError> {
        let node = node.to_owned();
        self.op(move |tx| ops::lease_runs(tx, &node, until_ms))
    }

    fn take_runs(&self, node: &str, until_ms: i64, driving: usize) -> Result<Vec<String>, StoreError> {
        let node = node.to_owned();
        self.op(move |tx| ops::take_runs(tx, &node, until_ms, driving))
    }

    fn lease_run(&self, node: &str, run: &str, until_ms: i64) -> Result<bool, StoreError> {
        let (node, run) = (node.to_owned(), run.to_owned());
        self.op(move |tx| ops::lease_run(tx, &node, &run, until_ms))
    }

    fn run_driver(&self, run: &str) -> Result<Option<String>, StoreError> {
        let rows = self.rows(
            "SELECT owner FROM run_leases WHERE run_id = ?1 AND expires_at_ms >= ?2",
            &[Arg::Text(run), Arg::Int(crate::now_ms())],
        )?;
        rows.into_iter().next().map(|mut r| r.text(0)).transpose()
    }

    fn release_runs(&self, node: &str) -> Result<(), StoreError> {
        let node = node.to_owned();
        self.op(move |tx| ops::release_runs(tx, &node))
    }

    fn nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        let rows = self.rows(ops::NODES, &[Arg::Int(crate::now_ms())])?;
        let leases = rows
            .into_iter()
            .map(|mut r| Ok((r.text(0)?, r.int(1)?, r.int(2)?, r.int(3)?, r.opt_text(4)?)))
            .collect::<Result<Vec<ops::NodeLease>, StoreError>>()?;
        Ok(ops::nodes(leases))
    }

    fn subscribe(&self) -> watch::Receiver<i64> {
        self.db.subscribe()
    }

    fn own_commits(&self) -> broadcast::Receiver<Arc<OwnCommit>> {
        self.db.own_commits()
    }
}
