//! A task's ACP exchange as a person reads it, rebuilt from the events its attempts
//! recorded: the answer's text joined, thoughts apart, each tool call merged from its
//! `tool_call` and `tool_call_update`s, each permission request with the options offered
//! and the one chosen, each question with its answer, and the task's transitions.

use std::collections::BTreeMap;

use pier_host::Event;
use serde_json::Value;

pub enum Item {
    Said(String),
    Thought(String),
    User(String),
    Tool(Value),
    Plan(Value),
    Permission(Value),
    Question(Value),
    Transition(Value),
}

/// The items of each attempt, in order; attempt 0 holds what belongs to none.
pub fn build(events: &[Event]) -> BTreeMap<i64, Vec<Item>> {
    let mut out: BTreeMap<i64, Vec<Item>> = BTreeMap::new();
    for e in events {
        let attempt = e.data["attempt"].as_i64().unwrap_or(0);
        let items = out.entry(attempt).or_default();
        match e.kind.as_str() {
            "session_update" => update(items, &e.data["update"]),
            "permission" => items.push(Item::Permission(e.data.clone())),
            "elicitation" => items.push(Item::Question(e.data.clone())),
            "transition" => {
                let mut t = e.data.clone();
                if let Some(o) = t.as_object_mut() {
                    o.insert("at_ms".into(), e.at_ms.into());
                }
                items.push(Item::Transition(t));
            }
            _ => {}
        }
    }
    out
}

fn update(items: &mut Vec<Item>, u: &Value) {
    let text = || u["content"]["text"].as_str().unwrap_or("").to_owned();
    match u["sessionUpdate"].as_str().unwrap_or("") {
        "agent_message_chunk" => match items.last_mut() {
            Some(Item::Said(s)) => s.push_str(&text()),
            _ => items.push(Item::Said(text())),
        },
        "agent_thought_chunk" => match items.last_mut() {
            Some(Item::Thought(s)) => s.push_str(&text()),
            _ => items.push(Item::Thought(text())),
        },
        "user_message_chunk" => match items.last_mut() {
            Some(Item::User(s)) => s.push_str(&text()),
            _ => items.push(Item::User(text())),
        },
        "tool_call" => items.push(Item::Tool(u.clone())),
        "tool_call_update" => {
            let id = &u["toolCallId"];
            let seen = items.iter_mut().rev().find_map(|i| match i {
                Item::Tool(t) if t["toolCallId"] == *id => Some(t),
                _ => None,
            });
            match seen {
                Some(t) => {
                    if let (Some(t), Some(fields)) = (t.as_object_mut(), u.as_object()) {
                        for (k, v) in fields {
                            if !v.is_null() {
                                t.insert(k.clone(), v.clone());
                            }
                        }
                    }
                }
                None => items.push(Item::Tool(u.clone())),
            }
        }
        "plan" => items.push(Item::Plan(u.clone())),
        _ => {}
    }
}

/// Texts past this are not diffed on a page (a diff is quadratic at worst).
const DIFF_BYTES: usize = 1 << 20;

/// A diff's lines as a unified diff: (class, text) with class `add`, `del`, `hunk` or `ctx`.
/// Bounded: large texts are not diffed, and a slow diff gives up after 100 ms with a coarser
/// (still correct) result.
pub fn diff_lines(old: &str, new: &str) -> Vec<(&'static str, String)> {
    if old.len() + new.len() > DIFF_BYTES {
        return vec![("hunk", format!("(too large to show here: {} → {} bytes)", old.len(), new.len()))];
    }
    let diff = similar::TextDiff::configure().timeout(std::time::Duration::from_millis(100)).diff_lines(old, new);
    let mut out = Vec::new();
    for group in diff.grouped_ops(3) {
        let (first, last) = (group.first(), group.last());
        if let (Some(f), Some(l)) = (first, last) {
            out.push((
                "hunk",
                format!(
                    "@@ -{},{} +{},{} @@",
                    f.old_range().start + 1,
                    l.old_range().end - f.old_range().start,
                    f.new_range().start + 1,
                    l.new_range().end - f.new_range().start
                ),
            ));
        }
        for op in &group {
            for change in diff.iter_changes(op) {
                let (class, sign) = match change.tag() {
                    similar::ChangeTag::Insert => ("add", '+'),
                    similar::ChangeTag::Delete => ("del", '-'),
                    similar::ChangeTag::Equal => ("ctx", ' '),
                };
                out.push((class, format!("{sign}{}", change.value().trim_end_matches('\n'))));
            }
        }
    }
    out
}
