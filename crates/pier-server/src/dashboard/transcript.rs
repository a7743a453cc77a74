//! A task's ACP exchange as a person reads it, rebuilt from the events its attempts
//! recorded: the answer's text joined, thoughts apart, each tool call merged from its
//! `tool_call` and `tool_call_update`s, each permission request with the options offered
//! and the one chosen, each question with its answer, each model request the gateway
//! passed, and the task's transitions.

use std::collections::BTreeMap;

use agent_client_protocol_schema::v1::{
    ContentBlock, CreateElicitationRequest, PermissionOption, Plan, RequestPermissionOutcome, SessionUpdate, ToolCall,
    ToolCallUpdate,
};
use pier_host::{AgentEvent, Entry, Event, LogEvent};
use serde_json::Value;

pub enum Item {
    Said(String),
    Thought(String),
    User(String),
    /// A tool call as its updates left it, and when it was first and last seen.
    Tool(Box<ToolCall>, Span),
    /// Lines the agent wrote to its stderr (consecutive batches joined); `dropped` more lost.
    Stderr {
        lines: Vec<String>,
        dropped: u64,
    },
    Plan(Plan),
    Permission {
        tool_call: Box<ToolCallUpdate>,
        options: Vec<PermissionOption>,
        outcome: RequestPermissionOutcome,
        rule: Value,
        reason: String,
    },
    Question {
        request: Box<CreateElicitationRequest>,
        response: Value,
    },
    /// A transition: when, and the event.
    Transition(i64, LogEvent),
    /// A model request through the gateway: what it cost, where the exchange was.
    Model(Box<pier_host::ModelRequest>),
}

/// When a tool call was announced, and when it reached a final state (if it did).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub started_ms: i64,
    pub ended_ms: Option<i64>,
}

/// The items of each attempt, in order; attempt 0 holds what belongs to none.
pub fn build(events: &[Event]) -> BTreeMap<i64, Vec<Item>> {
    let mut out: BTreeMap<i64, Vec<Item>> = BTreeMap::new();
    for e in events {
        match e.entry() {
            Entry::Agent { attempt, event } => {
                let items = out.entry(attempt).or_default();
                match *event {
                    AgentEvent::SessionUpdate { update: u } => update(items, u, e.at_ms),
                    AgentEvent::AgentStderr { lines, dropped } => match items.last_mut() {
                        Some(Item::Stderr { lines: kept, dropped: lost }) => {
                            kept.extend(lines);
                            *lost += dropped;
                        }
                        _ => items.push(Item::Stderr { lines, dropped }),
                    },
                    AgentEvent::Permission { tool_call, options, outcome, rule, reason } => {
                        items.push(Item::Permission { tool_call: Box::new(tool_call), options, outcome, rule, reason })
                    }
                    AgentEvent::Elicitation { request, response, .. } => {
                        items.push(Item::Question { request: Box::new(request), response })
                    }
                    AgentEvent::ClientCall { .. } | AgentEvent::ProtocolError { .. } => {}
                }
            }
            Entry::Host(t @ LogEvent::Transition { attempt, .. }) => {
                out.entry(attempt).or_default().push(Item::Transition(e.at_ms, t))
            }
            Entry::Model(r) => out.entry(r.attempt).or_default().push(Item::Model(r)),
            Entry::Host(_) | Entry::Other => {}
        }
    }
    out
}

fn text(block: &ContentBlock) -> &str {
    match block {
        ContentBlock::Text(t) => &t.text,
        _ => "",
    }
}

/// Appends a chunk to the item before it if that is of its kind, else starts one.
fn chunk(items: &mut Vec<Item>, piece: &str, same: fn(&mut Item) -> Option<&mut String>, new: fn(String) -> Item) {
    match items.last_mut().and_then(same) {
        Some(s) => s.push_str(piece),
        None => items.push(new(piece.to_owned())),
    }
}

fn update(items: &mut Vec<Item>, u: SessionUpdate, at_ms: i64) {
    match u {
        SessionUpdate::AgentMessageChunk(c) => {
            chunk(items, text(&c.content), |i| if let Item::Said(s) = i { Some(s) } else { None }, Item::Said)
        }
        SessionUpdate::AgentThoughtChunk(c) => {
            chunk(items, text(&c.content), |i| if let Item::Thought(s) = i { Some(s) } else { None }, Item::Thought)
        }
        SessionUpdate::UserMessageChunk(c) => {
            chunk(items, text(&c.content), |i| if let Item::User(s) = i { Some(s) } else { None }, Item::User)
        }
        SessionUpdate::ToolCall(call) => {
            let span = Span { started_ms: at_ms, ended_ms: finished(&call).then_some(at_ms) };
            items.push(Item::Tool(Box::new(call), span));
        }
        SessionUpdate::ToolCallUpdate(u) => {
            let seen = items.iter_mut().rev().find_map(|i| match i {
                Item::Tool(t, span) if t.tool_call_id == u.tool_call_id => Some((t, span)),
                _ => None,
            });
            match seen {
                Some((t, span)) => {
                    t.update(u.fields);
                    if span.ended_ms.is_none() && finished(t) {
                        span.ended_ms = Some(at_ms);
                    }
                }
                // An update of a call never announced: shown as far as it goes.
                None => {
                    if let Ok(call) = ToolCall::try_from(u) {
                        let span = Span { started_ms: at_ms, ended_ms: finished(&call).then_some(at_ms) };
                        items.push(Item::Tool(Box::new(call), span));
                    }
                }
            }
        }
        SessionUpdate::Plan(plan) => items.push(Item::Plan(plan)),
        _ => {}
    }
}

/// Whether a tool call reached a final state.
fn finished(call: &ToolCall) -> bool {
    use agent_client_protocol_schema::v1::ToolCallStatus;
    matches!(call.status, ToolCallStatus::Completed | ToolCallStatus::Failed)
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
