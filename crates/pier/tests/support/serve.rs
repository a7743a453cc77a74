//! A `pier serve` process of a test: started on a loopback port with a known token, its
//! API called with it, its SSE stream read.

use std::process::Stdio;

use futures::StreamExt;
use pier_model::sse::SseDecoder;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use super::{LIMIT, must};

const PIER: &str = env!("CARGO_BIN_EXE_pier");
pub const TOKEN: &str = "test-token-123";

pub struct Server {
    pub dir: tempfile::TempDir,
    _child: Child,
    pub base: String,
    pub http: reqwest::Client,
}

/// Runs `pier ARGS` as a client of `s` (`PIER_SERVER`, `PIER_TOKEN`), to its end.
#[allow(dead_code)]
pub async fn cli(s: &Server, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(PIER);
    cmd.args(args)
        .env("PIER_TOKEN", TOKEN)
        .env("PIER_SERVER", &s.base)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    must(must(tokio::time::timeout(LIMIT, cmd.output()).await, "cli in time"), "cli")
}

pub async fn server(base_url: Option<String>) -> Server {
    server_with(base_url, &[]).await.0
}

/// A server started with `extra` arguments; with `--metrics-listen`, also its metrics URL.
pub async fn server_with(base_url: Option<String>, extra: &[&str]) -> (Server, Option<String>) {
    server_configured(base_url, extra, None).await
}

/// [`server_with`], with `./pier.toml` of the server's directory holding `toml`.
pub async fn server_configured(
    base_url: Option<String>,
    extra: &[&str],
    toml: Option<&str>,
) -> (Server, Option<String>) {
    server_in(must(tempfile::tempdir(), "dir"), base_url, extra, toml).await
}

/// [`server_configured`] in `dir` (its store: `dir/data/pier.db`).
pub async fn server_in(
    dir: tempfile::TempDir,
    base_url: Option<String>,
    extra: &[&str],
    toml: Option<&str>,
) -> (Server, Option<String>) {
    if let Some(t) = toml {
        must(std::fs::write(dir.path().join("pier.toml"), t), "pier.toml");
    }
    let mut cmd = Command::new(PIER);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--token", TOKEN])
        .args(extra)
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", dir.path())
        .env("PIER_HOME", dir.path().join("data"))
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(url) = base_url {
        cmd.env("PIER_BASE_URL", url).env("PIER_MODEL", "fake-model");
    }
    let mut child = must(cmd.spawn(), "spawn pier serve");
    let stderr = child.stderr.take().unwrap_or_else(|| panic!("stderr"));
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    let wants_metrics = extra.contains(&"--metrics-listen");
    let (mut base, mut metrics) = (None, None);
    while base.is_none() || (wants_metrics && metrics.is_none()) {
        let line = must(tokio::time::timeout(LIMIT, lines.next_line()).await, "serve started");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier serve exited"));
        if let Some(url) = line.strip_prefix("pier serve: listening on ") {
            base = Some(url.to_owned());
        } else if let Some(url) = line.strip_prefix("pier serve: metrics on ") {
            metrics = Some(url.to_owned());
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (Server { dir, _child: child, base: base.unwrap_or_default(), http: reqwest::Client::new() }, metrics)
}

impl Server {
    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.base)).bearer_auth(TOKEN);
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(b.to_string());
        }
        let resp = must(must(tokio::time::timeout(LIMIT, req.send()).await, "answer in time"), "send");
        let status = resp.status().as_u16();
        let text = must(resp.text().await, "body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// Reads SSE events from `after` (via Last-Event-ID) until `stop` says so; returns them.
    pub async fn events_until(&self, after: Option<i64>, mut stop: impl FnMut(&Value) -> bool) -> Vec<Value> {
        let mut req = self.http.get(format!("{}/events", self.base)).bearer_auth(TOKEN);
        if let Some(a) = after {
            req = req.header("Last-Event-ID", a.to_string());
        }
        let resp = must(must(tokio::time::timeout(LIMIT, req.send()).await, "connect"), "send");
        assert_eq!(resp.status().as_u16(), 200);
        let mut stream = resp.bytes_stream();
        let mut sse = SseDecoder::new(1 << 20);
        let mut out = Vec::new();
        // One deadline for the whole wait: keep-alive comments must not extend it.
        let deadline = tokio::time::Instant::now() + LIMIT;
        loop {
            let chunk = must(tokio::time::timeout_at(deadline, stream.next()).await, "events in time");
            let chunk = must(chunk.unwrap_or_else(|| panic!("stream ended")), "chunk");
            for data in sse.push(&chunk).unwrap_or_default() {
                let v: Value = must(serde_json::from_str(&data), "event json");
                let done = stop(&v);
                out.push(v);
                if done {
                    return out;
                }
            }
        }
    }
}
