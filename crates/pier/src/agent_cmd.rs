//! `pier agent`: serve ACP on stdio.

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
    /// Confine commands' writes to the session's roots and the temp dir with Landlock [default: on, or `sandbox` in pier.toml]
    #[arg(long, value_enum)]
    sandbox: Option<config::SandboxArg>,
}

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    let env = ProcessEnv;
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    let files = config::load_files(&env, &cwd)?;
    let home = config::pier_home(&env)?;
    let (model, local) = choose_model(&args.model, &env, &files, &home)?;
    tracing::info!(model = %model.describe(), home = %home.display(), "pier agent starting");
    let mut engine_config = EngineConfig::new(home);
    if let Some(n) = args.max_turn_requests.or(files.max_turn_requests) {
        engine_config.max_turn_requests = n;
    }
    engine_config.system_prompt = files.system_prompt.clone();
    if !args.writable.is_empty() {
        let dirs = args.writable.iter().map(|d| cwd.join(d)).collect();
        engine_config.writable = Some(dirs);
    }
    let policy = config::resolve_policy(&files, &args.permissions)?;
    let mut limits = config::resolve_limits(&files);
    limits.confinement = config::resolve_confinement(&files, args.sandbox)?;
    // Without cgroups, this also makes pier a child subreaper before any command runs.
    tracing::info!(confinement = %pier_tools::contain::describe(&limits.confinement), "commands");
    // The embedded model cannot drive tool calls: it gets none, and a plain system prompt.
    let toolbox = if local {
        if engine_config.system_prompt.is_none() {
            engine_config.system_prompt =
                Some("You are a helpful assistant. Answer briefly and accurately.".to_owned());
        }
        Arc::new(Toolbox::empty())
    } else {
        Arc::new(Toolbox::builtin(limits))
    };
    let engine = Engine::new(engine_config, model, toolbox, policy);
    let profile = match (args.profile, files.profile.as_deref()) {
        (Some(ProfileArg::Editor), _) | (None, Some("editor")) => Profile::Editor,
        (Some(ProfileArg::Automation), _) | (None, None | Some("automation")) => Profile::Automation,
        (None, Some(other)) => anyhow::bail!("unknown profile `{other}` in pier.toml; expected automation or editor"),
    };
    let mut options = AgentOptions::new(profile);
    if let Some(mode) = &files.mode {
        options.mode = mode.parse().map_err(|e: String| anyhow::anyhow!("{e} (the `mode` setting of pier.toml)"))?;
    }
    if !local {
        options.vision = config::resolve_vision(&args.model, &env, &files);
        let (chosen, named) = config::named_models(&args.model, &env, &files)?;
        for (name, config, vision) in named {
            options.models.push(NamedModel { name, provider: Arc::new(OpenAiProvider::new(config)?), vision });
        }
        options.default_model = chosen.filter(|c| options.models.iter().any(|m| &m.name == c));
    }
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
    Ok(())
}

async fn terminated() {
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
    let wants_local = flags.model.as_deref() == Some("local")
        || (flags.model.is_none() && env.var("PIER_MODEL").as_deref() == Some("local"));
    if !wants_local && let Some(c) = config::resolve_model(flags, env, files)? {
        return Ok((Arc::new(OpenAiProvider::new(c)?), false));
    }
    #[cfg(feature = "local")]
    {
        let path = env
            .var("PIER_LOCAL_MODEL")
            .map(std::path::PathBuf::from)
            .or_else(|| files.local_model.clone())
            .unwrap_or_else(|| pier_model::local::model_path(home, pier_model::local::DEFAULT_MODEL));
        if wants_local || path.is_file() {
            tracing::info!(model = %path.display(), "using the embedded model");
            return Ok((
                Arc::new(pier_model::local::LocalProvider::new(pier_model::local::LocalConfig::new(path))),
                true,
            ));
        }
    }
    let _ = home;
    tracing::warn!("no model is configured; prompts will fail until one is: {}", pier_model::CONFIGURE_HINT);
    Ok((Arc::new(Unconfigured), false))
}
