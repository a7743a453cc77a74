//! B1/B2 on the official Rust SDK (`agent-client-protocol` 5.2): `sdk-bench agent` answers a
//! prompt whose text is a number N with N agent_message_chunk notifications; `sdk-bench client
//! UPDATES RTTS -- CMD…` drives any agent and prints one JSON line like pier-bench's.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::v1::schema::{
    AgentCapabilities, ContentBlock, ContentChunk, InitializeRequest, InitializeResponse, NewSessionRequest,
    NewSessionResponse, PromptRequest, PromptResponse, SessionNotification, SessionUpdate, StopReason, TextContent,
};
use agent_client_protocol::{AcpAgent, Agent, Client, Stdio};

const CHUNK: &str = "The quick brown fox jumps over the lazy dog while the benchmark counts every single message. ok";

async fn agent() -> agent_client_protocol::Result<()> {
    let sessions = Arc::new(AtomicU64::new(0));
    Agent
        .v1()
        .name("sdk-bench-agent")
        .on_receive_request(
            async move |req: InitializeRequest, responder, _c| {
                responder.respond(InitializeResponse::new(req.protocol_version).agent_capabilities(AgentCapabilities::new()))
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |_req: NewSessionRequest, responder, _c| {
                let n = sessions.fetch_add(1, Ordering::Relaxed);
                responder.respond(NewSessionResponse::new(format!("s{n}")))
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: PromptRequest, responder, connection: ConnectionTo<Client>| {
                let n: u64 = match req.prompt.first() {
                    Some(ContentBlock::Text(t)) => t.text.trim().parse().unwrap_or(1),
                    _ => 1,
                };
                let conn = connection.clone();
                connection.spawn(async move {
                    for _ in 0..n {
                        conn.send_notification(SessionNotification::new(
                            req.session_id.clone(),
                            SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(CHUNK)))),
                        ))?;
                    }
                    responder.respond(PromptResponse::new(StopReason::EndTurn))
                })
            },
            agent_client_protocol::on_receive_request!(),
        )
        .connect_to(Stdio::new())
        .await
}

async fn client(updates: u64, rtts: u64, cmd: String) -> agent_client_protocol::Result<()> {
    let count = Arc::new(AtomicU64::new(0));
    let seen = count.clone();
    let agent = AcpAgent::from_str(&cmd)?;
    Client
        .v1()
        .on_receive_notification(
            async move |_n: SessionNotification, _cx| {
                seen.fetch_add(1, Ordering::Relaxed);
                Ok(())
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .connect_with(agent, |connection: ConnectionTo<Agent>| async move {
            connection.send_request(InitializeRequest::new(ProtocolVersion::V1)).block_task().await?;
            let cwd = std::env::current_dir().unwrap_or_else(|_| "/".into());
            let session = connection.send_request(NewSessionRequest::new(cwd.clone())).block_task().await?;
            let started = Instant::now();
            connection
                .send_request(PromptRequest::new(
                    session.session_id.clone(),
                    vec![ContentBlock::Text(TextContent::new(updates.to_string()))],
                ))
                .block_task()
                .await?;
            let seconds = started.elapsed().as_secs_f64();
            let mut lat = Vec::new();
            for _ in 0..rtts {
                let t = Instant::now();
                connection.send_request(NewSessionRequest::new(cwd.clone())).block_task().await?;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            lat.sort_by(|a, b| a.total_cmp(b));
            let pct = |p: f64| lat.get(((lat.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0.0);
            let got = count.load(Ordering::Relaxed);
            println!(
                "{}",
                serde_json::json!({"updates": got, "seconds": seconds, "msgs_per_s": got as f64 / seconds,
                    "rtt_p50_us": pct(0.5), "rtt_p99_us": pct(0.99), "client_peak_rss_kb": peak_rss_kb()})
            );
            Ok(())
        })
        .await
}

/// This process's peak RSS (VmHWM), as pier-bench reports it.
fn peak_rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> agent_client_protocol::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("agent") => agent().await,
        Some("client") => {
            let updates = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(100_000);
            let rtts = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(20_000);
            let cmd = args.iter().skip_while(|a| *a != "--").skip(1).cloned().collect::<Vec<_>>().join(" ");
            client(updates, rtts, cmd).await
        }
        _ => {
            eprintln!("usage: sdk-bench agent | client UPDATES RTTS -- CMD");
            Ok(())
        }
    }
}
