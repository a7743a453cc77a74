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
//! | `POST /runs` `{plan, run_id?}` | submit a plan (TOML text) |
//! | `GET /runs`, `GET /runs/{run}` | runs with counts; one run with its tasks |
//! | `GET /runs/{run}/tasks/{task}` | one task with its current attempt's evidence |
//! | `POST /runs/{run}/cancel` | cancel every unfinished task of a run |
//! | `POST /runs/{run}/tasks/{task}/cancel` | cancel a task |
//! | `POST /runs/{run}/tasks/{task}/retry` `{with_dependents?}` | a failed or cancelled task runs again |
//! | `POST /runs/{run}/tasks/{task}/answer` `{allow, option?}` | answer `awaiting_input` |
//! | `GET /events?after=SEQ&run=ID&follow=BOOL` | SSE; `Last-Event-ID` resumes exactly after that seq; `follow=false` ends when caught up |
//! | `POST /lease` `{worker, capabilities, ttl_ms}` | a pull worker claims a runnable task |
//! | `POST /runs/{run}/tasks/{task}/heartbeat` `{worker, attempt, ttl_ms}` | renew the lease |
//! | `POST /runs/{run}/tasks/{task}/update` `{worker, attempt, status, idempotency_key, result?, error?, class?}` | a worker's report: only the holder of the live lease ends its task; the same key with another body is `idempotency_conflict` |
//!
//! The server claims nothing itself: one [`Host`] drives every run of the store, and the
//! routes call the same functions as the CLI ([`pier_host::person`]).

mod dashboard;
mod telemetry;
pub mod views;

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use pier_host::host::is_worker_task;
use pier_host::person::{ActionError, Answered, Report};
use pier_host::{Attempt, ErrorCode, Host, HostConfig, Scope, StoreError, TaskState, TaskStore};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A JSON error with a stable code.
pub struct ApiError {
    status: StatusCode,
    code: ErrorCode,
    message: String,
    extra: Option<Value>,
}

/// The HTTP status of each code: the one place that pairs them (README's table lists both).
pub fn status_of(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
        ErrorCode::BadRequest | ErrorCode::BadPlan => StatusCode::BAD_REQUEST,
        ErrorCode::NotFound | ErrorCode::UnknownRun | ErrorCode::UnknownTask => StatusCode::NOT_FOUND,
        ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ErrorCode::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::RunExists
        | ErrorCode::Duplicate
        | ErrorCode::BadTransition
        | ErrorCode::LeaseLost
        | ErrorCode::IdempotencyConflict
        | ErrorCode::NotAWorkerTask
        | ErrorCode::NotRunning
        | ErrorCode::NoSession => StatusCode::CONFLICT,
        ErrorCode::DiskFull => StatusCode::INSUFFICIENT_STORAGE,
        ErrorCode::StoreCorrupt | ErrorCode::Store | ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl ApiError {
    fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { status: status_of(code), code, message: message.into(), extra: None }
    }

    /// An error response axum (or a layer) made on its own, in the envelope: the code the
    /// status stands for, and its text as the message.
    fn of_status(status: StatusCode, text: &str) -> ApiError {
        let code = match status {
            StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
            StatusCode::NOT_FOUND => ErrorCode::NotFound,
            StatusCode::METHOD_NOT_ALLOWED => ErrorCode::MethodNotAllowed,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
            StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::TooLarge,
            s if s.is_client_error() => ErrorCode::BadRequest,
            _ => ErrorCode::Internal,
        };
        let message = match (code, text.trim()) {
            (ErrorCode::NotFound, _) => "no such route; the routes are listed in the README (pier serve)".to_owned(),
            (ErrorCode::MethodNotAllowed, _) => "this route does not take that method".to_owned(),
            (_, "") => status.canonical_reason().unwrap_or("error").to_owned(),
            (_, t) => t.to_owned(),
        };
        ApiError { status, code, message, extra: None }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"error": {"code": self.code, "message": self.message}});
        if let Some(extra) = self.extra {
            body["error"]["details"] = extra;
        }
        (self.status, Json(body)).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

impl From<ActionError> for ApiError {
    fn from(e: ActionError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

/// A JSON body whose rejection (not JSON, the wrong shape, the wrong content type, too
/// large) is the JSON error envelope, never axum's plain text.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(Body(value)),
            Err(rejection) => {
                let mut e = ApiError::of_status(rejection.status(), &rejection.body_text());
                if e.code == ErrorCode::BadRequest {
                    // Not JSON (400) and the wrong shape (422) are one code, one status.
                    e.status = StatusCode::BAD_REQUEST;
                }
                Err(e)
            }
        }
    }
}

/// The envelope for every error response a handler did not make itself (axum's own
/// rejections of a path or query, an unknown route, a wrong method, a body limit): one
/// mechanism, so no route can answer an error in plain text.
async fn envelope(resp: Response) -> Response {
    let status = resp.status();
    // JSON is the API's own envelope; HTML is the dashboard's own error page.
    let own = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json") || v.starts_with("text/html"));
    if !(status.is_client_error() || status.is_server_error()) || own {
        return resp;
    }
    let text = axum::body::to_bytes(resp.into_body(), 64 * 1024).await.unwrap_or_default();
    ApiError::of_status(status, &String::from_utf8_lossy(&text)).into_response()
}

/// What the service shares between requests.
pub struct App {
    store: Arc<dyn TaskStore>,
    config: HostConfig,
    token: String,
    /// The host that drives every run of the store; started by [`App::start`].
    host: Arc<Host>,
    shutdown: CancellationToken,
    /// The store error that stopped a scheduler and makes serving pointless (a full
    /// disk, a corrupt row), once there is one; `failed` fires with it.
    fatal: Mutex<Option<StoreError>>,
    failed: CancellationToken,
    sse: SseLimits,
    /// The dashboard's login sessions.
    ui: dashboard::Sessions,
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
        SseLimits { buffer: 1024, patience: Duration::from_secs(30) }
    }
}

type Shared = Arc<App>;

async fn blocking<T: Send + 'static>(
    app: &Shared,
    f: impl FnOnce(&dyn TaskStore) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    let store = app.store.clone();
    tokio::task::spawn_blocking(move || f(store.as_ref()))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Store, e.to_string()))?
        .map_err(ApiError::from)
}

impl App {
    pub fn new(store: Arc<dyn TaskStore>, config: HostConfig, token: String) -> Shared {
        Arc::new(App {
            host: Arc::new(Host::new(store.clone(), config.clone())),
            store,
            config,
            token,
            shutdown: CancellationToken::new(),
            fatal: Mutex::new(None),
            failed: CancellationToken::new(),
            sse: SseLimits::default(),
            ui: dashboard::Sessions::default(),
        })
    }

    /// `new` with the limits of each `/events` client.
    pub fn with_sse_limits(store: Arc<dyn TaskStore>, config: HostConfig, token: String, sse: SseLimits) -> Shared {
        let mut app = App::new(store, config, token);
        if let Some(a) = Arc::get_mut(&mut app) {
            a.sse = sse;
        }
        app
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
            if let Err(e) = app.host.drive(Scope::All, app.shutdown.clone()).await {
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
    let probes = Router::new()
        .route("/health", get(|| async { Json(json!({"ok": true})) }))
        .route("/ready", get(ready))
        .with_state(app.clone());
    Router::new()
        // A plan of 100,000 tasks is several megabytes of TOML.
        .route("/runs", post(submit).layer(axum::extract::DefaultBodyLimit::max(MAX_PLAN_BYTES)).get(list_runs))
        .route("/runs/{run}", get(show_run))
        .route("/runs/{run}/cancel", post(cancel_run))
        .route("/runs/{run}/tasks/{task}", get(show_task))
        .route("/runs/{run}/tasks/{task}/cancel", post(cancel_task))
        .route("/runs/{run}/tasks/{task}/retry", post(retry_task))
        .route("/runs/{run}/tasks/{task}/answer", post(answer))
        .route("/runs/{run}/tasks/{task}/messages", post(say))
        .route("/runs/{run}/tasks/{task}/heartbeat", post(heartbeat))
        .route("/runs/{run}/tasks/{task}/update", post(update))
        .route("/lease", post(lease))
        .route("/events", get(events))
        .route("/nodes", get(list_nodes))
        .route("/agents", get(list_agents))
        .route("/metrics", get(telemetry::scrape))
        .layer(axum::middleware::from_fn_with_state(app.clone(), auth))
        .with_state(app)
        .merge(probes)
        .merge(ui)
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
    match blocking(&app, |s| s.last_seq()).await {
        Ok(_) => Json(json!({"ready": true})).into_response(),
        Err(e) => {
            let mut e = e;
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

async fn auth(State(app): State<Shared>, req: Request, next: Next) -> Response {
    let given =
        req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(t) if same(t.as_bytes(), app.token.as_bytes()) => next.run(req).await,
        _ => ApiError::new(ErrorCode::Unauthorized, "send Authorization: Bearer TOKEN (see the token file)")
            .into_response(),
    }
}

#[derive(Deserialize)]
struct SubmitBody {
    plan: String,
    run_id: Option<String>,
}

async fn submit(State(app): State<Shared>, Body(body): Body<SubmitBody>) -> Result<Response, ApiError> {
    let agents = app.config.agents.clone();
    let exe = app.config.pier_exe.clone();
    let path = std::env::var("PATH").ok();
    let known = move |a: &str| {
        if a == "worker" || a.starts_with("worker:") {
            return Ok(());
        }
        pier_client::registry::resolve(a, &agents, &exe, path.as_deref()).map(|_| ()).map_err(|e| e.to_string())
    };
    let plan = pier_host::plan::parse(&body.plan, &known).map_err(|e| {
        let mut err = ApiError::new(ErrorCode::BadPlan, e.to_string());
        err.extra = Some(serde_json::to_value(&e.0).unwrap_or(Value::Null));
        err
    })?;
    if let Some(id) = &body.run_id {
        pier_host::plan::check_run_id(id).map_err(|why| ApiError::new(ErrorCode::BadRequest, why))?;
    }
    pier_host::caps::check(&plan, &app.store, &app.config).await.map_err(|e| {
        let mut err = ApiError::new(ErrorCode::BadPlan, e.to_string());
        err.extra = Some(serde_json::to_value(&e.0).unwrap_or(Value::Null));
        err
    })?;
    let run = body.run_id.unwrap_or_else(|| format!("run-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
    let r = run.clone();
    blocking(&app, move |s| s.create_run(&r, &plan, "http")).await?;
    Ok((StatusCode::CREATED, Json(json!({"run": run}))).into_response())
}

async fn list_runs(State(app): State<Shared>) -> Result<Json<Value>, ApiError> {
    let runs = blocking(&app, views::runs).await?;
    let runs: Vec<Value> = runs
        .iter()
        .map(|r| {
            json!({"run": r.run, "counts": r.counts, "state": r.state(), "created_at_ms": r.created_at_ms,
                   "updated_at_ms": r.updated_at_ms, "attempts": r.attempts})
        })
        .collect();
    Ok(Json(json!({"runs": runs})))
}

/// The live `pier serve` nodes on this store, each with the runs it drives and its last heartbeat.
async fn list_nodes(State(app): State<Shared>) -> Result<Json<Value>, ApiError> {
    let nodes = blocking(&app, views::nodes).await?;
    Ok(Json(json!({"node": app.config.node, "nodes": nodes})))
}

async fn show_run(State(app): State<Shared>, Path(run): Path<String>) -> Result<Json<Value>, ApiError> {
    let r = run.clone();
    let tasks = blocking(&app, move |s| views::run(s, &r)).await?;
    let rows: Vec<pier_host::TaskRow> = tasks.iter().map(|(t, _)| t.clone()).collect();
    let counts = views::counts(&rows);
    // A task waiting on a person carries the question it waits on.
    let rows: Vec<Value> = tasks
        .into_iter()
        .map(|(t, q)| {
            let mut row = serde_json::to_value(&t).unwrap_or(Value::Null);
            if let Some(q) = q {
                row["question"] = json!({"attempt": q.attempt, "n": q.n, "request": q.request});
            }
            row
        })
        .collect();
    Ok(Json(json!({"run": run, "counts": counts, "tasks": rows})))
}

async fn find_task(app: &Shared, run: &str, task: &str) -> Result<pier_host::TaskRow, ApiError> {
    let (r, t) = (run.to_owned(), task.to_owned());
    blocking(app, move |s| {
        if !s.run_exists(&r)? {
            return Err(StoreError::UnknownRun(r));
        }
        s.task(&r, &t)?.ok_or(StoreError::UnknownTask(t))
    })
    .await
}

/// Each agent spec's last `initialize` answer (what it can do), as the host recorded it.
async fn list_agents(State(app): State<Shared>) -> Result<Json<Value>, ApiError> {
    let agents = blocking(&app, |s| s.agents()).await?;
    Ok(Json(json!({"agents": agents})))
}

async fn show_task(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let v = blocking(&app, move |s| views::task(s, &run, &task)).await?;
    // `evidence`: the current attempt's, as before `attempts` was added.
    let evidence =
        v.attempts.iter().find(|a| a.attempt == v.row.attempt).map(|a| a.evidence.clone()).unwrap_or_default();
    let question = v.question.map(|q| json!({"attempt": q.attempt, "n": q.n, "request": q.request}));
    Ok(Json(
        json!({"task": v.row, "evidence": evidence, "attempts": v.attempts, "question": question, "agent": v.agent}),
    ))
}

async fn cancel_task(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    find_task(&app, &run, &task).await?;
    let (r, t) = (run.clone(), task.clone());
    let moved = blocking(&app, move |s| s.cancel(&r, &t, "cancelled over HTTP")).await?;
    let row = match moved {
        Some(row) => row,
        None => find_task(&app, &run, &task).await?,
    };
    Ok(Json(json!({"task": row})))
}

#[derive(Deserialize, Default)]
struct RetryBody {
    #[serde(default)]
    with_dependents: bool,
}

/// A person's retry: the task (and with `with_dependents` the cancelled tasks below it)
/// back to `pending`; the host drives it like any other pending task.
async fn retry_task(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    // The body is optional: no body is `{}`.
    let body: RetryBody = if raw.iter().all(u8::is_ascii_whitespace) {
        RetryBody::default()
    } else {
        serde_json::from_slice(&raw).map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("the body: {e}")))?
    };
    let (r, t) = (run.clone(), task.clone());
    let rows = tokio::task::spawn_blocking(move || {
        pier_host::person::retry(app.store.as_ref(), &r, &t, body.with_dependents, "http")
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))??;
    Ok(Json(json!({"run": run, "tasks": rows})))
}

async fn cancel_run(State(app): State<Shared>, Path(run): Path<String>) -> Result<Json<Value>, ApiError> {
    let r = run.clone();
    let cancelled = blocking(&app, move |s| views::cancel_run(s, &r, "run cancelled over HTTP")).await?;
    Ok(Json(json!({"run": run, "cancelled": cancelled})))
}

#[derive(Deserialize)]
struct AnswerBody {
    /// A permission request or a re-run decision.
    #[serde(default)]
    allow: bool,
    option: Option<String>,
    /// An agent's question: the values of the fields it asked for.
    content: Option<serde_json::Map<String, Value>>,
    /// An agent's question: declined.
    #[serde(default)]
    decline: bool,
}

async fn answer(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<AnswerBody>,
) -> Result<Json<Value>, ApiError> {
    let store = app.store.clone();
    if body.content.is_some() || body.decline {
        let input = match body.content {
            Some(_) if body.decline => {
                return Err(ApiError::new(ErrorCode::BadRequest, "give content or decline, not both"));
            }
            Some(content) => pier_host::person::Input::Json(content),
            None => pier_host::person::Input::Decline,
        };
        let answer = tokio::task::spawn_blocking(move || {
            pier_host::person::answer_input(store.as_ref(), &run, &task, input, "http")
        })
        .await
        .map_err(|e| ApiError::new(ErrorCode::Store, e.to_string()))??;
        return Ok(Json(json!({"answered": answer})));
    }
    let answered = tokio::task::spawn_blocking(move || {
        pier_host::person::answer(store.as_ref(), &run, &task, body.allow, body.option.as_deref(), "http")
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Store, e.to_string()))??;
    Ok(Json(match answered {
        Answered::Option(chosen) => json!({"answered": chosen}),
        Answered::Rerun(row) => json!({"task": row}),
    }))
}

#[derive(Deserialize)]
struct SayBody {
    text: String,
    #[serde(default)]
    interrupt: bool,
}

/// A person's message to a running task: queued for its next prompt, or at once.
async fn say(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<SayBody>,
) -> Result<Response, ApiError> {
    let store = app.store.clone();
    let n = tokio::task::spawn_blocking(move || {
        pier_host::person::say(store.as_ref(), &run, &task, &body.text, body.interrupt, "http")
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Store, e.to_string()))??;
    Ok((StatusCode::CREATED, Json(json!({"message": n}))).into_response())
}

#[derive(Deserialize)]
struct LeaseBody {
    worker: String,
    #[serde(default)]
    capabilities: Vec<String>,
    ttl_ms: Option<i64>,
}

async fn lease(State(app): State<Shared>, Body(body): Body<LeaseBody>) -> Result<Response, ApiError> {
    let ttl = body.ttl_ms.unwrap_or(30_000).clamp(1_000, 3_600_000);
    let claimed = blocking(&app, move |s| {
        for t in s.pending_tasks()? {
            let capability = t.spec.agent.strip_prefix("worker:").unwrap_or("");
            let has = |c: &str| c.is_empty() || body.capabilities.iter().any(|mine| mine == c);
            // The task's `requires` are capabilities the worker must have too.
            let fits = is_worker_task(&t) && has(capability) && t.spec.requires.iter().all(|r| has(r));
            if !fits || t.not_before_ms > pier_host::store::now_ms() {
                continue;
            }
            let mut ready = true;
            for d in &t.spec.depends_on {
                ready &= s.task(&t.run_id, d)?.is_some_and(|d| d.state == TaskState::Completed);
            }
            if !ready {
                continue;
            }
            let until = pier_host::store::now_ms() + ttl;
            if let Some((_, row)) = s.claim(&t.run_id, &t.id, &body.worker, until)? {
                return Ok(Some(row));
            }
        }
        Ok(None)
    })
    .await?;
    match claimed {
        Some(row) => {
            pier_host::telemetry::attempt_started();
            let (r, deps) = (row.run_id.clone(), row.spec.depends_on.clone());
            let results: HashMap<String, String> = blocking(&app, move |s| {
                let mut results = HashMap::new();
                for d in deps {
                    if let Some(t) = s.task(&r, &d)? {
                        results.insert(t.id, t.result.unwrap_or_default());
                    }
                }
                Ok(results)
            })
            .await?;
            let prompt = pier_host::plan::render(&row.spec.prompt, &results);
            Ok(Json(json!({"task": row, "prompt": prompt})).into_response())
        }
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

#[derive(Deserialize)]
struct HeartbeatBody {
    worker: String,
    attempt: i64,
    ttl_ms: Option<i64>,
}

async fn heartbeat(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<HeartbeatBody>,
) -> Result<Json<Value>, ApiError> {
    let expires = pier_host::store::now_ms() + body.ttl_ms.unwrap_or(30_000).clamp(1_000, 3_600_000);
    let attempt = Attempt { run, task, n: body.attempt, owner: body.worker };
    let ok = blocking(&app, move |s| s.heartbeat(&attempt, expires)).await?;
    if !ok {
        return Err(ApiError::new(ErrorCode::LeaseLost, "the lease is not yours any more; stop working on this task"));
    }
    Ok(Json(json!({"lease_expires_at_ms": expires})))
}

async fn update(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<Value>,
) -> Result<Json<Value>, ApiError> {
    let report: Report = serde_json::from_value(body.clone())
        .map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("the report is not valid: {e}")))?;
    let (store, retry_base) = (app.store.clone(), app.config.retry_base);
    let row = tokio::task::spawn_blocking(move || {
        pier_host::person::report(store.as_ref(), &run, &task, &report, &body, retry_base)
    })
    .await
    .map_err(|e| ApiError::new(ErrorCode::Store, e.to_string()))??;
    Ok(Json(json!({"task": row})))
}

/// Read as text and checked by [`events`], so a malformed value is answered with
/// the JSON error envelope rather than axum's plain-text rejection.
#[derive(Deserialize)]
pub(crate) struct EventsQuery {
    after: Option<String>,
    run: Option<String>,
    /// `false` ends the stream once it has caught up.
    follow: Option<String>,
}

/// A sequence number given by a client: a whole number, 0 or more.
fn sequence(what: &str, text: &str) -> Result<i64, ApiError> {
    text.trim().parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("{what} must be an event sequence number (a whole number, 0 or more), not {text:?}"),
        )
    })
}

/// Events read from the store at a time for `/events`.
const EVENT_BATCH: usize = 2000;

struct Replay {
    store: Arc<dyn TaskStore>,
    run: Option<String>,
    cursor: pier_host::LogCursor,
    /// This process's commits with their events: a follower caught up takes them from here
    /// instead of reading the store (other processes' commits are read).
    own: tokio::sync::broadcast::Receiver<Arc<pier_host::store::OwnCommit>>,
    buffer: std::collections::VecDeque<pier_host::Event>,
    /// The read of the batch after `buffer`, already under way.
    next: Option<tokio::task::JoinHandle<Result<Vec<pier_host::Event>, StoreError>>>,
}

impl Replay {
    /// The events of this process's commits that follow on from what was read, in order (of
    /// the run followed, if one is). A commit that does not follow (another process committed
    /// in between) is passed over: the read that the gap calls for gives its events too.
    fn take_own(&mut self) -> Vec<pier_host::Event> {
        let commits = self.cursor.take_own(&mut self.own);
        let events = commits.iter().flat_map(|c| &c.events);
        let ours = events.filter(|e| self.run.as_ref().is_none_or(|r| *r == e.run));
        ours.cloned().map(pier_host::store::RawEvent::into_event).collect()
    }
}

/// One log event as SSE: `id` is its sequence, `event` its type, `data` the event
/// with its own fields first and its data's fields after.
fn sse_event(e: pier_host::Event) -> SseEvent {
    let mut data = json!({"seq": e.seq, "run": e.run, "type": e.kind, "at_ms": e.at_ms});
    if let Some(t) = &e.task {
        data["task"] = json!(t);
    }
    if let (Some(obj), Value::Object(d)) = (data.as_object_mut(), e.data) {
        for (k, v) in d {
            obj.entry(k).or_insert(v);
        }
    }
    SseEvent::default().id(e.seq.to_string()).event(e.kind).data(data.to_string())
}

async fn events(
    State(app): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Sse<impl futures::Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    event_stream(app, headers, q, CancellationToken::new())
}

/// The `/events` stream, which also ends when `end` is cancelled (a dashboard session that
/// logs out or expires).
fn event_stream(
    app: Shared,
    headers: HeaderMap,
    q: EventsQuery,
    end: CancellationToken,
) -> Result<Sse<impl futures::Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let from_header = match headers.get("last-event-id") {
        Some(v) => Some(sequence("Last-Event-ID", &String::from_utf8_lossy(v.as_bytes()))?),
        None => None,
    };
    let from_query = q.after.as_deref().map(|a| sequence("after", a)).transpose()?;
    let after = from_header.or(from_query).unwrap_or(0);
    let store = app.store.clone();
    let run = q.run;
    let follow = match q.follow.as_deref() {
        None | Some("true") => true,
        Some("false") => false,
        Some(other) => {
            return Err(ApiError::new(ErrorCode::BadRequest, format!("follow must be true or false, not {other:?}")));
        }
    };
    // While one batch is being sent, the next is read (a blocking thread reads and
    // decodes while the runtime encodes and writes): a replay uses both cores.
    let fetch = move |store: Arc<dyn TaskStore>, run: Option<String>, after: i64| {
        tokio::task::spawn_blocking(move || store.events_after(run.as_deref(), after, EVENT_BATCH))
    };
    let cursor = pier_host::LogCursor::new(after);
    let own = store.own_commits();
    let state = Replay { store, run, cursor, own, buffer: std::collections::VecDeque::new(), next: None };
    let replay = futures::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(e) = st.buffer.pop_front() {
                return Some((e, st));
            }
            let prefetched = match st.next.take() {
                Some(next) => next.await.ok().and_then(Result::ok).unwrap_or_default(),
                None => Vec::new(),
            };
            let events = if prefetched.is_empty() {
                let taken = st.take_own();
                if !taken.is_empty() {
                    st.buffer = taken.into();
                    continue;
                }
                // Subscribe before reading, so a commit in between is not missed; read only what
                // can have come (`LogCursor`).
                let mut rx = st.store.subscribe();
                let seen = *rx.borrow_and_update();
                if follow && !st.cursor.due(seen) {
                    if rx.changed().await.is_err() {
                        return None;
                    }
                    continue;
                }
                match fetch(st.store.clone(), st.run.clone(), st.cursor.after()).await {
                    Ok(Ok(events)) => {
                        st.cursor.read(&events, EVENT_BATCH, seen);
                        if events.is_empty() {
                            if !follow {
                                return None;
                            }
                            continue;
                        }
                        events
                    }
                    _ => return None,
                }
            } else {
                // A read ahead begun before the watch was looked at: it says nothing of it.
                st.cursor.read(&prefetched, EVENT_BATCH, 0);
                prefetched
            };
            // A full batch: more is waiting, read while this one is sent (a replay).
            if events.len() >= EVENT_BATCH {
                st.next = Some(fetch(st.store.clone(), st.run.clone(), st.cursor.after()));
            }
            st.buffer = events.into();
        }
    });
    // The replay feeds a bounded queue the response takes from. A client that takes
    // nothing for `patience` while the queue is full is cut: the queue ends, and the
    // last thing it is sent is a comment naming where to resume.
    let limits = app.sse;
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(limits.buffer.max(1));
    let (cut_tx, cut_rx) = tokio::sync::oneshot::channel::<i64>();
    tokio::spawn(async move {
        futures::pin_mut!(replay);
        let mut sent = after;
        loop {
            let e = tokio::select! {
                _ = end.cancelled() => return,
                // A client that left while nothing happened: stop reading for it.
                _ = tx.closed() => return,
                e = replay.next() => match e { Some(e) => e, None => return },
            };
            let seq = e.seq;
            match tokio::time::timeout(limits.patience, tx.send(sse_event(e))).await {
                Ok(Ok(())) => sent = seq,
                // The client is gone.
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::warn!(after = sent, "cut a slow /events client");
                    let _ = cut_tx.send(sent);
                    return;
                }
            }
        }
    });
    // The client is counted while its response lives (dropped when it disconnects).
    let client = telemetry::SseClient::new();
    let queued = futures::stream::unfold((rx, Some(cut_rx), client), |(mut rx, cut, client)| async move {
        if let Some(e) = rx.recv().await {
            return Some((Ok(e), (rx, cut, client)));
        }
        let seq = cut?.await.ok()?;
        let note = SseEvent::default().comment(format!("too slow; reconnect with Last-Event-ID {seq}"));
        Some((Ok(note), (rx, None, client)))
    });
    Ok(Sse::new(queued).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
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
