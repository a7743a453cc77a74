//! The errors of the model layer.

use std::time::Duration;

/// Why a model request failed. Every variant's message is meant for the user
/// and carries the provider's own words where there are any.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// No provider is configured. Never retried.
    #[error("no model is configured: {0}")]
    NotConfigured(String),
    /// The provider answered with an HTTP error. Retried on 429 and 5xx before output.
    #[error("the model provider answered HTTP {status}: {message}")]
    Http { status: u16, message: String },
    /// The endpoint could not be reached. Retried before output.
    #[error("could not reach the model endpoint {url}: {message}")]
    Connect { url: String, message: String },
    /// The endpoint went silent. Retried before output.
    #[error("the model endpoint sent nothing for {0:?}; raise idle_timeout_ms if the model is slow")]
    IdleTimeout(Duration),
    /// The stream broke or ended before the model finished. Retried only before output.
    #[error("the model stream was cut before the model finished: {0}")]
    StreamCut(String),
    /// The provider sent something that is not the streaming format.
    #[error("the model provider sent a malformed stream: {0}")]
    Protocol(String),
    /// The provider reported an error inside the stream.
    #[error("the model provider reported an error: {0}")]
    Provider(String),
    /// A local setup problem (TLS backend, bad header), never retried.
    #[error("could not set up the model client: {0}")]
    Setup(String),
}

impl ModelError {
    /// Whether the request may be retried when nothing has streamed yet.
    pub fn is_retryable(&self) -> bool {
        match self {
            ModelError::Http { status, .. } => *status == 429 || *status >= 500,
            ModelError::Connect { .. } | ModelError::IdleTimeout(_) | ModelError::StreamCut(_) => true,
            _ => false,
        }
    }
}
