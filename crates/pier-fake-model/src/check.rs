//! The invariants every Chat Completions request body must hold, checked on every
//! request the fake receives (as real providers do, and refuse with 400): roles in
//! order, and every assistant tool call answered exactly once by a `tool` message
//! before the conversation goes on. A test whose client sends a bad body fails.

use std::collections::BTreeSet;

use serde_json::Value;

/// Why `body` is not a request a provider would accept, if it is not.
pub fn chat_request(body: &Value) -> Result<(), String> {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return Err("the request has no `messages` array".into());
    };
    if messages.is_empty() {
        return Err("the request has no messages".into());
    }
    // Tool calls of the last assistant message still waiting for their answers.
    let mut open: BTreeSet<String> = BTreeSet::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        match role {
            "system" if i == 0 => {}
            "system" => return Err(format!("message {i}: a system message after the first")),
            "tool" => {
                let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or("");
                if !open.remove(id) {
                    return Err(format!("message {i}: a tool message answers `{id}`, which no open tool call has"));
                }
            }
            "user" | "assistant" => {
                if !open.is_empty() {
                    return Err(format!("message {i} ({role}): the tool calls {open:?} were never answered"));
                }
                if role == "assistant" {
                    for call in m.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                        let id = call.get("id").and_then(Value::as_str).unwrap_or("").to_owned();
                        if id.is_empty() || !open.insert(id.clone()) {
                            return Err(format!("message {i}: a tool call with an empty or repeated id `{id}`"));
                        }
                    }
                }
            }
            other => return Err(format!("message {i}: unknown role `{other}`")),
        }
    }
    if !open.is_empty() {
        return Err(format!("the last assistant message's tool calls {open:?} were never answered"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::chat_request;

    #[test]
    fn good_and_bad_conversations() {
        let call = |id: &str| json!({"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}});
        let good = json!({"messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "b", "content": "2"},
            {"role": "user", "content": "again"}
        ]});
        assert_eq!(chat_request(&good), Ok(()));
        let unanswered = json!({"messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "user", "content": "again"}
        ]});
        assert!(chat_request(&unanswered).is_err_and(|e| e.contains("never answered")));
        let twice = json!({"messages": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call("a")]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "a", "content": "1"}
        ]});
        assert!(chat_request(&twice).is_err());
        let late_system = json!({"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}]});
        assert!(chat_request(&late_system).is_err());
    }
}
