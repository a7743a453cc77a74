//! Engine values in ACP's wire types, shared by the profiles.

use agent_client_protocol_schema::v1::{
    Content, ContentBlock, Diff, SessionReference, Terminal, TextContent, ToolCallContent, ToolCallLocation,
    ToolCallStatus, ToolCallUpdateFields, ToolKind,
};
use pier_engine::{ToolCallRecord, ToolCallStatus as Status};
use pier_tools::{ToolContent, ToolKind as Kind};

pub fn tool_kind(kind: Kind) -> ToolKind {
    match kind {
        Kind::Read => ToolKind::Read,
        Kind::Edit => ToolKind::Edit,
        Kind::Delete => ToolKind::Delete,
        Kind::Move => ToolKind::Move,
        Kind::Search => ToolKind::Search,
        Kind::Execute => ToolKind::Execute,
        Kind::Think => ToolKind::Think,
        Kind::Fetch => ToolKind::Fetch,
        Kind::Other => ToolKind::Other,
    }
}

pub fn tool_status(status: Status) -> ToolCallStatus {
    match status {
        Status::Pending => ToolCallStatus::Pending,
        Status::InProgress => ToolCallStatus::InProgress,
        Status::Completed => ToolCallStatus::Completed,
        Status::Failed => ToolCallStatus::Failed,
    }
}

/// Every field of a tool call, as a full update.
pub fn tool_call_fields(call: &ToolCallRecord) -> ToolCallUpdateFields {
    let mut content: Vec<ToolCallContent> = call
        .content
        .iter()
        .map(|c| match c {
            ToolContent::Text { text } => {
                ToolCallContent::Content(Content::new(ContentBlock::Text(TextContent::new(text.clone()))))
            }
            ToolContent::Diff { path, old_text, new_text } => {
                ToolCallContent::Diff(Diff::new(path.clone(), new_text.clone()).old_text(old_text.clone()))
            }
            ToolContent::Session { session_id, .. } => {
                ToolCallContent::Session(SessionReference::new(session_id.clone()))
            }
            ToolContent::Terminal { terminal_id } => ToolCallContent::Terminal(Terminal::new(terminal_id.clone())),
            // ACP's content blocks are MCP's: one that does not read as ACP's is described.
            ToolContent::Block { block } => ToolCallContent::Content(Content::new(
                serde_json::from_value::<ContentBlock>(block.clone()).unwrap_or_else(|e| {
                    ContentBlock::Text(TextContent::new(format!("[a content block pier cannot pass on: {e}]")))
                }),
            )),
        })
        .collect();
    // Why it failed, unless the call's content already says it (a failed command's output is
    // both its content and the words the model reads): a client shows each once.
    if let Some(error) = &call.error
        && !call.content.iter().any(|c| says(c, error))
    {
        content.push(ToolCallContent::Content(Content::new(ContentBlock::Text(TextContent::new(error.clone())))));
    }
    let locations: Vec<ToolCallLocation> =
        call.locations.iter().map(|l| ToolCallLocation::new(l.path.clone()).line(l.line)).collect();
    let mut fields = ToolCallUpdateFields::new()
        .title(call.title.clone())
        .name(call.name.clone())
        .kind(tool_kind(call.kind))
        .status(tool_status(call.status))
        .raw_input(call.raw_input.clone())
        .locations(locations);
    if !content.is_empty() {
        fields = fields.content(content);
    }
    if let Some(raw) = &call.raw_output {
        fields = fields.raw_output(raw.clone());
    }
    fields
}

/// Whether content `c` is text `text` (a tool's own words, or an MCP text block).
fn says(c: &ToolContent, text: &str) -> bool {
    match c {
        ToolContent::Text { text: t } => t == text,
        ToolContent::Block { block } => block["type"] == "text" && block["text"] == text,
        _ => false,
    }
}

/// Only the fields of `after` that differ from `before` (P08: an update carries what changed).
pub fn changed_fields(before: &ToolCallRecord, after: &ToolCallRecord) -> ToolCallUpdateFields {
    let (old, new) = (tool_call_fields(before), tool_call_fields(after));
    let mut fields = ToolCallUpdateFields::new();
    if new.title != old.title {
        fields.title = new.title;
    }
    if new.kind != old.kind {
        fields.kind = new.kind;
    }
    if new.status != old.status {
        fields.status = new.status;
    }
    if new.content != old.content {
        // An update that empties the content must say so, not leave it out.
        fields.content = Some(new.content.unwrap_or_default());
    }
    if new.locations != old.locations {
        fields.locations = new.locations;
    }
    if new.raw_input != old.raw_input {
        fields.raw_input = new.raw_input;
    }
    if new.raw_output != old.raw_output {
        fields.raw_output = new.raw_output;
    }
    fields
}
