//! Which events a reader of the log is shown, and how: only some tasks, types or times
//! ([`EventFilter`]), and an agent's text deltas merged per message ([`merge_deltas`]). The
//! log itself keeps every delta (a session log must); this is how it is presented, once,
//! for `/events`, `pier events` and the dashboard alike.

use agent_client_protocol_schema::v1::{ContentBlock, ContentChunk, SessionUpdate};
use pier_store::Event;
use serde_json::Value;

/// The events a reader asked for; an empty filter keeps every event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// Only this task's events.
    pub task: Option<String>,
    /// Only events of these types (`transition`, `session_update`, …); none: every type.
    pub types: Vec<String>,
    /// Only events written at or after this instant (ms since the epoch).
    pub since_ms: Option<i64>,
}

impl EventFilter {
    pub fn keeps(&self, e: &Event) -> bool {
        self.task.as_ref().is_none_or(|t| e.task.as_ref() == Some(t))
            && (self.types.is_empty() || self.types.contains(&e.kind))
            && self.since_ms.is_none_or(|at| e.at_ms >= at)
    }

    /// The instant `text` names, in ms since the epoch: a duration back from `now_ms` (`30s`,
    /// `5m`, `2h`, `1d`) or a time (`2026-12-07T10:00:00Z`).
    pub fn since(text: &str, now_ms: i64) -> Result<i64, String> {
        if let Ok(ago) = crate::schedule::parse_duration(text) {
            return Ok(now_ms - ago);
        }
        crate::schedule::parse_rfc3339(text).map_err(|_| {
            format!("since {text:?} is neither a duration (30s, 5m, 2h, 1d) nor a time (2026-12-07T10:00:00Z)")
        })
    }
}

/// A text delta's message: which of the three chunk kinds, and its message id.
fn delta(e: &Event) -> Option<(&'static str, Option<String>, String)> {
    if e.kind != "session_update" {
        return None;
    }
    let update: SessionUpdate = serde_json::from_value(e.data.get("update")?.clone()).ok()?;
    let (kind, chunk): (&'static str, ContentChunk) = match update {
        SessionUpdate::AgentMessageChunk(c) => ("agent_message_chunk", c),
        SessionUpdate::AgentThoughtChunk(c) => ("agent_thought_chunk", c),
        SessionUpdate::UserMessageChunk(c) => ("user_message_chunk", c),
        _ => return None,
    };
    let ContentBlock::Text(text) = chunk.content else { return None };
    Some((kind, chunk.message_id.map(|m| m.to_string()), text.text))
}

/// Which message a delta belongs to: run, task, attempt, chunk kind and message id.
type MessageKey = (String, Option<String>, Value, &'static str, Option<String>);

/// A message being merged: its key, where its event is in the output, its text so far and
/// how many deltas it holds.
struct Open {
    key: MessageKey,
    at: usize,
    text: String,
    deltas: i64,
}

/// Each message's text deltas merged into one event: the last delta's `seq` and `at_ms`, and
/// it stands where the last delta stood (so sequences still only grow: a reader resuming after
/// it misses nothing and sees nothing twice), the texts joined, `merged` the deltas it holds
/// and `first_seq` the first's sequence. A message ends with any other event of its task but
/// the gateway's record of a model request (written while the answer streams). Anything else
/// passes as it is. Within what is given: a message whose deltas span two reads is shown as
/// two events.
pub fn merge_deltas(events: Vec<Event>) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::with_capacity(events.len());
    let mut open: Vec<Open> = Vec::new();
    let same_task = |k: &MessageKey, e: &Event| k.0 == e.run && k.1 == e.task;
    for e in events {
        let Some((kind, message, text)) = delta(&e) else {
            if e.kind != pier_store::MODEL_REQUEST {
                open.retain(|o| !same_task(&o.key, &e));
            }
            out.push(e);
            continue;
        };
        let key = (e.run.clone(), e.task.clone(), e.data.get("attempt").cloned().unwrap_or(Value::Null), kind, message);
        if let Some(pos) = open.iter().position(|o| o.key == key) {
            let mut o = open.remove(pos);
            let mut merged = out.remove(o.at);
            for other in &mut open {
                if other.at > o.at {
                    other.at -= 1;
                }
            }
            o.text.push_str(&text);
            o.deltas += 1;
            merged.seq = e.seq;
            merged.at_ms = e.at_ms;
            if let Some(t) = merged.data.pointer_mut("/update/content/text") {
                *t = Value::String(o.text.clone());
            }
            if let Value::Object(data) = &mut merged.data {
                data.insert("merged".into(), Value::from(o.deltas));
            }
            o.at = out.len();
            out.push(merged);
            open.push(o);
        } else {
            // Another kind of delta of the task (a thought after the answer) ends its message.
            open.retain(|o| !same_task(&o.key, &e));
            let mut e = e;
            if let Value::Object(data) = &mut e.data {
                data.insert("first_seq".into(), Value::from(e.seq));
                data.insert("merged".into(), Value::from(1));
            }
            open.push(Open { key, at: out.len(), text, deltas: 1 });
            out.push(e);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chunk(seq: i64, task: &str, kind: &str, text: &str) -> Event {
        let data = json!({"attempt": 1, "sessionId": "s",
            "update": {"sessionUpdate": kind, "content": {"type": "text", "text": text}}});
        Event { seq, run: "r".into(), task: Some(task.into()), kind: "session_update".into(), at_ms: seq * 10, data }
    }

    #[test]
    fn a_messages_deltas_become_one_event_that_ends_where_they_ended() {
        let transition = Event {
            seq: 4,
            run: "r".into(),
            task: Some("a".into()),
            kind: "transition".into(),
            at_ms: 40,
            data: json!({"from": "running", "to": "completed"}),
        };
        let events = vec![
            chunk(1, "a", "agent_message_chunk", "Hel"),
            chunk(2, "a", "agent_message_chunk", "lo"),
            chunk(3, "b", "agent_message_chunk", "other task"),
            transition.clone(),
            chunk(5, "a", "agent_thought_chunk", "hm"),
            chunk(6, "a", "agent_message_chunk", "!"),
        ];
        let merged = merge_deltas(events);
        let seqs: Vec<i64> = merged.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [2, 3, 4, 5, 6]);
        // The gateway's record and another task's delta between two deltas: still one message,
        // standing after them.
        let request =
            Event { seq: 2, kind: "model_request".into(), data: json!({"status": 200}), ..chunk(2, "a", "x", "") };
        let across = merge_deltas(vec![
            chunk(1, "a", "agent_message_chunk", "Hel"),
            request,
            chunk(3, "b", "agent_message_chunk", "B"),
            chunk(4, "a", "agent_message_chunk", "lo"),
        ]);
        let seqs: Vec<i64> = across.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [2, 3, 4], "sequences only grow");
        assert_eq!(across[2].data["update"]["content"]["text"], "Hello");
        assert_eq!(merged[0].data["update"]["content"]["text"], "Hello");
        assert_eq!((merged[0].data["merged"].as_i64(), merged[0].data["first_seq"].as_i64()), (Some(2), Some(1)));
        assert_eq!(merged[0].at_ms, 20);
        assert_eq!(merged[2], transition, "other events pass unchanged");
        assert_eq!(merged[4].data["update"]["content"]["text"], "!", "a thought between: another message");
    }

    #[test]
    fn a_filter_keeps_what_it_names() {
        let f = EventFilter { task: Some("a".into()), types: vec!["session_update".into()], since_ms: Some(20) };
        assert!(!f.keeps(&chunk(1, "a", "agent_message_chunk", "x")), "too early");
        assert!(f.keeps(&chunk(2, "a", "agent_message_chunk", "x")));
        assert!(!f.keeps(&chunk(3, "b", "agent_message_chunk", "x")), "another task");
        assert_eq!(EventFilter::since("10m", 1_000_000), Ok(400_000));
        assert!(EventFilter::since("soon", 0).is_err());
    }
}
