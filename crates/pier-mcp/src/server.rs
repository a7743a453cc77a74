//! One connected MCP server: its rmcp client, its process (stdio) and the way it is stopped.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rmcp::RoleClient;
use rmcp::service::Peer;

use crate::stdio::ChildProcess;

/// How long a stdio server gets between SIGTERM and SIGKILL.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(2);

/// How long an http server's client gets to close its session.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a call that found the connection gone waits for the process's exit and last stderr.
const SETTLE: Duration = Duration::from_secs(2);

/// A started server, shared by [`crate::McpServers`] and every tool of the server. Dropping the last
/// owner cancels the client (rmcp's drop guard) and kills the process ([`ChildProcess`]'s drop).
pub(crate) struct Server {
    pub(crate) name: String,
    pub(crate) peer: Peer<RoleClient>,
    /// Taken by [`Server::stop`]; while it is here, the client runs.
    service: Mutex<Option<crate::Client>>,
    /// `None` for an http server.
    process: Option<ChildProcess>,
    /// The lines of its stdout the transport dropped so far (a stdio server's).
    dropped: Option<tokio::sync::watch::Receiver<crate::lines::Dropped>>,
    /// How long one call may take.
    pub(crate) call_timeout: std::time::Duration,
}

impl Server {
    pub(crate) fn new(name: String, service: crate::Client, process: Option<ChildProcess>) -> Server {
        let peer = service.peer().clone();
        Server {
            name,
            peer,
            service: Mutex::new(Some(service)),
            process,
            dropped: None,
            call_timeout: crate::DEFAULT_CALL_TIMEOUT,
        }
    }

    /// With the lines of its stdout the transport drops.
    pub(crate) fn watching(mut self, dropped: tokio::sync::watch::Receiver<crate::lines::Dropped>) -> Server {
        self.dropped = Some(dropped);
        self
    }

    /// With how long one call may take.
    pub(crate) fn timed(mut self, call_timeout: std::time::Duration) -> Server {
        self.call_timeout = call_timeout;
        self
    }

    /// Resolves, with what was wrong with it, when a line the transport drops (too long, or a
    /// malformed answer) arrives after this call: the answer it carried never comes. Never for
    /// an http server.
    pub(crate) fn dropped(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        let rx = self.dropped.clone();
        async move {
            match rx {
                Some(mut rx) => {
                    rx.mark_unchanged();
                    match rx.changed().await {
                        Ok(()) => rx.borrow().why.clone(),
                        Err(_) => std::future::pending::<String>().await,
                    }
                }
                None => std::future::pending::<String>().await,
            }
        }
    }

    /// Closes the client, then stops and reaps the process. Idempotent.
    pub(crate) async fn stop(&self) {
        let service = self.service.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(mut service) = service {
            // A stdio server's client only closes pipes, so it cannot hang; an http one may send
            // a DELETE to a server that does not answer.
            let _ = service.close_with_timeout(CLOSE_TIMEOUT).await;
        }
        if let Some(process) = &self.process {
            process.stop(STOP_GRACE).await;
        }
    }

    /// Why calls to this server cannot run, when they cannot: `None` while it is up.
    pub(crate) async fn down_reason(&self) -> Option<String> {
        let exited = self.process.as_ref().and_then(ChildProcess::exit_status).is_some();
        if exited || self.peer.is_transport_closed() {
            return Some(self.describe_exit().await);
        }
        None
    }

    /// A sentence for a server whose connection is gone, with what its process left behind.
    pub(crate) async fn describe_exit(&self) -> String {
        let status = match &self.process {
            Some(process) => process.settle(SETTLE).await,
            None => None,
        };
        let mut reason = match status {
            Some(status) => format!("its process exited ({status})"),
            None if self.process.is_some() => "its connection closed".to_string(),
            None => "the connection to it closed".to_string(),
        };
        let tail = self.stderr_tail();
        if !tail.is_empty() {
            reason.push_str(&format!("; its stderr ended with:\n{tail}"));
        }
        reason
    }

    pub(crate) fn stderr_tail(&self) -> String {
        self.process.as_ref().map(ChildProcess::stderr_tail).unwrap_or_default()
    }
}
