//! What the delegate call shows while the child works: the child's tool calls, one
//! line each, and its text so far. Bounded, whatever the child sends.

use agent_client_protocol_schema::v1::ToolCallStatus;
use pier_client::{ClientEvent, Partial};
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
    seen: Partial,
    /// Whether anything changed since the last [`Progress::take`].
    dirty: bool,
}

impl Progress {
    /// Takes in one event of the child's run.
    pub fn see(&mut self, event: &ClientEvent) {
        self.dirty |= self.seen.see(event);
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
        let calls = &self.seen.tool_calls;
        for call in &calls[calls.len().saturating_sub(CALL_LINES)..] {
            let mark = match call.status {
                ToolCallStatus::Completed => "✓",
                ToolCallStatus::Failed => "✗",
                _ => "…",
            };
            out.push_str(&format!("{mark} {}\n", call.title));
        }
        let text = self.seen.text_tail(TEXT_BYTES);
        if !text.is_empty() {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(text);
        }
        out
    }
}
