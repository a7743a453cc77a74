//! `pier worker`: leases tasks from a `pier serve` and runs their agents on this machine
//! (`pier_host::worker`), confined as this machine's pier.toml says.

use std::time::Duration;

use anyhow::Context;
use pier_host::HostConfig;
use pier_host::worker::WorkerConfig;

use crate::config::{self, ProcessEnv};

#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// The host's base URL [env: PIER_SERVER]
    #[arg(long)]
    server: Option<String>,
    /// The host's token [env: PIER_TOKEN; the environment keeps it out of `ps`]
    #[arg(long)]
    token: Option<String>,
    /// What it takes: tasks with `agent = "worker:CAPABILITY"` (repeat the flag for more)
    #[arg(long = "capability", value_name = "CAPABILITY", required_unless_present = "agent")]
    capabilities: Vec<String>,
    /// The agent its tasks run on: `pier`, an `[agents.NAME]` of pier.toml, or a command
    /// [default: pier]. Given, it also takes the tasks that name this agent.
    #[arg(long)]
    agent: Option<String>,
    /// Attempts at once
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Its name on the host [default: HOSTNAME-PID]
    #[arg(long)]
    name: Option<String>,
    /// How long a lease lasts without a heartbeat, in milliseconds
    #[arg(long, default_value_t = 30_000)]
    lease_ttl_ms: u64,
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let server = args
        .server
        .or_else(|| std::env::var("PIER_SERVER").ok().filter(|s| !s.is_empty()))
        .context("name the host with --server URL or PIER_SERVER")?;
    let token = args
        .token
        .or_else(|| std::env::var("PIER_TOKEN").ok().filter(|t| !t.is_empty()))
        .context("give the host's token with PIER_TOKEN (or --token)")?;
    let here = std::env::current_dir()?;
    let files = config::load_files(&ProcessEnv, &here)?;
    let mut host = HostConfig::new(std::env::current_exe()?, files.agents.clone(), here);
    crate::run_cmd::confine(&files, &mut host)?;
    // Its agents' keys stay with its own gateway; what they spend goes back with each ending.
    host.gateway = config::gateway(&files, &ProcessEnv)?;
    tracing::info!("{}", host.sandbox.describe());
    let name = args.name.unwrap_or_else(|| {
        let machine = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", machine.trim(), std::process::id())
    });
    let config = WorkerConfig {
        server,
        token,
        name: name.clone(),
        capabilities: args.capabilities,
        takes_agent_tasks: args.agent.is_some(),
        agent: args.agent.unwrap_or_else(|| "pier".into()),
        concurrency: args.concurrency.max(1),
        lease_ttl: Duration::from_millis(args.lease_ttl_ms.max(1_000)),
        host,
    };
    let (stop, signals) = crate::run_cmd::stop_on_signals_saying(
        "pier worker: stopping; running attempts are cancelled and handed back to the host",
    );
    eprintln!("pier worker: {name} takes work from {}", config.server);
    let ran = pier_host::worker::run(config, stop).await;
    signals.abort();
    ran.map_err(anyhow::Error::from)
}
