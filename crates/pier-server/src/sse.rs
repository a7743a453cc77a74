//! `GET /events`: the log as SSE, through the host's one follower ([`pier_host::Follower`]).
//! `id` is an event's sequence, `event` its type, `data` the event as one flat object.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::StreamExt;
use pier_host::{Delivered, ErrorCode, EventFilter, Follow};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::{Shared, telemetry};

/// Read as text and checked by [`events`], so a malformed value is answered with
/// the JSON error envelope rather than axum's plain-text rejection.
#[derive(Deserialize)]
pub(crate) struct EventsQuery {
    after: Option<String>,
    run: Option<String>,
    /// `false` ends the stream once it has caught up.
    follow: Option<String>,
    /// Only this task's events.
    task: Option<String>,
    /// Only events of these types, comma-separated.
    #[serde(rename = "type")]
    types: Option<String>,
    /// Only events from this long ago (`10m`) or since this time (RFC 3339).
    since: Option<String>,
    /// `deltas`: an agent's text deltas merged per message.
    merge: Option<String>,
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

pub(crate) async fn events(
    State(app): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Sse<impl futures::Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    event_stream(app, headers, q, CancellationToken::new())
}

/// The `/events` stream, which also ends when `end` is cancelled (a dashboard session that
/// logs out or expires).
pub(crate) fn event_stream(
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
    let live = match q.follow.as_deref() {
        None | Some("true") => true,
        Some("false") => false,
        Some(other) => {
            return Err(ApiError::new(ErrorCode::BadRequest, format!("follow must be true or false, not {other:?}")));
        }
    };
    let after = from_header.or(from_query).unwrap_or(0);
    let since_ms = match q.since.as_deref() {
        Some(text) => Some(
            EventFilter::since(text, pier_host::store::now_ms())
                .map_err(|e| ApiError::new(ErrorCode::BadRequest, e))?,
        ),
        None => None,
    };
    let types =
        q.types.as_deref().map(|t| t.split(',').map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).collect());
    let only = EventFilter { task: q.task, types: types.unwrap_or_default(), since_ms };
    let merge = match q.merge.as_deref() {
        None => false,
        Some("deltas") => true,
        Some(other) => return Err(ApiError::new(ErrorCode::BadRequest, format!("merge takes deltas, not {other:?}"))),
    };
    let follower = app.tasks.follow(Follow { run: q.run, after, live, only, merge });
    let encode = |e: pier_host::Event| {
        let (seq, kind) = (e.seq, e.kind.clone());
        SseEvent::default().id(seq.to_string()).event(kind).data(e.into_wire().to_string())
    };
    let delivered = follower.queued(app.sse.buffer, app.sse.patience, end, encode);
    // The client is counted while its response lives (dropped when it disconnects).
    let client = telemetry::SseClient::new();
    let stream = delivered.map(move |d| {
        let _counted = &client;
        Ok(match d {
            Delivered::Event(e) => e,
            Delivered::Cut { after } => {
                SseEvent::default().comment(format!("too slow; reconnect with Last-Event-ID {after}"))
            }
        })
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
