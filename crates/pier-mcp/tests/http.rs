//! pier's MCP client against the fixture server over streamable HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Stdio;

use agent_client_protocol_schema::v1::{HttpHeader, McpServer, McpServerHttp};
use common::*;
use pier_mcp::{McpError, McpServers};
use pier_tools::ToolKind;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The fixture in `--http` mode and the port it listens on (127.0.0.1, chosen by the OS).
async fn http_server() -> (Child, u16) {
    let mut child =
        Command::new("python3").arg(fixture()).arg("--http").stdout(Stdio::piped()).kill_on_drop(true).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next_line().await.unwrap().expect("the server prints its port");
    let port = line.strip_prefix("PORT ").unwrap().parse().unwrap();
    (child, port)
}

#[tokio::test]
async fn an_http_server_is_listed_and_called_with_its_headers() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, port) = http_server().await;
    let spec = McpServer::Http(
        McpServerHttp::new("web", format!("http://127.0.0.1:{port}/mcp"))
            .headers(vec![HttpHeader::new("X-Api-Key", "s3cret")]),
    );
    let servers = start(&[spec], dir.path()).await;
    assert_eq!(servers.tools().len(), 8);
    assert_eq!(tool(&servers, "web__echo").kind(), ToolKind::Read);

    let out = tool(&servers, "web__echo").run(json!({"text": "over http"}), cx(dir.path())).await.unwrap();
    assert!(out.success);
    assert_eq!(out.text, "over http");
    let out = tool(&servers, "web__header").run(json!({"name": "x-api-key"}), cx(dir.path())).await.unwrap();
    assert_eq!(out.text, "s3cret");
    let out = tool(&servers, "web__fail").run(json!({}), cx(dir.path())).await.unwrap();
    assert!(!out.success);
    servers.shutdown().await;
    child.kill().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_or_malformed_http_server_fails_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let spec = McpServer::Http(McpServerHttp::new("gone", format!("http://127.0.0.1:{port}/mcp")));
    let err = McpServers::start(&[spec], dir.path(), START_TIMEOUT).await.err().unwrap();
    assert!(err.to_string().contains("MCP server `gone`"), "{err}");

    let spec = McpServer::Http(
        McpServerHttp::new("bad", "http://127.0.0.1:1/mcp").headers(vec![HttpHeader::new("X-Key", "s3cret\nvalue")]),
    );
    let err = McpServers::start(&[spec], dir.path(), START_TIMEOUT).await.err().unwrap();
    assert!(matches!(err, McpError::Config { .. }), "{err:?}");
    assert!(err.to_string().contains("`X-Key`") && !err.to_string().contains("s3cret"), "{err}");

    let spec = McpServer::Http(McpServerHttp::new("nourl", "not a url"));
    let err = McpServers::start(&[spec], dir.path(), START_TIMEOUT).await.err().unwrap();
    assert!(matches!(err, McpError::Config { .. }), "{err:?}");
}
