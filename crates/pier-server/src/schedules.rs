//! `/schedules`: declare, list, pause, resume and delete schedules, each one
//! [`pier_host::Tasks`] call.

use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pier_host::ActionError;
use pier_host::schedule::ScheduleSpec;
use serde_json::{Value, json};

use crate::Shared;
use crate::access::Caller;
use crate::error::{ApiError, Body};

pub(crate) async fn list(State(app): State<Shared>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"schedules": app.tasks.schedules().await?})))
}

/// A schedule as pier.toml's `[[schedules]]` says it, with `plan` the plan's text: 201 when
/// created, 200 when the same schedule was there already.
pub(crate) async fn add(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Body(body): Body<Value>,
) -> Result<Response, ApiError> {
    let spec = ScheduleSpec::from_value(body).map_err(|p| ActionError::bad_request(p.join("; ")))?;
    let (view, created) = app.tasks.add_schedule(spec, &caller.by("http")).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(json!({"schedule": view}))).into_response())
}

pub(crate) async fn show(State(app): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"schedule": app.tasks.schedule(&id).await?})))
}

pub(crate) async fn pause(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"schedule": app.tasks.pause_schedule(&id, true, &caller.by("http")).await?})))
}

pub(crate) async fn resume(
    State(app): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"schedule": app.tasks.pause_schedule(&id, false, &caller.by("http")).await?})))
}

pub(crate) async fn delete(State(app): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    app.tasks.delete_schedule(&id).await?;
    Ok(Json(json!({"deleted": id})))
}
