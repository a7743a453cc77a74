//! The schedules table's operations (see [`crate::schedule`] for what a schedule says and
//! when it comes due). A host moves a schedule on ([`advance`]) fenced on the next occurrence
//! it read, the schedule running, and, when the schedule must not overlap, its last run
//! ended: of every node ticking at one occurrence, one commit applies, and that commit also
//! creates the occurrence's run.

use crate::backend::Row;
use crate::ops::{Arg, Tx};
use crate::plan::Plan;
use crate::schedule::ScheduleSpec;
use crate::{StoreError, now_ms};

/// A schedule as stored, with its last run's state.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScheduleRow {
    pub spec: ScheduleSpec,
    /// Where it was declared: `pier.toml`, or `api by NAME`.
    pub source: String,
    /// Who paused it, if it is paused.
    pub paused_by: Option<String>,
    /// The next occurrence not yet handled; `None`: none comes.
    pub next_at_ms: Option<i64>,
    /// The last occurrence handled (run or dropped).
    pub last_at_ms: Option<i64>,
    pub last_run: Option<String>,
    /// What was done last, in words (a run, a skip and why, a pause).
    pub last_note: Option<String>,
    /// The last run has a task that has not ended.
    pub last_open: bool,
    /// When the last run's last event was written (its end, once it is not open).
    pub last_event_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// What [`put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    Created,
    /// The same spec was there already: nothing changed.
    Unchanged,
    /// Another spec was there and was replaced (pier.toml changed); its pause and last
    /// occurrence stay, its next occurrence is the new one's.
    Replaced,
}

/// A schedule moved on from occurrence `from` to `next`, with `note` saying what was done,
/// and the run of occurrence `fire` created in the same commit.
#[derive(Debug, Clone)]
pub struct Advance {
    pub id: String,
    pub from: i64,
    /// The schedule's spec as read (its stored JSON): a schedule replaced since (perhaps with
    /// the same next occurrence) is not moved by what was decided on the old one.
    pub spec: String,
    pub next: Option<i64>,
    pub fire: Option<Fire>,
    pub note: String,
    /// Applies only if the last run has ended (`overlap` is not `allow`).
    pub exclusive: bool,
}

/// An occurrence's run.
#[derive(Debug, Clone)]
pub struct Fire {
    pub at: i64,
    pub run: String,
    pub plan: Plan,
    pub source: String,
}

pub(crate) const SCHEDULES: &str = "SELECT s.id, s.spec, s.source, s.paused_by, s.next_at_ms, s.last_at_ms, s.last_run,
    s.last_note, s.created_at_ms, s.updated_at_ms,
    (SELECT COUNT(*) FROM tasks t WHERE t.run_id = s.last_run AND t.state IN ('pending', 'running', 'awaiting_input')),
    (SELECT e.at_ms FROM events e WHERE e.run_id = s.last_run ORDER BY e.seq DESC LIMIT 1)
    FROM schedules s WHERE CAST(?1 AS TEXT) IS NULL OR s.id = ?1 ORDER BY s.id";

pub(crate) fn row(mut r: Row) -> Result<ScheduleRow, StoreError> {
    let id = r.text(0)?;
    let spec = serde_json::from_str(&r.text(1)?)
        .map_err(|e| StoreError::Db(format!("schedule `{id}` does not read as a schedule: {e}")))?;
    Ok(ScheduleRow {
        spec,
        source: r.text(2)?,
        paused_by: r.opt_text(3)?,
        next_at_ms: r.opt_int(4)?,
        last_at_ms: r.opt_int(5)?,
        last_run: r.opt_text(6)?,
        last_note: r.opt_text(7)?,
        created_at_ms: r.int(8)?,
        updated_at_ms: r.int(9)?,
        last_open: r.int(10)? > 0,
        last_event_ms: r.opt_int(11)?,
    })
}

/// Stores schedule `spec` from `source`, starting at `next`; an existing one of another spec
/// is replaced with `replace` (pier.toml, read at a node's start), else refused.
pub(crate) fn put(
    tx: &mut dyn Tx,
    spec: &ScheduleSpec,
    source: &str,
    next: Option<i64>,
    replace: bool,
) -> Result<(Put, i64), StoreError> {
    let text = serde_json::to_string(spec)?;
    let now = now_ms();
    // Inserted unless there: two nodes starting with one new pier.toml schedule both get here.
    let inserted = tx.exec(
        "INSERT INTO schedules (id, spec, source, next_at_ms, created_at_ms, updated_at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?5) ON CONFLICT (id) DO NOTHING",
        &[Arg::Text(&spec.id), Arg::Text(&text), Arg::Text(source), Arg::OptInt(next), Arg::Int(now)],
    )?;
    if inserted > 0 {
        return Ok((Put::Created, 0));
    }
    let was = tx.texts("SELECT spec FROM schedules WHERE id = ?1", &[Arg::Text(&spec.id)])?;
    let was = was.and_then(|cols| cols.into_iter().next().flatten());
    let put = match was {
        // Deleted between the two statements (by another node): the caller may declare it again.
        None => {
            return Err(StoreError::Db(format!(
                "schedule `{}` was deleted as it was declared; declare it again",
                spec.id
            )));
        }
        Some(was) if serde_json::from_str::<ScheduleSpec>(&was).is_ok_and(|w| &w == spec) => Put::Unchanged,
        Some(_) if replace => {
            tx.exec(
                "UPDATE schedules SET spec = ?2, source = ?3, next_at_ms = ?4, updated_at_ms = ?5 WHERE id = ?1",
                &[Arg::Text(&spec.id), Arg::Text(&text), Arg::Text(source), Arg::OptInt(next), Arg::Int(now)],
            )?;
            Put::Replaced
        }
        Some(_) => return Err(StoreError::ScheduleExists(spec.id.clone())),
    };
    Ok((put, 0))
}

/// Moves the schedule on as `a` says, if it still waits on occurrence `a.from`, runs, and (when
/// exclusive) its last run has ended; creates the occurrence's run in the same commit (unless
/// its id is taken, which is noted instead). Whether it applied.
pub(crate) fn advance(tx: &mut dyn Tx, a: &Advance) -> Result<(bool, i64), StoreError> {
    let taken = match &a.fire {
        Some(f) => tx.int("SELECT COUNT(*) FROM runs WHERE id = ?1", &[Arg::Text(&f.run)])?.unwrap_or(0) > 0,
        None => false,
    };
    let fire = a.fire.as_ref().filter(|_| !taken);
    let note = match (&a.fire, taken) {
        (Some(f), true) => format!("run id `{}` was taken by another run: occurrence not run", f.run),
        _ => a.note.clone(),
    };
    let moved = tx.exec(
        "UPDATE schedules SET next_at_ms = ?2, last_at_ms = COALESCE(?3, last_at_ms), last_run = COALESCE(?4, last_run),
             last_note = ?5, updated_at_ms = ?6
         WHERE id = ?1 AND next_at_ms = ?7 AND spec = ?9 AND paused_by IS NULL
             AND (CAST(?8 AS BIGINT) = 0 OR last_run IS NULL OR NOT EXISTS
             (SELECT 1 FROM tasks t WHERE t.run_id = schedules.last_run
              AND t.state IN ('pending', 'running', 'awaiting_input')))",
        &[
            Arg::Text(&a.id),
            Arg::OptInt(a.next),
            Arg::OptInt(a.fire.as_ref().map(|f| f.at)),
            Arg::OptText(fire.map(|f| f.run.as_str())),
            Arg::Text(&note),
            Arg::Int(now_ms()),
            Arg::Int(a.from),
            Arg::Int(i64::from(a.exclusive)),
            Arg::Text(&a.spec),
        ],
    )?;
    if moved == 0 {
        return Ok((false, 0));
    }
    let seq = match fire {
        Some(f) => crate::ops::create_run(tx, &f.run, &f.plan, &f.source, None)?.0,
        None => 0,
    };
    Ok((true, seq))
}

/// Pauses (`paused`) or resumes schedule `id`, by `by`; a resumed one starts again at `next`
/// (what came due while it was paused is not run). `None` if there is no such schedule,
/// else whether it changed.
pub(crate) fn pause(
    tx: &mut dyn Tx,
    id: &str,
    paused: bool,
    by: &str,
    next: Option<i64>,
) -> Result<(Option<bool>, i64), StoreError> {
    let now = now_ms();
    let changed = if paused {
        let note = format!("paused by {by}");
        tx.exec(
            "UPDATE schedules SET paused_by = ?2, last_note = ?3, updated_at_ms = ?4 WHERE id = ?1 AND paused_by IS NULL",
            &[Arg::Text(id), Arg::Text(by), Arg::Text(&note), Arg::Int(now)],
        )?
    } else {
        let note = format!("resumed by {by}");
        tx.exec(
            "UPDATE schedules SET paused_by = NULL, next_at_ms = ?2, last_note = ?3, updated_at_ms = ?4
             WHERE id = ?1 AND paused_by IS NOT NULL",
            &[Arg::Text(id), Arg::OptInt(next), Arg::Text(&note), Arg::Int(now)],
        )?
    };
    if changed > 0 {
        return Ok((Some(true), 0));
    }
    let exists = tx.int("SELECT COUNT(*) FROM schedules WHERE id = ?1", &[Arg::Text(id)])?.unwrap_or(0) > 0;
    Ok((exists.then_some(false), 0))
}

/// Deletes schedule `id` (its runs stay); whether there was one.
pub(crate) fn delete(tx: &mut dyn Tx, id: &str) -> Result<(bool, i64), StoreError> {
    Ok((tx.exec("DELETE FROM schedules WHERE id = ?1", &[Arg::Text(id)])? > 0, 0))
}
