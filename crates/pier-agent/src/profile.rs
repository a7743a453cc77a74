//! Profiles: how engine events and agent capabilities appear on the wire.
//!
//! A profile is a projection of [`EventMsg`]s onto `session/update`s plus the
//! surface it offers. Adding a profile never touches the engine.

use agent_client_protocol_schema::v1::{
    AgentCapabilities, ContentBlock, ContentChunk, McpCapabilities, PromptCapabilities, SessionUpdate, TextContent,
};
use pier_engine::EventMsg;

/// The profiles `pier agent` can speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profile {
    /// The strict automation contract of seed 003: fresh text sessions, committed
    /// assistant text only, one prompt in flight per session.
    #[default]
    Automation,
}

/// The client methods the automation profile answers; every other one is -32601.
const AUTOMATION_METHODS: &[&str] = &["initialize", "session/new", "session/prompt"];

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Automation => "automation",
        }
    }

    /// Whether the profile offers a client→agent request method.
    pub fn offers(self, method: &str) -> bool {
        match self {
            Profile::Automation => AUTOMATION_METHODS.contains(&method),
        }
    }

    /// The capabilities advertised in `initialize`.
    pub fn capabilities(self) -> AgentCapabilities {
        match self {
            Profile::Automation => AgentCapabilities::new()
                .load_session(false)
                .prompt_capabilities(PromptCapabilities::new().image(false).audio(false).embedded_context(false))
                .mcp_capabilities(McpCapabilities::new()),
        }
    }

    /// The updates an engine event becomes, in order.
    pub fn project(self, event: &EventMsg) -> Option<SessionUpdate> {
        match (self, event) {
            (Profile::Automation, EventMsg::MessageCommitted(text)) => Some(SessionUpdate::AgentMessageChunk(
                ContentChunk::new(ContentBlock::Text(TextContent::new(text.clone()))),
            )),
            // Deltas, reasoning and usage stay in the session log in this profile.
            (Profile::Automation, _) => None,
        }
    }
}
