//! What an event of the log says, typed: the host's own events ([`LogEvent`]) and what an
//! attempt's agent did as pier's client recorded it ([`AgentEvent`], the schema's types).
//! [`Event::entry`] is the one decoder every reader goes through, so no reader picks an
//! event apart by key; what it does not know (notes, a benchmark's rows, a kind written by
//! a newer pier) is [`Entry::Other`] and still passes through as it was written.

use agent_client_protocol_schema::v1::{
    CreateElicitationRequest, PermissionOption, RequestPermissionOutcome, SessionUpdate, ToolCallUpdate,
};
use serde::Deserialize;
use serde_json::Value;

use crate::log::{Event, LogEvent};
use crate::spend::{MODEL_REQUEST, ModelRequest};

/// An event's meaning.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    /// What the host wrote: runs and tasks created, transitions, questions, answers, messages.
    Host(LogEvent),
    /// What attempt `attempt`'s agent did.
    Agent { attempt: i64, event: Box<AgentEvent> },
    /// A model request the gateway passed for the task's agent.
    Model(Box<ModelRequest>),
    /// An event this pier does not read (its kind and data are on the [`Event`]).
    Other,
}

/// An agent's event as pier's client records it (`pier_client::ClientEvent` on the wire).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentEvent {
    /// A `session/update`.
    SessionUpdate { update: SessionUpdate },
    /// A permission request and the decision taken.
    Permission {
        #[serde(rename = "toolCall")]
        tool_call: ToolCallUpdate,
        options: Vec<PermissionOption>,
        outcome: RequestPermissionOutcome,
        /// The rule that decided it (a policy rule, `"ask"`; none: the default policy).
        #[serde(default)]
        rule: Value,
        #[serde(default)]
        reason: String,
    },
    /// A question from the agent and the answer it got.
    Elicitation {
        request: CreateElicitationRequest,
        response: Value,
        #[serde(default)]
        reason: String,
    },
    /// A client method the agent called, and how it ended.
    ClientCall {
        method: String,
        target: String,
        ok: bool,
        #[serde(default)]
        error: Option<Value>,
    },
    /// The agent wrote something to stdout that is not JSON-RPC.
    ProtocolError { message: String },
    /// Lines the agent wrote to its stderr; `dropped` more were not kept.
    AgentStderr {
        lines: Vec<String>,
        #[serde(default)]
        dropped: u64,
    },
}

/// The kinds the host writes ([`LogEvent`]'s names).
const HOST_KINDS: &[&str] =
    &["run_created", "task_created", "transition", "question", "answer", "message", "message_sent", "budget"];
/// The kinds an attempt records ([`AgentEvent`]'s names).
const AGENT_KINDS: &[&str] =
    &["session_update", "permission", "elicitation", "client_call", "protocol_error", "agent_stderr"];

/// Whether `data` (without its `type`) is an agent's event of kind `kind` the log knows: what a
/// remote attempt may write.
pub fn is_agent_event(kind: &str, data: &Value) -> bool {
    if !AGENT_KINDS.contains(&kind) || !data.is_object() {
        return false;
    }
    let mut tagged = data.clone();
    if let Value::Object(o) = &mut tagged {
        o.insert("type".into(), Value::String(kind.to_owned()));
    }
    serde_json::from_value::<AgentEvent>(tagged).is_ok()
}

impl Event {
    /// What the event says. Decoding a known kind that does not parse (an edited store, a
    /// field a newer agent sent in a shape this pier does not read) gives [`Entry::Other`]:
    /// a reader shows less, never fails.
    pub fn entry(&self) -> Entry {
        let tagged = || {
            let mut data = self.data.clone();
            if let Value::Object(o) = &mut data {
                o.insert("type".into(), Value::String(self.kind.clone()));
            }
            data
        };
        if HOST_KINDS.contains(&self.kind.as_str()) {
            return serde_json::from_value(tagged()).map_or(Entry::Other, Entry::Host);
        }
        if self.kind == MODEL_REQUEST {
            return serde_json::from_value(self.data.clone()).map_or(Entry::Other, |r| Entry::Model(Box::new(r)));
        }
        if AGENT_KINDS.contains(&self.kind.as_str()) {
            let attempt = self.data.get("attempt").and_then(Value::as_i64).unwrap_or(0);
            return serde_json::from_value(tagged())
                .map_or(Entry::Other, |event| Entry::Agent { attempt, event: Box::new(event) });
        }
        Entry::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TaskState;

    fn event(kind: &str, data: Value) -> Event {
        Event { seq: 1, run: "r".into(), task: Some("t".into()), kind: kind.into(), at_ms: 0, data }
    }

    #[test]
    fn host_and_agent_events_decode_and_the_rest_passes_as_other() {
        let moved = event(
            "transition",
            serde_json::json!({"from": "pending", "to": "running", "attempt": 1, "reason": "x", "version": 2}),
        );
        assert!(matches!(moved.entry(), Entry::Host(LogEvent::Transition { to: TaskState::Running, .. })));
        let said = event(
            "session_update",
            serde_json::json!({"attempt": 3, "sessionId": "s",
                "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "hi"}}}),
        );
        let Entry::Agent { attempt: 3, event: told } = said.entry() else { panic!("{:?}", said.entry()) };
        assert!(matches!(*told, AgentEvent::SessionUpdate { update: SessionUpdate::AgentMessageChunk(_) }));
        assert_eq!(event("note", serde_json::json!({"text": "x"})).entry(), Entry::Other);
        assert_eq!(event("transition", serde_json::json!({"to": "nowhere"})).entry(), Entry::Other);
    }
}
