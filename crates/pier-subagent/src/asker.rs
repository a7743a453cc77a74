//! The machine channel (seed 003): a child's permission request, judged by the parent.
//!
//! The child's `session/request_permission` becomes an [`Action`] sent up the
//! delegate call's [`CallLink`]; the parent's session judges it by its own policy,
//! mode and remembered answers, and asks its own client where those say *ask*. What
//! goes back to the child is always a once-answer (`allow_once` / `reject_once`):
//! an *always* from the person is remembered by the parent's session, never turned
//! into a grant the child keeps. A failure anywhere on that path is a rejection.

use agent_client_protocol_schema::v1::{ContentBlock, RequestPermissionRequest, ToolCallContent};
use futures::future::BoxFuture;
use pier_client::handler::{AskAnswer, Asker};
use pier_client::policy::{Choice, Rule, choose, kind_of};
use pier_tools::{Action, CallLink, Location, Permit, Scope, ToolContent, ToolKind};
use serde_json::Value;

/// Answers a child's permission requests through the parent's session.
pub struct ParentAsker {
    pub link: CallLink,
    /// The child's name, shown in front of its tool call's title.
    pub agent: String,
}

impl Asker for ParentAsker {
    fn ask(&self, request: &RequestPermissionRequest) -> BoxFuture<'static, AskAnswer> {
        let action = action_of(&self.agent, request);
        let options = request.options.clone();
        let link = self.link.clone();
        Box::pin(async move {
            let rule = match link.permit(action).await {
                Permit::Allow => Rule::Allow,
                Permit::Reject(why) => {
                    tracing::info!(reason = %why, "the parent rejected a subagent's tool call");
                    Rule::Deny
                }
                Permit::Cancelled => return AskAnswer::Withdrawn,
            };
            // Once-options only: `choose` picks `allow_once` / `reject_once` for these rules.
            match choose(rule, &options) {
                (Choice::Select { option_id, .. }, _) => AskAnswer::Option(option_id),
                (Choice::Cancelled, why) => {
                    tracing::warn!(%why, "the subagent offered no once-option; nothing is granted");
                    AskAnswer::Nobody
                }
            }
        })
    }
}

/// The child's tool call as the parent judges it.
pub fn action_of(agent: &str, request: &RequestPermissionRequest) -> Action {
    let fields = &request.tool_call.fields;
    // A call that does not say what it is, is judged as the strictest kind that may be
    // allowed at all: delegating (`other`) being allowed must not allow it too.
    let kind = fields.kind.as_ref().map_or(ToolKind::Execute, |k| kind_of(Some(k)));
    let title = fields.title.clone().unwrap_or_else(|| request.tool_call.tool_call_id.0.to_string());
    let raw_input = fields.raw_input.clone();
    let scope = match kind {
        ToolKind::Execute => raw_input.as_ref().and_then(command_of).and_then(|c| pier_tools::command::programs(&c)),
        _ => None,
    }
    .map_or(if kind == ToolKind::Execute { Scope::Unscoped } else { Scope::Kind }, Scope::Names);
    let locations =
        fields.locations.iter().flatten().map(|l| Location { path: l.path.clone(), line: l.line }).collect();
    let content = fields.content.iter().flatten().filter_map(content_of).collect();
    Action { title: format!("{agent}: {title}"), kind, scope, locations, content, raw_input }
}

/// The command line of an execute call, as pier's, codex's and most agents' raw input give it.
fn command_of(raw: &Value) -> Option<String> {
    match raw.get("command")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(words) => {
            let words: Option<Vec<&str>> = words.iter().map(Value::as_str).collect();
            words.map(|w| w.join(" "))
        }
        _ => None,
    }
}

/// A child's tool-call content as pier's: text and diffs (terminals and the rest are not shown).
pub fn content_of(content: &ToolCallContent) -> Option<ToolContent> {
    match content {
        ToolCallContent::Diff(d) => {
            Some(ToolContent::Diff { path: d.path.clone(), old_text: d.old_text.clone(), new_text: d.new_text.clone() })
        }
        ToolCallContent::Content(c) => match &c.content {
            ContentBlock::Text(t) => Some(ToolContent::Text { text: t.text.clone() }),
            _ => None,
        },
        _ => None,
    }
}
