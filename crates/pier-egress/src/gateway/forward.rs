//! One request through the gateway: the account its placeholder names, the real key swapped
//! in, the answer streamed back as it comes while its usage is read, and one [`ModelCall`]
//! recorded however it ends.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::limit::{self, Limiter};
use super::usage::Reader;
use super::{Account, Api, MAX_REQUEST_BYTES, ModelCall, Route, Shared, UPSTREAM_IDLE, Upstream};
use crate::proxy::{BoxError, chain, strip_hop_by_hop};

type Body = UnsyncBoxBody<Bytes, BoxError>;

/// How long an answer the agent hung up on is still read for its usage report.
const DRAIN_AFTER_HANG_UP: std::time::Duration = std::time::Duration::from_secs(2);

/// Headers that carry a key (the placeholder on the way in), and one that would let the
/// upstream compress what the gateway must read.
const KEY_HEADERS: [HeaderName; 3] =
    [header::AUTHORIZATION, HeaderName::from_static("x-api-key"), HeaderName::from_static("x-goog-api-key")];

pub(crate) async fn accept_loop(listener: TcpListener, shared: Weak<Shared>, limit: Arc<Semaphore>) {
    crate::proxy::accept_each(listener, limit, "model gateway", |stream, permit| {
        let cancel = shared.upgrade()?.cancel.clone();
        Some((cancel, serve_connection(stream, shared.clone(), permit)))
    })
    .await;
}

async fn serve_connection(stream: tokio::net::TcpStream, shared: Weak<Shared>, _permit: OwnedSemaphorePermit) {
    let service = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        async move { Ok::<_, Infallible>(handle(shared, req).await) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(crate::HEADER_READ_TIMEOUT);
    if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
        tracing::debug!(error = %e, "model gateway connection ended with an error");
    }
}

async fn handle(shared: Weak<Shared>, req: Request<Incoming>) -> Response<Body> {
    let started = Instant::now();
    let path = req.uri().path().to_owned();
    let Some(route) = Route::ALL
        .into_iter()
        .find(|r| path.strip_prefix(r.prefix()).is_some_and(|rest| rest.is_empty() || rest.starts_with('/')))
    else {
        let routes: Vec<&str> = Route::ALL.iter().map(|r| r.prefix()).collect();
        let message = format!("pier gateway: no model API at {path}; base URLs end in one of {}", routes.join(", "));
        return error(Api::OpenAi, StatusCode::NOT_FOUND, &message);
    };
    let api = route.api();
    let Some(shared) = shared.upgrade() else {
        return error(api, StatusCode::SERVICE_UNAVAILABLE, "pier gateway: shutting down");
    };
    let Some(account) = placeholder(&req).and_then(|k| shared.account(&k)) else {
        return error(
            api,
            StatusCode::UNAUTHORIZED,
            "pier gateway: this key does not name a running attempt; use the key pier gave the agent",
        );
    };
    let Some(upstream) = account.upstreams.iter().find(|u| u.route == route).cloned() else {
        let message = format!("pier gateway: this task has no upstream for {}", route.name());
        return error(api, StatusCode::NOT_FOUND, &message);
    };
    if let Err(why) = account.meter.admit() {
        return error(api, StatusCode::PAYMENT_REQUIRED, &format!("pier gateway: {why}"));
    }
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, MAX_REQUEST_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            let message = format!("pier gateway: the request is over {} MiB", MAX_REQUEST_BYTES >> 20);
            return error(api, StatusCode::PAYLOAD_TOO_LARGE, &message);
        }
        Err(e) => return error(api, StatusCode::BAD_REQUEST, &format!("pier gateway: reading the request: {e}")),
    };
    let (model, streamed) = requested(route, &path, &body);
    // The node's rate limit for the provider: wait for a slot within the provider's hold, or
    // give the agent the provider's own 429 and have the host park the task until the slot.
    let limiter = shared.limiters.of(&upstream.provider);
    let hold = limiter.hold();
    match limiter.reserve(hold) {
        Ok(wait) if !wait.is_zero() => tokio::time::sleep(wait).await,
        Ok(_) => {}
        Err(wait) => {
            metrics::counter!("pier_model_requests_refused_total", "why" => "rate_limit").increment(1);
            let why = format!(
                "the rate limit of {} on this node is reached for {} s (more than the {} s a request may be held); the task waits until then",
                upstream.provider,
                wait.as_secs_f64().ceil(),
                hold.as_secs_f64()
            );
            account.meter.rate_limited(limit::wall_ms_after(wait), why.clone());
            let mut resp = error(api, StatusCode::TOO_MANY_REQUESTS, &format!("pier gateway: {why}"));
            if let Ok(v) = HeaderValue::from_str(&wait.as_secs_f64().ceil().to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
            return resp;
        }
    }
    // From here every path records the call exactly once.
    account.meter.begin();
    let mut call = ModelCall {
        provider: upstream.provider.clone(),
        route,
        model,
        status: 0,
        latency_ms: 0,
        held_ms: started.elapsed().as_millis() as u64,
        streamed,
        usage: None,
        complete: false,
        hung_up: false,
        error: None,
    };
    let rest = &path[route.prefix().len()..];
    let url = format!("{}{rest}{}", upstream.base_url.trim_end_matches('/'), query(parts.uri.query()));
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    for name in KEY_HEADERS.iter().chain([header::HOST, header::CONTENT_LENGTH, header::ACCEPT_ENCODING].iter()) {
        headers.remove(name);
    }
    set_key(&mut headers, &upstream);
    let mut tries = 0;
    let resp = loop {
        let sent = shared.client.request(parts.method.clone(), &url).headers(headers.clone()).body(body.clone()).send();
        let resp = match tokio::time::timeout(UPSTREAM_IDLE, sent).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                let why = format!("the upstream {} did not answer: {}", upstream.provider, chain(&e));
                return failed(&account, call, started, api, why);
            }
            Err(_) => {
                let why = format!("the upstream {} sent no answer in {} s", upstream.provider, UPSTREAM_IDLE.as_secs());
                return failed(&account, call, started, api, why);
            }
        };
        if !limit::too_many(resp.status().as_u16()) {
            break resp;
        }
        // The provider says "too many": nobody on this node sends to it before its reset; this
        // request is sent again then if that is within its hold, else the agent gets the answer.
        let status = resp.status();
        let head = resp.headers().clone();
        let answer = small_body(resp).await;
        let wait = limit::retry_delay(&head, &answer, tries);
        limiter.close_for(wait);
        tries += 1;
        let held = started.elapsed();
        let slot = if held + wait <= hold {
            tokio::time::sleep(wait).await;
            limiter.reserve(hold.saturating_sub(started.elapsed()))
        } else {
            Err(wait)
        };
        match slot {
            Ok(more) => {
                metrics::counter!("pier_model_retries_total", "provider" => upstream.provider.clone()).increment(1);
                tracing::info!(provider = %upstream.provider, ?wait, "the upstream is rate limited; sending again");
                tokio::time::sleep(more).await;
                call.held_ms = started.elapsed().as_millis() as u64;
            }
            Err(wait) => {
                let why = format!(
                    "the upstream {} is rate limited ({}) for {} s more, past the {} s a request may be held; the task waits until then",
                    upstream.provider,
                    status.as_u16(),
                    wait.as_secs_f64().ceil(),
                    hold.as_secs_f64()
                );
                account.meter.rate_limited(limit::wall_ms_after(wait), why.clone());
                call.status = status.as_u16();
                call.held_ms = held.as_millis() as u64;
                call.latency_ms = started.elapsed().as_millis() as u64;
                call.error = Some(why);
                record(&account, call);
                let mut out = Response::new(Full::new(answer).map_err(|never| match never {}).boxed_unsync());
                *out.status_mut() = status;
                *out.headers_mut() = head;
                strip_hop_by_hop(out.headers_mut());
                out.headers_mut().remove(header::CONTENT_LENGTH);
                return out;
            }
        }
    };
    call.status = resp.status().as_u16();
    let sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    call.streamed |= sse;
    let mut out = Response::builder().status(resp.status());
    if let Some(h) = out.headers_mut() {
        h.clone_from(resp.headers());
        strip_hop_by_hop(h);
    }
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(pump(resp, tx, Reader::new(api, sse), account, limiter, call, started));
    out.body(ChannelBody(rx).boxed_unsync()).unwrap_or_else(|e| {
        error(api, StatusCode::BAD_GATEWAY, &format!("pier gateway: the upstream's answer head is not valid: {e}"))
    })
}

/// A "too many requests" answer, read whole for the wait it names (bounded: it is small).
async fn small_body(resp: reqwest::Response) -> Bytes {
    const MAX: usize = 64 << 10;
    let read = async {
        let mut resp = resp;
        let mut out = Vec::new();
        while let Ok(Some(chunk)) = resp.chunk().await {
            out.extend_from_slice(&chunk);
            if out.len() > MAX {
                out.truncate(MAX);
                break;
            }
        }
        Bytes::from(out)
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), read).await.unwrap_or_default()
}

/// Passes the answer on chunk by chunk and records the call when it ends, however it ends.
async fn pump(
    mut resp: reqwest::Response,
    tx: mpsc::Sender<Result<Bytes, BoxError>>,
    mut reader: Reader,
    account: Arc<Account>,
    limiter: Arc<Limiter>,
    mut call: ModelCall,
    started: Instant,
) {
    let ended: Result<(), String> = loop {
        let next = tokio::select! {
            biased;
            () = tx.closed() => {
                call.hung_up = true;
                account.meter.hung_up();
                break Err(hung_up(&mut resp, &mut reader).await);
            }
            next = tokio::time::timeout(UPSTREAM_IDLE, resp.chunk()) => next,
        };
        match next {
            Ok(Ok(Some(bytes))) => {
                reader.feed(&bytes);
                if tx.send(Ok(bytes)).await.is_err() {
                    call.hung_up = true;
                    account.meter.hung_up();
                    break Err(hung_up(&mut resp, &mut reader).await);
                }
            }
            Ok(Ok(None)) => break Ok(()),
            Ok(Err(e)) => {
                let why = format!("the upstream's answer broke off: {}", chain(&e));
                let _ = tx.send(Err(why.clone().into())).await;
                break Err(why);
            }
            Err(_) => {
                let why = format!("the upstream sent nothing for {} s", UPSTREAM_IDLE.as_secs());
                let _ = tx.send(Err(why.clone().into())).await;
                break Err(why);
            }
        }
    };
    reader.finish();
    call.usage = reader.usage;
    if reader.model.is_some() {
        call.model = reader.model.take();
    }
    call.complete = ended.is_ok();
    call.error = ended.err();
    if reader.unparsed > 0 && call.error.is_none() && call.status < 300 {
        call.error = Some(format!("{} part(s) of the answer could not be read for usage", reader.unparsed));
    }
    call.latency_ms = started.elapsed().as_millis() as u64;
    if let Some(u) = &call.usage {
        limiter.spent(u.input + u.output);
    }
    record(&account, call);
}

/// The agent went away mid-answer. The provider bills what it generated, and reports it only at
/// the end: the rest of the answer is read (not passed on) for its usage, for at most
/// [`DRAIN_AFTER_HANG_UP`], then the upstream is dropped, which ends its generation.
async fn hung_up(resp: &mut reqwest::Response, reader: &mut Reader) -> String {
    let drained = tokio::time::timeout(DRAIN_AFTER_HANG_UP, async {
        while let Ok(Some(bytes)) = resp.chunk().await {
            reader.feed(&bytes);
        }
    })
    .await;
    match drained {
        Ok(()) => "the agent hung up before the answer ended (the rest was read for its usage)".into(),
        Err(_) => format!(
            "the agent hung up before the answer ended; the upstream was cut {} s later, before it reported usage",
            DRAIN_AFTER_HANG_UP.as_secs()
        ),
    }
}

fn failed(account: &Account, mut call: ModelCall, started: Instant, api: Api, why: String) -> Response<Body> {
    call.latency_ms = started.elapsed().as_millis() as u64;
    call.error = Some(why.clone());
    record(account, call);
    error(api, StatusCode::BAD_GATEWAY, &format!("pier gateway: {why}"))
}

fn record(account: &Account, call: ModelCall) {
    let model = call.model.clone().unwrap_or_else(|| "unknown".into());
    let labels = [("provider", call.provider.clone()), ("model", model)];
    metrics::counter!("pier_model_requests_total", &labels).increment(1);
    metrics::histogram!("pier_model_request_seconds", "provider" => call.provider.clone())
        .record(call.latency_ms as f64 / 1000.0);
    if let Some(u) = call.usage {
        for (kind, n) in
            [("input", u.input), ("cached_input", u.cached_input), ("output", u.output), ("reasoning", u.reasoning)]
        {
            let labels = [labels[0].clone(), labels[1].clone(), ("kind", kind.to_owned())];
            metrics::counter!("pier_model_tokens_total", &labels).increment(n);
        }
    }
    tracing::debug!(attempt = %account.label, ?call, "model request");
    account.meter.record(call);
}

/// The placeholder the agent sent, in whichever place its SDK puts a key.
fn placeholder<B>(req: &Request<B>) -> Option<String> {
    let h = req.headers();
    let header = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(auth) = header("authorization") {
        return auth.strip_prefix("Bearer ").or_else(|| auth.strip_prefix("bearer ")).map(|k| k.trim().to_owned());
    }
    header("x-api-key")
        .or_else(|| header("x-goog-api-key"))
        .map(str::to_owned)
        .or_else(|| req.uri().query()?.split('&').find_map(|kv| kv.strip_prefix("key=")).map(str::to_owned))
}

/// The query without the placeholder (`?key=`), which never goes upstream.
fn query(q: Option<&str>) -> String {
    let kept: Vec<&str> = q.unwrap_or("").split('&').filter(|kv| !kv.is_empty() && !kv.starts_with("key=")).collect();
    if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) }
}

/// The real key, in the header the provider's API reads it from.
fn set_key(headers: &mut HeaderMap, upstream: &Upstream) {
    let Some(key) = &upstream.key else { return };
    let (name, value) = match upstream.route.api() {
        Api::OpenAi => (header::AUTHORIZATION, format!("Bearer {key}")),
        Api::Anthropic => (HeaderName::from_static("x-api-key"), key.clone()),
        Api::Gemini => (HeaderName::from_static("x-goog-api-key"), key.clone()),
    };
    if let Ok(mut v) = HeaderValue::from_str(&value) {
        v.set_sensitive(true);
        headers.insert(name, v);
    }
}

/// The model a request names and whether it asked for a stream.
fn requested(route: Route, path: &str, body: &[u8]) -> (Option<String>, bool) {
    if route == Route::Gemini {
        let model = path.split("/models/").nth(1).and_then(|m| m.split(':').next()).map(str::to_owned);
        return (model, path.contains(":streamGenerateContent"));
    }
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    (v.get("model").and_then(Value::as_str).map(str::to_owned), v.get("stream") == Some(&Value::Bool(true)))
}

/// An error in the shape the route's SDK reads, so the agent shows the message as its own.
fn error(api: Api, status: StatusCode, message: &str) -> Response<Body> {
    let body = match api {
        Api::OpenAi => json!({"error": {"message": message, "type": openai_type(status), "code": status.as_u16()}}),
        Api::Anthropic => json!({"type": "error", "error": {"type": anthropic_type(status), "message": message}}),
        Api::Gemini => json!({"error": {"code": status.as_u16(), "message": message, "status": gemini_status(status)}}),
    };
    let mut resp =
        Response::new(Full::new(Bytes::from(body.to_string())).map_err(|never| match never {}).boxed_unsync());
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn openai_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "invalid_api_key",
        429 => "rate_limit_exceeded",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

fn gemini_status(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "UNAUTHENTICATED",
        404 => "NOT_FOUND",
        429 => "RESOURCE_EXHAUSTED",
        503 => "UNAVAILABLE",
        s if s >= 500 => "INTERNAL",
        _ => "INVALID_ARGUMENT",
    }
}

/// The answer's body as the pump hands it over.
struct ChannelBody(mpsc::Receiver<Result<Bytes, BoxError>>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|next| next.map(|r| r.map(Frame::data)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_placeholder_never_goes_upstream_in_the_query() {
        assert_eq!(query(Some("alt=sse&key=pier-gw-1")), "?alt=sse");
        assert_eq!(query(Some("key=x")), "");
        assert_eq!(query(None), "");
    }

    #[test]
    fn gemini_names_its_model_in_the_path() {
        let (m, s) = requested(Route::Gemini, "/gemini/v1beta/models/gemini-2.5-pro:streamGenerateContent", b"");
        assert_eq!((m.as_deref(), s), (Some("gemini-2.5-pro"), true));
        let (m, s) = requested(Route::OpenAi, "/openai/v1/responses", br#"{"model":"o4","stream":true}"#);
        assert_eq!((m.as_deref(), s), (Some("o4"), true));
    }
}
