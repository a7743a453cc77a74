//! The stable error codes a person or a program meets when the host refuses something:
//! the `code` of `pier serve`'s JSON error envelope, and what the CLI matches on. One
//! closed list, so a code cannot be misspelt at one site and documented at none.

use std::fmt;

/// One stable error code. The HTTP status that goes with each lives in `pier-server`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// No bearer token, or the wrong one.
    Unauthorized,
    /// A token whose user's role does not allow the route.
    Forbidden,
    /// A body, query or path that is malformed or not the right shape.
    BadRequest,
    /// A plan refused before anything was stored, with every problem and its line.
    BadPlan,
    /// No such route.
    NotFound,
    /// The route exists, but not for this method.
    MethodNotAllowed,
    /// A body sent without `Content-Type: application/json`.
    UnsupportedMediaType,
    /// A body over the route's limit.
    TooLarge,
    /// Too many requests of a kind: failed authentication, messages waiting for a task.
    TooManyRequests,
    UnknownRun,
    UnknownTask,
    /// A run id that is taken (by another plan).
    RunExists,
    UnknownSchedule,
    /// A schedule id that is taken (by another spec).
    ScheduleExists,
    Duplicate,
    /// The task is not in a state that allows the operation.
    BadTransition,
    /// The caller's lease is gone: stop working on the task.
    LeaseLost,
    /// A person cancelled the task the caller's attempt holds: stop its agent and report its
    /// ending (with its output); the task ends cancelled.
    CancelRequested,
    /// An idempotency key reused with another body.
    IdempotencyConflict,
    NotAWorkerTask,
    /// A message for a task that is not running.
    NotRunning,
    /// A message for a task whose agent has no session to take it.
    NoSession,
    /// An ending refused because a person's message waits for the task: take it and go on.
    MessagesWaiting,
    StoreCorrupt,
    DiskFull,
    /// The store failed or cannot be reached.
    Store,
    /// Anything else that went wrong on the server's side.
    Internal,
}

impl ErrorCode {
    /// Every code, in the order the documentation lists them.
    pub const ALL: [ErrorCode; 27] = [
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::BadRequest,
        ErrorCode::BadPlan,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::TooLarge,
        ErrorCode::TooManyRequests,
        ErrorCode::UnknownRun,
        ErrorCode::UnknownTask,
        ErrorCode::RunExists,
        ErrorCode::UnknownSchedule,
        ErrorCode::ScheduleExists,
        ErrorCode::Duplicate,
        ErrorCode::BadTransition,
        ErrorCode::LeaseLost,
        ErrorCode::CancelRequested,
        ErrorCode::IdempotencyConflict,
        ErrorCode::NotAWorkerTask,
        ErrorCode::NotRunning,
        ErrorCode::NoSession,
        ErrorCode::MessagesWaiting,
        ErrorCode::StoreCorrupt,
        ErrorCode::DiskFull,
        ErrorCode::Store,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::BadPlan => "bad_plan",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::TooManyRequests => "too_many_requests",
            ErrorCode::UnknownRun => "unknown_run",
            ErrorCode::UnknownTask => "unknown_task",
            ErrorCode::RunExists => "run_exists",
            ErrorCode::UnknownSchedule => "unknown_schedule",
            ErrorCode::ScheduleExists => "schedule_exists",
            ErrorCode::Duplicate => "duplicate",
            ErrorCode::BadTransition => "bad_transition",
            ErrorCode::LeaseLost => "lease_lost",
            ErrorCode::CancelRequested => "cancel_requested",
            ErrorCode::IdempotencyConflict => "idempotency_conflict",
            ErrorCode::NotAWorkerTask => "not_a_worker_task",
            ErrorCode::NotRunning => "not_running",
            ErrorCode::NoSession => "no_session",
            ErrorCode::MessagesWaiting => "messages_waiting",
            ErrorCode::StoreCorrupt => "store_corrupt",
            ErrorCode::DiskFull => "disk_full",
            ErrorCode::Store => "store",
            ErrorCode::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl serde::Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}
