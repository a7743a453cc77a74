//! B8, the cost of confinement: an agent's start open and in each jail level, side by side
//! (`jail-startup`), and a model-sized HTTP request direct and through the egress proxy
//! (`egress`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::{arg, call, connect};

fn median_ms(v: &mut [Duration]) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// `jail-startup --pier PIER --n N -- AGENT…`: spawn → `initialize` → `session/new`, open and
/// under `workspace` and `strict`, interleaved so drift hits all three alike.
pub async fn startup(args: &[String], cmd: &[String]) {
    let n = arg(args, "--n", 20);
    let pier =
        PathBuf::from(args.iter().skip_while(|a| *a != "--pier").nth(1).cloned().unwrap_or_else(|| "pier".into()));
    let Some((program, rest)) = cmd.split_first() else { panic!("give the agent command after --") };
    let jailer = pier_jail::Jailer::new(&pier);
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    let levels = [None, Some(pier_jail::Level::Workspace), Some(pier_jail::Level::Strict)];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); levels.len()];
    for _ in 0..n {
        for (i, level) in levels.iter().enumerate() {
            let started = Instant::now();
            let program = pier_jail::Program { program: PathBuf::from(program), args: rest.to_vec(), env: vec![] };
            let (mut cmd, prepared) = match level {
                None => (tokio::process::Command::new(&program.program), None),
                Some(level) => {
                    let request = pier_jail::Request {
                        level: *level,
                        cwd: cwd.clone(),
                        roots: vec![],
                        writable: None,
                        network: vec![],
                        limits: Default::default(),
                        hide: vec![],
                        through_gateway: false,
                    };
                    let p = jailer.prepare(&request, &program).unwrap_or_else(|e| panic!("jail: {e}"));
                    (tokio::process::Command::new(&p.program), Some(p))
                }
            };
            match &prepared {
                Some(p) => cmd.args(&p.args),
                None => cmd.args(&program.args),
            };
            cmd.current_dir(&cwd)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .process_group(0)
                .kill_on_drop(true);
            let mut prepared = prepared;
            if let Some(p) = prepared.as_mut() {
                p.configure(&mut cmd);
            }
            let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn: {e}"));
            let running = match prepared {
                Some(p) => Some(p.started("bench".into(), Duration::from_secs(10)).await),
                None => None,
            };
            let conn = connect(&mut child, Arc::new(AtomicU64::new(0)));
            call(&conn, "initialize", json!({"protocolVersion": 1})).await;
            call(&conn, "session/new", json!({"cwd": cwd, "mcpServers": []})).await;
            times[i].push(started.elapsed());
            drop(conn);
            crate::end(child).await;
            drop(running);
        }
    }
    let open = median_ms(&mut times[0]);
    let workspace = median_ms(&mut times[1]);
    let strict = median_ms(&mut times[2]);
    println!(
        "{}",
        json!({"open_ms": open, "workspace_ms": workspace, "strict_ms": strict,
               "workspace_overhead_ms": workspace - open, "strict_overhead_ms": strict - open})
    );
}

/// A keep-alive HTTP/1.1 server answering every request with a small body (a model's
/// non-streamed answer stands in for it).
async fn upstream() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("bind: {e}"));
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            // Without TCP_NODELAY a small answer waits on the peer's delayed ACK (~40 ms).
            let _ = conn.set_nodelay(true);
            tokio::spawn(async move {
                let (r, mut w) = conn.into_split();
                let mut r = BufReader::new(r);
                let mut line = String::new();
                loop {
                    let mut length = 0usize;
                    loop {
                        line.clear();
                        if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0u8; length];
                    if tokio::io::AsyncReadExt::read_exact(&mut r, &mut body).await.is_err() {
                        return;
                    }
                    let answer = br#"{"choices":[{"message":{"content":"ok"}}]}"#;
                    let mut reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        answer.len()
                    )
                    .into_bytes();
                    reply.extend_from_slice(answer);
                    if w.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// `egress --n N`: p50 and p99 of a 2 KB POST answered by a loopback server, direct and through
/// pier's egress proxy (a kept-alive client each way, interleaved).
pub async fn egress(args: &[String]) {
    let n = arg(args, "--n", 2000);
    let port = upstream().await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
    let proxy_port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    let allow = pier_egress::Allow::parse(&[format!("127.0.0.1:{port}")]).unwrap_or_else(|e| panic!("{e}"));
    let serving =
        pier_egress::Egress::new().serve(listener, Arc::new(allow), "bench".into()).unwrap_or_else(|e| panic!("{e}"));
    let direct = reqwest::Client::builder().no_proxy().build().unwrap_or_else(|e| panic!("{e}"));
    let proxy = reqwest::Proxy::http(format!("http://127.0.0.1:{proxy_port}")).unwrap_or_else(|e| panic!("{e}"));
    let proxied = reqwest::Client::builder().proxy(proxy).build().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(2000)}]}).to_string();
    let mut times = [Vec::new(), Vec::new()];
    for _ in 0..n {
        for (i, client) in [&direct, &proxied].into_iter().enumerate() {
            let started = Instant::now();
            let r = client.post(&url).body(body.clone()).send().await.unwrap_or_else(|e| panic!("request: {e}"));
            let _ = r.bytes().await;
            times[i].push(started.elapsed());
        }
    }
    // Microseconds: a loopback hop is tens of them, below the table's two decimals of a ms.
    let us = |v: &mut Vec<Duration>, q: usize| {
        v.sort();
        v.get(v.len() * q / 100).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    let (d50, p50) = (us(&mut times[0], 50), us(&mut times[1], 50));
    println!(
        "{}",
        json!({"direct_p50_us": d50, "proxied_p50_us": p50, "added_p50_us": p50 - d50,
               "direct_p99_us": us(&mut times[0], 99), "proxied_p99_us": us(&mut times[1], 99),
               "forwarded": serving.forwarded()})
    );
}
