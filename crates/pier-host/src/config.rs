//! How a host runs tasks ([`HostConfig`]), and the one way the host's code calls the store,
//! whose calls block, from async code ([`blocking`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pier_client::AgentDef;
use pier_jail::{Jailer, Level, Limits};
use pier_store::{StoreError, TaskSpec, TaskStore};

/// How the host runs tasks.
#[derive(Debug, Clone)]
pub struct HostConfig {
    pub pier_exe: PathBuf,
    pub agents: BTreeMap<String, AgentDef>,
    /// Relative task `cwd`s are resolved against it (the plan's directory).
    pub base_dir: PathBuf,
    pub concurrency: usize,
    /// This host's identity in leases: `HOST:PID:RANDOM`.
    pub owner: String,
    /// This host's name among `pier serve` nodes (run leases, `GET /nodes`): `--node-id`,
    /// by default `HOST-PID`.
    pub node: String,
    pub lease_ttl: Duration,
    pub retry_base: Duration,
    pub cancel_grace: Duration,
    pub default_idle_timeout: Duration,
    /// How agents are confined when their task does not say.
    pub sandbox: SandboxConfig,
    /// The model gateway agents' model traffic goes through (`None`: agents call their
    /// providers themselves, with the keys pier's environment gives them, and spend is unknown).
    pub gateway: Option<crate::gateway::GatewayConfig>,
    /// The task types every plan may use (pier.toml's `[types]`).
    pub types: pier_store::plan::Shared,
    /// The host's own MCP endpoint, given to every attempt's agent that takes HTTP MCP servers
    /// (`pier serve`); `None` where nothing serves it (`pier run`, a pull worker).
    pub mcp: Option<crate::host_mcp::HostMcp>,
}

/// The confinement of a host's agents (pier.toml's `[sandbox]` and `[limits]`), and the
/// jailer that applies it.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// The level of tasks that give none: strict unless pier.toml says otherwise.
    pub level: Level,
    /// Hosts every task's agent may reach, besides the model providers' and the task's own.
    pub network: Vec<String>,
    /// Limits of every attempt, under the task's own.
    pub limits: Limits,
    /// pier's own state (its home, the store's files, the token): never visible to an agent.
    pub hide: Vec<PathBuf>,
    pub jailer: Jailer,
}

impl SandboxConfig {
    /// Strict, no extra hosts, no limits; probes this machine once (`pier_exe jail --probe`).
    pub fn new(pier_exe: &std::path::Path) -> SandboxConfig {
        let hide = std::env::var_os("PIER_HOME").map(PathBuf::from).into_iter().collect();
        SandboxConfig {
            level: Level::Strict,
            network: Vec::new(),
            limits: Limits::default(),
            hide,
            jailer: Jailer::new(pier_exe),
        }
    }

    /// The level, hosts and limits an attempt of `spec` runs with.
    pub fn for_task(&self, spec: &TaskSpec) -> (Level, Vec<String>, Limits) {
        let mut network = self.network.clone();
        network.extend(spec.network.iter().cloned());
        (spec.sandbox.unwrap_or(self.level), network, self.limits.overlaid(spec.limits))
    }

    /// Why `spec` cannot run confined as it asks on this machine, if it cannot (checked at
    /// submit): never run open instead.
    pub fn refuses(&self, spec: &TaskSpec) -> Option<String> {
        if spec.is_worker() {
            return None;
        }
        let (level, _, limits) = self.for_task(spec);
        self.jailer.kernel().refuses(level, &limits)
    }

    /// How an attempt of `spec` is confined, in one line for `pier show` and `GET /runs/…/tasks/…`.
    pub fn describe_task(&self, spec: &TaskSpec) -> String {
        if spec.is_worker() {
            return "as its pull worker confines it".into();
        }
        let (level, network, limits) = self.for_task(spec);
        let mut out = level.to_string();
        if level == Level::Strict && !network.is_empty() {
            out.push_str(&format!("; network also to {}", network.join(", ")));
        }
        if level != Level::Off {
            out.push_str(&format!("; {limits}; this machine enforces {}", self.jailer.kernel().describe()));
        }
        out
    }

    /// One line for the start-up log and `GET /agents`: the default level and what this machine enforces.
    pub fn describe(&self) -> String {
        format!("sandbox {} by default; this machine enforces: {}", self.level, self.jailer.kernel().describe())
    }
}

impl HostConfig {
    /// A host of `pier_exe` with the agents `agents` (pier.toml's), resolving relative task
    /// directories against `base_dir`; the rest as `pier run` has it by default.
    pub fn new(pier_exe: PathBuf, agents: BTreeMap<String, AgentDef>, base_dir: PathBuf) -> HostConfig {
        HostConfig {
            agents,
            base_dir,
            concurrency: 4,
            owner: HostConfig::owner_id(),
            node: HostConfig::node_id(),
            lease_ttl: Duration::from_secs(15),
            retry_base: Duration::from_secs(1),
            cancel_grace: Duration::from_secs(5),
            default_idle_timeout: Duration::from_secs(600),
            sandbox: SandboxConfig::new(&pier_exe),
            gateway: None,
            types: pier_store::plan::Shared::default(),
            mcp: None,
            pier_exe,
        }
    }

    pub fn owner_id() -> String {
        format!("{}:{}:{}", hostname(), std::process::id(), uuid::Uuid::new_v4().simple())
    }

    pub fn node_id() -> String {
        format!("{}-{}", hostname(), std::process::id())
    }
}

/// This machine's name, read once: lease owners are `HOST:PID:RANDOM`.
pub(crate) fn hostname() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_owned())
}

/// Counts by state at the end of a run.
pub type Summary = BTreeMap<&'static str, usize>;

pub(crate) async fn blocking<T: Send + 'static>(
    store: &Arc<dyn TaskStore>,
    f: impl FnOnce(&dyn TaskStore) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || f(store.as_ref()))
        .await
        .map_err(|e| StoreError::Db(format!("store worker: {e}")))?
}
