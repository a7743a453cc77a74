//! The egress proxy: the only way out of a confined agent's network namespace.
//!
//! An agent runs in a namespace that has nothing but loopback. The jail creates a listener on
//! `127.0.0.1:PORT` inside it and hands its descriptor to pier, which serves it here from pier's own
//! namespace, so upstream connections work normally; the agent finds the proxy through
//! `HTTP_PROXY`/`HTTPS_PROXY`/`ALL_PROXY`. This crate owns what happens to every connection on such
//! a listener:
//!
//! - `CONNECT host:port` (TLS and any other TCP) becomes a byte tunnel when the attempt's
//!   [`Allow`] list permits the target;
//! - absolute-form plain HTTP (`GET http://host/path`) is forwarded when permitted;
//! - everything else is refused with a message naming the target and the allowlist, a warning in
//!   the log, and a count (`pier_egress_refused_total` and [`Serving::refused`]).
//!
//! Plain HTTP goes through hyper as real HTTP rather than through spliced bytes: each request is
//! checked on its own (one keep-alive connection can name a different host per request), hop-by-hop
//! headers are dropped as a proxy must, upstream connections are pooled, and the model gateway built
//! on top of this proxy sees requests and responses as messages. Bodies are streamed frame by frame
//! in both directions, so a model's server-sent events reach the agent as they are produced.

mod allow;
pub mod gateway;
mod proxy;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use allow::Allow;

/// Connections one [`Serving`] handles at once; further ones wait in the listener's backlog.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a client may take to send a request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connecting upstream may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the egress proxy could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// A `network = [...]` entry is not a host.
    #[error(
        "network allowlist entry `{entry}` is not valid: {reason}; write it as `host`, `host:port` or `[ipv6-address]:port`"
    )]
    BadEntry {
        /// The entry as written.
        entry: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// The proxy, shared by every attempt: cheap to clone, one upstream connection pool for plain HTTP.
#[derive(Clone)]
pub struct Egress {
    inner: Arc<Inner>,
}

struct Inner {
    client: proxy::UpstreamClient,
}

impl Default for Egress {
    fn default() -> Self {
        Egress::new()
    }
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress").finish_non_exhaustive()
    }
}

impl Egress {
    /// A proxy with an empty connection pool.
    pub fn new() -> Egress {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_nodelay(true);
        // Without a timer the pool never expires idle upstream connections.
        let client = Client::builder(TokioExecutor::new()).pool_timer(TokioTimer::new()).build(connector);
        Egress { inner: Arc::new(Inner { client }) }
    }

    /// Serves `listener` for one attempt until the returned [`Serving`] is dropped; dropping it
    /// closes the listener and every connection and tunnel accepted on it. `label` names the attempt
    /// in logs.
    ///
    /// Must be called within a tokio runtime with I/O enabled; outside one this returns an error.
    pub fn serve(&self, listener: std::net::TcpListener, allow: Arc<Allow>, label: String) -> std::io::Result<Serving> {
        let runtime = tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let counters = Arc::new(Counters::default());
        let cancel = CancellationToken::new();
        let ctx = Arc::new(proxy::Ctx {
            client: self.inner.client.clone(),
            allow,
            label,
            counters: counters.clone(),
            cancel: cancel.clone(),
        });
        tracing::debug!(attempt = %ctx.label, %local_addr, "egress proxy serving");
        let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let accept = runtime.spawn(cancel.clone().run_until_cancelled_owned(proxy::accept_loop(listener, ctx, limit)));
        Ok(Serving { cancel, accept, counters, local_addr })
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    refused: AtomicU64,
    forwarded: AtomicU64,
}

impl Counters {
    pub(crate) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("pier_egress_refused_total").increment(1);
    }

    pub(crate) fn forwarded(&self) {
        self.forwarded.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("pier_egress_requests_total").increment(1);
    }
}

/// One attempt's listener being served; dropping it stops everything it started.
#[derive(Debug)]
pub struct Serving {
    cancel: CancellationToken,
    accept: JoinHandle<Option<()>>,
    counters: Arc<Counters>,
    local_addr: SocketAddr,
}

impl Serving {
    /// Requests and tunnels refused so far (not on the allowlist).
    pub fn refused(&self) -> u64 {
        self.counters.refused.load(Ordering::Relaxed)
    }

    /// Plain-HTTP requests answered by an upstream and tunnels opened so far.
    pub fn forwarded(&self) -> u64 {
        self.counters.forwarded.load(Ordering::Relaxed)
    }

    /// The address of the listener being served.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        // Every connection and tunnel task runs until this token is cancelled.
        self.cancel.cancel();
        self.accept.abort();
    }
}
