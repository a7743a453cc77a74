//! Unattended permission decisions: a rule per tool kind, and the choice of one
//! of the options the agent offered.
//!
//! pier only ever answers with an option the agent offered, picked by its kind,
//! and never picks an *always* option unless the rule says `allow_always` or
//! `deny_always`. When no offered option fits the rule, the answer is the
//! `cancelled` outcome, which grants nothing.

use std::collections::BTreeMap;

use agent_client_protocol_schema::v1::{PermissionOption, PermissionOptionKind};
pub use pier_tools::Rule;
use pier_tools::ToolKind;

/// What happens to an *ask* when nobody can be asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonInteractive {
    /// Reject the tool call and go on.
    #[default]
    Deny,
    /// Reject it, cancel the turn and exit with the permission code.
    Fail,
}

/// The client's permission policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientPolicy {
    rules: BTreeMap<ToolKind, Rule>,
    pub non_interactive: NonInteractive,
}

impl Default for ClientPolicy {
    /// `--approve-reads`: read, search, think and fetch are allowed; the rest asks.
    fn default() -> Self {
        let mut p = ClientPolicy { rules: BTreeMap::new(), non_interactive: NonInteractive::Deny };
        p.approve_reads();
        p
    }
}

impl ClientPolicy {
    pub fn approve_reads(&mut self) {
        for kind in ToolKind::ALL {
            let rule = match kind {
                ToolKind::Read | ToolKind::Search | ToolKind::Think | ToolKind::Fetch => Rule::Allow,
                _ => Rule::Ask,
            };
            self.rules.insert(kind, rule);
        }
    }

    pub fn approve_all(&mut self) {
        self.set_all(Rule::Allow);
    }

    pub fn deny_all(&mut self) {
        self.set_all(Rule::Deny);
    }

    fn set_all(&mut self, rule: Rule) {
        for kind in ToolKind::ALL {
            self.rules.insert(kind, rule);
        }
    }

    pub fn set(&mut self, kind: ToolKind, rule: Rule) {
        self.rules.insert(kind, rule);
    }

    pub fn rule(&self, kind: ToolKind) -> Rule {
        self.rules.get(&kind).copied().unwrap_or(Rule::Ask)
    }
}

/// The answer chosen for one permission request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// One of the offered options.
    Select { option_id: String, kind: PermissionOptionKind },
    /// The `cancelled` outcome: nothing granted.
    Cancelled,
}

/// Picks the offered option that carries out `rule` (which must not be `Ask`).
pub fn choose(rule: Rule, options: &[PermissionOption]) -> (Choice, String) {
    use PermissionOptionKind as K;
    let preference: &[K] = match rule {
        Rule::Allow => &[K::AllowOnce],
        Rule::AllowAlways => &[K::AllowAlways, K::AllowOnce],
        Rule::Deny | Rule::Ask => &[K::RejectOnce],
        Rule::DenyAlways => &[K::RejectAlways, K::RejectOnce],
    };
    for want in preference {
        if let Some(o) = options.iter().find(|o| &o.kind == want) {
            return (Choice::Select { option_id: o.option_id.0.to_string(), kind: o.kind }, String::new());
        }
    }
    let offered: Vec<String> = options.iter().map(|o| format!("{:?}", o.kind)).collect();
    (
        Choice::Cancelled,
        format!("no offered option fits the rule {rule:?} (offered: {}); answered cancelled", offered.join(", ")),
    )
}

/// ACP's tool kind as pier's.
pub fn kind_of(kind: Option<&agent_client_protocol_schema::v1::ToolKind>) -> ToolKind {
    use agent_client_protocol_schema::v1::ToolKind as K;
    match kind {
        Some(K::Read) => ToolKind::Read,
        Some(K::Edit) => ToolKind::Edit,
        Some(K::Delete) => ToolKind::Delete,
        Some(K::Move) => ToolKind::Move,
        Some(K::Search) => ToolKind::Search,
        Some(K::Execute) => ToolKind::Execute,
        Some(K::Think) => ToolKind::Think,
        Some(K::Fetch) => ToolKind::Fetch,
        _ => ToolKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(kinds: &[(&'static str, PermissionOptionKind)]) -> Vec<PermissionOption> {
        kinds.iter().map(|(id, k)| PermissionOption::new(*id, *id, *k)).collect()
    }

    #[test]
    fn picks_by_kind_and_never_always_unless_told() {
        use PermissionOptionKind as K;
        let all = opts(&[("aa", K::AllowAlways), ("ao", K::AllowOnce), ("ro", K::RejectOnce), ("ra", K::RejectAlways)]);
        let pick = |rule, o: &[PermissionOption]| match choose(rule, o).0 {
            Choice::Select { option_id, .. } => option_id,
            Choice::Cancelled => "cancelled".to_owned(),
        };
        assert_eq!(pick(Rule::Allow, &all), "ao");
        assert_eq!(pick(Rule::AllowAlways, &all), "aa");
        assert_eq!(pick(Rule::Deny, &all), "ro");
        assert_eq!(pick(Rule::DenyAlways, &all), "ra");
        let only_always = opts(&[("aa", K::AllowAlways), ("ra", K::RejectAlways)]);
        assert_eq!(pick(Rule::Allow, &only_always), "cancelled");
        assert_eq!(pick(Rule::Deny, &only_always), "cancelled");
        let claude = opts(&[("allow_always", K::AllowAlways), ("allow", K::AllowOnce), ("reject", K::RejectOnce)]);
        assert_eq!(pick(Rule::Allow, &claude), "allow");
    }

    #[test]
    fn defaults_approve_reads() {
        let p = ClientPolicy::default();
        for k in [ToolKind::Read, ToolKind::Search, ToolKind::Think, ToolKind::Fetch] {
            assert_eq!(p.rule(k), Rule::Allow);
        }
        for k in [ToolKind::Edit, ToolKind::Execute, ToolKind::Delete, ToolKind::Move, ToolKind::Other] {
            assert_eq!(p.rule(k), Rule::Ask);
        }
    }
}
