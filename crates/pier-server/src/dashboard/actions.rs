//! What a person does to a run or a task from the pages: cancel a run, cancel a task, retry a
//! task (with the cancelled tasks below it). Each is two steps: a link opens a page that says
//! what will happen (a GET, which changes nothing), and its CSRF-checked form does it — so no
//! stray click or tab-and-enter ends work, and all of it works without script.

use axum::extract::{Form, Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};
use pier_host::TaskState;
use serde::Deserialize;

use super::auth::Session;
use super::pages::{layout, seg};
use super::{back, page, refusal};
use crate::Shared;

/// What a task's action form carries.
#[derive(Deserialize)]
pub(super) struct ActionForm {
    csrf: String,
    /// Retry: also the cancelled tasks that depend on it (a checkbox: present when ticked).
    dependents: Option<String>,
}

fn task_path(run: &str, task: &str) -> String {
    format!("/ui/runs/{}/tasks/{}", seg(run), seg(task))
}

/// The links to a task's actions its state allows (none for a viewer). `pending_too`: also
/// Cancel on a task that has not started (a run's table leaves it to the task's page, so a
/// run of thousands of waiting tasks is not a page of thousands of links).
pub(super) fn task_links(s: &Session, run: &str, task: &str, state: TaskState, pending_too: bool) -> Markup {
    let here = task_path(run, task);
    let retryable = matches!(state, TaskState::Failed | TaskState::Cancelled);
    let cancellable = !state.is_terminal() && (pending_too || state != TaskState::Pending);
    html! {
        @if s.may(crate::access::Role::Operator) && (retryable || cancellable) {
            span class="actions" {
                @if cancellable { a class="action danger" href={ (here) "/cancel" } { "Cancel…" } }
                @if retryable { a class="action" href={ (here) "/retry" } { "Retry…" } }
            }
        }
    }
}

/// `GET …/tasks/{task}/{cancel|retry}`: what the action will do, and the form that does it.
pub(super) async fn confirm_task(
    State(app): State<Shared>,
    s: Session,
    Path((run, task, action)): Path<(String, String, String)>,
) -> Response {
    if !matches!(action.as_str(), "cancel" | "retry") {
        return refusal(StatusCode::NOT_FOUND, &format!("No action {action:?} on a task."));
    }
    page(
        async {
            let view = app.tasks.task(&run, &task).await?;
            let back_to = task_path(&run, &task);
            let title = format!("{} task {task}", if action == "retry" { "Retry" } else { "Cancel" });
            let body = html! {
                h1 { (title) "?" }
                p { "Run " a href={ "/ui/runs/" (seg(&run)) } { (run) } ", task " a href=(back_to) { (task) } ", now " strong { (view.row.state.as_str()) } "." }
                form method="post" action={ (back_to) "/" (action) } class="confirm" {
                    input type="hidden" name="csrf" value=(s.csrf);
                    @if action == "retry" {
                        p { "It goes back to pending and runs again as a new attempt; what its attempts did is kept." }
                        label { input type="checkbox" name="dependents" value="1" checked; " Also run again the cancelled tasks that depend on it" }
                        button type="submit" autofocus { "Retry " (task) }
                    } @else {
                        p { "Its agent is stopped through the cancel handshake (what it showed is kept); the tasks that wait on it will not run." }
                        button type="submit" class="danger" autofocus { "Cancel " (task) }
                    }
                    " " a href=(back_to) { "Keep it as it is" }
                }
            };
            Ok(layout(&title, Some(&s), None, None, body))
        }
        .await,
    )
}

/// `POST …/tasks/{task}/{cancel|retry}`.
pub(super) async fn act_on_task(
    State(app): State<Shared>,
    s: Session,
    Path((run, task, action)): Path<(String, String, String)>,
    Form(f): Form<ActionForm>,
) -> Response {
    if let Err(refused) = s.check(&f.csrf) {
        return refused;
    }
    let notice = match action.as_str() {
        "cancel" => {
            let why = format!("cancelled from the dashboard by {}", s.name());
            match app.tasks.cancel_task(&run, &task, &why, pier_host::CANCEL_WAIT).await {
                Ok(row) if row.state.is_terminal() => format!("task {task} is {}", row.state.as_str()),
                Ok(_) => format!("task {task} is stopping: its agent is being cancelled"),
                Err(e) => format!("refused: {e}"),
            }
        }
        "retry" => match app.tasks.retry(&run, &task, f.dependents.is_some(), &s.by()).await {
            Ok(rows) if rows.len() > 1 => format!("task {task} and {} task(s) below it run again", rows.len() - 1),
            Ok(_) => format!("task {task} runs again"),
            Err(e) => format!("refused: {e}"),
        },
        other => return refusal(StatusCode::NOT_FOUND, &format!("No action {other:?} on a task.")),
    };
    back(&task_path(&run, &task), &notice)
}

/// `GET /ui/runs/{run}/cancel`: what cancelling the run does, and the form that does it.
pub(super) async fn confirm_run(State(app): State<Shared>, s: Session, Path(run): Path<String>) -> Response {
    page(
        async {
            let view = app.tasks.run(&run).await?;
            let open = view.tasks.iter().filter(|(t, _)| !t.state.is_terminal()).count();
            let here = format!("/ui/runs/{}", seg(&run));
            let body = html! {
                h1 { "Cancel run " (run) "?" }
                p { (open) " of its " (view.tasks.len()) " tasks have not ended: each is cancelled, a running agent through the cancel handshake (what it showed is kept)." }
                form method="post" action={ (here) "/cancel" } class="confirm" {
                    input type="hidden" name="csrf" value=(s.csrf);
                    button type="submit" class="danger" autofocus { "Cancel run " (run) }
                    " " a href=(here) { "Keep it running" }
                }
            };
            Ok(layout(&format!("Cancel run {run}"), Some(&s), None, None, body))
        }
        .await,
    )
}
