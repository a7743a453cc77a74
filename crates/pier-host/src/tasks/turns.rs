//! A task's exchange turn by turn, from its events: each attempt's first turn answers the
//! task's prompt, and each person's message sent to it (`message_sent`) opens the next; a turn
//! holds what the agent said and its tool calls with their last status. `pier show RUN TASK`
//! prints a block per turn from it.

use std::collections::HashMap;

use agent_client_protocol_schema::v1::{ContentBlock, SessionUpdate, ToolCallStatus};
use pier_store::{AgentEvent, Entry, Event, LogEvent, TaskState};
use serde::Serialize;

/// What opened a turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Opened {
    /// The task's own prompt, at the attempt's start.
    Task,
    /// A person's message `n`, sent as the next prompt.
    Message { n: i64, by: String, text: String },
}

/// One tool call of a turn, as its updates left it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnCall {
    pub id: String,
    pub title: String,
    /// `pending`, `in_progress`, `completed` or `failed`.
    pub status: String,
    /// When it was announced, and when it reached `completed` or `failed` (ms since the epoch).
    pub started_at_ms: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<i64>,
}

fn is_final(s: ToolCallStatus) -> bool {
    matches!(s, ToolCallStatus::Completed | ToolCallStatus::Failed)
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Turn {
    pub attempt: i64,
    /// From 1 within its attempt.
    pub turn: usize,
    pub opened: Opened,
    pub said: String,
    pub tool_calls: Vec<TurnCall>,
}

fn status_name(s: ToolCallStatus) -> String {
    serde_json::to_value(s).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_else(|| "other".into())
}

/// The turns of a task's events (in log order).
pub fn turns(events: &[Event]) -> Vec<Turn> {
    let mut out: Vec<Turn> = Vec::new();
    // People's messages by number, from when they were said.
    let mut messages: HashMap<i64, (String, String)> = HashMap::new();
    let open = |out: &mut Vec<Turn>, attempt: i64, opened: Opened| {
        let turn = out.iter().filter(|t| t.attempt == attempt).count() + 1;
        out.push(Turn { attempt, turn, opened, said: String::new(), tool_calls: Vec::new() });
    };
    for e in events {
        match e.entry() {
            Entry::Host(LogEvent::Transition { from: TaskState::Pending, to: TaskState::Running, attempt, .. }) => {
                open(&mut out, attempt, Opened::Task);
            }
            Entry::Host(LogEvent::Message { n, text, by, .. }) => {
                messages.insert(n, (by, text));
            }
            Entry::Host(LogEvent::MessageSent { n, attempt }) => {
                let (by, text) = messages.get(&n).cloned().unwrap_or_default();
                open(&mut out, attempt, Opened::Message { n, by, text });
            }
            Entry::Agent { attempt, event } => {
                let AgentEvent::SessionUpdate { update } = *event else { continue };
                if out.last().is_none_or(|t| t.attempt != attempt) {
                    open(&mut out, attempt, Opened::Task);
                }
                let Some(turn) = out.last_mut() else { continue };
                match update {
                    SessionUpdate::AgentMessageChunk(c) => {
                        if let ContentBlock::Text(t) = c.content {
                            turn.said.push_str(&t.text);
                        }
                    }
                    SessionUpdate::ToolCall(call) => turn.tool_calls.push(TurnCall {
                        id: call.tool_call_id.0.to_string(),
                        title: call.title,
                        status: status_name(call.status),
                        started_at_ms: e.at_ms,
                        ended_at_ms: is_final(call.status).then_some(e.at_ms),
                    }),
                    SessionUpdate::ToolCallUpdate(u) => {
                        let id = u.tool_call_id.0.to_string();
                        if let Some(call) = turn.tool_calls.iter_mut().rev().find(|c| c.id == id) {
                            if let Some(s) = u.fields.status {
                                call.status = status_name(s);
                                if is_final(s) && call.ended_at_ms.is_none() {
                                    call.ended_at_ms = Some(e.at_ms);
                                }
                            }
                            if let Some(title) = u.fields.title {
                                call.title = title;
                            }
                        }
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn event(seq: i64, kind: &str, data: serde_json::Value) -> Event {
        Event { seq, run: "r".into(), task: Some("t".into()), kind: kind.into(), at_ms: seq, data }
    }

    fn said(seq: i64, text: &str) -> Event {
        let update = json!({"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}});
        event(seq, "session_update", json!({"attempt": 1, "sessionId": "s", "update": update}))
    }

    #[test]
    fn a_message_sent_opens_the_next_turn() {
        let events = vec![
            event(1, "transition", json!({"from": "pending", "to": "running", "attempt": 1, "reason": "started"})),
            said(2, "dra"),
            said(3, "ft"),
            event(4, "message", json!({"n": 1, "text": "add a summary", "interrupt": false, "by": "cli:me"})),
            event(5, "message_sent", json!({"n": 1, "attempt": 1})),
            said(6, "revised"),
        ];
        let t = turns(&events);
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].turn, &t[0].opened, t[0].said.as_str()), (1, &Opened::Task, "draft"));
        let message = Opened::Message { n: 1, by: "cli:me".into(), text: "add a summary".into() };
        assert_eq!((t[1].turn, &t[1].opened, t[1].said.as_str()), (2, &message, "revised"));
    }
}
