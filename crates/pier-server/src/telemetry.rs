//! `GET /metrics`: Prometheus text from the `metrics` facade and its Prometheus exporter.
//! The host and the client count what happens where it happens (`pier_host::telemetry`,
//! `pier_client::process`); this module installs the recorder once per process, keeps its
//! histograms drained, times every request, counts SSE clients, and reads the store's
//! figures (tasks by state, events appended) at scrape time.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use pier_host::TaskState;

use crate::{ApiError, ErrorCode, Shared};

const LATENCY: &str = "pier_http_request_duration_seconds";

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// The process's recorder, installed on first use (another recorder already installed
/// leaves `/metrics` answering 503, never a panic).
pub fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
            let built = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(LATENCY.to_owned()), &buckets)
                .and_then(PrometheusBuilder::install_recorder);
            match built {
                Ok(handle) => {
                    describe();
                    if let Ok(rt) = tokio::runtime::Handle::try_current() {
                        let h = handle.clone();
                        // Histogram samples wait in buffers until upkeep folds them into buckets.
                        rt.spawn(async move {
                            loop {
                                tokio::time::sleep(Duration::from_secs(5)).await;
                                h.run_upkeep();
                            }
                        });
                    }
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot install the metrics recorder; /metrics will answer 503");
                    None
                }
            }
        })
        .as_ref()
}

fn describe() {
    metrics::describe_gauge!("pier_tasks", "Tasks of the store, by state");
    metrics::describe_counter!("pier_attempts_total", "Attempts started by this node");
    metrics::describe_counter!("pier_retries_total", "Attempts that ended in a retry, by the class of what went wrong");
    metrics::describe_counter!("pier_lease_losses_total", "Attempts of this node whose lease was gone");
    metrics::describe_counter!("pier_events_total", "Events appended to the store's log (its last sequence number)");
    metrics::describe_gauge!("pier_sse_clients", "Clients connected to /events");
    metrics::describe_gauge!("pier_agent_processes", "Agent processes alive in this node");
    metrics::describe_histogram!(LATENCY, metrics::Unit::Seconds, "HTTP request latency, to the response head");
}

/// `GET /metrics`.
pub async fn scrape(State(app): State<Shared>) -> Result<Response, ApiError> {
    let Some(handle) = handle() else {
        return Err(ApiError::new(ErrorCode::Internal, "no metrics recorder is installed in this process"));
    };
    let counts = app.tasks.counts().await?;
    for state in TaskState::ALL {
        let n = counts.tasks.iter().find(|(s, _)| s == state.as_str()).map_or(0, |(_, n)| *n);
        metrics::gauge!("pier_tasks", "state" => state.as_str()).set(n as f64);
    }
    metrics::counter!("pier_events_total").absolute(counts.last_seq.max(0) as u64);
    handle.run_upkeep();
    Ok(([(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render()).into_response())
}

/// Times every request by method, route (as routed, not as asked: bounded labels) and status.
pub async fn track(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().as_str().to_owned();
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", MatchedPath::as_str).to_owned();
    let resp = next.run(req).await;
    let status = resp.status().as_u16().to_string();
    metrics::histogram!(LATENCY, "method" => method, "route" => route, "status" => status)
        .record(started.elapsed().as_secs_f64());
    resp
}

/// Counts one `/events` client while it is held.
pub struct SseClient(());

impl SseClient {
    pub fn new() -> SseClient {
        metrics::gauge!("pier_sse_clients").increment(1.0);
        SseClient(())
    }
}

impl Drop for SseClient {
    fn drop(&mut self) {
        metrics::gauge!("pier_sse_clients").decrement(1.0);
        give_back_memory();
    }
}

/// When readers leave, glibc's allocator keeps what they freed for later (the RSS of a server
/// 200 readers had left stayed at their peak): it is asked to return it to the system, at most
/// once a second, off the async threads.
fn give_back_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::sync::atomic::{AtomicU64, Ordering};
        static LAST: AtomicU64 = AtomicU64::new(0);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if LAST.swap(now, Ordering::Relaxed) == now {
            return;
        }
        let trim = || {
            // SAFETY: malloc_trim only returns free memory of the allocator's own to the system.
            #[allow(unsafe_code)]
            unsafe {
                libc::malloc_trim(0);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                // A second later: the reader's last buffers are freed by then.
                rt.spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let _ = tokio::task::spawn_blocking(trim).await;
                });
            }
            Err(_) => trim(),
        }
    }
}
