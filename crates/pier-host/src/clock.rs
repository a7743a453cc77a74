//! The schedules' clock: every `pier serve` node runs one. It reads the schedules (at least
//! once a second, at once when this node changed one), and for each that is due does what
//! [`Schedule::tick`] says, through the store's fenced [`pier_store::TaskStore::advance_schedule`]:
//! every node may try an occurrence, one commit creates its run. A node that was down finds
//! its occurrences late, and the misfire policy decides what runs.

use std::collections::HashMap;
use std::time::Duration;

use pier_store::schedule::{Overlap, Schedule, ScheduleSpec, Tick, rfc3339, run_id};
use pier_store::{Advance, Fire, ScheduleRow, now_ms};
use tokio_util::sync::CancellationToken;

use crate::tasks::Tasks;

/// How often the schedules are read when nothing is due sooner: another node's new schedule
/// or pause is seen within it, and a queued occurrence notices its previous run's end.
const POLL: Duration = Duration::from_secs(1);

/// What wakes the clock.
enum ClockEvent {
    /// An occurrence is due, or it is time to read again.
    Due,
    /// This node declared, paused or resumed a schedule.
    Changed,
    Stop,
}

/// Each schedule compiled once per spec.
#[derive(Default)]
struct Compiled(HashMap<String, (ScheduleSpec, Option<Schedule>)>);

impl Compiled {
    fn get(&mut self, spec: &ScheduleSpec) -> Option<&Schedule> {
        let fresh = self.0.get(&spec.id).is_none_or(|(s, _)| s != spec);
        if fresh {
            let compiled = spec.clone().compile().map_err(|problems| {
                tracing::error!(schedule = %spec.id, ?problems, "a stored schedule does not compile; it does not run");
            });
            self.0.insert(spec.id.clone(), (spec.clone(), compiled.ok()));
        }
        self.0.get(&spec.id).and_then(|(_, s)| s.as_ref())
    }
}

/// Runs the schedules until `stop`.
pub(crate) async fn run(tasks: Tasks, stop: CancellationToken) {
    let mut compiled = Compiled::default();
    loop {
        let wake = match tasks.blocking(|s| Ok(s.schedules(None)?)).await {
            Ok(rows) => {
                let mut wake = now_ms() + POLL.as_millis() as i64;
                for row in rows {
                    if let Some(at) = visit(&tasks, &mut compiled, row).await {
                        wake = wake.min(at);
                    }
                }
                wake
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read the schedules; trying again in a second");
                now_ms() + POLL.as_millis() as i64
            }
        };
        let sleep = Duration::from_millis((wake - now_ms()).max(0) as u64);
        let event = tokio::select! {
            _ = tokio::time::sleep(sleep) => ClockEvent::Due,
            _ = tasks.schedules_changed.notified() => ClockEvent::Changed,
            _ = stop.cancelled() => ClockEvent::Stop,
        };
        match event {
            ClockEvent::Due | ClockEvent::Changed => {}
            ClockEvent::Stop => return,
        }
    }
}

/// Does what schedule `row` needs now; when to look at it again, if sooner than a poll.
async fn visit(tasks: &Tasks, compiled: &mut Compiled, row: ScheduleRow) -> Option<i64> {
    if row.paused_by.is_some() {
        return None;
    }
    let schedule = compiled.get(&row.spec)?.clone();
    let now = now_ms();
    let from = row.next_at_ms?;
    // Only a run is fenced on the last one's end: a skip applies whatever the last run does.
    let advance = |next, fire: Option<Fire>, note| Advance {
        id: row.spec.id.clone(),
        from,
        spec: serde_json::to_string(&row.spec).unwrap_or_default(),
        next,
        exclusive: fire.is_some() && schedule.spec.overlap != Overlap::Allow,
        fire,
        note,
    };
    let advance = match schedule.tick(row.next_at_ms, now, row.last_open, row.last_event_ms) {
        Tick::Wait(at) => return at,
        Tick::Hold => return None,
        Tick::Skip { next, note } => {
            tracing::info!(schedule = %row.spec.id, "{note}");
            advance(next, None, note)
        }
        Tick::Fire { at, next, missed } => {
            let run = run_id(&row.spec.id, at);
            match tasks.schedule_plan(&schedule) {
                Ok(plan) => {
                    let mut note = format!("ran {run}");
                    if missed > 0 {
                        note.push_str(&format!(
                            " ({missed} earlier occurrence(s) missed, no host up in time: dropped, as misfire = run_once)"
                        ));
                    }
                    let source = format!("schedule {} at {}", row.spec.id, rfc3339(at));
                    advance(next, Some(Fire { at, run, plan, source }), note)
                }
                Err(e) => {
                    let note = format!("{} not run: its plan no longer parses: {e}", rfc3339(at));
                    tracing::error!(schedule = %row.spec.id, "{note}");
                    advance(next, None, note)
                }
            }
        }
    };
    let next = advance.next;
    match tasks.blocking(move |s| Ok(s.advance_schedule(&advance)?)).await {
        Ok(true) => next,
        // Another node moved it first, or it was paused, or the last run had not ended after
        // all: the next read (within a poll) sees how it stands.
        Ok(false) => None,
        Err(e) => {
            tracing::warn!(schedule = %row.spec.id, error = %e, "could not move the schedule on; trying again");
            None
        }
    }
}
