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
    AgentCapabilities, ContentBlock, ContentChunk, Error, ErrorStopReason, IdleStateUpdate, IdleStopReason,
    McpCapabilities, Plan, PlanEntry, PlanEntryPriority, PlanEntryStatus, PromptCapabilities, RunningStateUpdate,
    SessionAdditionalDirectoriesCapabilities, SessionCancelCapabilities, SessionCapabilities, SessionCloseCapabilities,
    SessionDeleteCapabilities, SessionInfoUpdate, SessionListCapabilities, SessionResumeCapabilities, SessionUpdate,
    StateUpdate, SubagentSessionCapabilities, SubagentUpdate, TextContent, ToolCall, ToolCallContent, ToolCallUpdate,
    UsageUpdate,
};
use pier_engine::{EventMsg, ToolCallRecord};
use pier_tools::{PlanPriority, PlanStatus, ToolContent};

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

    /// A projector for one turn's events. `subagents`: the client advertised the
    /// `subagents` capability, so subagents' sessions are shown as such.
    pub fn projector(self, context_window: Option<u64>, subagents: bool) -> Projector {
        Projector { profile: self, context_window, subagents, calls: HashMap::new(), children: HashMap::new() }
    }
}

/// Projects one turn's events; remembers what each tool call last showed, so an
/// update carries only what changed.
pub struct Projector {
    profile: Profile,
    context_window: Option<u64>,
    subagents: bool,
    calls: HashMap<String, ToolCallRecord>,
    /// Subagent sessions announced so far, and whether their end was.
    children: HashMap<String, bool>,
}

impl Projector {
    /// The updates an engine event becomes, in order.
    pub fn project(&mut self, event: &EventMsg) -> Vec<SessionUpdate> {
        match event {
            EventMsg::ToolCall(record) | EventMsg::ToolCallUpdate(record)
                if self.profile == Profile::Editor && has_sessions(record) =>
            {
                if !self.subagents {
                    // A session reference is for clients that know subagents (ACP `subagents`).
                    let mut shown = record.clone();
                    shown.content.retain(|c| !matches!(c, ToolContent::Session { .. }));
                    return self.project_one(&with_record(event, shown)).into_iter().collect();
                }
                let mut out = self.subagent_updates(record);
                out.extend(self.project_one(event));
                out
            }
            _ => self.project_one(event).into_iter().collect(),
        }
    }

    /// `subagent_update`s for the subagent sessions of `record`: each is announced (with
    /// its title and per-child cancel) before the tool call that references it, and
    /// reported idle, with how it ended, once.
    fn subagent_updates(&mut self, record: &ToolCallRecord) -> Vec<SessionUpdate> {
        let mut out = Vec::new();
        for content in &record.content {
            let ToolContent::Session { session_id, stop_reason } = content else { continue };
            if !self.children.contains_key(session_id) {
                self.children.insert(session_id.clone(), false);
                out.push(SessionUpdate::SubagentUpdate(
                    SubagentUpdate::new(session_id.clone())
                        .title(record.title.clone())
                        .capabilities(SubagentSessionCapabilities::new().cancel(SessionCancelCapabilities::new()))
                        .state(StateUpdate::Running(RunningStateUpdate::new())),
                ));
            }
            let ended = stop_reason.is_some() || record.status.is_terminal();
            if ended && self.children.insert(session_id.clone(), true) == Some(false) {
                let stop = idle_stop(stop_reason.as_deref(), record);
                out.push(SessionUpdate::SubagentUpdate(
                    SubagentUpdate::new(session_id.clone())
                        .state(StateUpdate::Idle(IdleStateUpdate::new().stop_reason(stop))),
                ));
            }
        }
        out
    }

    /// The update an engine event becomes, if any.
    fn project_one(&mut self, event: &EventMsg) -> Option<SessionUpdate> {
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
            (Profile::Editor, EventMsg::ToolCallRestated(record)) => {
                self.calls.insert(record.id.clone(), record.clone());
                let mut fields = wire::tool_call_fields(record);
                if !self.subagents {
                    fields.content = fields
                        .content
                        .map(|c| c.into_iter().filter(|c| !matches!(c, ToolCallContent::Session(_))).collect());
                }
                Some(SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(record.id.clone(), fields)))
            }
            (Profile::Editor, EventMsg::Plan(entries)) => Some(plan(entries)),
            (Profile::Editor, EventMsg::Title(title)) => {
                Some(SessionUpdate::SessionInfoUpdate(SessionInfoUpdate::new().title(title.clone())))
            }
        }
    }
}

fn has_sessions(record: &ToolCallRecord) -> bool {
    record.content.iter().any(|c| matches!(c, ToolContent::Session { .. }))
}

/// `event` carrying `record` instead.
fn with_record(event: &EventMsg, record: ToolCallRecord) -> EventMsg {
    match event {
        EventMsg::ToolCall(_) => EventMsg::ToolCall(record),
        _ => EventMsg::ToolCallUpdate(record),
    }
}

/// How a subagent's turn ended, from its stop reason's wire name, or from its call.
fn idle_stop(stop_reason: Option<&str>, record: &ToolCallRecord) -> IdleStopReason {
    match stop_reason {
        Some("end_turn") => IdleStopReason::EndTurn,
        Some("max_tokens") => IdleStopReason::MaxTokens,
        Some("max_turn_requests") => IdleStopReason::MaxTurnRequests,
        Some("refusal") => IdleStopReason::Refusal,
        Some("cancelled") => IdleStopReason::Cancelled,
        _ => {
            let message = record.error.clone().unwrap_or_else(|| "the subagent ended without an answer".into());
            IdleStopReason::Error(ErrorStopReason::new().error(Error::new(-32603, message)))
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
