//! pier's MCP client: the MCP servers a client names in `session/new`, `session/load` or
//! `session/resume`, started (stdio) or connected (http), each tool offered to the model as a
//! [`pier_tools::Tool`]. The protocol is rmcp's; this crate owns processes, names and errors.
//!
//! - [`McpServers`]: the servers of one session; [`McpServers::start`], [`McpServers::tools`],
//!   [`McpServers::shutdown`].
//! - `stdio`: a server's process (pipes, stderr tail, parent-death signal, stop and reap).
//! - `http`: the streamable-HTTP transport (rmcp over reqwest with ring TLS).
//! - `server`: one connected server, shared by the session and its tools.
//! - `tool`: a server's tool as a pier tool: names, calls, results.
//!
//! **Invariant:** no stdio server outlives its owners. [`McpServers::shutdown`] stops every
//! process (SIGTERM, SIGKILL after a grace) and reaps it; dropping `McpServers` and every tool
//! SIGKILLs and reaps it; a SIGKILLed agent takes them down by `PR_SET_PDEATHSIG`.
//!
//! Env values and header values are never logged or put in an error: only their names.

mod http;
mod lines;
mod server;
mod stdio;
mod tool;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use agent_client_protocol_schema::v1::{McpServer, McpServerHttp, McpServerStdio};
use pier_tools::Tool;
use rmcp::RoleClient;
use rmcp::model::{ClientCapabilities, ClientConfig, Implementation, ProtocolVersion};
use rmcp::service::{RunningService, ServiceExt};

use crate::server::{STOP_GRACE, Server};
use crate::stdio::{ChildProcess, Spawn};

/// Why the MCP servers of a session could not be started. Returned by [`McpServers::start`]; never
/// retried by this crate (the client fixes its configuration and opens the session again).
#[derive(thiserror::Error, Debug)]
pub enum McpError {
    /// The process could not be spawned: a missing or non-executable command, a bad cwd.
    #[error(
        "MCP server `{server}` could not be started: running `{command}` failed: {source}; check that the command exists, is executable and is on PATH"
    )]
    Spawn { server: String, command: String, source: std::io::Error },
    /// The server ran but the `initialize` handshake failed (it exited, or spoke something else).
    #[error(
        "MCP server `{server}` failed to initialize: {reason}; check its command, arguments and environment{}",
        stderr_suffix(.stderr)
    )]
    Initialize { server: String, reason: String, stderr: String },
    /// The server initialized but `tools/list` failed.
    #[error("MCP server `{server}` failed to list its tools: {reason}{}", stderr_suffix(.stderr))]
    ListTools { server: String, reason: String, stderr: String },
    /// An http server could not be reached, or did not answer `initialize` as an MCP server.
    #[error(
        "MCP server `{server}` could not be connected at {url}: {reason}; check the URL, that the server is running, and its headers"
    )]
    Connect { server: String, url: String, reason: String },
    /// Initializing and listing took longer than the caller's timeout.
    #[error(
        "MCP server `{server}` did not initialize and list its tools within {timeout:?}; check that it speaks MCP (stdio: JSON-RPC lines on stdout) and that its URL is reachable{}",
        stderr_suffix(.stderr)
    )]
    Timeout { server: String, timeout: Duration, stderr: String },
    /// The server's configuration cannot be used (bad URL, bad header, unsupported transport).
    #[error("MCP server `{server}` is misconfigured: {reason}")]
    Config { server: String, reason: String },
}

fn stderr_suffix(stderr: &str) -> String {
    if stderr.is_empty() { String::new() } else { format!("; its stderr ended with:\n{stderr}") }
}

/// The MCP servers of one session, started and listed.
///
/// Tools keep their server alive: the last of `McpServers` and its tools to be dropped kills a
/// stdio server's process. [`McpServers::shutdown`] stops every server whoever still holds tools;
/// their calls then fail with "MCP server `x` is not running".
pub struct McpServers {
    servers: Vec<Arc<Server>>,
    tools: Vec<Arc<dyn Tool>>,
}

impl McpServers {
    /// Starts every stdio server and connects to every http server, initializes each, lists its
    /// tools. Fails with an error naming the server and (stdio) the tail of its stderr when any
    /// server fails to start, to initialize or to list its tools within `timeout`; servers already
    /// started are stopped. Servers start concurrently; the first failure in `servers` order wins.
    pub async fn start(servers: &[McpServer], cwd: &Path, timeout: Duration) -> Result<McpServers, McpError> {
        McpServers::start_guarded(servers, cwd, timeout, None).await
    }

    /// [`McpServers::start`], each stdio server under `guard`'s `subagent-guard` (the `pier`
    /// binary), which ends the server's whole process tree with it.
    pub async fn start_guarded(
        servers: &[McpServer],
        cwd: &Path,
        timeout: Duration,
        guard: Option<&Path>,
    ) -> Result<McpServers, McpError> {
        let starts = servers.iter().map(|spec| start_one(spec, cwd, timeout, guard));
        let results = futures::future::join_all(starts).await;
        let mut started = Vec::new();
        let mut failure = None;
        for result in results {
            match result {
                Ok(server) => started.push(server),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failure {
            futures::future::join_all(started.iter().map(|(server, _)| server.stop())).await;
            return Err(e);
        }
        let mut taken = HashSet::new();
        let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
        for (server, listed) in &started {
            for listed in listed {
                let name = tool::exposed_name(&server.name, &listed.name, &mut taken);
                tools.push(Arc::new(tool::McpTool::new(name, listed, server.clone())));
            }
        }
        Ok(McpServers { servers: started.into_iter().map(|(server, _)| server).collect(), tools })
    }

    /// The tools of every server, servers in the order given to [`McpServers::start`], each
    /// server's tools in its order: name `{server}__{tool}` sanitised to `^[a-zA-Z0-9_-]{1,64}$`
    /// (a duplicate gets `_2`, `_3`...), kind `Read` when the tool's annotations say
    /// `readOnlyHint: true`, else `Other`; the tool's description; its `inputSchema`.
    pub fn tools(&self) -> Vec<Arc<dyn Tool>> {
        self.tools.clone()
    }

    /// Stops every server: closes the client, then SIGTERMs a stdio server's process, SIGKILLs
    /// it after a short grace (2 s) and reaps it. Servers stop concurrently.
    pub async fn shutdown(self) {
        futures::future::join_all(self.servers.iter().map(|server| server.stop())).await;
    }
}

type Started = (Arc<Server>, Vec<rmcp::model::Tool>);
pub(crate) type Client = RunningService<RoleClient, ClientConfig>;

/// Why a server's handshake did not finish.
enum Failure {
    Timeout,
    Initialize(String),
    ListTools(String),
}

async fn start_one(spec: &McpServer, cwd: &Path, timeout: Duration, guard: Option<&Path>) -> Result<Started, McpError> {
    match spec {
        McpServer::Stdio(stdio) => start_stdio(stdio, cwd, timeout, guard).await,
        McpServer::Http(http) => start_http(http, timeout).await,
        McpServer::Sse(sse) => Err(McpError::Config {
            server: sse.name.clone(),
            reason:
                "the SSE transport is not supported; use the server's streamable HTTP endpoint (type `http`) or stdio"
                    .to_string(),
        }),
        other => Err(McpError::Config {
            server: server_name(other),
            reason: "its transport is not supported; use stdio or http".to_string(),
        }),
    }
}

async fn start_stdio(
    spec: &McpServerStdio,
    cwd: &Path,
    timeout: Duration,
    guard: Option<&Path>,
) -> Result<Started, McpError> {
    let server = spec.name.clone();
    let env_names: Vec<&str> = spec.env.iter().map(|v| v.name.as_str()).collect();
    tracing::debug!(server, command = %spec.command.display(), args = ?spec.args, env = ?env_names, "starting MCP server");
    let env = spec.env.iter().map(|v| (v.name.clone().into(), v.value.clone().into())).collect();
    let (process, stdout, stdin) =
        ChildProcess::spawn(Spawn { command: &spec.command, args: &spec.args, env, cwd, guard }).map_err(|source| {
            McpError::Spawn { server: server.clone(), command: spec.command.display().to_string(), source }
        })?;
    tracing::debug!(server, pid = process.pid(), "MCP server spawned");
    let (stdout, dropped) = lines::Watched::new(stdout);
    let transport =
        rmcp::transport::async_rw::AsyncRwTransport::new_client(stdout, stdin).with_max_line_length(lines::MAX_LINE);
    match handshake(transport, timeout).await {
        Ok((service, tools)) => {
            let server =
                Server::new(server, service, Some(process)).watching(dropped).timed(call_timeout(spec.meta.as_ref()));
            Ok((Arc::new(server), tools))
        }
        Err(failure) => {
            // The handshake (and with it the pipes) is gone; the process may still run.
            process.stop(STOP_GRACE).await;
            Err(failed(server, failure, timeout, process.stderr_tail()))
        }
    }
}

async fn start_http(spec: &McpServerHttp, timeout: Duration) -> Result<Started, McpError> {
    let server = spec.name.clone();
    let header_names: Vec<&str> = spec.headers.iter().map(|h| h.name.as_str()).collect();
    tracing::debug!(server, url = %spec.url, headers = ?header_names, "connecting to MCP server");
    let transport = http::transport(&spec.url, &spec.headers)
        .map_err(|reason| McpError::Config { server: server.clone(), reason })?;
    match handshake(transport, timeout).await {
        Ok((service, tools)) => {
            Ok((Arc::new(Server::new(server, service, None).timed(call_timeout(spec.meta.as_ref()))), tools))
        }
        Err(Failure::Initialize(reason)) => Err(McpError::Connect { server, url: spec.url.clone(), reason }),
        Err(failure) => Err(failed(server, failure, timeout, String::new())),
    }
}

/// `initialize`, `notifications/initialized`, then every page of `tools/list`, within `timeout`.
async fn handshake<T, E, A>(transport: T, timeout: Duration) -> Result<(Client, Vec<rmcp::model::Tool>), Failure>
where
    T: rmcp::transport::IntoTransport<RoleClient, E, A>,
    E: std::error::Error + Send + Sync + 'static,
{
    let steps = async {
        let service = client_info().serve(transport).await.map_err(|e| Failure::Initialize(describe(&e)))?;
        // A server without the tools capability would answer `tools/list` with an error.
        let offers_tools = service.peer().peer_info().is_none_or(|info| info.capabilities.tools.is_some());
        if !offers_tools {
            return Ok((service, Vec::new()));
        }
        let tools = list_tools(service.peer()).await?;
        Ok((service, tools))
    };
    tokio::time::timeout(timeout, steps).await.unwrap_or(Err(Failure::Timeout))
}

/// The `_meta` key of a server's entry (in `mcpServers`) that sets how long one of its calls
/// may take, in seconds.
pub const CALL_TIMEOUT_META: &str = pier_acp::MCP_CALL_TIMEOUT_META_KEY;
/// How long a call takes at most unless the server's entry says otherwise.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(600);

fn call_timeout(meta: Option<&agent_client_protocol_schema::v1::Meta>) -> Duration {
    meta.and_then(|m| m.get(CALL_TIMEOUT_META))
        .and_then(serde_json::Value::as_f64)
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(DEFAULT_CALL_TIMEOUT, |s| Duration::from_secs_f64(s.min(86_400.0)))
}

/// Pages of `tools/list` a server may answer with, at most.
const MAX_PAGES: usize = 100;
/// Tools one server may offer, at most.
const MAX_TOOLS: usize = 1_000;
/// The tools' descriptions of one server together (names, texts, schemas), at most.
const MAX_TOOL_BYTES: usize = 8 << 20;

/// Every page of `tools/list`, within bounds: a server that pages on and on, or offers more
/// tools (or larger ones) than a model could be told about, fails its start, saying which
/// bound it passed, instead of growing the agent without end.
async fn list_tools(peer: &rmcp::Peer<RoleClient>) -> Result<Vec<rmcp::model::Tool>, Failure> {
    let (mut tools, mut bytes, mut cursor) = (Vec::new(), 0usize, None);
    for _ in 0..MAX_PAGES {
        let params = rmcp::model::PaginatedRequestParams::default().with_cursor(cursor.take());
        let page = peer.list_tools(Some(params)).await.map_err(|e| Failure::ListTools(describe(&e)))?;
        for tool in page.tools {
            bytes += serde_json::to_vec(&tool).map_or(0, |v| v.len());
            tools.push(tool);
            if tools.len() > MAX_TOOLS || bytes > MAX_TOOL_BYTES {
                return Err(Failure::ListTools(format!(
                    "it offers more than {MAX_TOOLS} tools or {} MiB of tool descriptions; pier takes at most that from one server",
                    MAX_TOOL_BYTES >> 20
                )));
            }
        }
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(tools),
        }
    }
    Err(Failure::ListTools(format!(
        "its tools/list is still paging after {MAX_PAGES} pages; pier takes at most that many from one server"
    )))
}

/// An error and its causes, one sentence: rmcp's and reqwest's top-level messages hide the
/// cause ("error sending request" of "connection refused"). rmcp names the transport's Rust type
/// in brackets, which tells the user nothing, so that prefix is cut.
pub(crate) fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    match text.find("] error: ") {
        Some(at) if text.starts_with("Send message error Transport [") => text[at + "] error: ".len()..].to_string(),
        _ => text,
    }
}

fn failed(server: String, failure: Failure, timeout: Duration, stderr: String) -> McpError {
    match failure {
        Failure::Timeout => McpError::Timeout { server, timeout, stderr },
        Failure::Initialize(reason) => McpError::Initialize { server, reason, stderr },
        Failure::ListTools(reason) => McpError::ListTools { server, reason, stderr },
    }
}

/// How pier introduces itself. The newest protocol version that still has an `initialize`
/// handshake: the servers pier meets today all speak it.
fn client_info() -> ClientConfig {
    ClientConfig::new(ClientCapabilities::default(), Implementation::new("pier", env!("CARGO_PKG_VERSION")))
        .with_protocol_version(ProtocolVersion::LATEST_WITH_INITIALIZE)
}

fn server_name(spec: &McpServer) -> String {
    serde_json::to_value(spec)
        .ok()
        .and_then(|v| v.get("name").and_then(|n| n.as_str().map(str::to_string)))
        .unwrap_or_else(|| "(unnamed)".to_string())
}
