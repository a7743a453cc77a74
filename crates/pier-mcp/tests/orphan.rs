//! A SIGKILLed agent leaves no MCP server behind (`PR_SET_PDEATHSIG`). The test binary plays the
//! agent: run with `PIER_MCP_TEST_AGENT_DIR` set, the `agent` test starts a server and blocks.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const AGENT_DIR: &str = "PIER_MCP_TEST_AGENT_DIR";

/// The agent's half: does nothing unless the other test started this binary to play the agent.
#[tokio::test]
async fn agent() {
    let Some(dir) = std::env::var_os(AGENT_DIR) else { return };
    let dir = Path::new(&dir);
    // MCP_LINGER: the server outlives its stdin, so only the parent-death signal can stop it.
    let env = [("MCP_PID_FILE", &*dir.join("server.pid")), ("MCP_LINGER", Path::new("1"))];
    let servers = start(&[stdio("s", &[], &env)], dir).await;
    std::fs::write(dir.join("ready"), "").unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    drop(servers);
}

#[tokio::test]
async fn a_sigkilled_agent_takes_its_servers_down() {
    if std::env::var_os(AGENT_DIR).is_some() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut agent = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "agent", "--nocapture"])
        .env(AGENT_DIR, dir.path())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually("the agent to start its server", || dir.path().join("ready").exists()).await;
    let server = read_pid(&dir.path().join("server.pid"));
    agent.start_kill().unwrap();
    agent.wait().await.unwrap();
    // The server is re-parented when it dies; a container's init may never reap it, so a zombie
    // counts as gone.
    eventually("the server to die with its agent", || !exists(server) || is_zombie(server)).await;
}

fn is_zombie(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the parenthesised command name, which may itself contain spaces.
    stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
}
