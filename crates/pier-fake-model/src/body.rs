//! Reading a recorded Chat Completions request body: what a scripted reply keys on and what
//! a test asserts about (which conversation a request belongs to, the results it carries).

use serde_json::Value;

/// The text of the first user message: which conversation the request belongs to.
pub fn first_user(body: &Value) -> String {
    user_messages(body).into_iter().next().unwrap_or_default()
}

/// The text of every user message, in order.
pub fn user_messages(body: &Value) -> Vec<String> {
    texts_of(body, "user")
}

/// The tool results the request carries, in order: Chat Completions' `tool` messages, or the
/// Responses API's `function_call_output` items.
pub fn tool_results(body: &Value) -> Vec<String> {
    let mut out = texts_of(body, "tool");
    let items = body["input"].as_array().into_iter().flatten();
    out.extend(items.filter(|i| i["type"] == "function_call_output").map(|i| match &i["output"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }));
    out
}

/// The names of the tools the request offers: Chat Completions' functions, the Responses
/// API's, and a Responses `namespace`'s tools (codex offers each MCP server's as one) as
/// `NAMESPACE/TOOL`, the name that calls one of them ([`crate::Reply::tool_call`]).
pub fn tool_names(body: &Value) -> Vec<String> {
    let mut names = Vec::new();
    for t in body["tools"].as_array().into_iter().flatten() {
        if t["type"] == "namespace" {
            let ns = t["name"].as_str().unwrap_or_default();
            let inner = t["tools"].as_array().into_iter().flatten();
            names.extend(inner.filter_map(|i| i["name"].as_str()).map(|n| format!("{ns}/{n}")));
        } else if let Some(n) = t["function"]["name"].as_str().or(t["name"].as_str()) {
            names.push(n.to_owned());
        }
    }
    names
}

fn texts_of(body: &Value, role: &str) -> Vec<String> {
    body["messages"]
        .as_array()
        .map(|m| {
            m.iter().filter(|m| m["role"] == role).filter_map(|m| m["content"].as_str().map(str::to_owned)).collect()
        })
        .unwrap_or_default()
}
