//! `pier agent --sandbox strict|workspace`: the agent runs itself again inside the jail a host
//! task gets (pier-jail), so its `run_command` commands and `delegate` children, which are its
//! descendants, are inside too. This process stays outside as the jail's keeper: it serves the
//! jail's egress proxy, holds its cgroup, and passes its own stdin and stdout straight through.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::config;

/// How long the helper may take to hand over its proxy listener.
const JAIL_START: Duration = Duration::from_secs(10);

/// What the jailed agent is given that it could not read inside: the model the user's own
/// configuration (hidden with their home) chose.
pub struct Inside {
    pub level: pier_jail::Level,
    pub cwd: PathBuf,
    pub writable: Vec<PathBuf>,
    pub files: config::FileConfig,
    pub model: Option<pier_model::ModelConfig>,
    pub home: PathBuf,
}

/// Runs this same `pier agent` command line inside the jail and returns its exit code.
/// Refused, never run open, where the machine cannot build the jail.
pub async fn run(inside: Inside) -> anyhow::Result<i32> {
    let exe = std::env::current_exe().context("cannot find the running pier binary to jail it")?;
    let jailer = pier_jail::Jailer::new(&exe);
    let level = inside.level;
    if let Some(why) = jailer.kernel().refuses(level, &inside.files.limits) {
        anyhow::bail!(
            "--sandbox {level}: {why}; use --sandbox on (Landlock for commands only) or run on a machine that can"
        );
    }
    let writable =
        (!inside.writable.is_empty()).then(|| inside.writable.iter().map(|d| inside.cwd.join(d)).collect::<Vec<_>>());
    let request = pier_jail::Request {
        level,
        cwd: inside.cwd.clone(),
        roots: writable.clone().unwrap_or_default(),
        writable,
        network: inside.files.network.clone(),
        limits: inside.files.limits,
        hide: vec![inside.home.clone()],
        through_gateway: false,
    };
    let mut env = Vec::new();
    // The model as resolved here: inside, the user's configuration files are out of sight.
    // `PIER_BASE_URL` also opens the provider's host on the jail's proxy.
    if let Some(model) = &inside.model {
        env.push(("PIER_BASE_URL".to_owned(), model.base_url.clone()));
        env.push(("PIER_MODEL".to_owned(), model.model.clone()));
        if let Some(key) = &model.api_key {
            env.push(("PIER_API_KEY".to_owned(), key.expose().to_owned()));
        }
    }
    let program = pier_jail::Program { program: exe.clone(), args: inner_args(std::env::args_os()), env };
    let mut prepared = jailer.prepare(&request, &program).map_err(|e| anyhow::anyhow!("--sandbox {level}: {e}"))?;
    let mut cmd = tokio::process::Command::new(&prepared.program);
    cmd.args(&prepared.args).current_dir(&inside.cwd).kill_on_drop(true);
    prepared.configure(&mut cmd);
    pier_tools::contain::die_with_parent(cmd.as_std_mut(), nix::sys::signal::Signal::SIGKILL);
    let mut child = cmd.spawn().with_context(|| format!("cannot start the jail helper {}", exe.display()))?;
    let running = prepared.started("pier agent".into(), JAIL_START).await;
    tracing::info!(level = %level, enforces = %jailer.kernel().describe(), "pier agent runs in a jail");
    let status = tokio::select! {
        status = child.wait() => status.context("waiting for the jailed agent")?,
        () = crate::agent_cmd::terminated() => {
            // The helper is PID 1 of the jail: its end takes every process inside with it.
            if let Some(pid) = child.id() {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM);
            }
            match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
                Ok(status) => status.context("waiting for the jailed agent")?,
                Err(_) => {
                    let _ = child.kill().await;
                    child.wait().await.context("waiting for the jailed agent")?
                }
            }
        }
    };
    if let Some(breach) = running.breach() {
        tracing::error!(limit = breach.limit, "{}", breach.message);
        eprintln!("pier: {}", breach.message);
    }
    drop(running);
    Ok(status.code().unwrap_or(1))
}

/// This process's command line with `--sandbox LEVEL` turned into `--sandbox on`: inside, the
/// agent confines its commands with Landlock and does not jail itself again. `--log-file` stays
/// outside (its directory is not the jail's to write): inside, logs go to the shared stderr.
fn inner_args(args: impl Iterator<Item = OsString>) -> Vec<String> {
    let mut out = Vec::new();
    let mut args = args.skip(1).map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = args.next() {
        if arg == "--sandbox" || arg == "--log-file" {
            args.next();
        } else if !arg.starts_with("--sandbox=") && !arg.starts_with("--log-file=") {
            out.push(arg);
        }
    }
    out.extend(["--sandbox".to_owned(), "on".to_owned()]);
    out
}

#[cfg(test)]
mod tests {
    use super::inner_args;

    fn args(v: &[&str]) -> Vec<String> {
        inner_args(v.iter().map(|s| std::ffi::OsString::from(*s)))
    }

    #[test]
    fn the_sandbox_flag_becomes_on_inside_and_nothing_else_changes() {
        assert_eq!(
            args(&["pier", "agent", "--sandbox", "strict", "--profile", "editor"]),
            ["agent", "--profile", "editor", "--sandbox", "on"]
        );
        assert_eq!(args(&["pier", "--log-file", "x", "agent", "--sandbox=workspace"]), ["agent", "--sandbox", "on"]);
    }
}
