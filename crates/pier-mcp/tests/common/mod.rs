//! Helpers shared by the MCP tests: the fixture server, tool lookup, process checks.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_client_protocol_schema::v1::{EnvVariable, McpServer, McpServerStdio};
use pier_mcp::McpServers;
use pier_tools::{Limits, Tool, ToolContext, Workspace};
use tokio_util::sync::CancellationToken;

/// Generous: Python starts slowly on a loaded machine.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The fixture MCP server (see its docstring for modes, tools and environment).
pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp_server.py")
}

/// A stdio server running the fixture with `args`, and `env` added.
pub fn stdio(name: &str, args: &[&str], env: &[(&str, &Path)]) -> McpServer {
    let mut argv = vec![fixture().display().to_string()];
    argv.extend(args.iter().map(|a| a.to_string()));
    let env = env.iter().map(|(k, v)| EnvVariable::new(*k, v.display().to_string())).collect();
    McpServer::Stdio(McpServerStdio::new(name, "python3").args(argv).env(env))
}

pub async fn start(servers: &[McpServer], cwd: &Path) -> McpServers {
    McpServers::start(servers, cwd, START_TIMEOUT).await.unwrap()
}

pub fn tool(servers: &McpServers, name: &str) -> Arc<dyn Tool> {
    servers.tools().into_iter().find(|t| t.name() == name).unwrap_or_else(|| panic!("no tool {name}"))
}

pub fn cx(dir: &Path) -> ToolContext {
    ToolContext {
        workspace: Workspace::new(dir).unwrap(),
        cancel: CancellationToken::new(),
        limits: Limits::default(),
        link: Default::default(),
    }
}

/// Polls `check` every 20 ms until it holds, for at most 10 s.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The pid the fixture wrote to `file`.
pub fn read_pid(file: &Path) -> u32 {
    std::fs::read_to_string(file).unwrap().trim().parse().unwrap()
}

/// Whether a process (a zombie included) exists with this pid.
pub fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

pub async fn wait_gone(pid: u32) {
    eventually(&format!("process {pid} to be gone (killed and reaped)"), || !exists(pid)).await;
}

pub fn read(file: &Path) -> String {
    std::fs::read_to_string(file).unwrap_or_default()
}
