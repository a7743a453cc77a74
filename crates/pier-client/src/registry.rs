//! Which agent to run: built-in names, `[agents.NAME]` from configuration, or a command line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::ClientError;

/// An agent defined in `pier.toml` as `[agents.NAME]`. Its `Debug` shows the environment's
/// names only (`redacted.rs`).
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentDef {
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// A resolved command to start an agent. Its `Debug` shows the environment's names only
/// (`redacted.rs`): the values can be keys.
#[derive(Clone, PartialEq, Eq)]
pub struct AgentCommand {
    /// The name shown in messages: the registry name or the program.
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Variables of pier's own environment the agent must not inherit (keys the model
    /// gateway holds in its place).
    pub env_remove: Vec<String>,
    /// The program is `pier subagent-guard` leading the agent's group: the kernel sends it
    /// SIGTERM when the thread that started it dies, even by SIGKILL (`PR_SET_PDEATHSIG`),
    /// and it is ended with SIGUSR1, on which it kills the rest of its group and reaps what
    /// it adopted before it exits, so nothing of the group becomes pier's to reap. Start
    /// such an agent from a long-lived thread (a runtime worker, never a `spawn_blocking`
    /// thread, which exits when idle).
    pub guarded: bool,
}

/// The built-in agent names, their programs and how to install them.
const BUILTIN: &[(&str, &str, &[&str], &str)] = &[
    ("codex", "codex-acp", &[], "npm install -g @zed-industries/codex-acp"),
    ("claude", "claude-agent-acp", &[], "npm install -g @zed-industries/claude-agent-acp"),
    ("gemini", "gemini", &["--acp"], "npm install -g @google/gemini-cli"),
];

/// Resolves `spec`: `pier`, a built-in name, a configured name, or a command line.
/// `pier_exe` is the running pier binary; `path` is the `PATH` to search.
pub fn resolve(
    spec: &str,
    configured: &BTreeMap<String, AgentDef>,
    pier_exe: &Path,
    path: Option<&str>,
) -> Result<AgentCommand, ClientError> {
    if let Some(def) = configured.get(spec) {
        let program = find_program(&def.command, path)
            .ok_or_else(|| ClientError::usage(format!("agent `{spec}`: `{}` was not found on PATH", def.command)))?;
        return Ok(AgentCommand {
            name: spec.to_owned(),
            program,
            args: def.args.clone(),
            env: def.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            env_remove: vec![],
            guarded: false,
        });
    }
    if spec == "pier" {
        return Ok(AgentCommand {
            name: "pier".into(),
            program: pier_exe.to_owned(),
            // The editor profile: deltas reset idle timers, tool calls and diffs reach the
            // caller (and a host's evidence), and sessions can be continued.
            args: vec!["agent".into(), "--profile".into(), "editor".into()],
            env: vec![],
            env_remove: vec![],
            guarded: false,
        });
    }
    if let Some((name, program, args, install)) = BUILTIN.iter().find(|(n, ..)| *n == spec) {
        let found = find_program(program, path).ok_or_else(|| {
            ClientError::usage(format!("agent `{name}` needs `{program}` on PATH; install it with `{install}`"))
        })?;
        return Ok(AgentCommand {
            name: (*name).to_owned(),
            program: found,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            env: vec![],
            env_remove: vec![],
            guarded: false,
        });
    }
    let words = shell_words::split(spec)
        .map_err(|e| ClientError::usage(format!("cannot parse the agent command `{spec}`: {e}")))?;
    let Some((program, args)) = words.split_first() else {
        return Err(ClientError::usage("the agent command is empty"));
    };
    let found = find_program(program, path).ok_or_else(|| {
        let known: Vec<&str> = ["pier"]
            .into_iter()
            .chain(BUILTIN.iter().map(|b| b.0))
            .chain(configured.keys().map(String::as_str))
            .collect();
        ClientError::usage(format!("`{program}` is neither a known agent ({}) nor a program on PATH", known.join(", ")))
    })?;
    Ok(AgentCommand {
        name: program.clone(),
        program: found,
        args: args.to_vec(),
        env: vec![],
        env_remove: vec![],
        guarded: false,
    })
}

/// `program` itself if it contains a slash, else the first match on `path`.
fn find_program(program: &str, path: Option<&str>) -> Option<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        return p.is_file().then_some(p);
    }
    path?.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(program)).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_configs_and_command_lines() {
        let exe = Path::new("/opt/pier");
        let path = Some("/usr/bin:/bin");
        let pier = resolve("pier", &BTreeMap::new(), exe, path);
        assert_eq!(
            pier.ok().map(|c| (c.program, c.args)),
            Some((exe.to_owned(), vec!["agent".to_owned(), "--profile".to_owned(), "editor".to_owned()]))
        );
        let cmd = resolve("sh -c 'echo hi'", &BTreeMap::new(), exe, path);
        assert_eq!(cmd.ok().map(|c| c.args), Some(vec!["-c".to_owned(), "echo hi".to_owned()]));
        let missing = resolve("codex", &BTreeMap::new(), exe, Some("/nonexistent"));
        assert!(missing.is_err_and(|e| e.to_string().contains("npm install -g @zed-industries/codex-acp")));
        let unknown = resolve("no-such-agent-xyz", &BTreeMap::new(), exe, path);
        assert!(unknown.is_err_and(|e| e.to_string().contains("neither a known agent")));
        let mut configured = BTreeMap::new();
        configured.insert(
            "mine".to_owned(),
            AgentDef { command: "sh".into(), args: vec!["x".into()], env: BTreeMap::from([("K".into(), "V".into())]) },
        );
        let mine = resolve("mine", &configured, exe, path);
        assert_eq!(
            mine.ok().map(|c| (c.name, c.args, c.env)),
            Some(("mine".into(), vec!["x".into()], vec![("K".into(), "V".into())]))
        );
    }
}
