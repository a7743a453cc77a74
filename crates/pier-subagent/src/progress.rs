//! What the delegate call shows while the child works: the child's tool calls, one
//! line each, and its text so far. Bounded, whatever the child sends.

use agent_client_protocol_schema::v1::{ContentBlock, SessionUpdate, ToolCallStatus};
use pier_client::ClientEvent;
use pier_tools::ToolContent;

/// Most tool-call lines shown (the latest ones).
const CALL_LINES: usize = 40;
/// Most bytes of the child's text shown (its end).
const TEXT_BYTES: usize = 8 * 1024;

/// The child's progress as the parent shows it.
#[derive(Debug, Default)]
pub struct Progress {
    /// The child's session, once the child gave it.
    session_id: Option<String>,
    calls: Vec<(String, String, ToolCallStatus)>,
    text: String,
    /// Whether anything changed since the last [`Progress::take`].
    dirty: bool,
}

impl Progress {
    /// Takes in one event of the child's run.
    pub fn see(&mut self, event: &ClientEvent) {
        let ClientEvent::Update(n) = event else { return };
        match &n.update {
            SessionUpdate::AgentMessageChunk(chunk) => {
                if let ContentBlock::Text(t) = &chunk.content {
                    self.text.push_str(&t.text);
                    if self.text.len() > 2 * TEXT_BYTES {
                        let cut = floor_boundary(&self.text, self.text.len() - TEXT_BYTES);
                        self.text.drain(..cut);
                    }
                    self.dirty = true;
                }
            }
            SessionUpdate::ToolCall(call) => {
                let id = call.tool_call_id.0.to_string();
                self.calls.push((id, call.title.clone(), call.status));
                if self.calls.len() > CALL_LINES {
                    self.calls.remove(0);
                }
                self.dirty = true;
            }
            SessionUpdate::ToolCallUpdate(update) => {
                let id = update.tool_call_id.0.as_ref();
                if let Some(entry) = self.calls.iter_mut().find(|(i, ..)| i.as_str() == id) {
                    if let Some(title) = &update.fields.title {
                        entry.1.clone_from(title);
                    }
                    if let Some(status) = update.fields.status {
                        entry.2 = status;
                    }
                    self.dirty = true;
                }
            }
            _ => {}
        }
    }

    /// The child's session is open.
    pub fn session(&mut self, session_id: String) {
        self.session_id = Some(session_id);
        self.dirty = true;
    }

    /// The content to show, if it changed since last asked.
    pub fn take(&mut self) -> Option<Vec<ToolContent>> {
        if !std::mem::take(&mut self.dirty) {
            return None;
        }
        Some(self.content(None, self.render()))
    }

    /// The call's last content: the child's session with how it ended, and `text`.
    pub fn finished(&self, stop_reason: Option<String>, text: String) -> Vec<ToolContent> {
        self.content(Some(stop_reason.unwrap_or_else(|| "error".into())), text)
    }

    fn content(&self, stop_reason: Option<String>, text: String) -> Vec<ToolContent> {
        let mut content = Vec::with_capacity(2);
        if let Some(session_id) = &self.session_id {
            content.push(ToolContent::Session { session_id: session_id.clone(), stop_reason });
        }
        if !text.is_empty() {
            content.push(ToolContent::Text { text });
        }
        content
    }

    /// What the child showed so far, as text.
    pub fn text(&self) -> String {
        self.render()
    }

    fn render(&self) -> String {
        let mut out = String::new();
        for (_, title, status) in &self.calls {
            let mark = match status {
                ToolCallStatus::Completed => "✓",
                ToolCallStatus::Failed => "✗",
                _ => "…",
            };
            out.push_str(&format!("{mark} {title}\n"));
        }
        if !self.text.is_empty() {
            if !out.is_empty() {
                out.push('\n');
            }
            let start = floor_boundary(&self.text, self.text.len().saturating_sub(TEXT_BYTES));
            out.push_str(&self.text[start..]);
        }
        out
    }
}

/// The largest char boundary at or before `at`.
fn floor_boundary(s: &str, mut at: usize) -> usize {
    while at > 0 && !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}
