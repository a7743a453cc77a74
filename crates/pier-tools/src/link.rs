//! What a running tool may ask of the turn that runs it.
//!
//! Most tools only take arguments and return an output. A tool that acts on the
//! user's behalf through someone else (`delegate`: a subagent whose tool calls need
//! permission) needs two more things while it runs: to show progress on its call,
//! and to have an action of its own judged by the session's permission rules, which
//! only the engine holds (policy, mode, remembered answers, the approver). The tool
//! sends those requests down a [`CallLink`]; the engine, which owns the call's state,
//! applies them in order. A tool run outside a turn (tests, other hosts) gets a link
//! that shows nothing and rejects every action.

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::{Location, Scope, ToolContent, ToolKind};

/// An action a tool wants to take for the user, judged like a tool call of its own.
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    pub title: String,
    pub kind: ToolKind,
    /// What an *always* answer about it covers.
    pub scope: Scope,
    pub locations: Vec<Location>,
    /// What it would produce, where known: an edit's diff.
    pub content: Vec<ToolContent>,
    pub raw_input: Option<Value>,
}

/// The session's answer about an [`Action`]. Always once-only: a remembered answer
/// stays with the session that gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Permit {
    Allow,
    /// Not allowed; why, for whoever asked.
    Reject(String),
    /// The turn is being cancelled.
    Cancelled,
}

/// A request from a running tool to its turn.
#[derive(Debug)]
pub enum CallRequest {
    /// The call's content so far, replacing what it showed before.
    Progress(Vec<ToolContent>),
    /// Judge an action; the answer comes back on `answer`.
    Permit { action: Action, answer: oneshot::Sender<Permit> },
}

/// The tool's end of the link to its turn.
#[derive(Debug, Clone, Default)]
pub struct CallLink {
    tx: Option<mpsc::UnboundedSender<CallRequest>>,
}

impl CallLink {
    /// A link and the receiver the turn reads while the call runs.
    pub fn channel() -> (CallLink, mpsc::UnboundedReceiver<CallRequest>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (CallLink { tx: Some(tx) }, rx)
    }

    /// Shows `content` on the call. Dropped when nobody is listening.
    pub fn progress(&self, content: Vec<ToolContent>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(CallRequest::Progress(content));
        }
    }

    /// Asks the session about `action`. Without a turn to ask, or when the turn has
    /// gone, the answer is a rejection: an action nobody judged never runs.
    pub async fn permit(&self, action: Action) -> Permit {
        let Some(tx) = &self.tx else {
            return Permit::Reject("nobody can grant permissions here".into());
        };
        let (answer, rx) = oneshot::channel();
        if tx.send(CallRequest::Permit { action, answer }).is_err() {
            return Permit::Reject("the session's permission channel is closed".into());
        }
        rx.await.unwrap_or_else(|_| Permit::Reject("the session's permission channel is closed".into()))
    }
}
