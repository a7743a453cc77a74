//! The MCP servers of a session (editor profile), over `pier-mcp`: started when
//! the session opens, their tools offered next to the built-in ones, stopped when
//! the session closes and when the agent exits.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use agent_client_protocol_schema::v1::{Error, McpServer};
use pier_tools::Tool;
use serde_json::json;

/// A session's started MCP servers.
pub struct Servers(pier_mcp::McpServers);

impl Servers {
    /// Starts every server, or fails with -32603 naming the server that did not start
    /// (and its stderr tail); servers already started are stopped.
    /// With `guard` (the `pier` binary), each stdio server runs under its `subagent-guard`.
    pub async fn start(
        servers: &[McpServer],
        cwd: &Path,
        timeout: Duration,
        guard: Option<&Path>,
    ) -> Result<Servers, Error> {
        let names: Vec<String> = servers.iter().map(server_name).collect();
        tracing::info!(servers = ?names, "starting MCP servers");
        match pier_mcp::McpServers::start_guarded(servers, cwd, timeout, guard).await {
            Ok(s) => Ok(Servers(s)),
            Err(e) => {
                tracing::warn!(error = %e, "an MCP server failed to start");
                Err(Error::new(-32603, e.to_string())
                    .data(json!({ "kind": "mcp_server_failed", "reason": e.to_string() })))
            }
        }
    }

    pub fn tools(&self) -> Vec<Arc<dyn Tool>> {
        self.0.tools()
    }

    pub async fn shutdown(self) {
        self.0.shutdown().await;
    }
}

fn server_name(s: &McpServer) -> String {
    match s {
        McpServer::Stdio(s) => s.name.clone(),
        McpServer::Http(s) => s.name.clone(),
        McpServer::Sse(s) => s.name.clone(),
        _ => "unknown".to_owned(),
    }
}
