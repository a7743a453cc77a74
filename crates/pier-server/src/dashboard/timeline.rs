//! A run's attempts on one time axis (a Gantt strip): a row per task that has run, a bar per
//! attempt from its start to its end (or to now while it is on), marked by how it ended. SVG
//! geometry, not inline style, so the page's strict CSP holds.

use std::collections::BTreeMap;

use maud::{Markup, html};
use pier_host::{AttemptTime, TaskRow};

use super::pages::seconds;

/// The width of the task names' column and of the bars' axis, in SVG units.
const LABEL: f64 = 160.0;
const AXIS: f64 = 800.0;
const ROW: f64 = 20.0;
const TOP: f64 = 18.0;
/// Rows drawn at most: a strip of thousands of tasks is read by nobody.
const MAX_ROWS: usize = 300;

/// Where the axis starts and how long it spans: the first start to the last end (or `now`).
fn span(rows: &[(&TaskRow, &[AttemptTime])], now_ms: i64) -> (i64, i64) {
    let all = || rows.iter().flat_map(|(_, times)| times.iter());
    let start = all().map(|t| t.started_at_ms).min().unwrap_or(now_ms);
    let end = all().map(|t| t.ended_at_ms.unwrap_or(now_ms)).max().unwrap_or(now_ms);
    (start, (end - start).max(1))
}

/// The x of instant `at_ms` on the axis.
pub fn x_of(at_ms: i64, start: i64, span: i64) -> f64 {
    LABEL + (at_ms - start) as f64 * AXIS / span as f64
}

pub fn gantt(tasks: &[TaskRow], times: &BTreeMap<String, Vec<AttemptTime>>, now_ms: i64) -> Markup {
    let ran: Vec<(&TaskRow, &[AttemptTime])> =
        tasks.iter().filter_map(|t| times.get(&t.id).filter(|v| !v.is_empty()).map(|v| (t, v.as_slice()))).collect();
    if ran.is_empty() {
        return html! {};
    }
    let more = ran.len().saturating_sub(MAX_ROWS);
    let rows = &ran[..ran.len() - more];
    let (start, span) = span(&ran, now_ms);
    let height = TOP + rows.len() as f64 * ROW + 4.0;
    let width = LABEL + AXIS + 10.0;
    html! {
        h2 { "Timeline" }
        section class="timeline scroll" aria-label="timeline" {
            svg class="gantt" role="img" aria-label="each attempt's start and end" viewBox={ "0 0 " (width) " " (height) }
                width=(width) height=(height) xmlns="http://www.w3.org/2000/svg"
                data-start-ms=(start) data-span-ms=(span) {
                text class="axis" x=(LABEL) y="12" { "0 s" }
                text class="axis" x=(LABEL + AXIS) y="12" text-anchor="end" { (seconds(span)) }
                @for (i, (t, attempts)) in rows.iter().enumerate() {
                    @let y = TOP + i as f64 * ROW;
                    text class="label" x="4" y=(format!("{:.1}", y + 14.0)) { (short(&t.id)) }
                    @for a in attempts.iter() {
                        @let end = a.ended_at_ms.unwrap_or(now_ms);
                        @let x = x_of(a.started_at_ms, start, span);
                        @let w = (x_of(end, start, span) - x).max(1.0);
                        @let how = a.ended.map_or("running", |s| s.as_str());
                        rect class={ "bar state-" (how) } x=(format!("{x:.2}")) y=(format!("{:.1}", y + 3.0))
                            width=(format!("{w:.2}")) height=(format!("{:.1}", ROW - 6.0))
                            data-for=(t.id) data-attempt=(a.attempt) data-start-ms=(a.started_at_ms)
                            data-end-ms=[a.ended_at_ms] {
                            title { (t.id) ", attempt " (a.attempt) ": " (seconds(end - a.started_at_ms)) ", " (how) }
                        }
                    }
                }
            }
            @if more > 0 { p class="more" { "and " (more) " more tasks that ran (their times are on their pages)" } }
        }
    }
}

fn short(id: &str) -> String {
    if id.chars().count() <= 20 { id.to_owned() } else { format!("{}…", id.chars().take(19).collect::<String>()) }
}
