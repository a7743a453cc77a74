//! How a run's options and an agent's command and definition are shown (`Debug`: logs,
//! panics) without what can hold a secret: the agent's environment by names only, MCP servers
//! by name and transport (no headers, no environment: the host's own endpoint carries an
//! attempt's token), whether there is a `_meta`. Arguments are shown, but the value of one
//! whose flag names a secret (`--api-key=…`, `--token …`).

use std::fmt;

use agent_client_protocol_schema::v1::McpServer;

use crate::registry::{AgentCommand, AgentDef};
use crate::run::RunOptions;

impl fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunOptions")
            .field("agent", &self.agent)
            .field("cwd", &self.cwd)
            .field("allow_dirs", &self.allow_dirs)
            .field("fs", &self.fs)
            .field("terminal", &self.terminal)
            .field("policy", &self.policy)
            .field("interactive", &self.interactive)
            .field("echo_stderr", &self.echo_stderr)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_time", &self.max_time)
            .field("cancel_grace", &self.cancel_grace)
            .field("setup_timeout", &self.setup_timeout)
            .field("asker", &self.asker.is_some())
            .field("writable", &self.writable)
            .field("confinement", &self.confinement)
            .field("jail", &self.jail)
            .field("session_ids", &self.session_ids.is_some())
            .field("meta", &self.meta.is_some())
            .field("mcp_servers", &McpNames(&self.mcp_servers))
            .field("host_mcp_servers", &McpNames(&self.host_mcp_servers))
            .finish()
    }
}

impl fmt::Debug for AgentCommand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentCommand")
            .field("name", &self.name)
            .field("program", &self.program)
            .field("args", &pier_jail::shown::Args(&self.args))
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("env_remove", &self.env_remove)
            .field("guarded", &self.guarded)
            .finish()
    }
}

impl fmt::Debug for AgentDef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentDef")
            .field("command", &self.command)
            .field("args", &pier_jail::shown::Args(&self.args))
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// MCP servers by name and transport.
struct McpNames<'a>(&'a [McpServer]);

impl fmt::Debug for McpNames<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|s| match s {
                McpServer::Stdio(s) => format!("{} (stdio)", s.name),
                McpServer::Http(s) => format!("{} (http)", s.name),
                McpServer::Sse(s) => format!("{} (sse)", s.name),
                _ => "(another transport)".to_owned(),
            }))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use agent_client_protocol_schema::v1::{EnvVariable, HttpHeader, McpServerHttp, McpServerStdio};

    use super::*;

    /// The agent's keys, an MCP server's headers (the host's endpoint token) and environment
    /// never reach a log or a panic through `Debug`; their names do.
    #[test]
    fn debug_shows_no_secret_of_the_agent_or_its_mcp_servers() {
        let agent = AgentCommand {
            name: "a".into(),
            program: "/bin/a".into(),
            args: Vec::new(),
            env: vec![("OPENAI_API_KEY".into(), "sk-agent-secret".into())],
            env_remove: Vec::new(),
            guarded: false,
        };
        let header = HttpHeader::new("Authorization".to_owned(), "Bearer mcp-secret".to_owned());
        let http = McpServer::Http(McpServerHttp::new("pier", "http://127.0.0.1:9/mcp").headers(vec![header]));
        let env = EnvVariable::new("TOKEN".to_owned(), "env-secret".to_owned());
        let stdio = McpServer::Stdio(McpServerStdio::new("tools", "/bin/t").env(vec![env]));
        let opts = RunOptions {
            agent,
            cwd: "/".into(),
            allow_dirs: Vec::new(),
            fs: true,
            terminal: true,
            policy: crate::policy::ClientPolicy::default(),
            interactive: false,
            echo_stderr: false,
            idle_timeout: None,
            max_time: None,
            cancel_grace: Duration::from_secs(1),
            setup_timeout: Duration::from_secs(1),
            asker: None,
            writable: None,
            confinement: pier_tools::Confinement::off(),
            jail: None,
            session_ids: None,
            meta: None,
            mcp_servers: vec![stdio],
            host_mcp_servers: vec![http],
        };
        let args = ["--model", "m", "--api-key=sk-arg-secret", "--Token", "tok-arg-secret", "-v"].map(String::from);
        let def = AgentDef { command: "a".into(), args: args.into(), env: [("K".into(), "def-secret".into())].into() };
        let shown = format!("{opts:?} {def:?}");
        for secret in ["sk-agent-secret", "mcp-secret", "env-secret", "def-secret", "sk-arg-secret", "tok-arg-secret"] {
            assert!(!shown.contains(secret), "{secret} shown: {shown}");
        }
        for name in
            ["OPENAI_API_KEY", "pier (http)", "tools (stdio)", "\"--model\", \"m\"", "--api-key=<redacted>", "\"-v\""]
        {
            assert!(shown.contains(name), "{name} not shown: {shown}");
        }
    }
}
