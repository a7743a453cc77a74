//! What happens in a run, decoded once at the client's edge: the upper layers (the
//! renderers of `pier exec`, the host's recorder) match on types, never on ACP JSON keys.
//! One `Serialize` gives the JSON that `pier exec --format json` prints and the host logs.

use std::collections::{HashMap, HashSet};

use agent_client_protocol_schema::v1::{
    PermissionOptionKind, RequestPermissionOutcome, RequestPermissionRequest, SessionNotification, SessionUpdate,
    ToolCallStatus, ToolKind,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Something that happened in a run.
#[derive(Debug, Clone)]
pub enum ClientEvent {
    /// A `session/update`, as the schema types it.
    Update(Box<SessionNotification>),
    /// A permission request and the decision taken.
    Permission {
        request: Box<RequestPermissionRequest>,
        outcome: RequestPermissionOutcome,
        /// The rule that decided it (a policy rule, `"ask"`), as JSON.
        rule: Value,
        reason: String,
    },
    /// A client method the agent called, and how it ended.
    ClientCall { method: String, target: String, error: Option<Value> },
    /// The agent wrote something to stdout that is not a JSON-RPC message.
    ProtocolError(String),
    /// A question from the agent (`elicitation/create`) and the answer it got.
    Elicitation {
        request: Box<agent_client_protocol_schema::v1::CreateElicitationRequest>,
        response: Value,
        reason: String,
    },
    /// Lines the agent wrote to its stderr, in batches (at most a second, 64 lines or 8 KiB
    /// each); `dropped` lines were not kept because nobody took the events in time.
    Stderr { lines: Vec<String>, dropped: u64 },
}

/// The wire shape of [`ClientEvent`]: `type` first, then the event's own fields.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Wire<'a> {
    SessionUpdate(&'a SessionNotification),
    Permission {
        #[serde(rename = "sessionId")]
        session_id: &'a agent_client_protocol_schema::v1::SessionId,
        #[serde(rename = "toolCall")]
        tool_call: &'a agent_client_protocol_schema::v1::ToolCallUpdate,
        options: &'a [agent_client_protocol_schema::v1::PermissionOption],
        outcome: &'a RequestPermissionOutcome,
        rule: &'a Value,
        reason: &'a str,
    },
    ClientCall {
        method: &'a str,
        target: &'a str,
        ok: bool,
        error: &'a Option<Value>,
    },
    ProtocolError {
        message: &'a str,
    },
    Elicitation {
        request: &'a agent_client_protocol_schema::v1::CreateElicitationRequest,
        response: &'a Value,
        reason: &'a str,
    },
    AgentStderr {
        lines: &'a [String],
        dropped: u64,
    },
}

impl Serialize for ClientEvent {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let wire = match self {
            ClientEvent::Update(n) => Wire::SessionUpdate(n),
            ClientEvent::Permission { request, outcome, rule, reason } => Wire::Permission {
                session_id: &request.session_id,
                tool_call: &request.tool_call,
                options: &request.options,
                outcome,
                rule,
                reason,
            },
            ClientEvent::ClientCall { method, target, error } => {
                Wire::ClientCall { method, target, ok: error.is_none(), error }
            }
            ClientEvent::ProtocolError(message) => Wire::ProtocolError { message },
            ClientEvent::Elicitation { request, response, reason } => Wire::Elicitation { request, response, reason },
            ClientEvent::Stderr { lines, dropped } => Wire::AgentStderr { lines, dropped: *dropped },
        };
        wire.serialize(serializer)
    }
}

impl ClientEvent {
    /// The event's `type` as logged: `session_update`, `permission`, `client_call`, `protocol_error`.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientEvent::Update(_) => "session_update",
            ClientEvent::Permission { .. } => "permission",
            ClientEvent::ClientCall { .. } => "client_call",
            ClientEvent::ProtocolError(_) => "protocol_error",
            ClientEvent::Elicitation { .. } => "elicitation",
            ClientEvent::Stderr { .. } => "agent_stderr",
        }
    }
}

/// A side effect an attempt reported: what makes running it again unsafe without a person.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "effect", rename_all = "snake_case")]
pub enum Evidence {
    /// A tool call of a kind that changes things (edit, delete, move, execute) ran.
    ToolCall {
        #[serde(rename = "toolCallId")]
        tool_call_id: String,
        kind: String,
        status: String,
        title: Option<String>,
    },
    /// A permission request was granted.
    Permission {
        #[serde(rename = "toolCallId")]
        tool_call_id: String,
        option: String,
    },
    /// The agent wrote a file or started a command through the client.
    ClientCall { method: String, target: String },
}

/// Finds the side effects in a run's events. Tool call updates may omit their kind, so the
/// kind of each call is remembered from the update that gave it; each call counts once.
#[derive(Debug, Default)]
pub struct SideEffects {
    kinds: HashMap<String, ToolKind>,
    seen: HashSet<String>,
}

impl SideEffects {
    pub fn see(&mut self, event: &ClientEvent) -> Option<Evidence> {
        match event {
            ClientEvent::Update(n) => {
                let (id, kind, status, title) = match &n.update {
                    SessionUpdate::ToolCall(c) => (&c.tool_call_id, Some(c.kind), Some(c.status), Some(&c.title)),
                    SessionUpdate::ToolCallUpdate(u) => {
                        (&u.tool_call_id, u.fields.kind, u.fields.status, u.fields.title.as_ref())
                    }
                    _ => return None,
                };
                let id = id.0.to_string();
                if let Some(kind) = kind {
                    self.kinds.insert(id.clone(), kind);
                }
                let kind = *self.kinds.get(&id)?;
                let changes = matches!(kind, ToolKind::Edit | ToolKind::Delete | ToolKind::Move | ToolKind::Execute);
                let ran = matches!(status, Some(ToolCallStatus::InProgress | ToolCallStatus::Completed));
                if !(changes && ran && self.seen.insert(id.clone())) {
                    return None;
                }
                Some(Evidence::ToolCall {
                    tool_call_id: id,
                    kind: wire_name(&kind),
                    status: status.map(|s| wire_name(&s)).unwrap_or_default(),
                    title: title.cloned(),
                })
            }
            ClientEvent::Permission { request, outcome: RequestPermissionOutcome::Selected(chosen), .. } => {
                let option = request.options.iter().find(|o| o.option_id == chosen.option_id)?;
                let granted =
                    matches!(option.kind, PermissionOptionKind::AllowOnce | PermissionOptionKind::AllowAlways);
                granted.then(|| Evidence::Permission {
                    tool_call_id: request.tool_call.tool_call_id.0.to_string(),
                    option: chosen.option_id.0.to_string(),
                })
            }
            ClientEvent::ClientCall { method, target, error: None }
                if matches!(method.as_str(), "fs/write_text_file" | "terminal/create") =>
            {
                Some(Evidence::ClientCall { method: method.clone(), target: target.clone() })
            }
            _ => None,
        }
    }
}

/// A unit enum's wire name (`edit`, `in_progress`, `end_turn`).
pub fn wire_name<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}
