//! The API's routes: each takes its request apart, makes one [`pier_host::Tasks`] call and
//! turns the answer into JSON. No rule of a task's life is written here.

use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pier_host::{Answered, ErrorCode, Input, Submission, TaskView};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Shared;
use crate::access::Caller;
use crate::error::{ApiError, Body};

/// A plan, or one task of a declared type (`type`, `input`, and `priority`, `task_id` if given).
#[derive(Deserialize)]
pub(crate) struct SubmitBody {
    plan: Option<String>,
    run_id: Option<String>,
    #[serde(rename = "type")]
    task_type: Option<String>,
    input: Option<Value>,
    priority: Option<u8>,
    task_id: Option<String>,
    /// The text of the types file beside the plan (`types.toml`), whose types the plan may use.
    types: Option<String>,
}

pub(crate) async fn submit(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Body(body): Body<SubmitBody>,
) -> Result<Response, ApiError> {
    let config = app.tasks.config();
    let (text, whole) = match (body.plan, body.task_type) {
        (Some(plan), None) if body.input.is_none() && body.task_id.is_none() => (plan, body.priority),
        (None, Some(ty)) if body.types.is_none() => {
            let input = body.input.unwrap_or_else(|| json!({}));
            let text = pier_host::tasks::one_task_plan(&ty, &input, body.priority, body.task_id.as_deref())
                .map_err(pier_host::ActionError::Plan)?;
            (text, None)
        }
        _ => {
            return Err(pier_host::ActionError::bad_request(
                "give either `plan` (a plan's text, with `types` and `priority` if you like) or `type` with its \
                 `input` (and `priority`, `task_id` if you like)",
            )
            .into());
        }
    };
    let types =
        pier_host::tasks::plan_types(&config.types, body.types.as_deref()).map_err(pier_host::ActionError::Plan)?;
    let mut plan = pier_host::tasks::parse_plan(&text, &config.agents, &config.pier_exe, &types)
        .map_err(pier_host::ActionError::Plan)?;
    if let Some(p) = whole {
        plan = plan.at_priority(p).map_err(pier_host::ActionError::Plan)?;
    }
    let submission = Submission { plan, run: body.run_id, source: caller.by("http"), own: false };
    let submitted = app.tasks.submit(submission).await?;
    // A repeated submission (same id, same plan) is answered as it was, with nothing run again.
    let status = if submitted.created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(json!({"run": submitted.run, "created": submitted.created}))).into_response())
}

/// `GET /runs?state=&limit=`: newest first.
#[derive(Deserialize)]
pub(crate) struct RunsQuery {
    state: Option<String>,
    limit: Option<usize>,
    /// Runs whose id contains this, in any case.
    q: Option<String>,
    /// Skips this many of the newest that match (a page further down).
    #[serde(default)]
    offset: usize,
}

pub(crate) async fn list_runs(
    State(app): State<Shared>,
    axum::extract::Query(q): axum::extract::Query<RunsQuery>,
) -> Result<Json<Value>, ApiError> {
    let filter = pier_host::tasks::RunFilter { state: q.state, limit: q.limit, search: q.q, offset: q.offset };
    let list = app.tasks.list_runs(&filter).await?;
    let runs: Vec<Value> = list
        .runs
        .iter()
        .map(|r| {
            json!({"run": r.run, "counts": r.counts, "state": r.state(), "created_at_ms": r.created_at_ms,
                   "updated_at_ms": r.updated_at_ms, "attempts": r.attempts, "spend": r.spend.to_json()})
        })
        .collect();
    Ok(Json(json!({"runs": runs, "more": list.more})))
}

/// The live `pier serve` nodes on this store, each with the runs it drives and its last heartbeat.
pub(crate) async fn list_nodes(State(app): State<Shared>) -> Result<Json<Value>, ApiError> {
    let nodes = app.tasks.nodes().await?;
    let workers = app.tasks.workers().await?;
    Ok(Json(json!({"node": app.tasks.config().node, "nodes": nodes, "workers": workers})))
}

pub(crate) async fn show_run(State(app): State<Shared>, Path(run): Path<String>) -> Result<Json<Value>, ApiError> {
    let view = app.tasks.run(&run).await?;
    let counts = view.counts();
    // A task waiting on a person carries the question it waits on.
    let rows: Vec<Value> = view
        .tasks
        .iter()
        .map(|(t, q)| {
            let mut row = serde_json::to_value(t).unwrap_or(Value::Null);
            if let Some(q) = q {
                row["question"] = json!(q);
            }
            row["spend"] = view.task_spend.get(&t.id).map_or(Value::Null, pier_host::Spend::to_json);
            row["times"] = json!(view.times.get(&t.id).map_or(&[][..], Vec::as_slice));
            row
        })
        .collect();
    Ok(Json(json!({"run": run, "counts": counts, "tasks": rows, "spend": view.spend.to_json()})))
}

/// Each agent spec's last `initialize` answer (what it can do), as the host recorded it.
pub(crate) async fn list_agents(State(app): State<Shared>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"agents": app.tasks.agents().await?, "sandbox": app.tasks.config().sandbox.describe()})))
}

/// One task as the API shows it (and `pier show --server` reads).
pub fn task_json(v: &TaskView) -> Value {
    // `evidence`: the current attempt's, as before `attempts` was added.
    json!({"task": v.row, "evidence": v.evidence(), "attempts": v.attempts, "question": v.question,
           "agent": v.agent, "prompt": v.prompt, "sandbox": v.sandbox, "spend": v.spend.to_json(), "keys": v.keys,
           "times": v.times})
}

#[derive(Deserialize, Default)]
pub(crate) struct TaskQuery {
    /// Also the task's turns (a read of its whole transcript, so only when asked).
    #[serde(default)]
    turns: bool,
}

pub(crate) async fn show_task(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    axum::extract::Query(q): axum::extract::Query<TaskQuery>,
) -> Result<Json<Value>, ApiError> {
    let mut v = task_json(&app.tasks.task(&run, &task).await?);
    if q.turns {
        // Turn by turn, each tool call with its times: what `pier show RUN TASK` prints.
        v["turns"] = json!(pier_host::tasks::turns(&app.tasks.transcript(&run, &task).await?));
    }
    Ok(Json(v))
}

/// A run's new budget: on every task of it; those a budget stopped run again.
pub(crate) async fn run_budget(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(run): Path<String>,
    Body(body): Body<pier_host::Budget>,
) -> Result<Json<Value>, ApiError> {
    let rows = app.tasks.set_budget(&run, None, None, Some(body), &caller.by("http")).await?;
    Ok(Json(json!({"tasks": rows})))
}

/// A task's new budget; if a budget stopped it, it runs again.
pub(crate) async fn task_budget(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<pier_host::Budget>,
) -> Result<Json<Value>, ApiError> {
    let rows = app.tasks.set_budget(&run, Some(&task), Some(body), None, &caller.by("http")).await?;
    Ok(Json(json!({"tasks": rows})))
}

/// A cancel's optional body: how long to wait for the attempts holding the tasks to end them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    wait_ms: Option<u64>,
}

fn cancel_wait(raw: &[u8]) -> Result<std::time::Duration, ApiError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(pier_host::CANCEL_WAIT);
    }
    let body: CancelBody =
        serde_json::from_slice(raw).map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("the body: {e}")))?;
    let wait = body.wait_ms.map_or(pier_host::CANCEL_WAIT, std::time::Duration::from_millis);
    Ok(wait.min(pier_host::tasks::MAX_WAIT))
}

/// A task's cancel: answered once the task has ended (an attempt holding it ends it with its
/// output), or when `wait_ms` is over with the task still stopping (`cancel_requested`).
pub(crate) async fn cancel_task(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((run, task)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let wait = cancel_wait(&raw)?;
    let row = app.tasks.cancel_task(&run, &task, &format!("cancelled over HTTP{}", caller.by_whom()), wait).await?;
    Ok(Json(json!({"task": row})))
}

#[derive(Deserialize, Default)]
struct RetryBody {
    #[serde(default)]
    with_dependents: bool,
}

/// A person's retry: the task (and with `with_dependents` the cancelled tasks below it)
/// back to `pending`; the host drives it like any other pending task.
pub(crate) async fn retry_task(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((run, task)): Path<(String, String)>,
    raw: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    // The body is optional: no body is `{}`.
    let body: RetryBody = if raw.iter().all(u8::is_ascii_whitespace) {
        RetryBody::default()
    } else {
        serde_json::from_slice(&raw).map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("the body: {e}")))?
    };
    let rows = app.tasks.retry(&run, &task, body.with_dependents, &caller.by("http")).await?;
    Ok(Json(json!({"run": run, "tasks": rows})))
}

pub(crate) async fn cancel_run(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(run): Path<String>,
    raw: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let wait = cancel_wait(&raw)?;
    let c = app.tasks.cancel_run(&run, &format!("run cancelled over HTTP{}", caller.by_whom()), wait).await?;
    Ok(Json(json!({"run": run, "cancelled": c.cancelled, "stopping": c.stopping})))
}

#[derive(Deserialize)]
pub(crate) struct AnswerBody {
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

pub(crate) async fn answer(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<AnswerBody>,
) -> Result<Json<Value>, ApiError> {
    let input = match (body.content, body.decline) {
        (Some(_), true) => return Err(ApiError::new(ErrorCode::BadRequest, "give content or decline, not both")),
        (Some(content), false) => Some(Input::Json(content)),
        (None, true) => Some(Input::Decline),
        (None, false) => None,
    };
    if let Some(input) = input {
        let answer = app.tasks.answer_input(&run, &task, None, input, &caller.by("http")).await?;
        return Ok(Json(json!({"answered": answer})));
    }
    let answered = app.tasks.answer(&run, &task, None, body.allow, body.option.as_deref(), &caller.by("http")).await?;
    Ok(Json(match answered {
        Answered::Option(chosen) => json!({"answered": chosen}),
        Answered::Rerun(row) => json!({"task": row}),
    }))
}

#[derive(Deserialize)]
pub(crate) struct SayBody {
    text: String,
    #[serde(default)]
    interrupt: bool,
}

/// A person's message to a running task: queued for its next prompt, or at once.
pub(crate) async fn say(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<SayBody>,
) -> Result<Response, ApiError> {
    let n = app.tasks.say(&run, &task, &body.text, body.interrupt, &caller.by("http")).await?;
    Ok((StatusCode::CREATED, Json(json!({"message": n}))).into_response())
}

#[derive(Deserialize)]
pub(crate) struct LeaseBody {
    worker: String,
    #[serde(default)]
    capabilities: Vec<String>,
    ttl_ms: Option<i64>,
}

pub(crate) async fn lease(State(app): State<Shared>, Body(body): Body<LeaseBody>) -> Result<Response, ApiError> {
    match app.tasks.lease(&body.worker, &body.capabilities, &[], body.ttl_ms).await? {
        Some(leased) => Ok(Json(json!(leased)).into_response()),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

#[derive(Deserialize)]
pub(crate) struct HeartbeatBody {
    worker: String,
    attempt: i64,
    ttl_ms: Option<i64>,
}

pub(crate) async fn heartbeat(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<HeartbeatBody>,
) -> Result<Json<Value>, ApiError> {
    let expires = app.tasks.heartbeat(&run, &task, &body.worker, body.attempt, body.ttl_ms).await?;
    Ok(Json(json!({"lease_expires_at_ms": expires})))
}

pub(crate) async fn update(
    State(app): State<Shared>,
    Path((run, task)): Path<(String, String)>,
    Body(body): Body<Value>,
) -> Result<Json<Value>, ApiError> {
    let (row, next) = app.tasks.report(&run, &task, body).await?;
    Ok(Json(match next {
        Some(next) => json!({"task": row, "next": next}),
        None => json!({"task": row}),
    }))
}
