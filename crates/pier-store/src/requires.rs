//! The requirement words a task may name (`requires`): what an ACP agent must offer in its
//! `initialize` answer, or what a pull worker must have. They live with the plan, which
//! refuses a word no check could ever meet.

use serde_json::Value;

/// The requirement words of ACP agents, and where each is in an `initialize` answer.
/// (`elicitation`, that the agent's questions are answered, is the host's own: pier's client
/// serves form elicitation, so it always holds.)
pub const REQUIREMENTS: &[(&str, &str)] = &[
    ("image", "/agentCapabilities/promptCapabilities/image"),
    ("audio", "/agentCapabilities/promptCapabilities/audio"),
    ("embedded_context", "/agentCapabilities/promptCapabilities/embeddedContext"),
    ("load_session", "/agentCapabilities/loadSession"),
    ("mcp_http", "/agentCapabilities/mcpCapabilities/http"),
];

/// Whether `agent` names pull workers (`worker` or `worker:CAPABILITY`) rather than an ACP
/// agent the host starts: the one place that rule is written.
pub fn is_worker(agent: &str) -> bool {
    worker_capability(agent).is_some()
}

/// The capability a pull-worker agent names (`""` for plain `worker`); `None` for an ACP agent.
pub fn worker_capability(agent: &str) -> Option<&str> {
    if agent == "worker" { Some("") } else { agent.strip_prefix("worker:") }
}

/// The requirements of `t` no check could ever meet: unknown words (for an ACP agent) or
/// empty ones.
pub fn unknown_requirements(agent: &str, requires: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for r in requires {
        if r.trim().is_empty() {
            out.push("an empty requirement".to_owned());
        } else if !is_worker(agent) && r != "elicitation" && !REQUIREMENTS.iter().any(|(w, _)| w == r) {
            let mut known: Vec<&str> = REQUIREMENTS.iter().map(|(w, _)| *w).collect();
            known.push("elicitation");
            out.push(format!("unknown requirement `{r}`; an agent can be required to offer {}", known.join(", ")));
        }
    }
    out
}

/// The requirements an agent whose `initialize` answer is `init` does not meet, each with
/// where the answer says so.
pub fn missing(init: &Value, requires: &[String]) -> Vec<(String, &'static str)> {
    requires
        .iter()
        .filter_map(|r| {
            let (_, pointer) = REQUIREMENTS.iter().find(|(w, _)| w == r)?;
            let offered = init.pointer(pointer).and_then(Value::as_bool).unwrap_or(false);
            (!offered).then(|| (r.clone(), *pointer))
        })
        .collect()
}
