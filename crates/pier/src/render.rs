//! How `pier exec` and `pier prompt` print a run: `text` for people, `json` (NDJSON,
//! stable) for programs, `quiet` for the final answer only.
//!
//! # The JSON lines
//! Every line is an object with a `type`:
//! - `session_update`: a `session/update` notification's params, unchanged, plus `type`.
//! - `permission`: `toolCall` and `options` as the agent sent them, the `outcome`
//!   pier answered, the `rule` applied and the `reason`.
//! - `client_call`: an `fs/*` or `terminal/*` call: `method`, `target`, `ok`, `error`.
//! - `protocol_error`: the agent broke the protocol: `message`.
//! - `result`: always the last line: `stopReason` (null when there is none), `text`
//!   (the final assistant message), `usage`, `agent` (`name`, `version`),
//!   `sessionId`, `durationMs`, `exitCode`, and on failure `error` (`kind`, `message`).
//!
//! # The text view
//! The answer as it streams; thoughts dimmed; each tool call as one line
//! `MARK KIND TITLE [STATUS]`, rewritten in place on a terminal while it is the last
//! line; a call's `diff` content as a unified diff ([`diff`]) once, when the call
//! completes (or at the end of the run for a call that neither completed nor failed);
//! a call's text output only with `--verbose`; the plan as a checklist. Colour only
//! on a terminal without `NO_COLOR`.

mod diff;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use agent_client_protocol_schema::v1::{
    ContentBlock, PlanEntryStatus, RequestPermissionOutcome, SessionUpdate, ToolCallContent,
};
use pier_client::event::wire_name;
use pier_client::{ClientError, ClientEvent, Ending, RunOutcome};
use serde_json::{Value, json};

use self::diff::FileDiff;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
    Quiet,
}

/// Exit codes, documented in the README.
pub mod exit {
    pub const OK: i32 = 0;
    pub const FAILURE: i32 = 1;
    pub const USAGE: i32 = 2;
    pub const REFUSAL: i32 = 3;
    pub const MAX_TOKENS: i32 = 4;
    pub const MAX_TURN_REQUESTS: i32 = 5;
    pub const PERMISSION: i32 = 6;
    pub const TIMEOUT: i32 = 124;
    pub const CANCELLED: i32 = 130;
    /// Cancelled by SIGTERM.
    pub const TERMINATED: i32 = 143;
}

pub fn exit_code(outcome: &RunOutcome) -> i32 {
    use agent_client_protocol_schema::v1::StopReason as S;
    match outcome.ending {
        Ending::TimedOut { .. } => return exit::TIMEOUT,
        Ending::Interrupted { .. } => return exit::CANCELLED,
        Ending::PermissionRequired => return exit::PERMISSION,
        Ending::Failed | Ending::Answered => {}
    }
    if let Some(e) = &outcome.error {
        return match e {
            ClientError::Usage(_) => exit::USAGE,
            _ => exit::FAILURE,
        };
    }
    match outcome.stop_reason {
        Some(S::EndTurn) => exit::OK,
        Some(S::Refusal) => exit::REFUSAL,
        Some(S::MaxTokens) => exit::MAX_TOKENS,
        Some(S::MaxTurnRequests) => exit::MAX_TURN_REQUESTS,
        Some(S::Cancelled) => exit::CANCELLED,
        _ => exit::FAILURE,
    }
}

/// What the text renderer printed last, to know when a new line must start and
/// whether a tool call's line can be rewritten in place.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Last {
    Nothing,
    Message,
    Thought,
    /// The line of this tool call, still the last line on the screen.
    ToolLine(String),
    Other,
}

/// What the text renderer knows of one tool call, merged from its updates.
#[derive(Debug, Default)]
struct ToolState {
    title: Option<String>,
    kind: Option<String>,
    status: Option<String>,
    /// The call's `diff` content items, as last sent (an update's `content` replaces them).
    diffs: Vec<FileDiff>,
    /// The call's text content items (tool output), as last sent.
    texts: Vec<String>,
    diffs_shown: bool,
    texts_shown: bool,
}

/// Prints events as they come and the outcome at the end.
pub struct Renderer {
    format: Format,
    colour: bool,
    tty: bool,
    verbose: bool,
    last: Last,
    at_line_start: bool,
    /// Every tool call seen, in the order first seen.
    tools: Vec<(String, ToolState)>,
    /// Where diff paths are shown relative to.
    here: Option<PathBuf>,
}

impl Renderer {
    pub fn new(format: Format, verbose: bool) -> Renderer {
        let tty = std::io::stdout().is_terminal();
        let colour = tty && std::env::var_os("NO_COLOR").is_none();
        let here = std::env::current_dir().ok().and_then(|d| d.canonicalize().ok());
        Renderer { format, colour, tty, verbose, last: Last::Nothing, at_line_start: true, tools: Vec::new(), here }
    }

    fn out(&mut self, s: &str) {
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(s.as_bytes());
        let _ = stdout.flush();
        if let Some(last) = s.chars().last() {
            self.at_line_start = last == '\n';
        }
    }

    fn line(&mut self, s: &str) {
        self.end_line();
        self.out(&format!("{s}\n"));
    }

    fn end_line(&mut self) {
        if !self.at_line_start {
            self.out("\n");
        }
    }

    fn json(&mut self, v: &Value) {
        let mut line = serde_json::to_string(v).unwrap_or_default();
        line.push('\n');
        self.out(&line);
    }

    fn dim(&self, s: &str) -> String {
        if self.colour { format!("\x1b[2m{s}\x1b[0m") } else { s.to_owned() }
    }

    pub fn event(&mut self, event: &ClientEvent) {
        match self.format {
            Format::Quiet => {}
            Format::Json => {
                // The one serialization of events, shared with the host's log.
                let v = serde_json::to_value(event).unwrap_or(Value::Null);
                self.json(&v);
            }
            Format::Text => self.text_event(event),
        }
    }

    fn text_event(&mut self, event: &ClientEvent) {
        match event {
            ClientEvent::Update(n) => match &n.update {
                SessionUpdate::AgentMessageChunk(chunk) => {
                    if let ContentBlock::Text(t) = &chunk.content {
                        if !matches!(self.last, Last::Message | Last::Nothing) {
                            self.end_line();
                        }
                        self.last = Last::Message;
                        self.out(&t.text);
                    }
                }
                SessionUpdate::AgentThoughtChunk(chunk) => {
                    if let ContentBlock::Text(t) = &chunk.content {
                        if !matches!(self.last, Last::Thought | Last::Nothing) {
                            self.end_line();
                        }
                        self.last = Last::Thought;
                        let dimmed = self.dim(&t.text);
                        self.out(&dimmed);
                    }
                }
                SessionUpdate::ToolCall(c) => self.tool_call(ToolView {
                    id: c.tool_call_id.0.to_string(),
                    title: Some(&c.title),
                    kind: Some(wire_name(&c.kind)),
                    status: Some(wire_name(&c.status)),
                    content: Some(&c.content),
                    new: true,
                }),
                SessionUpdate::ToolCallUpdate(u) => self.tool_call(ToolView {
                    id: u.tool_call_id.0.to_string(),
                    title: u.fields.title.as_deref(),
                    kind: u.fields.kind.as_ref().map(wire_name),
                    status: u.fields.status.as_ref().map(wire_name),
                    content: u.fields.content.as_deref(),
                    new: false,
                }),
                SessionUpdate::Plan(plan) => {
                    let mut lines = vec!["plan:".to_owned()];
                    for e in &plan.entries {
                        let mark = match e.status {
                            PlanEntryStatus::Completed => "[x]",
                            PlanEntryStatus::InProgress => "[~]",
                            _ => "[ ]",
                        };
                        lines.push(format!("  {mark} {}", e.content));
                    }
                    self.line(&lines.join("\n"));
                    self.last = Last::Other;
                }
                _ => {}
            },
            ClientEvent::Permission { request, outcome, reason, .. } => {
                let title = request.tool_call.fields.title.as_deref().unwrap_or("a tool call");
                let answer = match outcome {
                    RequestPermissionOutcome::Selected(s) => s.option_id.0.to_string(),
                    _ => "cancelled".to_owned(),
                };
                eprintln!("pier: permission for {title}: {answer} ({reason})");
            }
            ClientEvent::ClientCall { method, target, error } => {
                if self.verbose || error.is_some() {
                    let how = error.as_ref().map_or("ok".to_owned(), |e| format!("error {e}"));
                    eprintln!("pier: {method} {target}: {how}");
                }
            }
            ClientEvent::ProtocolError(message) => eprintln!("pier: protocol error from the agent: {message}"),
            // Shown with --verbose (where it is echoed as it comes, never as events), kept for errors.
            ClientEvent::Stderr { .. } if !self.verbose => {}
            ClientEvent::Stderr { lines, dropped } => {
                if *dropped > 0 {
                    eprintln!("pier: {dropped} lines of the agent's stderr were dropped");
                }
                for line in lines {
                    eprintln!("{line}");
                }
            }
            ClientEvent::Elicitation { request, response, reason } => {
                let action = response["action"].as_str().unwrap_or("?");
                eprintln!("pier: the agent asked: {} — {action} ({reason})", request.message);
            }
        }
    }

    /// A `tool_call` or `tool_call_update`: the call's one line (`MARK KIND TITLE [STATUS]`),
    /// rewritten in place on a terminal while it is the last line; its diffs once, when it
    /// completes; its text output once it ends, with `--verbose` only.
    fn tool_call(&mut self, update: ToolView<'_>) {
        let id = update.id;
        let index = match self.tools.iter().position(|(known, _)| *known == id) {
            Some(i) => i,
            None => {
                self.tools.push((id.clone(), ToolState::default()));
                self.tools.len() - 1
            }
        };
        let (diffs, texts) = self.content(update.content.unwrap_or_default());
        let state = &mut self.tools[index].1;
        if let Some(title) = update.title {
            state.title = Some(title.to_owned());
        }
        if let Some(kind) = update.kind {
            state.kind = Some(kind);
        }
        let has_status = update.status.is_some();
        if let Some(status) = update.status {
            state.status = Some(status);
        }
        if update.content.is_some() {
            state.diffs = diffs;
            state.texts = texts;
        }
        let status = state.status.clone().unwrap_or_else(|| "pending".to_owned());
        let mark = match status.as_str() {
            "completed" => "✓",
            "failed" => "✗",
            "in_progress" => "…",
            _ => "·",
        };
        let kind = state.kind.as_deref().unwrap_or("other");
        let title = state.title.as_deref().unwrap_or(&id);
        let text = format!("{mark} {kind:<5} {title} [{status}]");
        let show_diffs = status == "completed" && !state.diffs_shown && !state.diffs.is_empty();
        let show_texts = self.verbose
            && matches!(status.as_str(), "completed" | "failed")
            && !state.texts_shown
            && !state.texts.is_empty();
        if self.tty && self.last == Last::ToolLine(id.clone()) {
            self.out(&format!("\r\x1b[2K{text}"));
        } else if update.new || has_status {
            self.end_line();
            self.out(&text);
        }
        self.last = Last::ToolLine(id);
        if show_diffs {
            self.tools[index].1.diffs_shown = true;
            self.print_diffs(index);
        }
        if show_texts {
            self.tools[index].1.texts_shown = true;
            let texts = self.tools[index].1.texts.clone();
            self.end_line();
            for t in texts {
                let indented: String = t.lines().map(|l| format!("  {l}\n")).collect();
                let dimmed = self.dim(&indented);
                self.out(&dimmed);
            }
            self.last = Last::Other;
        }
    }

    /// The diff and text items of a tool call's `content`.
    fn content(&self, content: &[ToolCallContent]) -> (Vec<FileDiff>, Vec<String>) {
        let (mut diffs, mut texts) = (Vec::new(), Vec::new());
        for item in content {
            match item {
                ToolCallContent::Diff(d) => diffs.push(FileDiff {
                    path: self.shown_path(&d.path.display().to_string()),
                    old: d.old_text.clone(),
                    new: d.new_text.clone(),
                }),
                ToolCallContent::Content(c) => {
                    if let ContentBlock::Text(t) = &c.content {
                        texts.push(t.text.clone());
                    }
                }
                _ => {}
            }
        }
        (diffs, texts)
    }

    /// `path` relative to the current directory when it is under it.
    fn shown_path(&self, path: &str) -> String {
        let p = Path::new(path);
        self.here
            .as_deref()
            .and_then(|here| p.strip_prefix(here).ok())
            .filter(|rel| !rel.as_os_str().is_empty())
            .map_or_else(|| path.to_owned(), |rel| rel.display().to_string())
    }

    fn print_diffs(&mut self, index: usize) {
        let diffs = self.tools[index].1.diffs.clone();
        self.end_line();
        for d in &diffs {
            let text = diff::unified(d, self.colour, diff::MAX_LINES);
            self.out(&text);
        }
        self.last = Last::Other;
    }

    /// Diffs of calls that never completed (nor failed) are shown when the run ends.
    fn flush_diffs(&mut self) {
        for index in 0..self.tools.len() {
            let state = &self.tools[index].1;
            if state.diffs_shown || state.diffs.is_empty() || state.status.as_deref() == Some("failed") {
                continue;
            }
            self.tools[index].1.diffs_shown = true;
            self.print_diffs(index);
        }
    }

    /// Prints the end of the run.
    pub fn finish(&mut self, outcome: &RunOutcome, code: i32) {
        let stop = outcome.stop_reason.map(|s| serde_json::to_value(s).unwrap_or(Value::Null));
        match self.format {
            Format::Json => {
                let mut v = json!({
                    "type": "result",
                    "stopReason": stop,
                    "text": outcome.text,
                    "usage": outcome.usage,
                    "agent": outcome.agent_info.as_ref().map(|i| json!({ "name": i.name, "version": i.version })),
                    "sessionId": outcome.session_id,
                    "durationMs": outcome.duration.as_millis() as u64,
                    "exitCode": code,
                });
                if let Some(e) = error_json(outcome) {
                    v["error"] = e;
                }
                self.json(&v);
            }
            Format::Quiet => {
                if !outcome.text.is_empty() {
                    let text =
                        if outcome.text.ends_with('\n') { outcome.text.clone() } else { format!("{}\n", outcome.text) };
                    self.out(&text);
                }
                if let Some(line) = failure_line(outcome, code) {
                    eprintln!("pier: {line}");
                }
            }
            Format::Text => {
                self.flush_diffs();
                self.end_line();
                match failure_line(outcome, code) {
                    Some(line) => eprintln!("pier: {line}"),
                    None => {
                        let stop = stop.and_then(|s| s.as_str().map(str::to_owned)).unwrap_or_else(|| "none".into());
                        let usage = outcome.usage.as_ref().map(|u| format!(" · {}", usage_text(u))).unwrap_or_default();
                        eprintln!("pier: stop reason {stop}{usage} · {:.1}s", outcome.duration.as_secs_f64());
                    }
                }
            }
        }
    }
}

/// What a failed run tells a person, in one line (the agent's stderr tail may follow):
/// the cause, and what to do next. `None` for a run that succeeded.
fn failure_line(outcome: &RunOutcome, code: i32) -> Option<String> {
    use agent_client_protocol_schema::v1::StopReason as S;
    if code == exit::OK {
        return None;
    }
    let unconfirmed =
        |confirmed: bool| if confirmed { "" } else { " (the agent did not confirm the cancel and was killed)" };
    let line = match (outcome.ending, &outcome.error) {
        (Ending::TimedOut { .. }, Some(e)) => e.to_string(),
        (Ending::TimedOut { confirmed, limit }, None) => {
            let flag = match limit {
                pier_client::TimeLimit::Idle(_) => "--timeout",
                pier_client::TimeLimit::Total(_) => "--max-time",
                pier_client::TimeLimit::Setup(_) => "--timeout (it also bounds the start)",
            };
            format!("{limit}; the turn was cancelled{}; raise {flag} to wait longer", unconfirmed(confirmed))
        }
        (Ending::Interrupted { confirmed }, _) => {
            format!(
                "interrupted; the turn was cancelled{} after {:.1}s",
                unconfirmed(confirmed),
                outcome.duration.as_secs_f64()
            )
        }
        (Ending::PermissionRequired, _) => "a permission request needed a person and --non-interactive fail was set; \
             allow the tool kind with --approve-all or [client.permissions], or run on a terminal"
            .to_owned(),
        (_, Some(e)) => e.to_string(),
        (_, None) => match outcome.stop_reason {
            Some(S::MaxTokens) => "the model reached its output limit (max_tokens) before finishing; \
                 raise the provider's max_tokens or ask for less"
                .to_owned(),
            Some(S::MaxTurnRequests) => "the turn made as many model requests as it may (max_turn_requests); \
                 raise max_turn_requests in pier.toml or split the task"
                .to_owned(),
            Some(S::Refusal) => "the agent refused the prompt (stop reason refusal)".to_owned(),
            Some(S::Cancelled) => "the agent cancelled the turn (stop reason cancelled)".to_owned(),
            _ => format!(
                "the run failed (exit {code}) without an answer; run again with --verbose to see the agent's stderr"
            ),
        },
    };
    Some(line)
}

fn error_json(outcome: &RunOutcome) -> Option<Value> {
    let kind = match (&outcome.error, outcome.ending) {
        (_, Ending::TimedOut { confirmed, .. }) => Some(("timeout", confirmed)),
        (_, Ending::Interrupted { confirmed }) => Some(("cancelled", confirmed)),
        (_, Ending::PermissionRequired) => Some(("permission_required", true)),
        (Some(ClientError::Usage(_)), _) => Some(("usage", true)),
        (Some(ClientError::Spawn { .. }), _) => Some(("spawn", true)),
        (Some(ClientError::Agent { .. }), _) => Some(("agent", true)),
        (Some(ClientError::Protocol { .. }), _) => Some(("protocol", true)),
        (None, _) => None,
    }?;
    let message = outcome.error.as_ref().map(ToString::to_string).unwrap_or_else(|| match kind.0 {
        "timeout" => match outcome.ending {
            Ending::TimedOut { limit, .. } => format!("{limit}; the turn was cancelled"),
            _ => "the turn timed out and was cancelled".to_owned(),
        },
        "cancelled" => "the turn was cancelled by the user".to_owned(),
        "permission_required" => "a permission request needed an answer and --non-interactive fail was set".to_owned(),
        _ => String::new(),
    });
    Some(json!({ "kind": kind.0, "message": message, "cancelConfirmed": kind.1 }))
}

/// Usage for a person: an ACP `usage_update` as `used/size tokens`, a prompt
/// response's token counts as `N tokens`, anything else as it came.
fn usage_text(u: &Value) -> String {
    match (u["used"].as_u64(), u["size"].as_u64(), u["totalTokens"].as_u64()) {
        (Some(used), Some(size), _) => format!("{used}/{size} tokens of context"),
        (_, _, Some(total)) => format!("{total} tokens"),
        _ => format!("usage {u}"),
    }
}

/// A `tool_call` or `tool_call_update`, as the line renderer needs it.
struct ToolView<'a> {
    id: String,
    title: Option<&'a str>,
    kind: Option<String>,
    status: Option<String>,
    content: Option<&'a [ToolCallContent]>,
    /// A `tool_call` (always drawn), not an update.
    new: bool,
}
