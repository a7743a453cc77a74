//! The JSON error envelope: every error response is `{"error": {"code", "message"}}` with a
//! stable [`ErrorCode`], paired with its HTTP status in one place ([`status_of`]).

use axum::Json;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pier_host::{ActionError, ErrorCode, StoreError};
use serde_json::{Value, json};

/// A JSON error with a stable code.
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    pub(crate) extra: Option<Value>,
}

/// The HTTP status of each code: the one place that pairs them (README's table lists both).
pub fn status_of(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
        ErrorCode::Forbidden => StatusCode::FORBIDDEN,
        ErrorCode::BadRequest | ErrorCode::BadPlan => StatusCode::BAD_REQUEST,
        ErrorCode::NotFound | ErrorCode::UnknownRun | ErrorCode::UnknownTask | ErrorCode::UnknownSchedule => {
            StatusCode::NOT_FOUND
        }
        ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ErrorCode::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::RunExists
        | ErrorCode::ScheduleExists
        | ErrorCode::Duplicate
        | ErrorCode::BadTransition
        | ErrorCode::LeaseLost
        | ErrorCode::CancelRequested
        | ErrorCode::IdempotencyConflict
        | ErrorCode::NotAWorkerTask
        | ErrorCode::NotRunning
        | ErrorCode::NoSession
        | ErrorCode::MessagesWaiting => StatusCode::CONFLICT,
        ErrorCode::DiskFull => StatusCode::INSUFFICIENT_STORAGE,
        ErrorCode::StoreCorrupt | ErrorCode::Store | ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl ApiError {
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { status: status_of(code), code, message: message.into(), extra: None }
    }

    /// An error response axum (or a layer) made on its own, in the envelope: the code the
    /// status stands for, and its text as the message.
    pub(crate) fn of_status(status: StatusCode, text: &str) -> ApiError {
        let code = match status {
            StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
            StatusCode::FORBIDDEN => ErrorCode::Forbidden,
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
        let mut err = ApiError::new(e.code(), e.to_string());
        // A refused plan's problems, each with its line.
        if let ActionError::Plan(plan) = &e {
            err.extra = Some(serde_json::to_value(&plan.0).unwrap_or(Value::Null));
        }
        err
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
pub(crate) async fn envelope(resp: Response) -> Response {
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
