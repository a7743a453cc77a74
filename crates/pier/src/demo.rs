//! `pier demo`: the ACP exchange of the main job, line by line. Starts a scripted
//! OpenAI-compatible model on loopback (so the answers are the same on every machine,
//! with or without the embedded model), spawns `pier agent` against it over real pipes,
//! and prints every JSON-RPC line exactly as it crosses the pipes, both ways. The
//! process, framing, engine and session log are the real thing; `PIER_HOME` is a
//! temporary directory removed at the end.

#![allow(clippy::print_stdout)]

use std::process::Stdio;
use std::sync::Arc;

use agent_client_protocol_schema::ProtocolVersion;
use agent_client_protocol_schema::v1::{
    ContentBlock, Error, InitializeRequest, InitializeResponse, NewSessionRequest, NewSessionResponse, PromptRequest,
    PromptResponse, ResourceLink, TextContent,
};
use anyhow::Context;
use pier_acp::{Connection, ConnectionConfig, Handler, RequestCx};
use pier_fake_model::{FakeModel, Reply};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::process::Command;

/// The client side answers nothing: pier's agent asks its client for nothing here.
struct Silent;

impl Handler for Silent {
    fn request(
        &self,
        _cx: RequestCx,
        method: String,
        _params: Value,
    ) -> futures::future::BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async move { Err(Error::method_not_found().data(Value::String(method))) })
    }

    fn notification(&self, _conn: &Connection, _method: &str, _params: Value) {}
}

/// Copies lines from `from` to `to`, printing each with `arrow` first: a tap on one pipe.
async fn tap(from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin, arrow: &'static str) {
    let mut lines = BufReader::new(from).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        println!("{arrow} {line}");
        if to.write_all(line.as_bytes()).await.is_err() || to.write_all(b"\n").await.is_err() {
            break;
        }
        let _ = to.flush().await;
    }
    let _ = to.shutdown().await;
}

fn answer(body: &Value) -> Reply {
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_owned();
    let text = if last.contains("ACP") {
        "ACP, the Agent Client Protocol, is JSON-RPC 2.0 over stdio between a client (an editor, a script) and an agent. \
         A turn starts with session/prompt and always ends with a stop reason."
            .to_owned()
    } else {
        format!("(scripted model) I read your prompt: {last}")
    };
    Reply::text(&text)
}

pub async fn run() -> anyhow::Result<()> {
    let fake = FakeModel::start().await.context("could not start the scripted model on loopback")?;
    fake.set_fallback(answer);
    // Dropped on every way out of this function, which removes the directory.
    let home =
        tempfile::Builder::new().prefix("pier-demo-").tempdir().context("cannot create a temporary PIER_HOME")?;
    let exe = std::env::current_exe().context("cannot find the pier executable")?;
    println!(
        "# pier demo: scripted model at {}, PIER_HOME={} (removed at the end)",
        fake.base_url(),
        home.path().display()
    );
    println!("# $ pier agent   (spawned over pipes; -> is what the client writes, <- what the agent writes)");
    let mut child = Command::new(exe)
        .arg("agent")
        .env("PIER_BASE_URL", fake.base_url())
        .env("PIER_MODEL", "demo-model")
        .env("PIER_API_KEY", "demo-key")
        .env("PIER_HOME", home.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("could not spawn `pier agent`")?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        anyhow::bail!("the agent's pipes are missing");
    };
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    let (their_read, their_write) = tokio::io::split(theirs);
    let outgoing = tokio::spawn(tap(their_read, stdin, "->"));
    let incoming = tokio::spawn(tap(stdout, their_write, "<-"));
    let (read, write) = tokio::io::split(ours);
    let conn = Connection::spawn(read, write, Arc::new(Silent), ConnectionConfig::default());

    let _: InitializeResponse = conn.request("initialize", &InitializeRequest::new(ProtocolVersion::V1)).await?;
    let cwd = std::env::current_dir()?;
    let session: NewSessionResponse = conn.request("session/new", &NewSessionRequest::new(cwd.clone())).await?;
    for prompt in [
        vec![ContentBlock::Text(TextContent::new("What is ACP, in two sentences?"))],
        vec![
            ContentBlock::Text(TextContent::new("Have a look at")),
            ContentBlock::ResourceLink(ResourceLink::new("README.md", format!("file://{}/README.md", cwd.display()))),
        ],
    ] {
        let _: PromptResponse =
            conn.request("session/prompt", &PromptRequest::new(session.session_id.clone(), prompt)).await?;
    }

    println!("# closing the agent's stdin");
    conn.close().await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
        .await
        .context("the agent did not exit within 10 s of stdin closing")??;
    let _ = outgoing.await;
    let _ = incoming.await;
    println!("# pier agent exited: {status}");
    let log = home.path().join("sessions").join(format!("{}.jsonl", session.session_id));
    let records = std::fs::read_to_string(&log).map(|t| t.lines().count()).unwrap_or(0);
    println!("# its session log held {records} records; `pier agent` keeps them in $PIER_HOME/sessions/");
    Ok(())
}
