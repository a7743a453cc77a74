//! pier's MCP client against the fixture server over stdio.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use pier_mcp::{McpError, McpServers};
use pier_tools::ToolKind;
use serde_json::json;

#[tokio::test]
async fn start_lists_every_servers_tools_with_names_kinds_and_schemas() {
    let dir = tempfile::tempdir().unwrap();
    let servers = start(&[stdio("alpha", &[], &[]), stdio("my beta", &[], &[])], dir.path()).await;
    let names: Vec<String> = servers.tools().iter().map(|t| t.name().to_string()).collect();
    let tools = ["echo", "write_note", "sleep", "crash", "fail", "mixed", "getenv", "header"];
    let mut expected: Vec<String> = tools.iter().map(|t| format!("alpha__{t}")).collect();
    expected.extend(tools.iter().map(|t| format!("my_beta__{t}")));
    assert_eq!(names, expected);

    let echo = tool(&servers, "alpha__echo");
    assert_eq!(echo.kind(), ToolKind::Read);
    assert_eq!(echo.description(), "Echoes its text");
    assert_eq!(
        echo.parameters(),
        json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
    );
    let preview = echo.preview(&json!({"text": "x"}), &cx(dir.path()).workspace);
    assert_eq!(preview.title, "alpha: echo");
    assert!(preview.locations.is_empty() && preview.content.is_empty());
    assert_eq!(tool(&servers, "my_beta__write_note").kind(), ToolKind::Other);
    assert_eq!(tool(&servers, "alpha__sleep").kind(), ToolKind::Other);
    servers.shutdown().await;
}

#[tokio::test]
async fn calls_return_text_raw_results_and_run_in_the_session_cwd_with_env() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("marker");
    let servers = start(&[stdio("s", &[], &[("PIER_TEST_VALUE", &marker)])], dir.path()).await;

    let out = tool(&servers, "s__echo").run(json!({"text": "hello"}), cx(dir.path())).await.unwrap();
    assert!(out.success);
    assert_eq!(out.text, "hello");
    assert_eq!(out.raw["content"][0], json!({"type": "text", "text": "hello"}));

    let out = tool(&servers, "s__write_note").run(json!({"name": "n.txt", "text": "note"}), cx(dir.path())).await;
    assert!(out.unwrap().success);
    assert_eq!(std::fs::read_to_string(dir.path().join("n.txt")).unwrap(), "note");

    let out = tool(&servers, "s__getenv").run(json!({"name": "PIER_TEST_VALUE"}), cx(dir.path())).await.unwrap();
    assert_eq!(out.text, marker.display().to_string());
    // The inherited environment is still there.
    let out = tool(&servers, "s__getenv").run(json!({"name": "PATH"}), cx(dir.path())).await.unwrap();
    assert!(!out.text.is_empty());

    let out = tool(&servers, "s__mixed").run(json!({}), cx(dir.path())).await.unwrap();
    assert_eq!(out.text, "first\n[image image/png, 3 bytes]\nembedded text\n[resource link file:///other.txt]");

    let err = tool(&servers, "s__echo").run(json!(["not", "an", "object"]), cx(dir.path())).await.unwrap_err();
    assert!(err.0.contains("must be a JSON object"), "{err}");
    servers.shutdown().await;
}

#[tokio::test]
async fn an_is_error_result_is_a_failed_output_the_model_reads() {
    let dir = tempfile::tempdir().unwrap();
    let servers = start(&[stdio("s", &[], &[])], dir.path()).await;
    let out = tool(&servers, "s__fail").run(json!({}), cx(dir.path())).await.unwrap();
    assert!(!out.success);
    assert_eq!(out.text, "the tool failed on purpose");
    assert_eq!(out.raw["isError"], json!(true));
    servers.shutdown().await;
}

/// An answer over the transport's 16 MiB, or one that is not JSON-RPC, fails its call at once,
/// saying so, and the server goes on serving (issue #35.6: the garbled one failed only at the
/// server's call timeout, `_meta` "pier.dev/callTimeoutSecs").
#[tokio::test]
async fn an_oversized_or_garbled_answer_fails_its_call_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let agent_client_protocol_schema::v1::McpServer::Stdio(spec) = stdio("u", &["--unruly"], &[]) else {
        panic!("a stdio server")
    };
    let mut meta = agent_client_protocol_schema::v1::Meta::new();
    meta.insert(pier_mcp::CALL_TIMEOUT_META.into(), json!(2));
    let servers = start(&[agent_client_protocol_schema::v1::McpServer::Stdio(spec.meta(meta))], dir.path()).await;
    let started = std::time::Instant::now();
    let err = tool(&servers, "u__huge").run(json!({}), cx(dir.path())).await.err().unwrap();
    assert!(err.to_string().contains("over 16 MiB"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2), "failed as the line passed, not at the timeout");
    let out = tool(&servers, "u__echo").run(json!({"text": "still here"}), cx(dir.path())).await.unwrap();
    assert_eq!(out.text, "still here");
    let started = std::time::Instant::now();
    let err = tool(&servers, "u__garbled").run(json!({}), cx(dir.path())).await.err().unwrap();
    assert!(err.to_string().contains("sent an answer that is not JSON"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2), "failed as the line passed, not at the timeout");
    let out = tool(&servers, "u__echo").run(json!({"text": "and still"}), cx(dir.path())).await.unwrap();
    assert_eq!(out.text, "and still");
    servers.shutdown().await;
}

#[tokio::test]
async fn a_missing_command_fails_start_naming_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let bad = agent_client_protocol_schema::v1::McpServer::Stdio(
        agent_client_protocol_schema::v1::McpServerStdio::new("ghost", "/nonexistent/mcp-server"),
    );
    let pid_file = dir.path().join("good.pid");
    let err = McpServers::start(&[stdio("good", &[], &[("MCP_PID_FILE", &pid_file)]), bad], dir.path(), START_TIMEOUT)
        .await
        .err()
        .unwrap();
    assert!(matches!(err, McpError::Spawn { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("MCP server `ghost`") && message.contains("/nonexistent/mcp-server"), "{message}");
    // The server that did start was stopped.
    eventually("the good server's pid file", || pid_file.exists()).await;
    wait_gone(read_pid(&pid_file)).await;
}

#[tokio::test]
async fn a_server_that_exits_at_once_fails_start_with_its_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let spec = stdio("quitter", &["--exit-at-once", "cannot open the database: permission denied"], &[]);
    let err = McpServers::start(&[spec], dir.path(), START_TIMEOUT).await.err().unwrap();
    assert!(matches!(err, McpError::Initialize { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("MCP server `quitter`"), "{message}");
    assert!(message.contains("cannot open the database: permission denied"), "{message}");
}

#[tokio::test]
async fn a_server_that_pages_its_tools_on_and_on_fails_its_start_within_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let spec = stdio("pager", &["--endless-pages"], &[("MCP_PID_FILE", &pid_file)]);
    let err = McpServers::start(&[spec], dir.path(), START_TIMEOUT).await.err().unwrap();
    assert!(matches!(err, McpError::ListTools { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("MCP server `pager`") && message.contains("more than 1000 tools"), "{message}");
    if pid_file.exists() {
        wait_gone(read_pid(&pid_file)).await;
    }
}

#[tokio::test]
async fn a_server_that_never_answers_times_out_and_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let spec = stdio("mute", &["--hang"], &[("MCP_PID_FILE", &pid_file)]);
    let err = McpServers::start(&[spec], dir.path(), Duration::from_millis(1500)).await.err().unwrap();
    assert!(matches!(err, McpError::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("MCP server `mute` did not initialize"), "{err}");
    if pid_file.exists() {
        wait_gone(read_pid(&pid_file)).await;
    }
}

#[tokio::test]
async fn cancel_stops_waiting_at_once_and_tells_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let servers = start(&[stdio("s", &[], &[("MCP_LOG_FILE", &log)])], dir.path()).await;
    let cx = cx(dir.path());
    let cancel = cx.cancel.clone();
    let call = tokio::spawn(tool(&servers, "s__sleep").run(json!({}), cx));
    eventually("the sleep call to reach the server", || read(&log).contains("call sleep")).await;
    cancel.cancel();
    let result = tokio::time::timeout(Duration::from_secs(2), call).await.expect("cancel returned promptly").unwrap();
    assert_eq!(result.unwrap_err().0, "cancelled");
    eventually("the server to see notifications/cancelled", || read(&log).contains("cancelled")).await;
    // The server is still usable.
    let out = tool(&servers, "s__echo").run(json!({"text": "still here"}), common::cx(dir.path())).await.unwrap();
    assert_eq!(out.text, "still here");
    servers.shutdown().await;
}

#[tokio::test]
async fn a_crashed_server_fails_only_its_own_calls() {
    let dir = tempfile::tempdir().unwrap();
    let servers = start(&[stdio("a", &[], &[]), stdio("b", &[], &[])], dir.path()).await;
    let err = tool(&servers, "a__crash").run(json!({}), cx(dir.path())).await.unwrap_err();
    assert!(err.0.starts_with("MCP server `a` is not running:"), "{err}");
    assert!(err.0.contains("crashing on request"), "{err}");
    let err = tool(&servers, "a__echo").run(json!({"text": "x"}), cx(dir.path())).await.unwrap_err();
    assert!(err.0.starts_with("MCP server `a` is not running:"), "{err}");
    assert!(err.0.contains("exit status: 7"), "{err}");
    let out = tool(&servers, "b__echo").run(json!({"text": "fine"}), cx(dir.path())).await.unwrap();
    assert_eq!(out.text, "fine");
    servers.shutdown().await;
}

#[tokio::test]
async fn shutdown_kills_and_reaps_every_server_and_fails_later_calls() {
    let dir = tempfile::tempdir().unwrap();
    let (pid_a, pid_b) = (dir.path().join("a.pid"), dir.path().join("b.pid"));
    let servers = start(
        // b outlives its stdin: only the signals stop it.
        &[
            stdio("a", &[], &[("MCP_PID_FILE", &pid_a)]),
            stdio("b", &[], &[("MCP_PID_FILE", &pid_b), ("MCP_LINGER", Path::new("1"))]),
        ],
        dir.path(),
    )
    .await;
    let (a, b) = (read_pid(&pid_a), read_pid(&pid_b));
    assert!(exists(a) && exists(b));
    let echo = tool(&servers, "a__echo");
    servers.shutdown().await;
    // Reaped before shutdown returns: no zombie is left to wait for.
    assert!(!exists(a) && !exists(b), "shutdown left a process behind");
    let err = echo.run(json!({"text": "x"}), cx(dir.path())).await.unwrap_err();
    assert!(err.0.starts_with("MCP server `a` is not running:"), "{err}");
}

#[tokio::test]
async fn drop_kills_the_server_once_its_last_tool_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let servers = start(&[stdio("s", &[], &[("MCP_PID_FILE", &pid_file)])], dir.path()).await;
    let pid = read_pid(&pid_file);
    let echo = tool(&servers, "s__echo");
    drop(servers);
    // The tool holds the server: it still answers.
    let out = echo.run(json!({"text": "alive"}), cx(dir.path())).await.unwrap();
    assert_eq!(out.text, "alive");
    assert!(exists(pid));
    drop(echo);
    wait_gone(pid).await;
}
