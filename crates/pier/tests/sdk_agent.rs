//! `pier exec` against a real third-party agent: the example agent of the official
//! TypeScript SDK (npm `@agentclientprotocol/sdk` 1.9.0), installed by `scripts/test`.
//!
//! Its scripted turn: a message, a `read` tool call, a message, an `edit` tool call
//! with `session/request_permission` (options `allow` = allow_once and `reject` =
//! reject_once), a last message, `end_turn`; about 5 s in all. It honours `session/cancel`.

mod support;

use std::process::{Output, Stdio};

use serde_json::Value;
use support::{LIMIT, must, sdk_agent};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const PIER: &str = env!("CARGO_BIN_EXE_pier");

fn command(work: &std::path::Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(PIER);
    cmd.args(args)
        .current_dir(work)
        .env("PIER_HOME", work.join(".pier"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

async fn run(args: &[&str]) -> (Output, Vec<Value>) {
    let work = must(tempfile::tempdir(), "work dir");
    let child = must(command(work.path(), args).spawn(), "spawn pier exec");
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "finished in time"), "wait");
    let lines = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    (o, lines)
}

fn permission(lines: &[Value]) -> Value {
    lines.iter().find(|l| l["type"] == "permission").cloned().unwrap_or_else(|| panic!("no permission line"))
}

fn result(lines: &[Value]) -> Value {
    let last = lines.last().cloned().unwrap_or_default();
    assert_eq!(last["type"], "result");
    last
}

#[tokio::test]
async fn a_full_turn_with_the_permission_allowed() {
    let agent = sdk_agent();
    let (o, lines) = run(&["exec", "--agent", &agent, "--format", "json", "--approve-all", "improve the config"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let p = permission(&lines);
    assert_eq!(p["outcome"], serde_json::json!({"outcome": "selected", "optionId": "allow"}));
    assert_eq!(p["toolCall"]["kind"], "edit");
    let kinds: Vec<&str> = lines.iter().filter_map(|l| l["update"]["sessionUpdate"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            "agent_message_chunk",
            "tool_call",
            "tool_call_update",
            "agent_message_chunk",
            "tool_call",
            "tool_call_update",
            "agent_message_chunk"
        ]
    );
    let r = result(&lines);
    assert_eq!(r["stopReason"], "end_turn");
    assert!(r["text"].as_str().is_some_and(|t| t.contains("successfully updated the configuration")), "{r}");
}

#[tokio::test]
async fn the_default_policy_rejects_the_edit_unattended() {
    let agent = sdk_agent();
    let (o, lines) = run(&["exec", "--agent", &agent, "--format", "json", "improve the config"]).await;
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(permission(&lines)["outcome"]["optionId"], "reject");
    assert!(result(&lines)["text"].as_str().is_some_and(|t| t.contains("skip the configuration update")));
}

#[tokio::test]
async fn deny_all_and_non_interactive_fail() {
    let agent = sdk_agent();
    let (o, lines) = run(&["exec", "--agent", &agent, "--format", "json", "--deny-all", "x"]).await;
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(permission(&lines)["outcome"]["optionId"], "reject");
    let (o, lines) = run(&["exec", "--agent", &agent, "--format", "json", "--non-interactive", "fail", "x"]).await;
    assert_eq!(o.status.code(), Some(6), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(permission(&lines)["outcome"], serde_json::json!({"outcome": "cancelled"}));
    let r = result(&lines);
    assert_eq!(r["error"]["kind"], "permission_required");
    // The example agent ends its turn normally when a permission comes back cancelled.
    assert!(r["stopReason"] == "cancelled" || r["stopReason"] == "end_turn", "{r}");
}

/// Starts `pier exec` and returns it once the agent's first update has arrived.
async fn started(
    args: &[&str],
) -> (tokio::process::Child, tokio::io::Lines<BufReader<tokio::process::ChildStdout>>, tempfile::TempDir) {
    let work = must(tempfile::tempdir(), "work dir");
    let mut child = must(command(work.path(), args).spawn(), "spawn");
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut lines = BufReader::new(stdout).lines();
    loop {
        let line = must(tokio::time::timeout(LIMIT, lines.next_line()).await, "first update in time");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier exec ended early"));
        if line.contains("session_update") {
            break;
        }
    }
    (child, lines, work)
}

async fn rest(
    child: tokio::process::Child,
    mut lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) -> (Option<i32>, Value) {
    let mut last = String::new();
    while let Ok(Ok(Some(line))) = tokio::time::timeout(LIMIT, lines.next_line()).await {
        last = line;
    }
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
    (o.status.code(), serde_json::from_str(&last).unwrap_or_default())
}

#[tokio::test]
async fn ctrl_c_mid_turn_is_confirmed_by_the_agent() {
    let agent = sdk_agent();
    let (child, lines, _work) = started(&["exec", "--agent", &agent, "--format", "json", "x"]).await;
    let pid = child.id().map_or(0, |p| p as i32);
    must(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGINT), "SIGINT");
    let (code, r) = rest(child, lines).await;
    assert_eq!(code, Some(130));
    assert_eq!(r["stopReason"], "cancelled", "{r}");
    assert_eq!(r["error"]["cancelConfirmed"], true);
}

#[tokio::test]
async fn an_agent_killed_mid_turn() {
    let agent = sdk_agent();
    let (child, lines, _work) = started(&["exec", "--agent", &agent, "--format", "json", "x"]).await;
    // The agent is pier's only child; kill it behind pier's back.
    let pier_pid = child.id().unwrap_or(0);
    let children = std::fs::read_to_string(format!("/proc/{pier_pid}/task/{pier_pid}/children")).unwrap_or_default();
    let mut killed = 0;
    for pid in children.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
        must(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL), "kill agent");
        killed += 1;
    }
    assert_eq!(killed, 1, "pier runs exactly one agent process");
    let (code, r) = rest(child, lines).await;
    assert_eq!(code, Some(1));
    assert_eq!(r["error"]["kind"], "agent");
    assert!(r["error"]["message"].as_str().is_some_and(|m| m.contains("closed the connection")), "{r}");
}
