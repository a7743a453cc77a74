//! `pier agent`: serve ACP on stdio.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pier_acp::{Connection, ConnectionConfig};
use pier_agent::{AcpAgent, AgentHandler, Profile};
use pier_engine::{Engine, EngineConfig};
use pier_model::{ModelProvider, OpenAiProvider, Unconfigured};
use pier_tools::Toolbox;

use crate::config::{self, ModelFlags, PermissionFlags, ProcessEnv};

#[derive(Debug, Clone, Copy, clap::ValueEnum, Default)]
pub enum ProfileArg {
    /// Fresh text sessions, committed assistant text only (seed 003)
    #[default]
    Automation,
}

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// Which ACP surface to offer
    #[arg(long, value_enum, default_value_t)]
    profile: ProfileArg,
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
}

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    let env = ProcessEnv;
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    let files = config::load_files(&env, &cwd)?;
    let home = config::pier_home(&env)?;
    let model: Arc<dyn ModelProvider> = match config::resolve_model(&args.model, &env, &files)? {
        Some(c) => Arc::new(OpenAiProvider::new(c)?),
        None => {
            tracing::warn!("no model is configured; prompts will fail until one is: {}", pier_model::CONFIGURE_HINT);
            Arc::new(Unconfigured)
        }
    };
    tracing::info!(model = %model.describe(), home = %home.display(), "pier agent starting");
    let mut engine_config = EngineConfig::new(home);
    if let Some(n) = args.max_turn_requests.or(files.max_turn_requests) {
        engine_config.max_turn_requests = n;
    }
    engine_config.system_prompt = files.system_prompt.clone();
    let policy = config::resolve_policy(&files, &args.permissions)?;
    let toolbox = Arc::new(Toolbox::builtin(config::resolve_limits(&files)));
    let engine = Engine::new(engine_config, model, toolbox, policy);
    let profile = match args.profile {
        ProfileArg::Automation => Profile::Automation,
    };
    let agent = AcpAgent::new(engine, profile);
    let conn_config = ConnectionConfig { max_frame_bytes: args.max_frame_bytes, ..ConnectionConfig::default() };
    let conn =
        Connection::spawn(tokio::io::stdin(), tokio::io::stdout(), Arc::new(AgentHandler(agent.clone())), conn_config);

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
