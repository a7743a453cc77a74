//! `pier agent`: serve ACP on stdio.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pier_acp::{Connection, ConnectionConfig};
use pier_agent::{AcpAgent, AgentHandler, AgentOptions, NamedModel, Profile};
use pier_engine::{Engine, EngineConfig};
use pier_model::{ModelProvider, OpenAiProvider, Unconfigured};
use pier_tools::Toolbox;

use crate::config::{self, ModelFlags, PermissionFlags, ProcessEnv};

#[derive(Debug, Clone, Copy, clap::ValueEnum, Default)]
pub enum ProfileArg {
    /// Fresh text sessions, committed assistant text only (seed 003)
    #[default]
    Automation,
    /// Everything an editor shows: deltas, tool calls with diffs, plans, modes, sessions that reopen, MCP
    Editor,
}

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// Which ACP surface to offer [default: automation, or `profile` in pier.toml]
    #[arg(long, value_enum)]
    profile: Option<ProfileArg>,
    #[command(flatten)]
    model: ModelFlags,
    #[command(flatten)]
    permissions: PermissionFlags,
    /// Model requests allowed in one turn before it ends with max_turn_requests [default: 64]
    #[arg(long)]
    max_turn_requests: Option<u32>,
    /// Longest accepted JSON-RPC frame in bytes
    #[arg(long, default_value_t = pier_acp::frame::DEFAULT_MAX_FRAME_BYTES)]
    max_frame_bytes: usize,
    /// The only directories writes may land in (repeatable): tools' writes elsewhere are
    /// refused and commands may write only there and in the temp dir [default: the session's roots]
    #[arg(long, value_name = "DIR")]
    writable: Vec<std::path::PathBuf>,
    /// `on`: commands' writes confined to the session's roots and the temp dir with Landlock;
    /// `strict`: the agent itself, its commands and its subagents run in a jail (files beneath
    /// the working directory and --writable, network only through pier's proxy to the model's
    /// host and pier.toml's `network`, processes, `[limits]`), as a host task does; `workspace`:
    /// the jail for files only; `off`: nothing [default: on, or `sandbox = "off"` in pier.toml]
    #[arg(long, value_enum)]
    sandbox: Option<config::SandboxArg>,
    #[command(flatten)]
    subagents: SubagentFlags,
    /// Do not tell the model the metadata of the task a host runs a session for
    /// (`_meta["pier.dev/task"]`) [default: told, or `task_context` in pier.toml]
    #[arg(long)]
    no_task_context: bool,
}

/// The `delegate` tool's flags.
#[derive(Debug, clap::Args)]
struct SubagentFlags {
    /// Offer the `delegate` tool: hand work to other ACP agents as subagents [default: on in the
    /// editor profile, off in automation, or `subagents` in pier.toml]
    #[arg(long, overrides_with = "no_subagents")]
    subagents: bool,
    /// Do not offer the `delegate` tool
    #[arg(long)]
    no_subagents: bool,
    /// This agent's depth in a chain of subagents; a parent pier starts its children with its own + 1
    #[arg(long, default_value_t = 0, value_name = "N")]
    subagent_depth: u32,
    /// Depth at which `delegate` is no longer offered [default: 2, or `max_subagent_depth` in pier.toml]
    #[arg(long, value_name = "N")]
    max_subagent_depth: Option<u32>,
    /// Most delegate calls of one model message that run at once [default: 4, or `max_subagents`]
    #[arg(long, value_name = "N")]
    max_subagents: Option<usize>,
    /// How long a cancelled subagent gets to confirm before its process group is ended
    /// (at most 4000: a cancelled tool gets 5 s in all to stop)
    #[arg(long, default_value_t = 2000, value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=4000))]
    cancel_grace_ms: u64,
}

/// Serves ACP on stdio; returns the exit code.
pub async fn run(args: AgentArgs) -> anyhow::Result<i32> {
    let env = ProcessEnv;
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    let files = config::load_files(&env, &cwd)?;
    let home = config::pier_home(&env)?;
    if let Some(level) = args.sandbox.and_then(config::SandboxArg::jail) {
        let model = if config::wants_local(&args.model, &env) {
            None
        } else {
            config::resolve_model(&args.model, &env, &files)?
        };
        let inside = crate::agent_jail::Inside { level, cwd, writable: args.writable.clone(), files, model, home };
        return crate::agent_jail::run(inside).await;
    }
    let (model, local) = choose_model(&args.model, &env, &files, &home)?;
    tracing::info!(model = %model.describe(), home = %home.display(), "pier agent starting");
    let mut engine_config = engine_config(&args, &files, home, &cwd);
    let policy = config::resolve_policy(&files, &args.permissions)?;
    let profile = match (args.profile, files.profile.as_deref()) {
        (Some(ProfileArg::Editor), _) | (None, Some("editor")) => Profile::Editor,
        (Some(ProfileArg::Automation), _) | (None, None | Some("automation")) => Profile::Automation,
        (None, Some(other)) => anyhow::bail!("unknown profile `{other}` in pier.toml; expected automation or editor"),
    };
    let mut limits = config::resolve_limits(&files);
    limits.confinement = config::resolve_confinement(&files, args.sandbox)?;
    // Without cgroups, this also makes pier a child subreaper before any command runs.
    tracing::info!(confinement = %pier_tools::contain::describe(&limits.confinement), "commands");
    let mut cancel_subagent: Option<pier_agent::CancelSubagent> = None;
    // The embedded model cannot drive tool calls: it gets none, and a plain system prompt.
    let toolbox = if local {
        if engine_config.system_prompt.is_none() {
            engine_config.system_prompt =
                Some("You are a helpful assistant. Answer briefly and accurately.".to_owned());
        }
        Arc::new(Toolbox::empty())
    } else {
        let confinement = limits.confinement.clone();
        let toolbox = Toolbox::builtin(limits);
        match subagents(&args, &files, profile, &policy, &engine_config, confinement, &env)? {
            Some(config) => {
                tracing::info!(depth = args.subagents.subagent_depth, "subagents: the delegate tool is offered");
                let children = config.children.clone();
                cancel_subagent = Some(Arc::new(move |id: &str| children.cancel(id)));
                Arc::new(toolbox.with(Arc::new(pier_subagent::Delegate::new(config))))
            }
            None => Arc::new(toolbox),
        }
    };
    let engine = Engine::new(engine_config, model, toolbox, policy);
    let mut options = agent_options(&args, &files, profile, local, &env)?;
    options.cancel_subagent = cancel_subagent;
    tracing::info!(profile = profile.name(), "profile");
    let agent = AcpAgent::with_options(engine, options);
    let (stdin, stdout) = pier_acp::stdio::streams();
    let conn_config = ConnectionConfig { max_frame_bytes: args.max_frame_bytes, ..ConnectionConfig::default() };
    let conn = Connection::spawn(stdin, stdout, Arc::new(AgentHandler(agent.clone())), conn_config);

    let reason = tokio::select! {
        reason = conn.closed() => reason,
        () = terminated() => {
            tracing::info!("terminated by signal; closing");
            conn.close().await
        }
    };
    tracing::info!(?reason, "connection closed");
    if tokio::time::timeout(Duration::from_secs(10), agent.shutdown()).await.is_err() {
        tracing::error!("sessions did not close within 10 s");
    }
    Ok(0)
}

/// The engine's settings from the flags and pier.toml.
fn engine_config(args: &AgentArgs, files: &config::FileConfig, home: PathBuf, cwd: &std::path::Path) -> EngineConfig {
    let mut engine_config = EngineConfig::new(home);
    if let Some(n) = args.max_turn_requests.or(files.max_turn_requests) {
        engine_config.max_turn_requests = n;
    }
    engine_config.system_prompt = files.system_prompt.clone();
    if !args.writable.is_empty() {
        engine_config.writable = Some(args.writable.iter().map(|d| cwd.join(d)).collect());
    }
    engine_config
}

/// The ACP agent's options: profile, task context, mode, and (with a remote model) the
/// models a session may switch between.
fn agent_options(
    args: &AgentArgs,
    files: &config::FileConfig,
    profile: Profile,
    local: bool,
    env: &dyn config::Env,
) -> anyhow::Result<AgentOptions> {
    let mut options = AgentOptions::new(profile);
    options.task_context = !args.no_task_context && files.task_context.unwrap_or(true);
    // This binary's `subagent-guard` leads each stdio MCP server's tree, as it does a subagent's;
    // its `command-guard` runs a command in a client's terminal confined as a local one.
    options.mcp_guard = std::env::current_exe().ok();
    options.terminal_guard = std::env::current_exe().ok();
    if let Some(mode) = &files.mode {
        options.mode = mode.parse().map_err(|e: String| anyhow::anyhow!("{e} (the `mode` setting of pier.toml)"))?;
    }
    if !local {
        options.vision = config::resolve_vision(&args.model, env, files);
        let (chosen, named) = config::named_models(&args.model, env, files)?;
        for (name, mut config, vision) in named {
            config.vision = vision;
            options.models.push(NamedModel { name, provider: Arc::new(OpenAiProvider::new(config)?), vision });
        }
        options.default_model = chosen.filter(|c| options.models.iter().any(|m| &m.name == c));
    }
    Ok(options)
}

/// The `delegate` tool's configuration, when this agent offers it: subagents are on
/// (flag, file, or the editor profile's default) and the depth is below the limit.
fn subagents(
    args: &AgentArgs,
    files: &config::FileConfig,
    profile: Profile,
    policy: &pier_engine::PermissionPolicy,
    engine: &EngineConfig,
    confinement: pier_tools::Confinement,
    env: &dyn config::Env,
) -> anyhow::Result<Option<pier_subagent::SubagentConfig>> {
    let flags = &args.subagents;
    let on = if flags.subagents {
        true
    } else if flags.no_subagents {
        false
    } else {
        files.subagents.unwrap_or(matches!(profile, Profile::Editor))
    };
    let max_depth = flags.max_subagent_depth.or(files.max_subagent_depth).unwrap_or(2);
    if !on || flags.subagent_depth >= max_depth {
        return Ok(None);
    }
    let max_concurrent = flags.max_subagents.or(files.max_subagents).unwrap_or(4).max(1);
    let pier_exe = std::env::current_exe().context("cannot find the running pier binary to start subagents")?;
    let own_args = own_child_args(args, files, policy, engine, &confinement, max_depth, max_concurrent);
    let own = pier_client::AgentCommand {
        name: "pier".into(),
        program: pier_exe.clone(),
        args: own_args,
        env: vec![],
        env_remove: vec![],
        guarded: false,
    };
    Ok(Some(pier_subagent::SubagentConfig {
        agents: files.agents.clone(),
        pier_exe,
        path: env.var("PATH"),
        own,
        max_concurrent,
        cancel_grace: Duration::from_millis(flags.cancel_grace_ms),
        setup_timeout: Duration::from_secs(60),
        writable: engine.writable.clone(),
        confinement,
        children: Default::default(),
    }))
}

/// The default child's arguments: pier's own agent, automation profile, this agent's model
/// and rules, one level deeper.
fn own_child_args(
    args: &AgentArgs,
    files: &config::FileConfig,
    policy: &pier_engine::PermissionPolicy,
    engine: &EngineConfig,
    confinement: &pier_tools::Confinement,
    max_depth: u32,
    max_concurrent: usize,
) -> Vec<String> {
    let flags = &args.subagents;
    let mut own_args: Vec<String> = vec!["agent".into(), "--profile".into(), "automation".into()];
    for (flag, value) in
        [("--provider", &args.model.provider), ("--base-url", &args.model.base_url), ("--model", &args.model.model)]
    {
        if let Some(v) = value {
            own_args.extend([flag.to_owned(), v.clone()]);
        }
    }
    // The child asks this agent about everything this agent's policy does not allow
    // outright; reads stay local. This agent's mode and remembered answers then decide.
    for kind in pier_tools::ToolKind::ALL {
        let reads =
            matches!(kind, pier_tools::ToolKind::Read | pier_tools::ToolKind::Search | pier_tools::ToolKind::Think);
        let flag = match policy.decide(kind) {
            pier_engine::Decision::Deny => "--deny",
            pier_engine::Decision::Allow if reads => "--allow",
            _ => "--ask",
        };
        own_args.extend([flag.to_owned(), kind.as_str().to_owned()]);
    }
    if let Some(n) = args.max_turn_requests.or(files.max_turn_requests) {
        own_args.extend(["--max-turn-requests".into(), n.to_string()]);
    }
    for dir in engine.writable.iter().flatten() {
        own_args.extend(["--writable".into(), dir.display().to_string()]);
    }
    if !confinement.landlock {
        own_args.extend(["--sandbox".into(), "off".into()]);
    }
    own_args.extend([
        "--subagents".into(),
        "--subagent-depth".into(),
        (flags.subagent_depth + 1).to_string(),
        "--max-subagent-depth".into(),
        max_depth.to_string(),
        "--max-subagents".into(),
        max_concurrent.to_string(),
        "--cancel-grace-ms".into(),
        flags.cancel_grace_ms.to_string(),
    ]);
    own_args
}

pub(crate) async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// The model provider: a configured endpoint wins; `--model local` (or `PIER_MODEL=local`)
/// forces the embedded model, which is also the default when nothing is configured and it
/// is installed. Returns whether the embedded model was chosen.
pub fn choose_model(
    flags: &ModelFlags,
    env: &dyn config::Env,
    files: &config::FileConfig,
    home: &std::path::Path,
) -> anyhow::Result<(Arc<dyn ModelProvider>, bool)> {
    let wants_local = config::wants_local(flags, env);
    if !wants_local && let Some(mut c) = config::resolve_model(flags, env, files)? {
        // Tools' images reach the model only where it takes them, as a prompt's do.
        c.vision = config::resolve_vision(flags, env, files);
        return Ok((Arc::new(OpenAiProvider::new(c)?), false));
    }
    #[cfg(feature = "local")]
    {
        let named = config::named_local_model(env, files);
        // A file someone named and got wrong is an error, not a quiet fall back to no model.
        if let Some((path, source)) = &named
            && !path.is_file()
        {
            anyhow::bail!(
                "the embedded model file {} ({source}) does not exist; fix the path, or unset it and run `pier models install`",
                path.display()
            );
        }
        let path = named
            .map(|(p, _)| p)
            .unwrap_or_else(|| pier_model::local::model_path(home, pier_model::local::DEFAULT_MODEL));
        if wants_local || path.is_file() {
            tracing::info!(model = %path.display(), "using the embedded model");
            let mut local = pier_model::local::LocalConfig::new(path);
            local.max_tokens = files.providers.get("local").and_then(|t| t.max_tokens);
            return Ok((Arc::new(pier_model::local::LocalProvider::new(local)), true));
        }
    }
    let _ = home;
    tracing::warn!("no model is configured; prompts will fail until one is: {}", pier_model::CONFIGURE_HINT);
    Ok((Arc::new(Unconfigured), false))
}
