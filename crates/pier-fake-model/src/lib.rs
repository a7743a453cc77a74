//! A scripted OpenAI-compatible Chat Completions endpoint on loopback.
//!
//! It speaks the real wire format: `POST …/chat/completions` answered with
//! `text/event-stream` chunks (`data: {…}`, SSE comments, `data: [DONE]`), or with
//! an HTTP error and an OpenAI-style error body. Tests script each reply and can
//! inject the failures real servers produce: split tool-call arguments, a stream
//! cut midway, a 429 before success, a server that never answers. It records every
//! request so tests can assert what the client sent, and counts the clients that
//! went away, so a test can see that a cancelled stream was really dropped.
//!
//! The same scripts render in other providers' formats too (see [`encode`]), so
//! third-party agents (codex, Claude Code, gemini-cli) can run against it.
//! Requests that are not part of the scripted conversation (title generation,
//! gemini's model router) get an automatic answer and do not use up the script.
//!
//! It is also the scripted model behind `pier demo`.

pub mod body;
pub mod check;
mod encode;
pub mod peers;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// One step of a streamed reply.
#[derive(Debug, Clone)]
pub enum Step {
    /// A `delta.content` chunk.
    Text(String),
    /// A DeepSeek-style `delta.reasoning_content` chunk.
    Reasoning(String),
    /// A `delta.refusal` chunk.
    Refusal(String),
    /// The opening chunk of a tool call: index, id and function name.
    ToolCallStart { index: u32, id: String, name: String },
    /// A fragment of a tool call's arguments.
    ToolCallArgs { index: u32, fragment: String },
    /// A chunk with `finish_reason` set.
    Finish(String),
    /// A usage chunk (empty `choices`), as sent with `stream_options.include_usage`.
    Usage { prompt: u64, completion: u64 },
    /// An SSE comment line, as keep-alives are sent.
    Comment(String),
    /// Any raw `data:` payload.
    Data(Value),
    /// `data: [DONE]`.
    Done,
    /// Stop sending and keep the connection open until the client goes away.
    Hang,
    /// Close the connection abruptly, without `[DONE]`.
    Cut,
    /// Wait before the next step (only for demos; tests synchronise on gates and counters).
    Pause(Duration),
    /// Wait until the test opens the gate ([`Gate::open`]).
    Gate(Gate),
    /// `count` text deltas of `text` each, written back to back as fast as the client takes
    /// them, one write per delta; the time each was written is kept ([`FakeModel::token_times`]).
    /// For benchmarks: a long stream without a `Step` per delta.
    Tokens { text: String, count: usize },
}

/// A point a scripted stream waits at until the test opens it.
#[derive(Debug, Clone, Default)]
pub struct Gate(Arc<tokio::sync::Notify>);

impl Gate {
    pub fn new() -> Gate {
        Gate::default()
    }

    /// Lets one waiting (or the next) stream through.
    pub fn open(&self) {
        self.0.notify_one();
    }
}

/// A scripted reply to one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// `200 text/event-stream` with these steps.
    Stream(Vec<Step>),
    /// An HTTP error with an OpenAI-style error body carrying `message`.
    Status { code: u16, message: String, retry_after_secs: Option<u64> },
    /// Accept the request and never answer.
    Hang,
}

impl Reply {
    /// A complete text answer: the text in chunks of about `chunk` chars, `stop`, usage, `[DONE]`.
    pub fn text(text: &str) -> Reply {
        let mut steps: Vec<Step> = split(text, 8).into_iter().map(Step::Text).collect();
        steps.push(Step::Finish("stop".into()));
        steps.push(Step::Usage { prompt: 10, completion: text.len() as u64 / 4 + 1 });
        steps.push(Step::Done);
        Reply::Stream(steps)
    }

    /// `count` deltas of `token` written as fast as the client takes them, then `stop`,
    /// usage and `[DONE]` (see [`Step::Tokens`]).
    pub fn tokens(token: &str, count: usize) -> Reply {
        Reply::Stream(vec![
            Step::Tokens { text: token.into(), count },
            Step::Finish("stop".into()),
            Step::Usage { prompt: 10, completion: count as u64 },
            Step::Done,
        ])
    }

    /// One tool call with its arguments split into two fragments, finishing `tool_calls`.
    pub fn tool_call(id: &str, name: &str, arguments: &str) -> Reply {
        let mid = arguments.char_indices().nth(arguments.chars().count() / 2).map_or(0, |(i, _)| i);
        Reply::Stream(vec![
            Step::ToolCallStart { index: 0, id: id.into(), name: name.into() },
            Step::ToolCallArgs { index: 0, fragment: arguments[..mid].into() },
            Step::ToolCallArgs { index: 0, fragment: arguments[mid..].into() },
            Step::Finish("tool_calls".into()),
            Step::Done,
        ])
    }

    pub fn status(code: u16, message: &str) -> Reply {
        Reply::Status { code, message: message.into(), retry_after_secs: None }
    }
}

fn split(text: &str, chunk: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(chunk.max(1)).map(|c| c.iter().collect()).collect()
}

/// A request as the server received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    /// Whether the request was answered automatically, outside the script.
    pub auxiliary: bool,
    pub authorization: Option<String>,
    /// The key however it was sent: `Authorization: Bearer`, `x-api-key`, `x-goog-api-key`.
    pub api_key: Option<String>,
    pub body: Value,
    /// The usage the answer reported, `(input, output)`, once it was written whole.
    pub reported: Option<(u64, u64)>,
    /// When its head was read.
    pub at: Instant,
}

type Fallback = Arc<dyn Fn(&Value) -> Reply + Send + Sync>;

struct State {
    script: VecDeque<Reply>,
    fallback: Option<Fallback>,
    requests: Vec<Recorded>,
    /// Request bodies that broke [`check::chat_request`]; dropping the fake then fails the test.
    violations: Vec<String>,
    /// When each delta of the last [`Step::Tokens`] was written.
    token_times: Vec<Instant>,
}

/// A running fake endpoint. It stops when dropped.
pub struct FakeModel {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    requests_seen: watch::Receiver<usize>,
    disconnects: watch::Receiver<usize>,
    task: tokio::task::JoinHandle<()>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl FakeModel {
    /// Binds 127.0.0.1 on a free port and starts serving.
    pub async fn start() -> std::io::Result<FakeModel> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            script: VecDeque::new(),
            fallback: None,
            requests: Vec::new(),
            violations: Vec::new(),
            token_times: Vec::new(),
        }));
        let (seen_tx, requests_seen) = watch::channel(0usize);
        let (gone_tx, disconnects) = watch::channel(0usize);
        let (seen_tx, gone_tx) = (Arc::new(seen_tx), Arc::new(gone_tx));
        let task_state = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let state = task_state.clone();
                let (seen_tx, gone_tx) = (seen_tx.clone(), gone_tx.clone());
                tokio::spawn(async move {
                    if let Err(e) = serve(socket, state, &seen_tx, &gone_tx).await {
                        tracing::debug!(error = %e, "fake model connection ended");
                    }
                });
            }
        });
        Ok(FakeModel { addr, state, requests_seen, disconnects, task })
    }

    /// The base URL to configure a client with, e.g. `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Queues the reply to the next unanswered request.
    pub fn push(&self, reply: Reply) {
        lock(&self.state).script.push_back(reply);
    }

    /// Drops every queued reply that was not used.
    pub fn clear_script(&self) {
        lock(&self.state).script.clear();
    }

    /// Answers requests with `f` once the script is exhausted.
    pub fn set_fallback(&self, f: impl Fn(&Value) -> Reply + Send + Sync + 'static) {
        lock(&self.state).fallback = Some(Arc::new(f));
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.state).requests.clone()
    }

    /// When each delta of the last [`Step::Tokens`] was written to the socket, in order
    /// (taken when its write returned; only the deltas that were written).
    pub fn token_times(&self) -> Vec<Instant> {
        lock(&self.state).token_times.clone()
    }

    /// Waits until at least `n` requests have been received.
    pub async fn wait_for_requests(&self, n: usize) {
        let mut rx = self.requests_seen.clone();
        let _ = rx.wait_for(|&seen| seen >= n).await;
    }

    /// Waits until at least `n` clients went away while a reply was hanging.
    pub async fn wait_for_disconnects(&self, n: usize) {
        let mut rx = self.disconnects.clone();
        let _ = rx.wait_for(|&gone| gone >= n).await;
    }

    /// How many clients went away while a reply was hanging.
    pub fn disconnects(&self) -> usize {
        *self.disconnects.borrow()
    }
}

impl Drop for FakeModel {
    fn drop(&mut self) {
        self.task.abort();
        let violations = std::mem::take(&mut lock(&self.state).violations);
        if !violations.is_empty() && !std::thread::panicking() {
            panic!("the client sent {} invalid request bodies:\n{}", violations.len(), violations.join("\n"));
        }
    }
}

async fn serve(
    mut socket: TcpStream,
    state: Arc<Mutex<State>>,
    seen: &watch::Sender<usize>,
    gone: &watch::Sender<usize>,
) -> std::io::Result<()> {
    let Some(Head { path, authorization, api_key, body }) = read_request(&mut socket).await? else {
        return Ok(());
    };
    let Some(api) = encode::Api::from_path(&path) else {
        lock(&state).requests.push(Recorded {
            path: path.clone(),
            auxiliary: true,
            authorization,
            api_key,
            body,
            reported: None,
            at: Instant::now(),
        });
        seen.send_modify(|n| *n += 1);
        return write_status(&mut socket, 404, &format!("fake model: no route for {path}"), None).await;
    };
    let streaming = body.get("stream").and_then(Value::as_bool).unwrap_or(api == encode::Api::GeminiStream);
    let auxiliary = match api {
        encode::Api::GeminiGenerate => true,
        // Claude Code's side requests (titles, quota checks) carry no tools.
        encode::Api::AnthropicMessages => body.get("tools").and_then(Value::as_array).is_none_or(Vec::is_empty),
        _ => false,
    };
    let invalid = match api {
        encode::Api::ChatCompletions => check::chat_request(&body).err(),
        _ => None,
    };
    let (reply, index) = {
        let mut st = lock(&state);
        let index = st.requests.len();
        st.requests.push(Recorded {
            path: path.clone(),
            auxiliary,
            authorization,
            api_key,
            body: body.clone(),
            reported: None,
            at: Instant::now(),
        });
        let reply = if let Some(why) = invalid {
            // Refused as a provider would; the test fails when the fake is dropped.
            st.violations.push(format!("{why}: {body}"));
            Some(Reply::status(400, &format!("fake model: invalid request body: {why}")))
        } else if auxiliary {
            None
        } else {
            Some(match st.script.pop_front() {
                Some(reply) => reply,
                None => match &st.fallback {
                    Some(f) => f(&body),
                    None => Reply::status(400, "fake model: no scripted reply left for this request"),
                },
            })
        };
        (reply, index)
    };
    seen.send_modify(|n| *n += 1);
    let reported = |usage: Option<(u64, u64)>| {
        if let Some(r) = lock(&state).requests.get_mut(index) {
            r.reported = usage;
        }
    };
    let Some(reply) = reply else {
        let (content_type, text, usage) = encode::auxiliary(api, streaming);
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            text.len()
        );
        socket.write_all(head.as_bytes()).await?;
        socket.write_all(text.as_bytes()).await?;
        reported(usage);
        return socket.shutdown().await;
    };
    match reply {
        Reply::Status { code, message, retry_after_secs } => {
            write_status(&mut socket, code, &message, retry_after_secs).await
        }
        Reply::Hang => hang(socket, gone).await,
        Reply::Stream(steps) => {
            socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n")
                .await?;
            let mut encoder = encode::Encoder::new(api);
            // The usage the script reports, known from the start (Anthropic reports input first).
            if let Some(Step::Usage { prompt, completion }) = steps.iter().find(|s| matches!(s, Step::Usage { .. })) {
                encoder.set_usage(*prompt, *completion);
            }
            let opening = encoder.begin();
            if !opening.is_empty() {
                socket.write_all(opening.as_bytes()).await?;
            }
            for step in steps {
                match &step {
                    Step::Hang => return hang(socket, gone).await,
                    Step::Cut => return Ok(()),
                    Step::Pause(d) => {
                        tokio::time::sleep(*d).await;
                        continue;
                    }
                    Step::Gate(gate) => {
                        gate.0.notified().await;
                        continue;
                    }
                    Step::Tokens { text, count } => {
                        let mut times = Vec::with_capacity(*count);
                        let written = write_tokens(&mut socket, &mut encoder, text, *count, &mut times).await;
                        lock(&state).token_times = times;
                        written?;
                        continue;
                    }
                    _ => {}
                }
                let out = encoder.step(&step);
                if !out.is_empty() {
                    socket.write_all(out.as_bytes()).await?;
                    socket.flush().await?;
                }
            }
            reported(encoder.reported);
            socket.shutdown().await
        }
    }
}

/// Writes `count` deltas of `text`, one write each, noting when each write returned. Every
/// delta after the first encodes the same (the first may open a content block), so the
/// second's bytes are reused.
async fn write_tokens(
    socket: &mut TcpStream,
    encoder: &mut encode::Encoder,
    text: &str,
    count: usize,
    times: &mut Vec<Instant>,
) -> std::io::Result<()> {
    let step = Step::Text(text.to_owned());
    let opening = encoder.open_message();
    if !opening.is_empty() {
        socket.write_all(opening.as_bytes()).await?;
    }
    let mut repeated = String::new();
    for i in 0..count {
        if i < 2 {
            repeated = encoder.step(&step);
        } else {
            encoder.note_text(text);
        }
        socket.write_all(repeated.as_bytes()).await?;
        times.push(Instant::now());
    }
    Ok(())
}

async fn hang(mut socket: TcpStream, gone: &watch::Sender<usize>) -> std::io::Result<()> {
    let mut buf = [0u8; 1024];
    loop {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => {
                gone.send_modify(|n| *n += 1);
                return Ok(());
            }
            Ok(_) => {}
        }
    }
}

async fn write_status(
    socket: &mut TcpStream,
    code: u16,
    message: &str,
    retry_after: Option<u64>,
) -> std::io::Result<()> {
    let body = json!({ "error": { "message": message, "type": "fake_error", "code": code } }).to_string();
    let retry = retry_after.map(|s| format!("retry-after: {s}\r\n")).unwrap_or_default();
    let head = format!(
        "HTTP/1.1 {code} Fake\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{retry}connection: close\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body.as_bytes()).await?;
    socket.shutdown().await
}

/// What [`read_request`] reads.
struct Head {
    path: String,
    authorization: Option<String>,
    api_key: Option<String>,
    body: Value,
}

/// Reads one HTTP/1.1 request; returns its path, key headers and JSON body.
async fn read_request(socket: &mut TcpStream) -> std::io::Result<Option<Head>> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos;
        }
        if buf.len() > 1 << 20 {
            return Ok(None);
        }
        let n = socket.read(&mut tmp).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let path = lines.next().and_then(|l| l.split_whitespace().nth(1)).unwrap_or("/").to_owned();
    let mut content_length = 0usize;
    let (mut authorization, mut api_key) = (None, None);
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "content-length" => content_length = v.trim().parse().unwrap_or(0),
                "authorization" => {
                    authorization = Some(v.trim().to_owned());
                    api_key = v.trim().strip_prefix("Bearer ").map(str::to_owned);
                }
                "x-api-key" | "x-goog-api-key" => api_key = Some(v.trim().to_owned()),
                _ => {}
            }
        }
    }
    if api_key.is_none() {
        let query = path.split_once('?').map(|(_, q)| q).unwrap_or("");
        api_key = query.split('&').find_map(|kv| kv.strip_prefix("key=")).map(str::to_owned);
    }
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < content_length {
        let n = socket.read(&mut tmp).await?;
        if n == 0 {
            return Ok(None);
        }
        body.extend_from_slice(&tmp[..n]);
    }
    let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(Some(Head { path, authorization, api_key, body }))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn post(base: &str, path: &str, body: &Value) -> String {
        let addr = base.trim_start_matches("http://").trim_end_matches("/v1");
        let mut socket = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
        let body = body.to_string();
        let head = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {}\r\n\r\n", body.len());
        socket.write_all(head.as_bytes()).await.unwrap_or_else(|e| panic!("{e}"));
        socket.write_all(body.as_bytes()).await.unwrap_or_else(|e| panic!("{e}"));
        let mut out = String::new();
        socket.read_to_string(&mut out).await.unwrap_or_else(|e| panic!("{e}"));
        out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_else(|| panic!("no body in {out:?}"))
    }

    #[tokio::test]
    async fn tokens_are_served_like_text_steps_and_timed() {
        for path in ["/v1/chat/completions", "/v1/responses", "/v1/messages"] {
            let fake = FakeModel::start().await.unwrap_or_else(|e| panic!("{e}"));
            fake.push(Reply::tokens("tok ", 5));
            let body =
                json!({"stream": true, "tools": [{"name": "t"}], "messages": [{"role": "user", "content": "go"}]});
            let got = post(&fake.base_url(), path, &body).await;
            let api = encode::Api::from_path(path).unwrap_or_else(|| panic!("no api for {path}"));
            let mut e = encode::Encoder::new(api);
            let mut want = e.begin();
            want.push_str(&e.open_message());
            let Reply::Stream(steps) = Reply::tokens("tok ", 5) else { unreachable!() };
            for s in steps.iter().skip(1) {
                if matches!(s, Step::Finish(_)) {
                    for _ in 0..5 {
                        want.push_str(&e.step(&Step::Text("tok ".into())));
                    }
                }
                want.push_str(&e.step(s));
            }
            assert_eq!(got, want, "{path}");
            assert_eq!(fake.token_times().len(), 5);
        }
    }
}
