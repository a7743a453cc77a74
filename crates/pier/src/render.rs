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

use std::io::{IsTerminal, Write};

use pier_client::{ClientError, ClientEvent, Ending, RunOutcome};
use serde_json::{Value, json};

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

/// Prints events as they come and the outcome at the end.
pub struct Renderer {
    format: Format,
    colour: bool,
    tty: bool,
    verbose: bool,
    /// The tool call whose line was printed last, to update it in place.
    last_tool_line: Option<String>,
    at_line_start: bool,
    titles: std::collections::HashMap<String, String>,
}

impl Renderer {
    pub fn new(format: Format, verbose: bool) -> Renderer {
        let tty = std::io::stdout().is_terminal();
        let colour = tty && std::env::var_os("NO_COLOR").is_none();
        Renderer { format, colour, tty, verbose, last_tool_line: None, at_line_start: true, titles: Default::default() }
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
        if !self.at_line_start {
            self.out("\n");
        }
        self.out(&format!("{s}\n"));
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
                let v = match event {
                    ClientEvent::Update(params) => {
                        let mut v = json!({ "type": "session_update" });
                        if let (Some(obj), Some(p)) = (v.as_object_mut(), params.as_object()) {
                            obj.extend(p.clone());
                        }
                        v
                    }
                    ClientEvent::Permission { request, outcome, rule, reason } => json!({
                        "type": "permission",
                        "sessionId": request["sessionId"],
                        "toolCall": request["toolCall"],
                        "options": request["options"],
                        "outcome": outcome,
                        "rule": rule,
                        "reason": reason,
                    }),
                    ClientEvent::ClientCall { method, target, error } => json!({
                        "type": "client_call", "method": method, "target": target, "ok": error.is_none(), "error": error,
                    }),
                    ClientEvent::ProtocolError(message) => json!({ "type": "protocol_error", "message": message }),
                };
                self.json(&v);
            }
            Format::Text => self.text_event(event),
        }
    }

    fn text_event(&mut self, event: &ClientEvent) {
        match event {
            ClientEvent::Update(params) => {
                let update = &params["update"];
                match update["sessionUpdate"].as_str().unwrap_or("") {
                    "agent_message_chunk" => {
                        if let Some(t) = update["content"]["text"].as_str() {
                            if self.last_tool_line.take().is_some() && !self.at_line_start {
                                self.out("\n");
                            }
                            self.out(t);
                        }
                    }
                    "agent_thought_chunk" => {
                        if let Some(t) = update["content"]["text"].as_str() {
                            self.last_tool_line = None;
                            let dimmed = self.dim(t);
                            self.out(&dimmed);
                        }
                    }
                    "tool_call" | "tool_call_update" => {
                        let id = update["toolCallId"].as_str().unwrap_or("?").to_owned();
                        if let Some(title) = update["title"].as_str() {
                            self.titles.insert(id.clone(), title.to_owned());
                        }
                        let title = self.titles.get(&id).cloned().unwrap_or_else(|| id.clone());
                        let status = update["status"].as_str().unwrap_or("pending");
                        let mark = match status {
                            "completed" => "✓",
                            "failed" => "✗",
                            "in_progress" => "…",
                            _ => "·",
                        };
                        let text = format!("{mark} {title} [{status}]");
                        if self.tty && self.last_tool_line.as_deref() == Some(id.as_str()) {
                            self.out(&format!("\r\x1b[2K{text}"));
                        } else if update["sessionUpdate"] == "tool_call" || update.get("status").is_some() {
                            if !self.at_line_start {
                                self.out("\n");
                            }
                            self.out(&text);
                        }
                        self.last_tool_line = Some(id);
                    }
                    "plan" => {
                        let entries = update["entries"].as_array().cloned().unwrap_or_default();
                        let mut lines = vec!["plan:".to_owned()];
                        for e in entries {
                            let mark = match e["status"].as_str() {
                                Some("completed") => "[x]",
                                Some("in_progress") => "[~]",
                                _ => "[ ]",
                            };
                            lines.push(format!("  {mark} {}", e["content"].as_str().unwrap_or("")));
                        }
                        self.last_tool_line = None;
                        self.line(&lines.join("\n"));
                    }
                    _ => {}
                }
            }
            ClientEvent::Permission { request, outcome, reason, .. } => {
                let title = request["toolCall"]["title"].as_str().unwrap_or("a tool call");
                let answer = outcome["optionId"].as_str().unwrap_or_else(|| outcome["outcome"].as_str().unwrap_or("?"));
                eprintln!("pier: permission for {title}: {answer} ({reason})");
            }
            ClientEvent::ClientCall { method, target, error } => {
                if self.verbose || error.is_some() {
                    let how = error.as_ref().map_or("ok".to_owned(), |e| format!("error {e}"));
                    eprintln!("pier: {method} {target}: {how}");
                }
            }
            ClientEvent::ProtocolError(message) => eprintln!("pier: protocol error from the agent: {message}"),
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
                if let Some(e) = &outcome.error {
                    eprintln!("pier: {e}");
                }
            }
            Format::Text => {
                if !self.at_line_start {
                    self.out("\n");
                }
                let stop = stop.and_then(|s| s.as_str().map(str::to_owned)).unwrap_or_else(|| "none".into());
                let usage = outcome.usage.as_ref().map(|u| format!(" · usage {u}")).unwrap_or_default();
                eprintln!("pier: stop reason {stop}{usage} · {:.1}s", outcome.duration.as_secs_f64());
                if let Some(e) = &outcome.error {
                    eprintln!("pier: {e}");
                }
            }
        }
    }
}

fn error_json(outcome: &RunOutcome) -> Option<Value> {
    let kind = match (&outcome.error, outcome.ending) {
        (_, Ending::TimedOut { confirmed }) => Some(("timeout", confirmed)),
        (_, Ending::Interrupted { confirmed }) => Some(("cancelled", confirmed)),
        (_, Ending::PermissionRequired) => Some(("permission_required", true)),
        (Some(ClientError::Usage(_)), _) => Some(("usage", true)),
        (Some(ClientError::Spawn { .. }), _) => Some(("spawn", true)),
        (Some(ClientError::Agent { .. }), _) => Some(("agent", true)),
        (None, _) => None,
    }?;
    let message = outcome.error.as_ref().map(ToString::to_string).unwrap_or_else(|| match kind.0 {
        "timeout" => "the turn timed out and was cancelled".to_owned(),
        "cancelled" => "the turn was cancelled by the user".to_owned(),
        "permission_required" => "a permission request needed an answer and --non-interactive fail was set".to_owned(),
        _ => String::new(),
    });
    Some(json!({ "kind": kind.0, "message": message, "cancelConfirmed": kind.1 }))
}
