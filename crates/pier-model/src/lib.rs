//! The model layer: a streaming, cancellable provider trait and its providers.
//!
//! A provider turns a [`ModelRequest`] into a stream of [`ModelEvent`]s. Dropping
//! the stream cancels the request: the HTTP connection is closed with it.
//!
//! - [`openai`]: the OpenAI-compatible Chat Completions provider (OpenAI, DeepSeek,
//!   Ollama, vLLM, llama.cpp's server).
//! - [`sse`]: the bounded Server-Sent Events decoder it reads with.
//! - [`config`]: endpoint settings, secrets and the retry backoff.

pub mod config;
pub mod error;
#[cfg(feature = "local")]
pub mod local;
pub mod openai;
pub mod sse;

use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

pub use config::{ModelConfig, Secret};
pub use error::ModelError;
pub use openai::OpenAiProvider;

/// Who said a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// One message of the conversation sent to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    /// Tool calls the assistant made in this message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a `Tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Images of a user message, for providers that take them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<Image>,
}

/// An image as base64 data with its MIME type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    pub mime_type: String,
    pub data: String,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self { role, content: content.into(), tool_calls: Vec::new(), tool_call_id: None, images: Vec::new() }
    }
}

/// A complete tool call, assembled from its streamed deltas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the model wrote them: JSON text, not yet validated.
    pub arguments: String,
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON schema of the parameters.
    pub parameters: serde_json::Value,
}

/// What to ask the model.
#[derive(Debug, Clone, Default)]
pub struct ModelRequest {
    pub messages: Vec<ChatMessage>,
    pub tools: Vec<ToolSpec>,
}

/// Token counts of one model request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

/// Why the model stopped generating.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The message is complete.
    Stop,
    /// The output token limit was reached.
    Length,
    /// The model refused (`content_filter`, or a `refusal` in the message).
    Refusal,
    /// The model wants tools run.
    ToolCalls,
    /// A reason this layer does not know; treated as the message's end.
    Other(String),
}

/// One event of a streamed model response.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelEvent {
    TextDelta(String),
    ReasoningDelta(String),
    RefusalDelta(String),
    /// A fragment of tool call `index`; `id` and `name` come with the first one.
    ToolCallDelta {
        index: u32,
        id: Option<String>,
        name: Option<String>,
        arguments: String,
    },
    Usage(Usage),
    /// The request failed before anything of an answer came (`error`) and is sent again, try
    /// `attempt` (2 for the first retry), after `delay_ms`: a retry marker for the session log.
    Retrying {
        attempt: u32,
        delay_ms: u64,
        error: String,
    },
    /// The last event: the finish reason and the tool calls assembled by index.
    Finish {
        reason: FinishReason,
        tool_calls: Vec<ToolCall>,
    },
}

/// A stream of model events; dropping it cancels the request.
pub type ModelStream = BoxStream<'static, Result<ModelEvent, ModelError>>;

/// A model provider.
pub trait ModelProvider: Send + Sync + 'static {
    /// A short description for logs, e.g. `openai-compatible deepseek-chat at https://…`.
    fn describe(&self) -> String;

    /// Starts a request and streams its events.
    fn stream(&self, request: ModelRequest) -> ModelStream;

    /// The model's context window in tokens, where it is known.
    fn context_window(&self) -> Option<u64> {
        None
    }

    /// Whether the model takes images (a user message's `images`).
    fn takes_images(&self) -> bool {
        false
    }
}

/// The provider used when none is configured: every request fails at once with
/// a message that says how to configure one.
pub struct Unconfigured;

/// How to configure a model, for error messages.
pub const CONFIGURE_HINT: &str = "run `pier models install` for the embedded offline model, or \
set PIER_MODEL and PIER_BASE_URL (and PIER_API_KEY if the endpoint needs a key), \
pass --model and --base-url, or name a provider from a [providers.NAME] table of ./pier.toml or \
~/.config/pier/config.toml with --provider or `provider = \"NAME\"`";

impl ModelProvider for Unconfigured {
    fn describe(&self) -> String {
        "no model configured".to_owned()
    }

    fn stream(&self, _request: ModelRequest) -> ModelStream {
        Box::pin(futures::stream::once(async { Err(ModelError::NotConfigured(CONFIGURE_HINT.to_owned())) }))
    }
}
