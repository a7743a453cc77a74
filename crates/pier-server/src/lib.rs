//! `pier serve`: the task host as an HTTP service.
//!
//! Every route but the probes needs `Authorization: Bearer TOKEN`. Every error response
//! is JSON, `{"error": {"code", "message"}}`, with a stable [`ErrorCode`] ([`status_of`]
//! pairs it with the status): the host's refusals from their handlers, and axum's own
//! rejections (an unknown route, a wrong method, a body or query it cannot take) through
//! [`Body`] and the `envelope` layer. Task failures are task states, not HTTP errors.
//!
//! | route | does |
//! |---|---|
//! | `GET /health` | liveness |
//! | `GET /metrics` | Prometheus text (also without the token on `--metrics-listen`) |
//! | `POST /runs` `{plan, run_id?}` or `{type, input, priority?, task_id?, run_id?}` | submit a plan (TOML text), or one task of a pier.toml type |
//! | `GET /runs`, `GET /runs/{run}` | runs with counts; one run with its tasks |
//! | `GET /runs/{run}/tasks/{task}` | one task with its attempts, their times and evidence, and with `?turns=true` its turns (each tool call with its times) |
//! | `POST /runs/{run}/cancel` | cancel every unfinished task of a run |
//! | `POST /runs/{run}/tasks/{task}/cancel` | cancel a task |
//! | `POST /runs/{run}/tasks/{task}/retry` `{with_dependents?}` | a failed or cancelled task runs again |
//! | `POST /runs/{run}/tasks/{task}/answer` `{allow, option?}` | answer `awaiting_input` |
//! | `POST /runs/{run}/budget`, `POST /runs/{run}/tasks/{task}/budget` `{tokens?, cost?}` | raise the run's or the task's budget; tasks a budget stopped resume |
//! | `GET /events?after=SEQ&run=ID&follow=BOOL` | SSE; `Last-Event-ID` resumes exactly after that seq; `follow=false` ends when caught up |
//! | `POST /lease` `{worker, capabilities, ttl_ms}` | a pull worker claims a runnable task |
//! | `POST /runs/{run}/tasks/{task}/heartbeat` `{worker, attempt, ttl_ms}` | renew the lease |
//! | `POST /runs/{run}/tasks/{task}/update` `{worker, attempt, status, idempotency_key, result?, error?, class?}` | a worker's report: only the holder of the live lease ends its task; the same key with another body is `idempotency_conflict` |
//! | `/mcp` | the host's MCP endpoint for its attempts' agents (an attempt's token, not a person's): `task_result`, `ask_person`, `submit_task` |
//!
//! The server decides nothing itself: every route is one call of the host's API
//! ([`pier_host::Tasks`]), the same calls the CLI makes, and its one host drives every run.

pub mod access;
mod dashboard;
mod error;
mod mcp;
mod routes;
mod schedules;
mod sse;
mod telemetry;
mod throttle;
mod v1;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pier_host::{ErrorCode, Scope, StoreError, Tasks};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use error::envelope;
pub use error::{ApiError, Body, status_of};
pub use routes::task_json;
use routes::*;
use sse::events;

/// What the service shares between requests.
pub struct App {
    /// The host's API; its host drives every run of the store once [`App::start`]ed.
    tasks: Tasks,
    token: String,
    /// The people with tokens of their own (`--users`), if any.
    users: Option<access::Users>,
    shutdown: CancellationToken,
    /// The store error that stopped a scheduler and makes serving pointless (a full
    /// disk, a corrupt row), once there is one; `failed` fires with it.
    fatal: Mutex<Option<StoreError>>,
    failed: CancellationToken,
    sse: SseLimits,
    /// The dashboard's login sessions.
    ui: dashboard::Sessions,
    /// Failed authentication per client address.
    throttle: throttle::Throttle,
}

/// What one `/events` client may hold: at most `buffer` events queued for it, and a
/// client that takes none of them for `patience` is cut with an SSE comment naming
/// the `Last-Event-ID` to resume from.
#[derive(Debug, Clone, Copy)]
pub struct SseLimits {
    pub buffer: usize,
    pub patience: Duration,
}

impl Default for SseLimits {
    fn default() -> Self {
        SseLimits { buffer: 256, patience: Duration::from_secs(30) }
    }
}

type Shared = Arc<App>;

impl App {
    pub fn new(tasks: Tasks, token: String) -> Shared {
        Arc::new(App {
            tasks,
            token,
            users: None,
            shutdown: CancellationToken::new(),
            fatal: Mutex::new(None),
            failed: CancellationToken::new(),
            sse: SseLimits::default(),
            ui: dashboard::Sessions::default(),
            throttle: throttle::Throttle::default(),
        })
    }

    /// `new` with the limits of each `/events` client and the users file's people.
    pub fn configured(tasks: Tasks, token: String, sse: SseLimits, users: Option<access::Users>) -> Shared {
        let mut app = App::new(tasks, token);
        if let Some(a) = Arc::get_mut(&mut app) {
            a.sse = sse;
            a.users = users;
        }
        app
    }

    /// Who holds `token`: the server's own token is its owner, an admin; a users file's
    /// token is that person, with their role.
    fn caller(&self, token: &str) -> Option<access::Caller> {
        if same(token.as_bytes(), self.token.as_bytes()) {
            return Some(access::Caller::owner());
        }
        self.users.as_ref()?.caller(token)
    }

    /// Resolves with the store error that stopped the service's work, once one does:
    /// `pier serve` then says what happened and exits non-zero.
    pub async fn failed(&self) -> StoreError {
        self.failed.cancelled().await;
        self.fatal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .unwrap_or_else(|| StoreError::Db("the service failed".into()))
    }

    /// Starts the host, which drives every unfinished run of the store (an earlier
    /// process's too) and every run submitted later, until [`App::shutdown`].
    pub fn start(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let app = self.clone();
        tokio::spawn(async move {
            if let Err(e) = app.tasks.drive(Scope::All, app.shutdown.clone()).await {
                tracing::error!(error = %e, "the host stopped");
                app.fatal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
                app.failed.cancel();
            }
        })
    }

    /// Stops the host (running tasks are cancelled through the ACP handshake).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }
}

/// The largest plan `POST /runs` takes, in bytes.
pub const MAX_PLAN_BYTES: usize = 64 << 20;

/// The router: the token check on every route but the two probes a supervisor needs,
/// `/health` (liveness, no data) and `/ready` (whether the store answers, no data either).
pub fn router(app: Shared) -> Router {
    // Installed before the first request, so every request and attempt is counted.
    let _ = telemetry::handle();
    let ui = dashboard::router(app.clone());
    // The host's MCP endpoint takes attempts' tokens, not people's: outside the token check.
    let mcp = match &app.tasks.config().mcp {
        Some(_) => mcp::service(app.clone()),
        None => Router::new(),
    };
    let probes = Router::new()
        .route("/health", get(|| async { Json(json!({"ok": true})) }))
        .route("/ready", get(ready))
        .with_state(app.clone());
    Router::new()
        // A plan of 100,000 tasks is several megabytes of TOML.
        .route("/runs", post(submit).layer(axum::extract::DefaultBodyLimit::max(MAX_PLAN_BYTES)).get(list_runs))
        .route("/runs/{run}", get(show_run))
        .route("/runs/{run}/cancel", post(cancel_run))
        .route("/runs/{run}/budget", post(run_budget))
        .route("/runs/{run}/tasks/{task}/budget", post(task_budget))
        .route("/runs/{run}/tasks/{task}", get(show_task))
        .route("/runs/{run}/tasks/{task}/cancel", post(cancel_task))
        .route("/runs/{run}/tasks/{task}/retry", post(retry_task))
        .route("/runs/{run}/tasks/{task}/answer", post(answer))
        .route("/runs/{run}/tasks/{task}/messages", post(say))
        .route("/runs/{run}/tasks/{task}/heartbeat", post(heartbeat))
        .route("/runs/{run}/tasks/{task}/update", post(update))
        .route("/lease", post(lease))
        .route("/v1/lease", post(v1::lease))
        .route("/v1/workers", get(v1::workers))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/heartbeat", post(v1::heartbeat))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/progress", post(v1::progress))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/questions", post(v1::ask))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/questions/{q}/wait", post(v1::wait_answer))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/questions/{q}/withdraw", post(v1::withdraw))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/messages", post(v1::messages))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/notice", post(v1::notice))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/output", post(v1::output))
        .route("/v1/runs/{run}/tasks/{task}/attempts/{n}/end", post(v1::end))
        .route("/schedules", get(schedules::list).post(schedules::add))
        .route("/schedules/{id}", get(schedules::show).delete(schedules::delete))
        .route("/schedules/{id}/pause", post(schedules::pause))
        .route("/schedules/{id}/resume", post(schedules::resume))
        .route("/events", get(events))
        .route("/nodes", get(list_nodes))
        .route("/agents", get(list_agents))
        .route("/metrics", get(telemetry::scrape))
        .layer(axum::middleware::from_fn_with_state(app.clone(), auth))
        .with_state(app)
        .merge(probes)
        .merge(ui)
        .merge(mcp)
        .fallback(|| async { ApiError::of_status(StatusCode::NOT_FOUND, "") })
        .layer(axum::middleware::from_fn(telemetry::track))
        .layer(axum::middleware::map_response(envelope))
}

/// `/metrics` alone and without the token, for `pier serve --metrics-listen` (an address
/// only the scraper can reach).
pub fn metrics_router(app: Shared) -> Router {
    let _ = telemetry::handle();
    Router::new()
        .route("/metrics", get(telemetry::scrape))
        .with_state(app)
        .fallback(|| async { ApiError::of_status(StatusCode::NOT_FOUND, "") })
        .layer(axum::middleware::map_response(envelope))
}

/// Whether the store answers a read: 200, or 503 with the store's error code.
async fn ready(State(app): State<Shared>) -> Response {
    match app.tasks.ready().await {
        Ok(()) => Json(json!({"ready": true})).into_response(),
        Err(e) => {
            let mut e = ApiError::from(e);
            e.status = StatusCode::SERVICE_UNAVAILABLE;
            e.into_response()
        }
    }
}

/// One URL path segment (or query value), percent-encoded: run and task ids are the user's
/// text. The dashboard's links and the CLI's calls to the API build paths with it.
pub fn segment(text: &str) -> String {
    use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
    // RFC 3986's unreserved characters stay as they are.
    const ENCODED: &percent_encoding::AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');
    utf8_percent_encode(text, ENCODED).to_string()
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from timings.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(app): State<Shared>, mut req: Request, next: Next) -> Response {
    let client = throttle::client(&req);
    if let Err(wait) = app.throttle.check(client) {
        return throttle::refusal(wait);
    }
    let presented = req.headers().get("authorization");
    let given = presented.and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    match given.and_then(|t| app.caller(t)) {
        Some(caller) => {
            let needed = access::needs(req.method(), req.uri().path());
            if caller.role < needed {
                return forbidden(&caller, needed);
            }
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        None => {
            // A guess is a credential that is wrong; a request without one guesses nothing.
            if presented.is_some() {
                app.throttle.failed(client);
            }
            ApiError::new(ErrorCode::Unauthorized, "send Authorization: Bearer TOKEN (see the token file)")
                .into_response()
        }
    }
}

/// A caller whose role is short of what the route needs.
fn forbidden(caller: &access::Caller, needed: access::Role) -> Response {
    ApiError::new(
        ErrorCode::Forbidden,
        format!(
            "{} is a {}: this needs the {} role (the users file gives roles)",
            caller.name.as_deref().unwrap_or("this token"),
            caller.role.as_str(),
            needed.as_str()
        ),
    )
    .into_response()
}

/// Reads the token file, or creates it (mode 0600) and says so once. A token file
/// others can read is refused with the fix named.
pub fn load_or_create_token(path: &std::path::Path) -> std::io::Result<(String, bool)> {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the token file {} can be read by others (mode {:o}); run `chmod 600 {}`",
                path.display(),
                meta.permissions().mode() & 0o777,
                path.display()
            ),
        ));
    }
    match std::fs::read_to_string(path) {
        Ok(t) if !t.trim().is_empty() => Ok((t.trim().to_owned(), false)),
        _ => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let token = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
            f.write_all(token.as_bytes())?;
            f.sync_all()?;
            Ok((token, true))
        }
    }
}

/// The default token file.
pub fn token_path(pier_home: &std::path::Path) -> PathBuf {
    pier_home.join("serve.token")
}
