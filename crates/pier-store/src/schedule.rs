//! Schedules: a plan, or a task of a declared type, that the host submits on a clock
//! (`[[schedules]]` in pier.toml, `POST /schedules`). What one says ([`ScheduleSpec`], stored
//! as written), when it comes due ([`Timing`]: a cron expression in a time zone, or a fixed
//! interval aligned on the Unix epoch), and what a host does at a moment ([`Schedule::tick`]):
//! the whole policy, with no clock or store of its own, so it is tested by itself.
//!
//! Exactly once: each occurrence's run id is derived from the schedule and the occurrence's
//! time ([`run_id`]), and the store moves a schedule's next occurrence fenced on the one the
//! host saw, in the commit that creates the run. Every node ticks; one commit wins.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How an occurrence that no host fired within [`ScheduleSpec::grace`] of its time is handled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Misfire {
    /// The missed occurrences are dropped; the next on-time one runs.
    Skip,
    /// The latest missed occurrence runs once (under its own time's id); the others are dropped.
    #[default]
    RunOnce,
}

/// What an occurrence does while the schedule's previous run has not ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// The occurrence is dropped (noted on the schedule).
    #[default]
    Skip,
    /// The occurrence waits for the previous run to end, then runs; later ones queue behind it.
    Queue,
    /// The occurrence runs beside the previous run.
    Allow,
}

/// A schedule as written (pier.toml's `[[schedules]]`, the body of `POST /schedules`) and
/// as stored. `plan` is the plan's text (pier.toml names a file, read at start: `plan_file`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    /// The cron expression's time zone (IANA name) [default: UTC].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// A fixed interval (`30s`, `5m`, `1h30m`, `1d`), occurrences at multiples of it since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// Where `plan` was read from, when it was a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan_file: Option<String>,
    /// The text of the types file beside the plan (`types.toml`), whose types it may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub types: Option<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub task_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Value>,
    /// The task's priority, for a `type` schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    #[serde(default)]
    pub misfire: Misfire,
    #[serde(default)]
    pub overlap: Overlap,
    /// How late an occurrence may still be fired as on time [default: 60s].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace: Option<String>,
}

/// What an occurrence submits.
#[derive(Debug, Clone, PartialEq)]
pub enum What<'a> {
    Plan(&'a str),
    Type { task_type: &'a str, input: &'a Value, priority: Option<u8> },
}

/// When a schedule's occurrences fall.
#[derive(Debug, Clone)]
pub enum Timing {
    Cron { cron: Box<croner::Cron>, zone: jiff::tz::TimeZone },
    Every { ms: i64 },
}

/// The default [`ScheduleSpec::grace`].
pub const DEFAULT_GRACE_MS: i64 = 60_000;
/// The longest schedule id: it is the start of every run id it makes.
pub const MAX_ID: usize = 64;
/// How much later than a previous run's end a host may see it (the clock reads the schedules
/// at least once a second, and the read takes time): a queued occurrence is not missed for that.
pub const QUEUE_SLACK_MS: i64 = 2_000;
/// Missed occurrences counted one by one at most (a cron schedule down for years is "more than").
const MAX_COUNTED: u64 = 10_000;

/// A schedule checked and compiled: its spec, timing and grace.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub spec: ScheduleSpec,
    pub timing: Timing,
    pub grace_ms: i64,
}

/// What a host does about a schedule now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tick {
    /// Nothing is due before `at` (`None`: never again).
    Wait(Option<i64>),
    /// The previous run has not ended and the schedule queues: look again later.
    Hold,
    /// Run occurrence `at`; the next one is `next`. `missed` earlier occurrences were dropped
    /// (misfire = run_once).
    Fire { at: i64, next: Option<i64>, missed: u64 },
    /// Drop the occurrences before `next`, saying why.
    Skip { next: Option<i64>, note: String },
}

impl ScheduleSpec {
    /// Reads a schedule from JSON (an API body, or pier.toml's table turned into JSON), naming
    /// the field that does not fit.
    pub fn from_value(value: Value) -> Result<ScheduleSpec, Vec<String>> {
        serde_path_to_error::deserialize(value).map_err(|e| {
            let at = e.path().to_string();
            let at = if at == "." { String::new() } else { format!("`{at}`: ") };
            vec![format!("{at}{}", e.into_inner())]
        })
    }

    pub fn what(&self) -> Option<What<'_>> {
        match (&self.plan, &self.task_type) {
            (Some(plan), None) => Some(What::Plan(plan)),
            (None, Some(t)) => Some(What::Type {
                task_type: t,
                input: self.input.as_ref().unwrap_or(&Value::Null),
                priority: self.priority,
            }),
            _ => None,
        }
    }

    /// Checks every field at once and compiles the timing; every problem, each naming its field.
    pub fn compile(self) -> Result<Schedule, Vec<String>> {
        let mut problems = Vec::new();
        if let Err(why) = check_id(&self.id) {
            problems.push(why);
        }
        let timing = match (&self.cron, &self.every) {
            (Some(expr), None) => match cron_timing(expr, self.timezone.as_deref()) {
                Ok(t) => Some(t),
                Err(why) => {
                    problems.push(why);
                    None
                }
            },
            (None, Some(every)) => {
                if self.timezone.is_some() {
                    problems.push("`timezone` goes with `cron`; an `every` interval is the same in every zone".into());
                }
                match parse_duration(every) {
                    Ok(ms) if ms >= 1000 => Some(Timing::Every { ms }),
                    Ok(_) => {
                        problems.push(format!("`every = {every:?}` is under a second; give 1s or more"));
                        None
                    }
                    Err(why) => {
                        problems.push(format!("`every = {every:?}`: {why}"));
                        None
                    }
                }
            }
            (Some(_), Some(_)) => {
                problems.push("give either `cron` or `every`, not both".into());
                None
            }
            (None, None) => {
                problems.push("say when: `cron = \"*/5 * * * *\"` (with `timezone`) or `every = \"30s\"`".into());
                None
            }
        };
        match (&self.plan, &self.task_type) {
            (Some(_), Some(_)) => problems.push("give either `plan` or `type` (with `input`), not both".into()),
            (None, None) => problems.push("say what runs: `plan` (a plan) or `type` with `input`".into()),
            (Some(_), None) if self.input.is_some() || self.priority.is_some() => {
                problems.push("`input` and `priority` go with `type`; a plan says its own".into())
            }
            _ => {}
        }
        if self.priority.is_some_and(|p| p > 9) {
            problems.push(format!("`priority = {}`: give 0 to 9", self.priority.unwrap_or_default()));
        }
        let grace_ms = match self.grace.as_deref().map(parse_duration) {
            None => DEFAULT_GRACE_MS,
            Some(Ok(ms)) if ms >= 1000 => ms,
            Some(Ok(_)) => {
                problems.push("`grace` is under a second; give 1s or more".into());
                0
            }
            Some(Err(why)) => {
                problems.push(format!("`grace`: {why}"));
                0
            }
        };
        match timing {
            Some(timing) if problems.is_empty() => Ok(Schedule { spec: self, timing, grace_ms }),
            _ => Err(problems),
        }
    }
}

/// Why a schedule id is unusable, if it is: it starts every run id the schedule makes.
pub fn check_id(id: &str) -> Result<(), String> {
    let fits = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    // A path segment of dots alone (`.`, `..`) is not one a URL can name.
    if id.is_empty() || id.len() > MAX_ID || !id.chars().all(fits) || id.chars().all(|c| c == '.') {
        Err(format!("the schedule id {id:?}: give 1 to {MAX_ID} letters, digits, `-`, `_` or `.`"))
    } else {
        Ok(())
    }
}

fn cron_timing(expr: &str, zone: Option<&str>) -> Result<Timing, String> {
    let cron = croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Optional)
        .build()
        .parse(expr)
        .map_err(|e| format!("`cron = {expr:?}` is not a cron expression: {e}"))?;
    let zone = match zone {
        None => jiff::tz::TimeZone::UTC,
        Some(name) => jiff::tz::TimeZone::get(name).map_err(|_| {
            format!("`timezone = {name:?}` is not a time zone; give an IANA name like \"Europe/Paris\"")
        })?,
    };
    let timing = Timing::Cron { cron: Box::new(cron), zone };
    // A pattern that never matches (February 30th) is refused now, not found out at run time.
    if timing.after(crate::now_ms()).is_none() {
        return Err(format!("`cron = {expr:?}` never comes due"));
    }
    Ok(timing)
}

/// `30s`, `5m`, `2h`, `1d` or a sum of them (`1h30m`), in milliseconds.
pub fn parse_duration(text: &str) -> Result<i64, String> {
    let bad = || format!("{text:?} is not a duration; write it like 30s, 5m, 2h, 1d or 1h30m");
    let (mut total, mut digits) = (0i64, String::new());
    for c in text.trim().chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1_000,
            'm' => 60_000,
            'h' => 3_600_000,
            'd' => 86_400_000,
            _ => return Err(bad()),
        };
        let n: i64 = digits.parse().map_err(|_| bad())?;
        total = n.checked_mul(unit).and_then(|v| total.checked_add(v)).ok_or_else(bad)?;
        digits.clear();
    }
    if !digits.is_empty() || total == 0 && text.trim().is_empty() {
        return Err(bad());
    }
    if total > 366 * 86_400_000 {
        return Err(format!("{text:?} is over a year"));
    }
    Ok(total)
}

impl Timing {
    /// The first occurrence strictly after `t` (ms since the epoch); `None` if none comes.
    pub fn after(&self, t: i64) -> Option<i64> {
        match self {
            Timing::Every { ms } => t.div_euclid(*ms).checked_add(1)?.checked_mul(*ms),
            Timing::Cron { cron, zone } => {
                let z = zoned(t, zone)?;
                cron.find_next_occurrence(&z, false).ok().map(|z| z.timestamp().as_millisecond())
            }
        }
    }

    /// The last occurrence at or before `t`; `None` if none did.
    pub fn at_or_before(&self, t: i64) -> Option<i64> {
        match self {
            Timing::Every { ms } => t.div_euclid(*ms).checked_mul(*ms),
            Timing::Cron { cron, zone } => {
                let z = zoned(t, zone)?;
                cron.find_previous_occurrence(&z, true).ok().map(|z| z.timestamp().as_millisecond())
            }
        }
    }

    /// How many occurrences fall in `from..=to` (`from` one of them), up to [`MAX_COUNTED`].
    fn count(&self, from: i64, to: i64) -> u64 {
        match self {
            Timing::Every { ms } => ((to - from).max(0) / ms) as u64 + 1,
            Timing::Cron { .. } => {
                let (mut n, mut at) = (1, from);
                while n < MAX_COUNTED {
                    match self.after(at) {
                        Some(next) if next <= to => (n, at) = (n + 1, next),
                        _ => break,
                    }
                }
                n
            }
        }
    }
}

/// `t` in `zone`, at a whole second (cron's finest unit).
fn zoned(t: i64, zone: &jiff::tz::TimeZone) -> Option<jiff::Zoned> {
    let ts = jiff::Timestamp::from_second(t.div_euclid(1000)).ok()?;
    Some(ts.to_zoned(zone.clone()))
}

/// The run id of schedule `id`'s occurrence at `at`: `ID-YYYYMMDDTHHMMSSZ` (UTC).
pub fn run_id(id: &str, at: i64) -> String {
    format!("{id}-{}", stamp(at, "%Y%m%dT%H%M%SZ"))
}

/// `at` (ms since the epoch) as RFC 3339 in UTC, to the second.
pub fn rfc3339(at: i64) -> String {
    stamp(at, "%Y-%m-%dT%H:%M:%SZ")
}

/// `at` as a person reads it: `2026-12-07 10:00:00 UTC`.
pub fn human(at: i64) -> String {
    stamp(at, "%Y-%m-%d %H:%M:%S UTC")
}

/// An RFC 3339 time (`2026-12-07T10:00:00Z`, or with an offset), in ms since the epoch.
pub fn parse_rfc3339(text: &str) -> Result<i64, String> {
    let at: jiff::Timestamp = text.trim().parse().map_err(|e| format!("{text:?} is not an RFC 3339 time ({e})"))?;
    Ok(at.as_millisecond())
}

fn stamp(at: i64, format: &str) -> String {
    jiff::Timestamp::from_millisecond(at).map_or_else(|_| at.to_string(), |t| t.strftime(format).to_string())
}

impl Schedule {
    /// The first occurrence after `t`: where a new (or resumed) schedule starts.
    pub fn first_after(&self, t: i64) -> Option<i64> {
        self.timing.after(t)
    }

    /// What to do at `now` about the occurrence due at `next_at`, given whether the schedule's
    /// last run is still open and when it ended. An occurrence fired more than `grace` after
    /// its time (for `overlap = queue`, after the later of its time and the previous run's
    /// end) is missed, and the misfire policy decides; `overlap` decides for an open run.
    pub fn tick(&self, next_at: Option<i64>, now: i64, last_open: bool, last_ended: Option<i64>) -> Tick {
        let Some(due) = next_at.filter(|&at| at <= now) else { return Tick::Wait(next_at) };
        let queue = self.spec.overlap == Overlap::Queue;
        if queue && last_open {
            return Tick::Hold;
        }
        // Occurrences at or before `cutoff` are missed. A queued one waited on its previous run,
        // whose end a host sees up to a poll later (`QUEUE_SLACK_MS`): not missed for that.
        let cutoff = now - self.grace_ms;
        let missed = due <= cutoff && !(queue && last_ended.is_some_and(|e| e + QUEUE_SLACK_MS > cutoff));
        let (at, missed_before) = if missed {
            let latest = self.timing.at_or_before(cutoff).unwrap_or(due).max(due);
            let n = self.timing.count(due, latest);
            let more = if n >= MAX_COUNTED { "more than " } else { "" };
            let span = format!("{more}{n} occurrence(s) from {} to {}", rfc3339(due), rfc3339(latest));
            match self.spec.misfire {
                Misfire::Skip => {
                    let note = format!("missed {span} (no host fired them in time): skipped, as misfire = skip");
                    return Tick::Skip { next: self.timing.after(latest), note };
                }
                Misfire::RunOnce => (latest, n - 1),
            }
        } else {
            (due, 0)
        };
        let next = self.timing.after(at);
        if last_open && self.spec.overlap == Overlap::Skip {
            let note = format!("skipped {}: the previous run had not ended (overlap = skip)", rfc3339(at));
            return Tick::Skip { next, note };
        }
        Tick::Fire { at, next, missed: missed_before }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compile(v: Value) -> Result<Schedule, Vec<String>> {
        ScheduleSpec::from_value(v)?.compile()
    }

    fn every(s: &str, extra: Value) -> Schedule {
        let mut v = json!({"id": "s", "every": s, "plan": "x"});
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        compile(v).unwrap_or_else(|e| panic!("{e:?}"))
    }

    #[test]
    fn every_is_aligned_on_the_epoch() {
        let s = every("2s", json!({}));
        assert_eq!(s.timing.after(1_000), Some(2_000));
        assert_eq!(s.timing.after(2_000), Some(4_000));
        assert_eq!(s.timing.at_or_before(3_999), Some(2_000));
        assert_eq!(run_id("s", 1_765_000_000_000), "s-20251206T054640Z");
    }

    #[test]
    fn cron_follows_its_time_zone_across_a_dst_change() {
        let s = compile(json!({"id": "n", "cron": "30 2 * * *", "timezone": "America/New_York", "plan": "x"}))
            .unwrap_or_else(|e| panic!("{e:?}"));
        // 2026-03-08 is the spring-forward day in New York: 02:30 does not exist.
        let before = jiff::Timestamp::from_second(1_772_928_000).unwrap_or_else(|e| panic!("{e}")); // 2026-03-08T00:00Z
        let next = s.timing.after(before.as_millisecond()).unwrap_or_default();
        assert_eq!(rfc3339(next), "2026-03-08T07:00:00Z", "02:30 does not exist that night: 03:00 EDT, as cron does");
        assert_eq!(rfc3339(s.timing.after(next).unwrap_or_default()), "2026-03-09T06:30:00Z", "02:30 EDT");
        let utc = compile(json!({"id": "u", "cron": "0 0 * * *", "plan": "x"})).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(rfc3339(utc.timing.after(before.as_millisecond()).unwrap_or_default()), "2026-03-09T00:00:00Z");
    }

    #[test]
    fn every_problem_is_named_at_once() {
        assert!(check_id("..").is_err() && check_id(".").is_err() && check_id("a.b").is_ok());
        let e = compile(json!({"id": "a b", "cron": "61 * * * *", "every": "1s", "timezone": "Mars/Base"}))
            .err()
            .unwrap_or_default();
        let all = e.join("\n");
        for part in ["schedule id", "either `cron` or `every`", "say what runs"] {
            assert!(all.contains(part), "`{part}` in {all}");
        }
        let e = compile(json!({"id": "c", "cron": "61 * * * *", "plan": "x"})).err().unwrap_or_default();
        assert!(e.join("").contains("not a cron expression"), "{e:?}");
        let e = compile(json!({"id": "c", "cron": "0 0 * * *", "timezone": "Mars/Base", "plan": "x"}))
            .err()
            .unwrap_or_default();
        assert!(e.join("").contains("not a time zone"), "{e:?}");
        let e = compile(json!({"id": "c", "every": "500ms", "plan": "x", "grace": "0s"})).err().unwrap_or_default();
        assert_eq!(e.len(), 2, "{e:?}");
        let e = compile(json!({"id": "c", "every": "1s", "plan": "x", "misfire": "later"})).err().unwrap_or_default();
        assert!(e.join("").contains("misfire"), "{e:?}");
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert!(parse_duration("").is_err() && parse_duration("10").is_err() && parse_duration("5x").is_err());
    }

    #[test]
    fn an_on_time_occurrence_fires_and_a_late_one_follows_the_misfire_policy() {
        let s = every("10s", json!({"grace": "5s"}));
        assert_eq!(s.tick(Some(20_000), 19_000, false, None), Tick::Wait(Some(20_000)));
        assert_eq!(s.tick(Some(20_000), 24_000, false, None), Tick::Fire { at: 20_000, next: Some(30_000), missed: 0 });
        // Down from 20 s to 61 s: 20..=50 are missed (more than 5 s late), 60 is on time.
        assert_eq!(s.tick(Some(20_000), 61_000, false, None), Tick::Fire { at: 50_000, next: Some(60_000), missed: 3 });
        let skip = every("10s", json!({"grace": "5s", "misfire": "skip"}));
        let Tick::Skip { next, note } = skip.tick(Some(20_000), 61_000, false, None) else { panic!() };
        assert_eq!(next, Some(60_000));
        assert!(note.contains("4 occurrence(s)"), "{note}");
        assert_eq!(skip.tick(next, 61_000, false, None), Tick::Fire { at: 60_000, next: Some(70_000), missed: 0 });
    }

    #[test]
    fn overlap_skips_queues_or_allows() {
        let skip = every("10s", json!({}));
        assert!(matches!(skip.tick(Some(10_000), 10_001, true, None), Tick::Skip { next: Some(20_000), .. }));
        let allow = every("10s", json!({"overlap": "allow"}));
        assert!(matches!(allow.tick(Some(10_000), 10_001, true, None), Tick::Fire { at: 10_000, .. }));
        let queue = every("10s", json!({"overlap": "queue", "grace": "5s"}));
        assert_eq!(queue.tick(Some(10_000), 30_000, true, None), Tick::Hold);
        // The previous run ended a second ago: the queued occurrence is not missed, however old.
        assert!(matches!(queue.tick(Some(10_000), 30_000, false, Some(29_000)), Tick::Fire { at: 10_000, .. }));
        // It ended long ago (no host was up since): missed as any other.
        assert!(matches!(queue.tick(Some(10_000), 30_000, false, Some(11_000)), Tick::Fire { at: 20_000, .. }));
        // It ended just past the grace, seen a poll late: still the queued occurrence.
        assert!(matches!(queue.tick(Some(10_000), 30_000, false, Some(24_500)), Tick::Fire { at: 10_000, .. }));
    }
}
