//! The seam where tools plug into the turn loop.
//!
//! The engine asks a [`ToolHost`] which tools to offer the model and hands it each
//! tool call. This issue ships no tools ([`NoTools`]): a call is answered with a
//! failure the model can read, and the turn goes on.

use futures::future::BoxFuture;
use pier_model::{ToolCall, ToolSpec};
use serde_json::Value;

/// How a tool call ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutcome {
    /// `completed` or `failed`.
    pub success: bool,
    /// What the model reads as the tool's result.
    pub output: String,
    /// Structured output for the session log.
    pub raw: Value,
}

/// Executes tool calls for a session.
pub trait ToolHost: Send + Sync + 'static {
    /// The tools offered to the model.
    fn specs(&self) -> Vec<ToolSpec>;
    /// Runs one call. Must never panic; failures are outcomes.
    fn call(&self, call: ToolCall) -> BoxFuture<'static, ToolOutcome>;
}

/// A host with no tools.
pub struct NoTools;

impl ToolHost for NoTools {
    fn specs(&self) -> Vec<ToolSpec> {
        Vec::new()
    }

    fn call(&self, call: ToolCall) -> BoxFuture<'static, ToolOutcome> {
        Box::pin(async move {
            let output = format!("error: tool `{}` is not available in this session; answer without tools", call.name);
            ToolOutcome { success: false, raw: Value::String(output.clone()), output }
        })
    }
}
