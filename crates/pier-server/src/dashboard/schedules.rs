//! The schedules page (`/ui/schedules`): every schedule with when it runs, what, its next and
//! last occurrences and what was done last; pause and resume, each a CSRF-checked form.

use axum::extract::{Form, Path, Query, State};
use axum::response::Response;
use maud::{Markup, html};
use pier_host::ScheduleView;
use serde::Deserialize;

use super::auth::{self, Session};
use super::pages::{layout, seg, time};
use super::{CancelForm, Notice, back, page};
use crate::Shared;

pub(super) async fn list(State(app): State<Shared>, s: auth::Session, Query(n): Query<Notice>) -> Response {
    page(async { Ok(view(&s, &app.tasks.schedules().await?, n.notice.as_deref())) }.await)
}

#[derive(Deserialize)]
pub(super) struct Action {
    id: String,
    action: String,
}

pub(super) async fn act(
    State(app): State<Shared>,
    s: auth::Session,
    Path(a): Path<Action>,
    Form(f): Form<CancelForm>,
) -> Response {
    if let Err(refused) = s.check(&f.csrf) {
        return refused;
    }
    let by = s.by();
    let notice = match a.action.as_str() {
        "pause" | "resume" => match app.tasks.pause_schedule(&a.id, a.action == "pause", &by).await {
            Ok(v) if v.row.paused_by.is_some() => format!("schedule {} paused", a.id),
            Ok(_) => format!("schedule {} runs", a.id),
            Err(e) => format!("refused: {e}"),
        },
        other => format!("refused: no action {other:?} on a schedule"),
    };
    back("/ui/schedules", &notice)
}

fn when(v: &ScheduleView) -> String {
    match (&v.row.spec.cron, &v.row.spec.every) {
        (Some(c), _) => format!("cron {c} ({})", v.row.spec.timezone.as_deref().unwrap_or("UTC")),
        (_, Some(e)) => format!("every {e}"),
        _ => "?".into(),
    }
}

fn what(v: &ScheduleView) -> String {
    match (&v.row.spec.task_type, &v.row.spec.plan_file) {
        (Some(t), _) => format!("a task of type {t}"),
        (_, Some(f)) => format!("plan {f}"),
        _ => "a plan".into(),
    }
}

fn view(s: &Session, schedules: &[ScheduleView], notice: Option<&str>) -> Markup {
    let body = html! {
        h1 { "Schedules" }
        @if schedules.is_empty() {
            p { "No schedules. Declare one in pier.toml's " code { "[[schedules]]" } " or with " code { "pier schedules add FILE" } "." }
        } @else {
            table class="schedules cards" {
                thead { tr { th { "schedule" } th { "when" } th { "runs" } th { "next" } th { "last run" } th { "state" } } }
                tbody {
                    @for v in schedules {
                        tr data-schedule=(v.id) {
                            td data-label="schedule" { (v.id) }
                            td data-label="when" { (when(v)) }
                            td data-label="runs" { (what(v)) }
                            td data-label="next" { @if let Some(at) = v.row.next_at_ms { (time(at)) } @else { "never" } }
                            td data-label="last run" {
                                @if let Some(run) = &v.row.last_run {
                                    a href={ "/ui/runs/" (seg(run)) } { (run) }
                                    @if v.row.last_open { " (running)" }
                                } @else { "—" }
                                @if let Some(note) = &v.row.last_note { br; small { (note) } }
                            }
                            td data-label="state" {
                                @let (label, action) = match &v.row.paused_by { Some(_) => ("Resume", "resume"), None => ("Pause", "pause") };
                                @if let Some(by) = &v.row.paused_by { "paused by " (by) " " } @else { "on " }
                                @if s.may(crate::access::Role::Admin) {
                                    form method="post" action={ "/ui/schedules/" (seg(&v.id)) "/" (action) } class="inline" {
                                        input type="hidden" name="csrf" value=(s.csrf);
                                        button type="submit" { (label) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    layout("Schedules", Some(s), None, notice, body)
}
