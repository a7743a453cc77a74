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

/// The tool results the request carries, in order.
pub fn tool_results(body: &Value) -> Vec<String> {
    texts_of(body, "tool")
}

/// The names of the tools the request offers.
pub fn tool_names(body: &Value) -> Vec<String> {
    body["tools"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["function"]["name"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn texts_of(body: &Value, role: &str) -> Vec<String> {
    body["messages"]
        .as_array()
        .map(|m| {
            m.iter().filter(|m| m["role"] == role).filter_map(|m| m["content"].as_str().map(str::to_owned)).collect()
        })
        .unwrap_or_default()
}
