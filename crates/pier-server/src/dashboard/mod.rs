//! The dashboard: server-rendered pages under `/ui` (the API owns `/runs`), read through
//! the host's API ([`pier_host::Tasks`]) — the API's own reads — and kept live by one small ES module that
//! listens to the same `/events` stream and re-renders the page's live region.
//!
//! Invariants: every value the plan, the agent or the model wrote reaches the page through
//! maud's escaping (no `PreEscaped` of data); every state-changing form carries the
//! session's CSRF token; every response carries a strict CSP (no inline script or style);
//! a session is a random id in an `HttpOnly`, `SameSite=Strict` cookie, held in memory
//! with an expiry (a restart revokes every session).

mod actions;
mod auth;
mod graph;
mod pages;
mod schedules;
mod timeline;
mod transcript;

use axum::Router;
use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;

pub use auth::Sessions;

use pier_host::{Answered, Input};

use crate::{ApiError, Shared};

/// The dashboard's routes, merged into the server's router.
pub fn router(app: Shared) -> Router {
    let open = Router::new()
        .route("/", get(|| async { Redirect::to("/ui/") }))
        .route("/ui/login", get(pages::login_page).post(auth::login))
        .route("/ui/assets/{name}", get(asset));
    let guarded = Router::new()
        .route("/ui/", get(runs_page))
        .route("/ui/approvals", get(approvals_page))
        .route("/ui/nodes", get(nodes_page))
        .route("/ui/schedules", get(schedules::list))
        .route("/ui/schedules/{id}/{action}", post(schedules::act))
        .route("/ui/runs/{run}", get(run_page))
        .route("/ui/runs/{run}/cancel", get(actions::confirm_run).post(cancel_run))
        .route("/ui/runs/{run}/tasks/{task}", get(task_page))
        .route("/ui/runs/{run}/tasks/{task}/answer", post(answer))
        .route("/ui/runs/{run}/tasks/{task}/input", post(input))
        .route("/ui/runs/{run}/tasks/{task}/{action}", get(actions::confirm_task).post(actions::act_on_task))
        .route("/ui/events", get(ui_events))
        .route("/ui/logout", post(auth::logout))
        .layer(axum::middleware::from_fn_with_state(app.clone(), auth::require));
    open.merge(guarded).layer(axum::middleware::from_fn(headers)).with_state(app)
}

/// The headers every dashboard response carries.
async fn headers(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; worker-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    resp
}

/// The embedded assets, named by content hash so they can be cached for good.
pub struct Assets {
    pub js: (String, &'static str),
    /// The SharedWorker that holds the one event stream of all tabs.
    pub worker: (String, &'static str),
    pub css: (String, &'static str),
}

const JS: &str = include_str!("assets/app.js");
const CSS: &str = include_str!("assets/app.css");
const WORKER: &str = include_str!("assets/live.js");

pub fn assets() -> &'static Assets {
    static ASSETS: std::sync::OnceLock<Assets> = std::sync::OnceLock::new();
    ASSETS.get_or_init(|| {
        let name = |stem: &str, ext: &str, text: &str| {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            text.hash(&mut h);
            format!("{stem}.{:016x}.{ext}", h.finish())
        };
        Assets {
            js: (name("app", "js", JS), JS),
            worker: (name("live", "js", WORKER), WORKER),
            css: (name("app", "css", CSS), CSS),
        }
    })
}

async fn asset(Path(name): Path<String>) -> Response {
    let a = assets();
    let (body, ctype) = if name == a.js.0 {
        (a.js.1, "text/javascript; charset=utf-8")
    } else if name == a.worker.0 {
        (a.worker.1, "text/javascript; charset=utf-8")
    } else if name == a.css.0 {
        (a.css.1, "text/css; charset=utf-8")
    } else {
        return StatusCode::NOT_FOUND.into_response();
    };
    ([(header::CONTENT_TYPE, ctype), (header::CACHE_CONTROL, "public, max-age=31536000, immutable")], body)
        .into_response()
}

/// A refusal as a page a person reads (the API's refusals are JSON; these are not).
pub fn refusal(status: StatusCode, message: &str) -> Response {
    (status, axum::response::Html(pages::error_page(message).into_string())).into_response()
}

/// `/events` for the pages: the same stream, ended when the session ends.
async fn ui_events(
    State(app): State<Shared>,
    s: auth::Session,
    headers: axum::http::HeaderMap,
    Query(q): Query<crate::sse::EventsQuery>,
) -> Response {
    match crate::sse::event_stream(app, headers, q, s.ending()) {
        Ok(sse) => sse.into_response(),
        Err(e) => e.into_response(),
    }
}

/// A page, or the error page in the same layout.
fn page(result: Result<maud::Markup, pier_host::ActionError>) -> Response {
    let result = result.map_err(ApiError::from);
    match result {
        Ok(markup) => axum::response::Html(markup.into_string()).into_response(),
        Err(e) => {
            let status = e.status;
            (status, axum::response::Html(pages::error_page(&e.message).into_string())).into_response()
        }
    }
}

/// The runs page's query: a state, a search in run ids, and the page (from 1).
#[derive(Deserialize, Default, Clone)]
pub(crate) struct RunsQuery {
    pub state: Option<String>,
    pub q: Option<String>,
    pub page: Option<usize>,
}

/// Runs shown on one page of `/ui/`.
pub(crate) const RUNS_PER_PAGE: usize = 100;

async fn runs_page(State(app): State<Shared>, s: auth::Session, Query(q): Query<RunsQuery>) -> Response {
    // The sequence before the reads: an event in between is shown twice, never missed.
    page(
        async {
            let seq = app.tasks.position().await?;
            let state = q.state.clone().filter(|st| !st.is_empty());
            let filter = pier_host::tasks::RunFilter {
                state,
                limit: Some(RUNS_PER_PAGE),
                search: q.q.clone(),
                offset: q.page.unwrap_or(1).saturating_sub(1).saturating_mul(RUNS_PER_PAGE),
            };
            let list = app.tasks.list_runs(&filter).await?;
            Ok(pages::runs(&s, &list, &q, seq))
        }
        .await,
    )
}

#[derive(Deserialize, Default)]
struct Notice {
    notice: Option<String>,
}

/// A run page's query: a notice to show, the tasks' state to list, the page of them (from 1).
#[derive(Deserialize, Default)]
pub(crate) struct RunPageQuery {
    pub notice: Option<String>,
    pub state: Option<String>,
    pub page: Option<usize>,
}

async fn run_page(
    State(app): State<Shared>,
    s: auth::Session,
    Path(run): Path<String>,
    Query(q): Query<RunPageQuery>,
) -> Response {
    page(
        async {
            let seq = app.tasks.position().await?;
            Ok(pages::run(&s, &run, &app.tasks.run(&run).await?, seq, q.notice.as_deref(), &q))
        }
        .await,
    )
}

async fn task_page(
    State(app): State<Shared>,
    s: auth::Session,
    Path((run, task)): Path<(String, String)>,
    Query(n): Query<Notice>,
) -> Response {
    page(
        async {
            let seq = app.tasks.position().await?;
            let view = app.tasks.task(&run, &task).await?;
            let events = app.tasks.transcript(&run, &task).await?;
            Ok(pages::task(&s, &run, &view, &events, seq, n.notice.as_deref()))
        }
        .await,
    )
}

async fn approvals_page(State(app): State<Shared>, s: auth::Session, Query(n): Query<Notice>) -> Response {
    page(
        async {
            let seq = app.tasks.position().await?;
            Ok(pages::approvals(&s, &app.tasks.waiting().await?, seq, n.notice.as_deref()))
        }
        .await,
    )
}

async fn nodes_page(State(app): State<Shared>, s: auth::Session) -> Response {
    page(async { Ok(pages::nodes(&s, &app.tasks.nodes().await?, &app.tasks.workers().await?)) }.await)
}

#[derive(Deserialize)]
struct CancelForm {
    csrf: String,
}

async fn cancel_run(
    State(app): State<Shared>,
    s: auth::Session,
    Path(run): Path<String>,
    Form(f): Form<CancelForm>,
) -> Response {
    if let Err(refused) = s.check(&f.csrf) {
        return refused;
    }
    let why = format!("run cancelled from the dashboard by {}", s.name());
    let notice = match app.tasks.cancel_run(&run, &why, pier_host::CANCEL_WAIT).await {
        Ok(c) if c.stopping > 0 => {
            format!("{} unfinished task(s) cancelled; {} still stopping", c.cancelled, c.stopping)
        }
        Ok(c) => format!("{} unfinished task(s) cancelled", c.cancelled),
        Err(e) => format!("refused: {e}"),
    };
    back(&format!("/ui/runs/{}", pages::seg(&run)), &notice)
}

#[derive(Deserialize)]
struct AnswerForm {
    csrf: String,
    /// The question answered (0: the re-run decision), as the page showed it.
    n: i64,
    /// `allow` or `reject`.
    decision: String,
    option: Option<String>,
    /// Where to go back to.
    from: Option<String>,
}

async fn answer(
    State(app): State<Shared>,
    s: auth::Session,
    Path((run, task)): Path<(String, String)>,
    Form(f): Form<AnswerForm>,
) -> Response {
    if let Err(refused) = s.check(&f.csrf) {
        return refused;
    }
    let allow = match f.decision.as_str() {
        "allow" => true,
        "reject" => false,
        _ => return refusal(StatusCode::BAD_REQUEST, "The form's decision is neither allow nor reject."),
    };
    let by = s.by();
    let notice = match app.tasks.answer(&run, &task, Some(f.n), allow, f.option.as_deref(), &by).await {
        Ok(Answered::Option(o)) => format!("answered `{o}` for task {task}"),
        Ok(Answered::Rerun(row)) => format!("task {task} is now {}", row.state.as_str()),
        Err(e) => format!("refused: {e}"),
    };
    // Back to the page the form was on (only dashboard paths), else the task's page.
    let to = f
        .from
        .filter(|p| returnable(p))
        .unwrap_or_else(|| format!("/ui/runs/{}/tasks/{}", pages::seg(&run), pages::seg(&task)));
    back(&to, &notice)
}

/// An answer to an agent's question: the form's `f.NAME` fields (empty ones left out), or a
/// decline; checked against the question's fields like `pier answer`.
async fn input(
    State(app): State<Shared>,
    s: auth::Session,
    Path((run, task)): Path<(String, String)>,
    Form(fields): Form<Vec<(String, String)>>,
) -> Response {
    let field = |k: &str| fields.iter().find(|(name, _)| name == k).map(|(_, v)| v.clone());
    if let Err(refused) = s.check(&field("csrf").unwrap_or_default()) {
        return refused;
    }
    let n = field("n").and_then(|n| n.parse::<i64>().ok());
    let given = if field("decline").is_some() {
        Input::Decline
    } else {
        Input::Pairs(
            fields
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix("f.")?.to_owned(), v.clone())))
                .filter(|(_, v)| !v.trim().is_empty())
                .collect(),
        )
    };
    let by = s.by();
    let notice = match app.tasks.answer_input(&run, &task, n, given, &by).await {
        Ok(_) => format!("answered the question of task {task}"),
        Err(e) => format!("refused: {e}"),
    };
    let to = field("from")
        .filter(|p| returnable(p))
        .unwrap_or_else(|| format!("/ui/runs/{}/tasks/{}", pages::seg(&run), pages::seg(&task)));
    back(&to, &notice)
}

/// A dashboard path a form may send the browser back to: ours, and plain (no scheme, no
/// host, no fragment, no line break).
fn returnable(path: &str) -> bool {
    path.starts_with("/ui/")
        && !path.contains("//")
        && path.bytes().all(|b| b.is_ascii_alphanumeric() || b"/%?=&._~-".contains(&b))
}

/// POST-redirect-GET, with a notice for the page to show.
fn back(path: &str, notice: &str) -> Response {
    let sep = if path.contains('?') { '&' } else { '?' };
    Redirect::to(&format!("{path}{sep}notice={}", crate::segment(notice))).into_response()
}
