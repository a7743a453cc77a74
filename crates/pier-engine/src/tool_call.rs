//! A tool call is an entity with a state machine, not a log line (seed 000).
//!
//! ```text
//! pending ──► in_progress ──► completed
//!    │              └───────► failed
//!    └──────────────────────► failed   (denied, unavailable, invalid, cancelled before it ran)
//! ```
//!
//! Every move goes through [`ToolCallStatus::can_move_to`]; a terminal state never moves again.

use pier_tools::{Location, ToolContent, ToolKind, ToolOutput};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallStatus {
    Pending,
    InProgress,
    Completed,
    Failed,
}

impl ToolCallStatus {
    /// Whether `self → next` is a legal move.
    pub fn can_move_to(self, next: ToolCallStatus) -> bool {
        use ToolCallStatus::*;
        matches!(
            (self, next),
            (Pending, InProgress) | (Pending, Failed) | (InProgress, Completed) | (InProgress, Failed)
        )
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, ToolCallStatus::Completed | ToolCallStatus::Failed)
    }
}

/// An attempted move the state machine forbids; a bug in the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal tool call transition {from:?} -> {to:?}")]
pub struct IllegalTransition {
    pub from: ToolCallStatus,
    pub to: ToolCallStatus,
}

/// Everything known about one tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRecord {
    pub id: String,
    /// The tool's name as the model called it.
    pub name: String,
    pub title: String,
    pub kind: ToolKind,
    pub status: ToolCallStatus,
    pub raw_input: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_output: Option<Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content: Vec<ToolContent>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locations: Vec<Location>,
    /// Why it failed, in the words the model reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its tool's calls are the session's plan (`Tool::shows_as_plan`): logged, and shown to
    /// a client as the plan they make, never as a tool call.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plan: bool,
}

impl ToolCallRecord {
    /// A new call in `pending`.
    pub fn new(id: String, name: String, title: String, kind: ToolKind, raw_input: Value) -> Self {
        ToolCallRecord {
            id,
            name,
            title,
            kind,
            status: ToolCallStatus::Pending,
            raw_input,
            raw_output: None,
            content: Vec::new(),
            locations: Vec::new(),
            error: None,
            plan: false,
        }
    }

    fn move_to(&mut self, to: ToolCallStatus) -> Result<(), IllegalTransition> {
        if !self.status.can_move_to(to) {
            return Err(IllegalTransition { from: self.status, to });
        }
        self.status = to;
        Ok(())
    }

    /// `pending → in_progress`.
    pub fn start(&mut self) -> Result<(), IllegalTransition> {
        self.move_to(ToolCallStatus::InProgress)
    }

    /// `in_progress → completed` (or `failed` when the tool reports no success).
    pub fn finish(&mut self, output: ToolOutput) -> Result<(), IllegalTransition> {
        let to = if output.success { ToolCallStatus::Completed } else { ToolCallStatus::Failed };
        self.move_to(to)?;
        self.raw_output = Some(output.raw);
        if !output.content.is_empty() {
            self.content = output.content;
        }
        if !output.locations.is_empty() {
            self.locations = output.locations;
        }
        if !output.success {
            self.error = Some(output.text);
        }
        Ok(())
    }

    /// `pending | in_progress → failed`, with the reason.
    pub fn fail(&mut self, reason: impl Into<String>) -> Result<(), IllegalTransition> {
        self.move_to(ToolCallStatus::Failed)?;
        self.error = Some(reason.into());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ToolCallStatus::*;
    use super::*;
    use serde_json::json;

    const ALL: [ToolCallStatus; 4] = [Pending, InProgress, Completed, Failed];

    #[test]
    fn exactly_four_moves_are_legal() {
        let legal: Vec<(ToolCallStatus, ToolCallStatus)> =
            ALL.iter().flat_map(|&a| ALL.iter().map(move |&b| (a, b))).filter(|(a, b)| a.can_move_to(*b)).collect();
        assert_eq!(
            legal,
            vec![(Pending, InProgress), (Pending, Failed), (InProgress, Completed), (InProgress, Failed)]
        );
    }

    fn record() -> ToolCallRecord {
        ToolCallRecord::new("c1".into(), "read_file".into(), "Read a".into(), ToolKind::Read, json!({"path": "a"}))
    }

    #[test]
    fn every_illegal_move_is_refused_and_changes_nothing() {
        // From pending: finish without start.
        let mut r = record();
        assert_eq!(r.finish(ToolOutput::ok("x", json!(null))), Err(IllegalTransition { from: Pending, to: Completed }));
        assert_eq!(r.status, Pending);
        // From in_progress: start again.
        r.start().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.start(), Err(IllegalTransition { from: InProgress, to: InProgress }));
        // From completed: nothing.
        r.finish(ToolOutput::ok("x", json!(1))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.status, Completed);
        assert_eq!(r.start(), Err(IllegalTransition { from: Completed, to: InProgress }));
        assert_eq!(r.fail("late"), Err(IllegalTransition { from: Completed, to: Failed }));
        assert_eq!(r.finish(ToolOutput::ok("y", json!(2))), Err(IllegalTransition { from: Completed, to: Completed }));
        assert_eq!(r.raw_output, Some(json!(1)));
        assert_eq!(r.error, None);
        // From failed: nothing.
        let mut f = record();
        f.fail("denied").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.start(), Err(IllegalTransition { from: Failed, to: InProgress }));
        assert_eq!(f.fail("again"), Err(IllegalTransition { from: Failed, to: Failed }));
        assert_eq!(f.finish(ToolOutput::ok("x", json!(null))), Err(IllegalTransition { from: Failed, to: Completed }));
        assert_eq!(f.error.as_deref(), Some("denied"));
        assert!(f.status.is_terminal());
    }

    #[test]
    fn an_unsuccessful_output_fails_the_call_and_keeps_its_output() {
        let mut r = record();
        r.start().unwrap_or_else(|e| panic!("{e}"));
        let mut out = ToolOutput::ok("exit code 1", json!({"exit_code": 1}));
        out.success = false;
        r.finish(out).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.status, r.error.as_deref()), (Failed, Some("exit code 1")));
        assert_eq!(r.raw_output, Some(json!({"exit_code": 1})));
    }
}
