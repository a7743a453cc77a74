//! `/v1`: the worker API, versioned. A worker leases a task (waiting for one), then drives its
//! attempt `/v1/runs/{run}/tasks/{task}/attempts/{n}/…` with the channels a local attempt has:
//! `heartbeat`, `progress` (ordered batches, once per `seq`), `questions` (a permission
//! request or an elicitation parks the task for a person; `…/questions/{q}/wait` long-polls
//! the answer, `…/withdraw` gives it up), `messages` (takes people's messages), `notice` (a
//! long-poll that returns as soon as the task is cancelled or lost, a message waits or an
//! answer came), `output` (what an attempt whose task was taken from it showed) and `end` (the report of the unversioned `…/update`, with the attempt from the
//! path). Every body names its `worker`, the owner its lease is fenced on. Each route makes
//! one [`pier_host::Tasks`] call.

use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pier_host::Attempt;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Shared;
use crate::error::{ApiError, Body};

type AttemptPath = Path<(String, String, i64)>;

fn attempt((run, task, n): (String, String, i64), worker: String) -> Attempt {
    Attempt { run, task, n, owner: worker }
}

fn wait(ms: Option<u64>) -> Duration {
    Duration::from_millis(ms.unwrap_or(0))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LeaseBody {
    worker: String,
    #[serde(default)]
    capabilities: Vec<String>,
    /// Agents (as tasks name them) whose tasks the worker also runs.
    #[serde(default)]
    agents: Vec<String>,
    ttl_ms: Option<i64>,
    /// How long to wait for a task when none is ready [0; at most 30 s].
    wait_ms: Option<u64>,
}

pub(crate) async fn lease(State(app): State<Shared>, Body(b): Body<LeaseBody>) -> Result<Response, ApiError> {
    match app.tasks.lease_waiting(&b.worker, &b.capabilities, &b.agents, b.ttl_ms, wait(b.wait_ms)).await? {
        Some(leased) => Ok(Json(json!(leased)).into_response()),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Heartbeat {
    worker: String,
    ttl_ms: Option<i64>,
}

pub(crate) async fn heartbeat(
    State(app): State<Shared>,
    Path((run, task, n)): AttemptPath,
    Body(b): Body<Heartbeat>,
) -> Result<Json<Value>, ApiError> {
    let expires = app.tasks.heartbeat(&run, &task, &b.worker, n, b.ttl_ms).await?;
    Ok(Json(json!({"lease_expires_at_ms": expires})))
}

/// The worker's name, and the rest of the body as the call takes it.
fn worker_of(body: &mut Value) -> Result<String, ApiError> {
    match body.as_object_mut().and_then(|o| o.remove("worker")) {
        Some(Value::String(w)) => Ok(w),
        _ => Err(pier_host::ActionError::bad_request("the body names no `worker`").into()),
    }
}

pub(crate) async fn progress(
    State(app): State<Shared>,
    Path(path): AttemptPath,
    Body(mut body): Body<Value>,
) -> Result<Json<Value>, ApiError> {
    let a = attempt(path, worker_of(&mut body)?);
    let written = app.tasks.progress(&a, body).await?;
    Ok(Json(json!({"written": written})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Ask {
    worker: String,
    /// A `session/request_permission` request's params, or `{"elicitation": CreateElicitationRequest}`.
    request: Value,
}

pub(crate) async fn ask(
    State(app): State<Shared>,
    Path(path): AttemptPath,
    Body(b): Body<Ask>,
) -> Result<Response, ApiError> {
    let n = app.tasks.ask(&attempt(path, b.worker), b.request).await?;
    Ok((StatusCode::CREATED, Json(json!({"question": n}))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Wait {
    worker: String,
    wait_ms: Option<u64>,
    /// Of `notice`: the question whose answer also ends the wait.
    #[serde(default)]
    question: Option<i64>,
}

pub(crate) async fn wait_answer(
    State(app): State<Shared>,
    Path((run, task, n, q)): Path<(String, String, i64, i64)>,
    Body(b): Body<Wait>,
) -> Result<Json<Value>, ApiError> {
    let answer = app.tasks.wait_answer(&attempt((run, task, n), b.worker), q, wait(b.wait_ms)).await?;
    Ok(Json(json!({"answer": answer})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Worker {
    worker: String,
}

pub(crate) async fn withdraw(
    State(app): State<Shared>,
    Path((run, task, n, q)): Path<(String, String, i64, i64)>,
    Body(b): Body<Worker>,
) -> Result<Json<Value>, ApiError> {
    app.tasks.withdraw(&attempt((run, task, n), b.worker), q).await?;
    Ok(Json(json!({"withdrawn": q})))
}

pub(crate) async fn messages(
    State(app): State<Shared>,
    Path(path): AttemptPath,
    Body(b): Body<Worker>,
) -> Result<Json<Value>, ApiError> {
    let taken = app.tasks.take_messages(&attempt(path, b.worker)).await?;
    let messages: Vec<Value> = taken.into_iter().map(|(n, text)| json!({"n": n, "text": text})).collect();
    Ok(Json(json!({"messages": messages})))
}

pub(crate) async fn notice(
    State(app): State<Shared>,
    Path(path): AttemptPath,
    Body(b): Body<Wait>,
) -> Result<Json<Value>, ApiError> {
    let notice = app.tasks.notice(&attempt(path, b.worker), b.question, wait(b.wait_ms)).await?;
    Ok(Json(json!(notice)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Output {
    worker: String,
    output: Value,
}

pub(crate) async fn output(
    State(app): State<Shared>,
    Path(path): AttemptPath,
    Body(b): Body<Output>,
) -> Result<Json<Value>, ApiError> {
    app.tasks.keep_output(&attempt(path, b.worker), b.output).await?;
    Ok(Json(json!({"kept": true})))
}

pub(crate) async fn end(
    State(app): State<Shared>,
    Path((run, task, n)): AttemptPath,
    Body(mut body): Body<Value>,
) -> Result<Json<Value>, ApiError> {
    if let Some(o) = body.as_object_mut() {
        o.insert("attempt".into(), json!(n));
    }
    let (row, next) = app.tasks.report(&run, &task, body).await?;
    Ok(Json(match next {
        Some(next) => json!({"task": row, "next": next}),
        None => json!({"task": row}),
    }))
}

pub(crate) async fn workers(State(app): State<Shared>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"workers": app.tasks.workers().await?})))
}
