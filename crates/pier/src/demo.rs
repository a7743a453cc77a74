//! `pier demo`: the main job on an embedded default. Starts a scripted
//! OpenAI-compatible model on loopback, spawns `pier agent` against it over real
//! pipes, drives an ACP exchange and prints both directions.
//!
//! The scripted model stands in until the embedded local model lands; everything
//! else (process, pipes, framing, engine, session log) is the real thing.

#![allow(clippy::print_stdout)]

use std::process::Stdio;
use std::sync::Arc;

use agent_client_protocol_schema::ProtocolVersion;
use agent_client_protocol_schema::v1::{
    ContentBlock, Error, InitializeRequest, InitializeResponse, NewSessionRequest, NewSessionResponse, PromptRequest,
    PromptResponse, ResourceLink, SessionNotification, SessionUpdate, TextContent,
};
use anyhow::Context;
use pier_acp::{Connection, ConnectionConfig, Handler, RequestCx};
use pier_fake_model::{FakeModel, Reply};
use serde_json::Value;
use tokio::process::Command;

struct PrintUpdates;

impl Handler for PrintUpdates {
    fn request(
        &self,
        _cx: RequestCx,
        method: String,
        _params: Value,
    ) -> futures::future::BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async move { Err(Error::method_not_found().data(Value::String(method))) })
    }

    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        if method != "session/update" {
            return;
        }
        if let Ok(n) = serde_json::from_value::<SessionNotification>(params)
            && let SessionUpdate::AgentMessageChunk(chunk) = n.update
            && let ContentBlock::Text(t) = chunk.content
        {
            println!("  <- session/update agent_message_chunk: {}", t.text);
        }
    }
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
    let home = std::env::temp_dir().join(format!("pier-demo-{}", std::process::id()));
    let exe = std::env::current_exe().context("cannot find the pier executable")?;
    println!("pier demo: scripted model at {}, PIER_HOME={}", fake.base_url(), home.display());
    println!("$ pier agent    (spawned over pipes)");
    let mut child = Command::new(exe)
        .arg("agent")
        .env("PIER_BASE_URL", fake.base_url())
        .env("PIER_MODEL", "demo-model")
        .env("PIER_API_KEY", "demo-key")
        .env("PIER_HOME", &home)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("could not spawn `pier agent`")?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        anyhow::bail!("the agent's pipes are missing");
    };
    let conn = Connection::spawn(stdout, stdin, Arc::new(PrintUpdates), ConnectionConfig::default());

    println!("  -> initialize {{protocolVersion: 1}}");
    let init: InitializeResponse = conn.request("initialize", &InitializeRequest::new(ProtocolVersion::V1)).await?;
    let name = init.agent_info.map(|i| format!("{} {}", i.name, i.version)).unwrap_or_default();
    println!("  <- protocolVersion {}, agent {name}", init.protocol_version);

    let cwd = std::env::current_dir()?;
    println!("  -> session/new {{cwd: {}}}", cwd.display());
    let session: NewSessionResponse = conn.request("session/new", &NewSessionRequest::new(cwd.clone())).await?;
    println!("  <- sessionId {}", session.session_id);

    for prompt in [
        vec![ContentBlock::Text(TextContent::new("What is ACP, in two sentences?"))],
        vec![
            ContentBlock::Text(TextContent::new("Have a look at")),
            ContentBlock::ResourceLink(ResourceLink::new("README.md", format!("file://{}/README.md", cwd.display()))),
        ],
    ] {
        let shown: Vec<String> = prompt
            .iter()
            .map(|b| match b {
                ContentBlock::Text(t) => format!("text {:?}", t.text),
                ContentBlock::ResourceLink(l) => format!("resource_link {}", l.uri),
                _ => "other".to_owned(),
            })
            .collect();
        println!("  -> session/prompt [{}]", shown.join(", "));
        let response: PromptResponse =
            conn.request("session/prompt", &PromptRequest::new(session.session_id.clone(), prompt)).await?;
        println!("  <- stopReason {}", serde_json::to_value(response.stop_reason)?.as_str().unwrap_or("?"));
    }

    println!("  (closing stdin)");
    conn.close().await;
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
        .await
        .context("the agent did not exit within 10 s of stdin closing")??;
    println!("$ pier agent exited: {status}");
    let log = home.join("sessions").join(format!("{}.jsonl", session.session_id));
    let records = std::fs::read_to_string(&log).map(|t| t.lines().count()).unwrap_or(0);
    println!("session log: {} ({records} records; inspect with jq)", log.display());
    Ok(())
}
