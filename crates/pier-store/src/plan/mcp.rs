//! MCP servers a plan gives its tasks' agents: seed 001's second stack (ACP outside, for the
//! scheduling; MCP inside, for the tools). The host passes them in `session/new` to an agent
//! that takes them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One server: stdio (`command`, `args`, `env`) or HTTP (`url`, and headers whose values the
/// host reads from its own environment when an attempt starts, so that no secret is stored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// A header's name → the name of the host's environment variable holding its value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers_env: BTreeMap<String, String>,
}

/// `later` over `earlier`: a server of the same name is replaced, the rest add up.
pub(super) fn merged(earlier: &[McpServerSpec], later: Vec<McpServerSpec>) -> Vec<McpServerSpec> {
    let mut out: Vec<McpServerSpec> =
        earlier.iter().filter(|e| !later.iter().any(|l| l.name == e.name)).cloned().collect();
    out.extend(later);
    out
}

/// What is wrong with a task's servers, each said once.
/// The name of the host's own MCP endpoint among an agent's servers (`pier_host::host_mcp`).
pub const HOST_SERVER: &str = "pier";

pub(super) fn problems(servers: &[McpServerSpec]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, s) in servers.iter().enumerate() {
        let name = &s.name;
        if name.trim().is_empty() {
            out.push("an MCP server has an empty name".to_owned());
        } else if name == HOST_SERVER {
            out.push(format!(
                "MCP server `{name}`: that name is the host's own MCP endpoint's (`pier serve` gives it to every agent); give the server another name"
            ));
        } else if servers[..i].iter().any(|o| &o.name == name) {
            out.push(format!("MCP server `{name}` is named twice"));
        }
        match (&s.command, &s.url) {
            (Some(_), Some(_)) => out.push(format!("MCP server `{name}` gives both `command` and `url`; give one")),
            (None, None) => out.push(format!(
                "MCP server `{name}` gives neither `command` (a stdio server) nor `url` (an HTTP server)"
            )),
            (Some(c), None) if c.trim().is_empty() => out.push(format!("MCP server `{name}` has an empty command")),
            (Some(_), None) if !s.headers_env.is_empty() => {
                out.push(format!("MCP server `{name}`: `headers_env` is for an HTTP server (`url`)"))
            }
            (None, Some(u)) if !(u.starts_with("http://") || u.starts_with("https://")) => {
                out.push(format!("MCP server `{name}`: url `{u}` is not http:// or https://"))
            }
            (None, Some(_)) if !s.args.is_empty() || !s.env.is_empty() => {
                out.push(format!("MCP server `{name}`: `args` and `env` are for a stdio server (`command`)"))
            }
            _ => {}
        }
    }
    out
}
