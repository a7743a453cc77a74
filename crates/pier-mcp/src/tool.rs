//! An MCP server's tool as a [`pier_tools::Tool`]: its exposed name, and a call as `tools/call`.
//!
//! A result with `isError: true` is `Ok` with `success: false`: the model reads the server's own
//! words and the call is marked failed. Only what stops the call from being answered (the server is
//! down, the request failed, the turn was cancelled) is a [`ToolError`].

use std::collections::HashSet;
use std::sync::Arc;

use futures::future::BoxFuture;
use pier_tools::{Preview, Tool, ToolContext, ToolError, ToolKind, ToolOutput, ToolSpec, Workspace};
use rmcp::model::CallToolRequestParams;
use rmcp::service::ServiceError;
use serde_json::Value;

use crate::server::Server;

/// The longest tool name models accept.
const MAX_NAME: usize = 64;

pub(crate) struct McpTool {
    /// Its name is the one the model sees: `{server}__{tool}`, sanitised and unique.
    spec: ToolSpec,
    /// The name the server knows.
    tool: String,
    server: Arc<Server>,
}

impl McpTool {
    pub(crate) fn new(name: String, tool: &rmcp::model::Tool, server: Arc<Server>) -> McpTool {
        let read_only = tool.annotations.as_ref().and_then(|a| a.read_only_hint).unwrap_or(false);
        McpTool {
            spec: ToolSpec {
                name: name.into(),
                kind: if read_only { ToolKind::Read } else { ToolKind::Other },
                description: tool.description.as_deref().unwrap_or_default().to_owned().into(),
                parameters: Value::Object((*tool.input_schema).clone()),
            },
            tool: tool.name.to_string(),
            server,
        }
    }
}

impl Tool for McpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    /// An *always* answer covers this tool only, not every tool of kind `other`.
    fn scope(&self, _args: &Value) -> pier_tools::Scope {
        pier_tools::Scope::Names(vec![self.spec.name.to_string()])
    }

    fn preview(&self, _args: &Value, _workspace: &Workspace) -> Preview {
        Preview { title: format!("{}: {}", self.server.name, self.tool), locations: Vec::new(), content: Vec::new() }
    }

    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        let server = self.server.clone();
        let tool = self.tool.clone();
        Box::pin(async move { call(&server, tool, args, cx).await })
    }
}

async fn call(server: &Server, tool: String, args: Value, cx: ToolContext) -> Result<ToolOutput, ToolError> {
    let mut params = CallToolRequestParams::new(tool.clone());
    match args {
        Value::Object(map) => params = params.with_arguments(map),
        Value::Null => {}
        other => {
            return Err(ToolError::new(format!("the arguments of {} must be a JSON object, not {other}", server.name)));
        }
    }
    if let Some(reason) = server.down_reason().await {
        return Err(not_running(server, &reason));
    }
    let dropped = server.dropped();
    let result = tokio::select! {
        biased;
        // Dropping the call future makes rmcp send `notifications/cancelled` for the request.
        () = cx.cancel.cancelled() => return Err(ToolError::new("cancelled")),
        // The transport drops such a line: the answer it carried will never come. Which call it
        // answered is not known, so each call in flight on the server fails.
        why = dropped => {
            return Err(ToolError::new(format!(
                "MCP server `{}` sent an answer that {why}; the call to `{tool}` failed with the calls in flight on it \
                 (for a large answer, ask the tool for less)",
                server.name,
            )));
        }
        result = tokio::time::timeout(server.call_timeout, server.peer.call_tool(params)) => match result {
            Ok(result) => result,
            Err(_) => {
                return Err(ToolError::new(format!(
                    "MCP server `{}` did not answer the call to `{tool}` within {:?}; the call is cancelled. `_meta` \
                     \"{}\" on the server's entry sets the limit",
                    server.name,
                    server.call_timeout,
                    crate::CALL_TIMEOUT_META
                )));
            }
        },
    };
    let result = match result {
        Ok(result) => result,
        Err(ServiceError::TransportClosed | ServiceError::TransportSend(_)) => {
            return Err(not_running(server, &server.describe_exit().await));
        }
        Err(e) => {
            let reason = crate::describe(&e);
            return Err(ToolError::new(format!("MCP server `{}` failed the call to `{tool}`: {reason}", server.name)));
        }
    };
    let raw = serde_json::to_value(&result).unwrap_or(Value::Null);
    let mut output = ToolOutput::ok(render(&raw), raw.clone());
    // A client is shown the blocks themselves (an image as an image), not the model's text.
    output.content = raw
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|block| pier_tools::ToolContent::Block { block: block.clone() })
        .collect();
    output.images = images(&raw);
    output.success = result.is_error != Some(true);
    Ok(output)
}

/// The most image data (base64) one call shows the model; past it, images are only described.
const MAX_IMAGE_BYTES: usize = 8 << 20;

/// The image blocks of a result (and embedded image resources), for a model that takes
/// images, up to [`MAX_IMAGE_BYTES`] in all.
fn images(raw: &Value) -> Vec<pier_tools::ToolImage> {
    let blocks = raw.get("content").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let mut total = 0;
    let mut out = Vec::new();
    for block in blocks {
        let (mime, data) = match block.get("type").and_then(Value::as_str) {
            Some("image") => (block.get("mimeType"), block.get("data")),
            Some("resource") => {
                let r = block.get("resource").unwrap_or(&Value::Null);
                (r.get("mimeType"), r.get("blob"))
            }
            _ => continue,
        };
        let (Some(mime), Some(data)) = (mime.and_then(Value::as_str), data.and_then(Value::as_str)) else { continue };
        if !mime.starts_with("image/") || total + data.len() > MAX_IMAGE_BYTES {
            continue;
        }
        total += data.len();
        out.push(pier_tools::ToolImage { mime_type: mime.to_owned(), data: data.to_owned() });
    }
    out
}

fn not_running(server: &Server, reason: &str) -> ToolError {
    ToolError::new(format!("MCP server `{}` is not running: {reason}", server.name))
}

/// The text the model reads: each text block as is, other blocks described in one line.
/// Walks the JSON rather than rmcp's types so that content kinds added later are still described.
fn render(raw: &Value) -> String {
    let blocks = raw.get("content").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let mut lines: Vec<String> = blocks.iter().map(describe_block).collect();
    if lines.is_empty()
        && let Some(structured) = raw.get("structuredContent")
    {
        lines.push(structured.to_string());
    }
    lines.join("\n")
}

fn describe_block(block: &Value) -> String {
    let str_of = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).unwrap_or_default().to_string();
    let kind = str_of(block, "type");
    match kind.as_str() {
        "text" => str_of(block, "text"),
        "image" | "audio" => {
            let bytes = base64_len(block.get("data").and_then(Value::as_str).unwrap_or_default());
            format!("[{kind} {}, {bytes} bytes]", str_of(block, "mimeType"))
        }
        "resource" => {
            let resource = block.get("resource").unwrap_or(&Value::Null);
            match resource.get("text").and_then(Value::as_str) {
                Some(text) => text.to_string(),
                None => format!("[resource {}]", str_of(resource, "uri")),
            }
        }
        "resource_link" => format!("[resource link {}]", str_of(block, "uri")),
        _ => format!("[{kind} content]"),
    }
}

/// Decoded size of base64 text, without decoding it.
fn base64_len(data: &str) -> usize {
    let data = data.trim_end_matches('=');
    data.len() * 3 / 4
}

/// `{server}__{tool}` made to match `^[a-zA-Z0-9_-]{1,64}$`; a name taken already gets `_2`, `_3`...
pub(crate) fn exposed_name(server: &str, tool: &str, taken: &mut HashSet<String>) -> String {
    let base: String = format!("{server}__{tool}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' })
        .take(MAX_NAME)
        .collect();
    let mut name = base.clone();
    let mut n = 2u32;
    while taken.contains(&name) {
        let suffix = format!("_{n}");
        // The base is ASCII after sanitising, so byte slicing is char slicing.
        name = format!("{}{suffix}", &base[..base.len().min(MAX_NAME - suffix.len())]);
        n += 1;
    }
    taken.insert(name.clone());
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_are_sanitised_bounded_and_unique() {
        let mut taken = HashSet::new();
        assert_eq!(exposed_name("files", "read", &mut taken), "files__read");
        assert_eq!(exposed_name("my server", "do.it/now", &mut taken), "my_server__do_it_now");
        assert_eq!(exposed_name("my.server", "do it/now", &mut taken), "my_server__do_it_now_2");
        assert_eq!(exposed_name("my:server", "do it now", &mut taken), "my_server__do_it_now_3");
        assert_eq!(exposed_name("é", "ü", &mut taken), "____");
        let long = "x".repeat(100);
        let first = exposed_name(&long, "t", &mut taken);
        assert_eq!(first, "x".repeat(64));
        let second = exposed_name(&long, "u", &mut taken);
        assert_eq!(second, format!("{}_2", "x".repeat(62)));
    }

    #[test]
    fn content_is_rendered_for_the_model() {
        let raw = json!({"content": [
            {"type": "text", "text": "first"},
            {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            {"type": "resource", "resource": {"uri": "file:///a", "text": "embedded"}},
            {"type": "resource", "resource": {"uri": "file:///b", "blob": "AA=="}},
            {"type": "resource_link", "uri": "file:///c", "name": "c"},
            {"type": "hologram"},
        ]});
        assert_eq!(
            render(&raw),
            "first\n[image image/png, 3 bytes]\nembedded\n[resource file:///b]\n[resource link file:///c]\n[hologram content]"
        );
        assert_eq!(render(&json!({"content": [], "structuredContent": {"a": 1}})), "{\"a\":1}");
    }
}
