//! Permissions: a policy by tool kind, and the seam through which *ask* asks.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use pier_tools::ToolKind;
use serde::{Deserialize, Serialize};

use crate::tool_call::ToolCallRecord;

/// What the policy says about a kind of tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Allow,
    Ask,
    Deny,
}

impl std::str::FromStr for Decision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "allow" => Ok(Decision::Allow),
            "ask" => Ok(Decision::Ask),
            "deny" => Ok(Decision::Deny),
            other => Err(format!("unknown permission `{other}`; expected allow, ask or deny")),
        }
    }
}

/// Maps tool kinds to decisions. Defaults: read, search and think are allowed;
/// everything else (edit, delete, move, execute, fetch, other) asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermissionPolicy {
    rules: BTreeMap<ToolKind, Decision>,
}

impl Default for PermissionPolicy {
    fn default() -> Self {
        let mut rules = BTreeMap::new();
        for kind in ToolKind::ALL {
            let d = match kind {
                ToolKind::Read | ToolKind::Search | ToolKind::Think => Decision::Allow,
                _ => Decision::Ask,
            };
            rules.insert(kind, d);
        }
        PermissionPolicy { rules }
    }
}

impl PermissionPolicy {
    pub fn set(&mut self, kind: ToolKind, decision: Decision) {
        self.rules.insert(kind, decision);
    }

    /// Allows every kind.
    pub fn approve_all(&mut self) {
        for kind in ToolKind::ALL {
            self.rules.insert(kind, Decision::Allow);
        }
    }

    pub fn decide(&self, kind: ToolKind) -> Decision {
        self.rules.get(&kind).copied().unwrap_or(Decision::Ask)
    }
}

/// The answer to one permission request. It is never remembered: each *ask* asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PermissionAnswer {
    AllowOnce,
    RejectOnce,
    /// The client cancelled the request; the turn ends `cancelled`.
    Cancelled,
    /// No usable answer (an error, a malformed answer, a closed connection): denied.
    Unavailable(String),
}

/// Asks someone whether a pending tool call may run.
pub trait Approver: Send + Sync + 'static {
    fn ask(&self, call: &ToolCallRecord) -> BoxFuture<'static, PermissionAnswer>;
}

/// An approver with nobody to ask: every request is unavailable.
pub struct NoApprover;

impl Approver for NoApprover {
    fn ask(&self, _call: &ToolCallRecord) -> BoxFuture<'static, PermissionAnswer> {
        Box::pin(async { PermissionAnswer::Unavailable("there is no client to ask".into()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_allow_reading_and_ask_for_changes() {
        let p = PermissionPolicy::default();
        for k in [ToolKind::Read, ToolKind::Search, ToolKind::Think] {
            assert_eq!(p.decide(k), Decision::Allow, "{k:?}");
        }
        for k in [ToolKind::Edit, ToolKind::Delete, ToolKind::Move, ToolKind::Execute, ToolKind::Fetch, ToolKind::Other]
        {
            assert_eq!(p.decide(k), Decision::Ask, "{k:?}");
        }
    }

    #[test]
    fn approve_all_then_deny_one() {
        let mut p = PermissionPolicy::default();
        p.approve_all();
        p.set(ToolKind::Execute, Decision::Deny);
        assert_eq!(p.decide(ToolKind::Edit), Decision::Allow);
        assert_eq!(p.decide(ToolKind::Execute), Decision::Deny);
    }
}
