//! The OpenAI-compatible Chat Completions provider, streaming over SSE.
//!
//! Works with OpenAI, DeepSeek (`reasoning_content`), Ollama, vLLM and llama.cpp's
//! server. Retries with jittered backoff on 429, 5xx, connection errors and
//! timeouts, but only while nothing has streamed yet: once output has reached the
//! caller, a failure ends the stream with an error instead of a silent retry.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::backoff;
use crate::sse::SseDecoder;
use crate::{
    ChatMessage, FinishReason, ModelConfig, ModelError, ModelEvent, ModelProvider, ModelRequest, ModelStream, Role,
    ToolCall, Usage,
};

/// Longest SSE line accepted from a provider.
const MAX_SSE_LINE: usize = 16 * 1024 * 1024;
/// Longest error body read from a failed response.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// An OpenAI-compatible Chat Completions client. Cheap to clone.
#[derive(Clone)]
pub struct OpenAiProvider {
    inner: Arc<Inner>,
}

struct Inner {
    config: ModelConfig,
    client: reqwest::Client,
}

impl OpenAiProvider {
    pub fn new(config: ModelConfig) -> Result<Self, ModelError> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .user_agent(concat!("pier/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ModelError::Setup(e.to_string()))?;
        Ok(Self { inner: Arc::new(Inner { config, client }) })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.inner.config
    }
}

impl ModelProvider for OpenAiProvider {
    fn describe(&self) -> String {
        format!("openai-compatible {} at {}", self.inner.config.model, self.inner.config.base_url)
    }

    fn context_window(&self) -> Option<u64> {
        self.inner.config.context_window
    }

    fn takes_images(&self) -> bool {
        self.inner.config.vision
    }

    fn stream(&self, request: ModelRequest) -> ModelStream {
        let inner = self.inner.clone();
        Box::pin(async_stream::stream! {
            let body = request_body(&inner.config, &request);
            let mut attempt = 0u32;
            'attempts: loop {
                attempt += 1;
                let mut retry_after = None;
                // Whether any event has reached the caller in this attempt.
                let mut started = false;
                let failure = 'attempt: {
                    let response = match send(&inner, &body).await {
                        Ok(r) => r,
                        Err((e, ra)) => {
                            retry_after = ra;
                            break 'attempt e;
                        }
                    };
                    let mut bytes = response.bytes_stream();
                    let mut sse = SseDecoder::new(MAX_SSE_LINE);
                    let mut state = StreamState::default();
                    loop {
                        let next = match tokio::time::timeout(inner.config.idle_timeout, bytes.next()).await {
                            Ok(next) => next,
                            Err(_) => break 'attempt ModelError::IdleTimeout(inner.config.idle_timeout),
                        };
                        let (datas, eof) = match next {
                            None => (sse.finish().into_iter().collect::<Vec<_>>(), true),
                            Some(Err(e)) => break 'attempt ModelError::StreamCut(error_chain(&e)),
                            Some(Ok(chunk)) => match sse.push(&chunk) {
                                Ok(d) => (d, false),
                                Err(e) => break 'attempt ModelError::Protocol(format!("an SSE line of {} bytes is too long", e.0)),
                            },
                        };
                        for data in datas {
                            if data.trim() == "[DONE]" {
                                state.done = true;
                                break;
                            }
                            match state.chunk(&data) {
                                Ok(events) => {
                                    for event in events {
                                        started = true;
                                        yield Ok(event);
                                    }
                                }
                                Err(e) => break 'attempt e,
                            }
                        }
                        if state.done || eof {
                            break;
                        }
                    }
                    match state.finish() {
                        Ok(event) => {
                            yield Ok(event);
                            return;
                        }
                        Err(e) => break 'attempt e,
                    }
                };
                if !started && failure.is_retryable() && attempt <= inner.config.max_retries {
                    let delay = backoff(inner.config.retry_base_delay, attempt, retry_after);
                    tracing::warn!(attempt, ?delay, error = %failure, "model request failed; retrying");
                    yield Ok(ModelEvent::Retrying {
                        attempt: attempt + 1,
                        delay_ms: delay.as_millis().try_into().unwrap_or(u64::MAX),
                        error: failure.to_string(),
                    });
                    tokio::time::sleep(delay).await;
                    continue 'attempts;
                }
                yield Err(failure);
                return;
            }
        })
    }
}

/// Sends the request and returns the response if it succeeded, or the error and
/// the server's `Retry-After`.
async fn send(inner: &Inner, body: &Value) -> Result<reqwest::Response, (ModelError, Option<Duration>)> {
    let url = inner.config.completions_url();
    let payload = serde_json::to_vec(body).map_err(|e| (ModelError::Setup(e.to_string()), None))?;
    let mut req = inner
        .client
        .post(&url)
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(payload);
    if let Some(key) = &inner.config.api_key {
        req = req.bearer_auth(key.expose());
    }
    let response = match tokio::time::timeout(inner.config.idle_timeout, req.send()).await {
        Err(_) => return Err((ModelError::IdleTimeout(inner.config.idle_timeout), None)),
        Ok(Err(e)) => return Err((ModelError::Connect { url, message: error_chain(&e) }, None)),
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = read_bounded(response, inner.config.idle_timeout).await;
    Err((ModelError::Http { status: status.as_u16(), message: error_message(&body, status) }, retry_after))
}

async fn read_bounded(response: reqwest::Response, idle: Duration) -> String {
    let mut out = Vec::new();
    let mut bytes = response.bytes_stream();
    while let Ok(Some(Ok(chunk))) = tokio::time::timeout(idle, bytes.next()).await {
        out.extend_from_slice(&chunk);
        if out.len() >= MAX_ERROR_BODY {
            out.truncate(MAX_ERROR_BODY);
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The provider's own message from an error body, or the body, or the status text.
fn error_message(body: &str, status: reqwest::StatusCode) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        let msg = v.pointer("/error/message").or_else(|| v.get("error")).or_else(|| v.get("message"));
        if let Some(Value::String(s)) = msg {
            return s.clone();
        }
    }
    let trimmed = body.trim();
    if trimmed.is_empty() {
        status.canonical_reason().unwrap_or("no message").to_owned()
    } else {
        trimmed.chars().take(500).collect()
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

fn request_body(config: &ModelConfig, request: &ModelRequest) -> Value {
    let messages: Vec<Value> = request.messages.iter().map(message_json).collect();
    let mut body = json!({ "model": config.model, "messages": messages, "stream": true });
    if config.stream_usage {
        body["stream_options"] = json!({ "include_usage": true });
    }
    if let Some(max) = config.max_tokens {
        body["max_tokens"] = json!(max);
    }
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|t| json!({ "type": "function", "function": { "name": t.name, "description": t.description, "parameters": t.parameters } }))
            .collect();
    }
    body
}

fn message_json(m: &ChatMessage) -> Value {
    let role = match m.role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let mut v = json!({ "role": role, "content": m.content });
    if !m.images.is_empty() {
        // Chat Completions takes images as content parts with data URLs.
        let mut parts = vec![json!({ "type": "text", "text": m.content })];
        parts.extend(m.images.iter().map(|i| {
            json!({ "type": "image_url", "image_url": { "url": format!("data:{};base64,{}", i.mime_type, i.data) } })
        }));
        v["content"] = Value::Array(parts);
    }
    if !m.tool_calls.is_empty() {
        v["tool_calls"] = m
            .tool_calls
            .iter()
            .map(
                |c| json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } }),
            )
            .collect();
    }
    if let Some(id) = &m.tool_call_id {
        v["tool_call_id"] = json!(id);
    }
    v
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
}

#[derive(Deserialize)]
struct WireToolCall {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunction>,
}

#[derive(Deserialize)]
struct WireFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: u64,
}

/// What one response stream has said so far.
#[derive(Default)]
struct StreamState {
    finish: Option<String>,
    refused: bool,
    done: bool,
    calls: BTreeMap<u32, ToolCall>,
}

impl StreamState {
    /// Turns one `data:` payload into events.
    fn chunk(&mut self, data: &str) -> Result<Vec<ModelEvent>, ModelError> {
        let chunk: Chunk = serde_json::from_str(data).map_err(|e| {
            ModelError::Protocol(format!("{e} in chunk {}", data.chars().take(200).collect::<String>()))
        })?;
        if let Some(error) = chunk.error {
            let msg = error.get("message").and_then(Value::as_str).map_or_else(|| error.to_string(), str::to_owned);
            return Err(ModelError::Provider(msg));
        }
        let mut events = Vec::new();
        for choice in chunk.choices {
            if let Some(delta) = choice.delta {
                if let Some(r) = delta.reasoning_content.or(delta.reasoning).filter(|s| !s.is_empty()) {
                    events.push(ModelEvent::ReasoningDelta(r));
                }
                if let Some(t) = delta.content.filter(|s| !s.is_empty()) {
                    events.push(ModelEvent::TextDelta(t));
                }
                if let Some(r) = delta.refusal.filter(|s| !s.is_empty()) {
                    self.refused = true;
                    events.push(ModelEvent::RefusalDelta(r));
                }
                for call in delta.tool_calls.unwrap_or_default() {
                    events.push(self.tool_call_delta(call));
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(reason);
            }
        }
        if let Some(u) = chunk.usage {
            let total = if u.total_tokens == 0 { u.prompt_tokens + u.completion_tokens } else { u.total_tokens };
            events.push(ModelEvent::Usage(Usage {
                prompt_tokens: u.prompt_tokens,
                completion_tokens: u.completion_tokens,
                total_tokens: total,
            }));
        }
        Ok(events)
    }

    fn tool_call_delta(&mut self, call: WireToolCall) -> ModelEvent {
        // Some servers omit `index` and send each call whole: a new id starts a new call.
        let index = call.index.unwrap_or_else(|| {
            let last = self.calls.keys().next_back().copied();
            match (&call.id, last) {
                (Some(id), Some(l)) if self.calls.get(&l).is_some_and(|c| &c.id != id) => l + 1,
                (_, Some(l)) => l,
                (_, None) => 0,
            }
        });
        let (name, arguments) = match call.function {
            Some(f) => (f.name, f.arguments.unwrap_or_default()),
            None => (None, String::new()),
        };
        let entry = self.calls.entry(index).or_insert_with(|| ToolCall {
            id: String::new(),
            name: String::new(),
            arguments: String::new(),
        });
        if let Some(id) = &call.id {
            entry.id.clone_from(id);
        }
        if let Some(n) = &name {
            entry.name.push_str(n);
        }
        entry.arguments.push_str(&arguments);
        ModelEvent::ToolCallDelta { index, id: call.id, name, arguments }
    }

    /// The closing [`ModelEvent::Finish`], or the error for a stream that ended early.
    fn finish(&mut self) -> Result<ModelEvent, ModelError> {
        let reason = match self.finish.as_deref() {
            None if self.done => FinishReason::Stop,
            None => return Err(ModelError::StreamCut("the stream ended without a finish reason or [DONE]".into())),
            Some("stop") if self.refused => FinishReason::Refusal,
            Some("stop") | Some("eos") | Some("end_turn") => FinishReason::Stop,
            Some("length") => FinishReason::Length,
            Some("content_filter") => FinishReason::Refusal,
            Some("tool_calls") | Some("function_call") => FinishReason::ToolCalls,
            Some(other) => FinishReason::Other(other.to_owned()),
        };
        let mut tool_calls: Vec<ToolCall> = std::mem::take(&mut self.calls).into_values().collect();
        for (i, call) in tool_calls.iter_mut().enumerate() {
            if call.id.is_empty() {
                call.id = format!("call_{i}");
            }
        }
        // A model that sends tool calls but finishes with `stop` still wants them run.
        let reason =
            if reason == FinishReason::Stop && !tool_calls.is_empty() { FinishReason::ToolCalls } else { reason };
        Ok(ModelEvent::Finish { reason, tool_calls })
    }
}
