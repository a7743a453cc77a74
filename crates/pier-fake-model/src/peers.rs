//! How the third-party ACP agents (codex-acp, claude-agent-acp, gemini-cli) run offline
//! against this fake: the environment and files that send each one's model traffic to
//! it in its provider's API, with telemetry and updates off. Used by the interop run
//! (`crates/pier/examples/interop.rs`) and by tests that drive these agents.

use std::path::Path;

use serde_json::json;

/// A peer's command line and the environment it needs.
pub struct Setup {
    pub command: String,
    pub env: Vec<(String, String)>,
}

/// Prepares `agent` (`codex`, `claude` or `gemini`, installed in `bin`, npm's
/// `node_modules/.bin`) to talk to the fake at `base` (its `base_url()`); its home and
/// configuration go under `scratch`.
pub fn setup(agent: &str, bin: &Path, scratch: &Path, base: &str) -> std::io::Result<Setup> {
    let env = env(agent, scratch, base)?;
    let command = match agent {
        "codex" => bin.join("codex-acp").display().to_string(),
        "claude" => bin.join("claude-agent-acp").display().to_string(),
        _ => format!("{} --acp", bin.join("gemini").display()),
    };
    Ok(Setup { command, env })
}

/// The environment (and files under `scratch`) that points `agent` at the fake at `base`.
pub fn env(agent: &str, scratch: &Path, base: &str) -> std::io::Result<Vec<(String, String)>> {
    let home = scratch.join("home");
    std::fs::create_dir_all(&home)?;
    let mut env = vec![("HOME".to_owned(), home.display().to_string())];
    let root = base.trim_end_matches("/v1").to_owned();
    match agent {
        "codex" => {
            let codex_home = scratch.join("codex-home");
            std::fs::create_dir_all(&codex_home)?;
            std::fs::write(
                codex_home.join("config.toml"),
                format!(
                    "model = \"fake-model\"\nmodel_provider = \"fake\"\napproval_policy = \"untrusted\"\n\
                     sandbox_mode = \"danger-full-access\"\n\n[model_providers.fake]\nname = \"fake\"\n\
                     base_url = \"{base}\"\nenv_key = \"FAKE_API_KEY\"\nwire_api = \"responses\"\n"
                ),
            )?;
            env.push(("CODEX_HOME".into(), codex_home.display().to_string()));
            env.push(("FAKE_API_KEY".into(), "fake-key".into()));
        }
        "claude" => {
            let cfg = scratch.join("claude-config");
            std::fs::create_dir_all(&cfg)?;
            for (k, v) in [
                ("IS_SANDBOX", "1"),
                ("ANTHROPIC_BASE_URL", root.as_str()),
                ("ANTHROPIC_API_KEY", "fake-key"),
                ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
                ("DISABLE_TELEMETRY", "1"),
                ("DISABLE_AUTOUPDATER", "1"),
            ] {
                env.push((k.into(), v.into()));
            }
            env.push(("CLAUDE_CONFIG_DIR".into(), cfg.display().to_string()));
        }
        "gemini" => {
            let dir = home.join(".gemini");
            std::fs::create_dir_all(&dir)?;
            std::fs::write(
                dir.join("settings.json"),
                json!({
                    "privacy": {"usageStatisticsEnabled": false},
                    "telemetry": {"enabled": false},
                    "general": {"disableAutoUpdate": true, "disableUpdateNag": true},
                    "security": {"folderTrust": {"enabled": false}, "auth": {"selectedType": "gemini-api-key"}},
                })
                .to_string(),
            )?;
            env.push(("GEMINI_API_KEY".into(), "fake-key".into()));
            env.push(("GOOGLE_GEMINI_BASE_URL".into(), root));
        }
        other => return Err(std::io::Error::other(format!("unknown agent {other}: codex, claude or gemini"))),
    }
    Ok(env)
}
