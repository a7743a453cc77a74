//! What a turn has shown so far, bounded whatever the agent sends: its text (the end of
//! it) and its tool calls with their latest titles and states. The host keeps it on an
//! attempt (a cancelled task keeps its partial output); a parent shows its subagent's.

use agent_client_protocol_schema::v1::{ContentBlock, SessionUpdate, ToolCallStatus, ToolKind};
use serde::Serialize;

use crate::ClientEvent;

/// Most tool calls kept (the latest ones).
const CALLS: usize = 200;
/// Most bytes of text kept (its end).
const TEXT_BYTES: usize = 64 * 1024;

/// One tool call as last seen.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CallSeen {
    pub tool_call_id: String,
    pub title: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<ToolKind>,
    pub status: ToolCallStatus,
}

/// A turn's output so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Partial {
    /// The agent's text so far, every message of the turn (its last 64 KiB).
    pub text: String,
    pub tool_calls: Vec<CallSeen>,
}

impl Partial {
    /// Takes in one event; true if it changed what is kept.
    pub fn see(&mut self, event: &ClientEvent) -> bool {
        let ClientEvent::Update(n) = event else { return false };
        match &n.update {
            SessionUpdate::AgentMessageChunk(chunk) => {
                let ContentBlock::Text(t) = &chunk.content else { return false };
                self.text.push_str(&t.text);
                if self.text.len() > 2 * TEXT_BYTES {
                    let cut = floor_boundary(&self.text, self.text.len() - TEXT_BYTES);
                    self.text.drain(..cut);
                }
                true
            }
            SessionUpdate::ToolCall(call) => {
                self.tool_calls.push(CallSeen {
                    tool_call_id: call.tool_call_id.0.to_string(),
                    title: call.title.clone(),
                    kind: Some(call.kind),
                    status: call.status,
                });
                if self.tool_calls.len() > CALLS {
                    self.tool_calls.remove(0);
                }
                true
            }
            SessionUpdate::ToolCallUpdate(update) => {
                let id = update.tool_call_id.0.as_ref();
                let Some(seen) = self.tool_calls.iter_mut().rev().find(|c| c.tool_call_id == id) else { return false };
                if let Some(title) = &update.fields.title {
                    seen.title.clone_from(title);
                }
                if let Some(kind) = update.fields.kind {
                    seen.kind = Some(kind);
                }
                if let Some(status) = update.fields.status {
                    seen.status = status;
                }
                true
            }
            _ => false,
        }
    }

    /// The end of the text, at most `bytes` of it, cut on a character boundary.
    pub fn text_tail(&self, bytes: usize) -> &str {
        &self.text[floor_boundary(&self.text, self.text.len().saturating_sub(bytes))..]
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.tool_calls.is_empty()
    }
}

/// The largest char boundary at or before `at`.
fn floor_boundary(s: &str, mut at: usize) -> usize {
    while at > 0 && !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}
