//! One listener's connections: the accept loop, CONNECT tunnels and plain-HTTP forwarding.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::http::Extensions;
use hyper::{Method, Request, Response, StatusCode, Version};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::{Allow, CONNECT_TIMEOUT, Counters, HEADER_READ_TIMEOUT};

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;
/// Bodies in both directions: a client's or upstream's streamed body, or a message of our own.
type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;
pub(crate) type UpstreamClient = Client<HttpConnector, ProxyBody>;

/// A failing `accept` (out of descriptors, say) would otherwise spin the loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Headers that describe one connection, not the message, and must not cross the proxy (RFC 9110
/// §7.6.1), plus `Expect`, which the serving side has already answered.
const HOP_BY_HOP: [HeaderName; 10] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::EXPECT,
];

/// What every connection of one [`crate::Serving`] shares.
pub(crate) struct Ctx {
    pub(crate) client: UpstreamClient,
    pub(crate) allow: Arc<Allow>,
    pub(crate) label: String,
    pub(crate) counters: Arc<Counters>,
    pub(crate) cancel: CancellationToken,
}

pub(crate) async fn accept_loop(listener: TcpListener, ctx: Arc<Ctx>, limit: Arc<Semaphore>) {
    let label = ctx.label.clone();
    accept_each(listener, limit, &label, |stream, permit| {
        Some((ctx.cancel.clone(), serve_connection(stream, ctx.clone(), permit)))
    })
    .await;
}

/// Accepts connections while a permit of `limit` is free (the permit is taken before
/// accepting, so connections beyond the limit wait in the backlog), each served by what `serve`
/// returns until its token is cancelled; `serve` returning `None` ends the loop.
pub(crate) async fn accept_each<F, Fut>(listener: TcpListener, limit: Arc<Semaphore>, label: &str, mut serve: F)
where
    F: FnMut(TcpStream, OwnedSemaphorePermit) -> Option<(CancellationToken, Fut)>,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        let Ok(permit) = limit.clone().acquire_owned().await else { return };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(%label, error = %e, "could not accept a connection");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        // Latency matters more than packet count for interactive streams; failure changes nothing.
        let _ = stream.set_nodelay(true);
        let Some((cancel, served)) = serve(stream, permit) else { return };
        tokio::spawn(cancel.run_until_cancelled_owned(served));
    }
}

async fn serve_connection(stream: TcpStream, ctx: Arc<Ctx>, permit: OwnedSemaphorePermit) {
    // A tunnel outlives the HTTP connection it was upgraded from and keeps the permit with it.
    let permit = Arc::new(permit);
    let label = ctx.label.clone();
    let service = hyper::service::service_fn(move |req| {
        let ctx = ctx.clone();
        let permit = permit.clone();
        async move { Ok::<_, Infallible>(handle(ctx, permit, req).await) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    if let Err(e) = http.serve_connection(TokioIo::new(stream), service).with_upgrades().await {
        tracing::debug!(attempt = %label, error = %chain(&e), "egress proxy connection ended with an error");
    }
}

async fn handle(ctx: Arc<Ctx>, permit: Arc<OwnedSemaphorePermit>, req: Request<Incoming>) -> Response<ProxyBody> {
    if req.method() == Method::CONNECT { tunnel(&ctx, permit, req).await } else { forward(&ctx, req).await }
}

async fn tunnel(ctx: &Ctx, permit: Arc<OwnedSemaphorePermit>, mut req: Request<Incoming>) -> Response<ProxyBody> {
    let Some(authority) = req.uri().authority().cloned() else {
        return text(StatusCode::BAD_REQUEST, "pier egress: CONNECT needs a target of the form host:port".into());
    };
    let host = authority.host();
    let Some(port) = authority.port_u16() else {
        return text(
            StatusCode::BAD_REQUEST,
            format!("pier egress: CONNECT {host} has no port; send CONNECT {host}:443"),
        );
    };
    if !ctx.allow.permits(host, port) {
        return refuse(ctx, "CONNECT", host, port);
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let upstream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((bare, port))).await {
        Ok(Ok(upstream)) => upstream,
        Ok(Err(e)) => return upstream_failed(ctx, host, port, format!("could not connect to {host}:{port}: {e}")),
        Err(_) => {
            let secs = CONNECT_TIMEOUT.as_secs();
            return upstream_failed(ctx, host, port, format!("connecting to {host}:{port} timed out after {secs} s"));
        }
    };
    let _ = upstream.set_nodelay(true);
    let upgrade = hyper::upgrade::on(&mut req);
    let label = ctx.label.clone();
    let target = format!("{host}:{port}");
    tokio::spawn(ctx.cancel.clone().run_until_cancelled_owned(async move {
        let _permit = permit;
        let mut upstream = upstream;
        match upgrade.await {
            Ok(upgraded) => {
                let mut client = TokioIo::new(upgraded);
                match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                    Ok((up, down)) => tracing::debug!(attempt = %label, %target, up, down, "egress tunnel closed"),
                    Err(e) => {
                        tracing::debug!(attempt = %label, %target, error = %e, "egress tunnel ended with an error")
                    }
                }
            }
            Err(e) => {
                tracing::debug!(attempt = %label, %target, error = %chain(&e), "egress tunnel was never upgraded")
            }
        }
    }));
    ctx.counters.forwarded();
    tracing::debug!(attempt = %ctx.label, %host, port, "egress tunnel opened");
    let mut resp = Response::new(empty());
    resp.extensions_mut().insert(hyper::ext::ReasonPhrase::from_static(b"Connection Established"));
    resp
}

async fn forward(ctx: &Ctx, req: Request<Incoming>) -> Response<ProxyBody> {
    let uri = req.uri().clone();
    let (scheme, authority) = match (uri.scheme_str(), uri.authority()) {
        (Some(scheme), Some(authority)) => (scheme, authority),
        _ => {
            return text(
                StatusCode::BAD_REQUEST,
                "this is pier's egress proxy; send absolute-form requests or CONNECT \
                 (set HTTP_PROXY/HTTPS_PROXY to this address instead of requesting it directly)"
                    .into(),
            );
        }
    };
    if scheme.eq_ignore_ascii_case("https") {
        let (host, port) = (authority.host(), authority.port_u16().unwrap_or(443));
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "pier egress: {uri} must go through a CONNECT tunnel; send CONNECT {host}:{port} and speak TLS in it"
            ),
        );
    }
    if !scheme.eq_ignore_ascii_case("http") {
        return text(
            StatusCode::BAD_REQUEST,
            format!("pier egress: `{scheme}://` is not forwarded; use http:// or a CONNECT tunnel"),
        );
    }
    let host = authority.host();
    let port = authority.port_u16().unwrap_or(80);
    if !ctx.allow.permits(host, port) {
        return refuse(ctx, req.method().as_str(), host, port);
    }

    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // RFC 9112 §3.2.2: the target's authority, not the client's Host, names the origin; removing
    // Host lets the client set it from the absolute URI (no userinfo, default port omitted).
    parts.headers.remove(header::HOST);
    parts.version = Version::HTTP_11;
    // The serving connection's extensions (its upgrade handle among them) mean nothing upstream.
    parts.extensions = Extensions::new();
    let upstream_req = Request::from_parts(parts, body.map_err(BoxError::from).boxed_unsync());

    match ctx.client.request(upstream_req).await {
        Ok(resp) => {
            ctx.counters.forwarded();
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            parts.extensions = Extensions::new();
            Response::from_parts(parts, body.map_err(BoxError::from).boxed_unsync())
        }
        Err(e) => upstream_failed(ctx, host, port, format!("forwarding to {host}:{port} failed: {}", chain(&e))),
    }
}

fn refuse(ctx: &Ctx, what: &str, host: &str, port: u16) -> Response<ProxyBody> {
    ctx.counters.refused();
    tracing::warn!(attempt = %ctx.label, %host, port, request = what, "egress refused: not on the network allowlist");
    let allowed =
        if ctx.allow.is_empty() { "none".to_string() } else { ctx.allow.entries().collect::<Vec<_>>().join(", ") };
    text(
        StatusCode::FORBIDDEN,
        format!(
            "pier egress: {host}:{port} is not on this task's network allowlist (allowed: {allowed}); \
             add it to the plan's `network = [...]`"
        ),
    )
}

fn upstream_failed(ctx: &Ctx, host: &str, port: u16, reason: String) -> Response<ProxyBody> {
    tracing::info!(attempt = %ctx.label, %host, port, %reason, "egress upstream failed");
    text(StatusCode::BAD_GATEWAY, format!("pier egress: {reason}"))
}

pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

fn text(status: StatusCode, message: String) -> Response<ProxyBody> {
    let mut resp = Response::new(Full::new(Bytes::from(message + "\n")).map_err(|never| match never {}).boxed_unsync());
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

fn empty() -> ProxyBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// An error with its causes, which hyper keeps out of its own message ("client error (Connect)").
pub(crate) fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}
