//! Profiles: how engine events and agent capabilities appear on the wire.
//!
//! A profile is a projection of [`EventMsg`]s onto `session/update`s plus the
//! surface it offers. Adding a profile never touches the engine.
//!
//! - *automation* (seed 003): fresh text sessions, committed assistant text only.
//! - *editor*: everything an editor renders: deltas, thoughts, tool calls with
//!   their diffs and locations, plans, titles, usage; sessions that reopen; modes.

use std::collections::HashMap;

use agent_client_protocol_schema::v1::{
    AgentCapabilities, ContentBlock, ContentChunk, McpCapabilities, Plan, PlanEntry, PlanEntryPriority,
    PlanEntryStatus, PromptCapabilities, SessionAdditionalDirectoriesCapabilities, SessionCapabilities,
    SessionCloseCapabilities, SessionDeleteCapabilities, SessionInfoUpdate, SessionListCapabilities,
    SessionResumeCapabilities, SessionUpdate, TextContent, ToolCall, ToolCallUpdate, UsageUpdate,
};
use pier_engine::{EventMsg, ToolCallRecord};
use pier_tools::{PlanPriority, PlanStatus};

use crate::wire;

/// The profiles `pier agent` can speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profile {
    /// The strict automation contract of seed 003: fresh text sessions, committed
    /// assistant text only, one prompt in flight per session.
    #[default]
    Automation,
    /// The whole stable v1 surface editors render.
    Editor,
}

/// The client methods the automation profile answers; every other one is -32601.
const AUTOMATION_METHODS: &[&str] = &["initialize", "session/new", "session/prompt"];

/// The client methods the editor profile answers.
const EDITOR_METHODS: &[&str] = &[
    "initialize",
    "session/new",
    "session/load",
    "session/resume",
    "session/list",
    "session/close",
    "session/delete",
    "session/prompt",
    "session/set_mode",
    "session/set_config_option",
];

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Automation => "automation",
            Profile::Editor => "editor",
        }
    }

    /// Whether the profile offers a client→agent request method.
    pub fn offers(self, method: &str) -> bool {
        match self {
            Profile::Automation => AUTOMATION_METHODS.contains(&method),
            Profile::Editor => EDITOR_METHODS.contains(&method),
        }
    }

    /// The capabilities advertised in `initialize`; `image` where the model takes images.
    pub fn capabilities(self, image: bool) -> AgentCapabilities {
        match self {
            Profile::Automation => AgentCapabilities::new()
                .load_session(false)
                .prompt_capabilities(PromptCapabilities::new().image(false).audio(false).embedded_context(false))
                .mcp_capabilities(McpCapabilities::new()),
            Profile::Editor => AgentCapabilities::new()
                .load_session(true)
                .prompt_capabilities(PromptCapabilities::new().image(image).audio(false).embedded_context(true))
                .mcp_capabilities(McpCapabilities::new().http(true))
                .session_capabilities(
                    SessionCapabilities::new()
                        .list(SessionListCapabilities::new())
                        .resume(SessionResumeCapabilities::new())
                        .close(SessionCloseCapabilities::new())
                        .delete(SessionDeleteCapabilities::new())
                        .additional_directories(SessionAdditionalDirectoriesCapabilities::new()),
                ),
        }
    }

    /// A projector for one turn's events.
    pub fn projector(self, context_window: Option<u64>) -> Projector {
        Projector { profile: self, context_window, calls: HashMap::new() }
    }
}

/// Projects one turn's events; remembers what each tool call last showed, so an
/// update carries only what changed.
pub struct Projector {
    profile: Profile,
    context_window: Option<u64>,
    calls: HashMap<String, ToolCallRecord>,
}

impl Projector {
    /// The update an engine event becomes, if any.
    pub fn project(&mut self, event: &EventMsg) -> Option<SessionUpdate> {
        match (self.profile, event) {
            (Profile::Automation, EventMsg::MessageCommitted(text)) => Some(agent_text(text)),
            // Deltas, reasoning, tool activity and usage stay in the session log in this profile.
            (Profile::Automation, _) => None,
            (Profile::Editor, EventMsg::TextDelta(t)) => Some(agent_text(t)),
            (Profile::Editor, EventMsg::ReasoningDelta(t)) => Some(thought(t)),
            // The deltas already carried the text.
            (Profile::Editor, EventMsg::MessageCommitted(_)) => None,
            (Profile::Editor, EventMsg::Usage(u)) => {
                let size = self.context_window?;
                Some(SessionUpdate::UsageUpdate(UsageUpdate::new(u.total_tokens, size)))
            }
            (Profile::Editor, EventMsg::ToolCall(record)) => {
                self.calls.insert(record.id.clone(), record.clone());
                Some(SessionUpdate::ToolCall(full_tool_call(record)))
            }
            (Profile::Editor, EventMsg::ToolCallUpdate(record)) => {
                let fields = match self.calls.get(&record.id) {
                    Some(before) => wire::changed_fields(before, record),
                    None => wire::tool_call_fields(record),
                };
                self.calls.insert(record.id.clone(), record.clone());
                Some(SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(record.id.clone(), fields)))
            }
            (Profile::Editor, EventMsg::Plan(entries)) => Some(plan(entries)),
            (Profile::Editor, EventMsg::Title(title)) => {
                Some(SessionUpdate::SessionInfoUpdate(SessionInfoUpdate::new().title(title.clone())))
            }
        }
    }
}

pub fn agent_text(text: &str) -> SessionUpdate {
    SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(text))))
}

pub fn user_text(text: &str) -> SessionUpdate {
    SessionUpdate::UserMessageChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(text))))
}

pub fn thought(text: &str) -> SessionUpdate {
    SessionUpdate::AgentThoughtChunk(ContentChunk::new(ContentBlock::Text(TextContent::new(text))))
}

/// A tool call with every field it has.
pub fn full_tool_call(record: &ToolCallRecord) -> ToolCall {
    let mut call = ToolCall::new(record.id.clone(), record.title.clone());
    call.update(wire::tool_call_fields(record));
    call
}

/// The whole plan (R099).
pub fn plan(entries: &[pier_tools::PlanEntry]) -> SessionUpdate {
    let entries = entries
        .iter()
        .map(|e| {
            let priority = match e.priority {
                PlanPriority::High => PlanEntryPriority::High,
                PlanPriority::Medium => PlanEntryPriority::Medium,
                PlanPriority::Low => PlanEntryPriority::Low,
            };
            let status = match e.status {
                PlanStatus::Pending => PlanEntryStatus::Pending,
                PlanStatus::InProgress => PlanEntryStatus::InProgress,
                PlanStatus::Completed => PlanEntryStatus::Completed,
            };
            PlanEntry::new(e.content.clone(), priority, status)
        })
        .collect();
    SessionUpdate::Plan(Plan::new(entries))
}
