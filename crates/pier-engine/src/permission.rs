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

/// A session's permission mode: how much it may do without asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Reading only: edits, writes, commands and other tools fail without asking.
    ReadOnly,
    /// Reads are allowed; edits and commands ask (the policy as configured).
    #[default]
    Ask,
    /// Edits inside the roots are allowed; commands and other tools ask.
    Auto,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::ReadOnly, Mode::Ask, Mode::Auto];

    pub fn id(self) -> &'static str {
        match self {
            Mode::ReadOnly => "read-only",
            Mode::Ask => "ask",
            Mode::Auto => "auto",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::ReadOnly => "Read only",
            Mode::Ask => "Ask",
            Mode::Auto => "Auto",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Mode::ReadOnly => "Read and search only; edits and commands fail without asking",
            Mode::Ask => "Read freely; ask before edits and commands",
            Mode::Auto => "Edit files inside the session's roots freely; ask before commands",
        }
    }

    /// Applies the mode over the policy's decision for `kind`. A policy's *deny* always stands.
    pub fn verdict(self, kind: ToolKind, policy: Decision) -> Verdict {
        let reads = matches!(kind, ToolKind::Read | ToolKind::Search | ToolKind::Think);
        match (self, policy) {
            (_, Decision::Deny) => Verdict::Deny(format!(
                "the permission policy denies {} tools, so the call did not run; do the task another way or \
                 explain what you need",
                kind.as_str()
            )),
            (Mode::ReadOnly, _) if !reads => Verdict::Deny(format!(
                "the session is in read-only mode, so {} tools do not run; say what you would change instead, \
                 or ask the user to switch modes",
                kind.as_str()
            )),
            (Mode::Auto, Decision::Ask) if matches!(kind, ToolKind::Edit | ToolKind::Delete | ToolKind::Move) => {
                Verdict::Allow
            }
            (_, Decision::Allow) => Verdict::Allow,
            (_, Decision::Ask) => Verdict::Ask,
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::ALL.into_iter().find(|m| m.id() == s).ok_or_else(|| {
            let known: Vec<&str> = Mode::ALL.iter().map(|m| m.id()).collect();
            format!("unknown mode `{s}`; expected one of {}", known.join(", "))
        })
    }
}

/// What the policy and the mode say about one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Ask,
    /// Fails the call without asking, with the reason the model reads.
    Deny(String),
}

/// The *always* answers a session remembers, by scope key (`edit`, `execute:git`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    allowed: std::collections::BTreeSet<String>,
    rejected: std::collections::BTreeSet<String>,
}

impl Grants {
    /// The scope keys of a call: its kind, or each of its names under its kind. Empty when
    /// the call cannot be scoped (an *always* answer then covers this call only).
    pub fn keys(kind: ToolKind, scope: &pier_tools::Scope) -> Vec<String> {
        match scope {
            pier_tools::Scope::Kind => vec![kind.as_str().to_owned()],
            pier_tools::Scope::Names(names) => names.iter().map(|n| format!("{}:{n}", kind.as_str())).collect(),
            pier_tools::Scope::Unscoped => Vec::new(),
        }
    }

    pub fn remember(&mut self, key: String, allow: bool) {
        if allow {
            self.rejected.remove(&key);
            self.allowed.insert(key);
        } else {
            self.allowed.remove(&key);
            self.rejected.insert(key);
        }
    }

    /// Whether every key is allowed (a compound command needs each of its programs).
    pub fn allows(&self, keys: &[String]) -> bool {
        !keys.is_empty() && keys.iter().all(|k| self.allowed.contains(k))
    }

    /// The first key that was rejected for good, if any.
    pub fn rejects<'a>(&self, keys: &'a [String]) -> Option<&'a str> {
        keys.iter().find(|k| self.rejected.contains(*k)).map(String::as_str)
    }
}

/// The answer to one permission request. *Always* answers are remembered by the
/// session for the call's scope ([`Grants`]); the automation profile never gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PermissionAnswer {
    AllowOnce,
    AllowAlways,
    RejectOnce,
    RejectAlways,
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
    fn modes_over_the_default_policy() {
        let p = PermissionPolicy::default();
        let v = |m: Mode, k: ToolKind| m.verdict(k, p.decide(k));
        assert_eq!(v(Mode::Ask, ToolKind::Edit), Verdict::Ask);
        assert_eq!(v(Mode::Ask, ToolKind::Read), Verdict::Allow);
        assert_eq!(v(Mode::Auto, ToolKind::Edit), Verdict::Allow);
        assert_eq!(v(Mode::Auto, ToolKind::Execute), Verdict::Ask);
        assert_eq!(v(Mode::Auto, ToolKind::Other), Verdict::Ask);
        assert!(matches!(v(Mode::ReadOnly, ToolKind::Edit), Verdict::Deny(r) if r.contains("read-only")));
        assert!(matches!(v(Mode::ReadOnly, ToolKind::Other), Verdict::Deny(_)));
        assert_eq!(v(Mode::ReadOnly, ToolKind::Search), Verdict::Allow);
        // A policy's deny stands in every mode.
        assert!(matches!(Mode::Auto.verdict(ToolKind::Edit, Decision::Deny), Verdict::Deny(_)));
    }

    #[test]
    fn grants_cover_every_program_of_a_compound_command() {
        let mut g = Grants::default();
        let scope = |names: &[&str]| pier_tools::Scope::Names(names.iter().map(|s| (*s).to_owned()).collect());
        g.remember("execute:git".into(), true);
        assert!(g.allows(&Grants::keys(ToolKind::Execute, &scope(&["git"]))));
        assert!(!g.allows(&Grants::keys(ToolKind::Execute, &scope(&["git", "rm"]))));
        assert!(!g.allows(&Grants::keys(ToolKind::Execute, &pier_tools::Scope::Unscoped)));
        g.remember("execute:rm".into(), false);
        assert_eq!(g.rejects(&Grants::keys(ToolKind::Execute, &scope(&["git", "rm"]))), Some("execute:rm"));
        g.remember("edit".into(), true);
        assert!(g.allows(&Grants::keys(ToolKind::Edit, &pier_tools::Scope::Kind)));
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
