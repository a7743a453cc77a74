//! Configuration: `./pier.toml` over `~/.config/pier/config.toml`, environment over
//! files, flags over environment. Produces the model and engine settings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use pier_engine::{Decision, PermissionPolicy};
use pier_model::{ModelConfig, Secret};
use pier_tools::{Confinement, Limits, ToolKind};
use serde::Deserialize;

/// One configuration file.
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// The provider to use, by name.
    pub provider: Option<String>,
    /// `pier agent`'s profile: `automation` or `editor`.
    pub profile: Option<String>,
    /// The permission mode new editor-profile sessions start in: `read-only`, `ask`, `auto`.
    pub mode: Option<String>,
    pub max_turn_requests: Option<u32>,
    pub system_prompt: Option<String>,
    /// The embedded model's GGUF file [default: $PIER_HOME/models/smollm2.q8_0.gguf].
    pub local_model: Option<PathBuf>,
    #[serde(default)]
    pub providers: BTreeMap<String, ProviderTable>,
    /// `[permissions]`: tool kind → `allow`, `ask` or `deny`.
    #[serde(default)]
    pub permissions: BTreeMap<String, String>,
    /// `[tools]`: limits of the built-in tools.
    #[serde(default)]
    pub tools: ToolsTable,
    /// `sandbox = "strict" | "workspace" | "off"`: how `pier run` and `pier serve` confine agents
    /// whose task does not say (default strict); `"off"` also runs `pier agent`'s commands without
    /// Landlock (they still end with their turn). `"on"` is the old word for the default.
    pub sandbox: Option<String>,
    /// `network = ["host[:port]", …]`: hosts every confined agent may reach through pier's proxy,
    /// besides the model providers'.
    #[serde(default)]
    pub network: Vec<String>,
    /// `[limits]`: memory, pids and cpu of every confined agent (a task's own win).
    #[serde(default)]
    pub limits: pier_jail::Limits,
    /// The host's store: `postgres://USER@HOST/DB`, `sqlite://PATH` or a path
    /// [default: $PIER_HOME/pier.db].
    pub store: Option<String>,
    /// `pier agent` tells the model the metadata of the task a host runs a session for [default: true].
    pub task_context: Option<bool>,
    /// `pier agent` offers the `delegate` tool [default: on in the editor profile, off in automation].
    pub subagents: Option<bool>,
    /// Most delegate calls of one model message that run at once [default: 4].
    pub max_subagents: Option<usize>,
    /// Depth at which `delegate` is no longer offered (the first agent is depth 0) [default: 2].
    pub max_subagent_depth: Option<u32>,
    /// `[agents.NAME]`: agents for `pier exec --agent NAME`.
    #[serde(default)]
    pub agents: BTreeMap<String, pier_client::AgentDef>,
    /// `[client]`: `pier exec` and `pier prompt` settings.
    #[serde(default)]
    pub client: ClientTable,
    /// `gateway = false`: `pier run` and `pier serve` agents call their providers themselves,
    /// with the keys of pier's environment, and their spend is unknown [default: true].
    pub gateway: Option<bool>,
    /// `[prices."MODEL"]`: `input`, `cached_input` and `output` per million tokens.
    #[serde(default)]
    pub prices: BTreeMap<String, pier_host::gateway::Price>,
    /// `budget = { tokens = N, cost = X }`: every task's budget when its plan gives none.
    pub budget: Option<pier_host::Budget>,
    /// `run_budget = { … }`: every run's budget when its plan gives none.
    pub run_budget: Option<pier_host::Budget>,
    /// `[rate_limits."PROVIDER"]`: `rpm`, `tpm` and `hold` for the gateway, across the store's nodes.
    #[serde(default)]
    pub rate_limits: BTreeMap<String, pier_egress::gateway::RateLimit>,
    /// `[types.NAME]`: task types every plan (and `pier submit --type`) may use.
    #[serde(default)]
    pub types: BTreeMap<String, toml::Value>,
    /// `[[schedules]]`: plans (or tasks of a type) `pier serve` submits on a clock.
    #[serde(default)]
    pub schedules: Vec<toml::Table>,
    /// `[[mcp_servers]]`: MCP servers every task's agent of `pier run` and `pier serve` is given.
    #[serde(default)]
    pub mcp_servers: Vec<pier_host::plan::McpServerSpec>,
}

/// `[client]`.
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct ClientTable {
    /// `[client.permissions]`: tool kind → allow, allow_always, ask, deny or deny_always.
    #[serde(default)]
    pub permissions: BTreeMap<String, String>,
}

/// `[tools]`.
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct ToolsTable {
    /// Longest tool output sent back to the model, in bytes (default 65536).
    pub output_bytes: Option<usize>,
    /// Default `run_command` timeout (default 120000).
    pub command_timeout_ms: Option<u64>,
}

/// A named provider: `[providers.NAME]`.
#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct ProviderTable {
    pub base_url: Option<String>,
    pub model: Option<String>,
    /// The environment variable holding the key; keys never live in the file.
    pub api_key_env: Option<String>,
    pub connect_timeout_ms: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
    pub max_retries: Option<u32>,
    pub retry_base_delay_ms: Option<u64>,
    pub max_tokens: Option<u32>,
    pub stream_usage: Option<bool>,
    /// Whether the model takes images (the editor profile then accepts image prompts).
    pub vision: Option<bool>,
    /// The model's context window in tokens (default 128000), for usage meters.
    pub context_window: Option<u64>,
}

impl FileConfig {
    /// Reads a file; a missing file is an empty configuration.
    pub fn read(path: &Path) -> anyhow::Result<FileConfig> {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                toml::from_str(&text).with_context(|| format!("{} is not a valid pier configuration", path.display()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FileConfig::default()),
            Err(e) => Err(e).with_context(|| format!("could not read {}", path.display())),
        }
    }

    /// `self` overridden by `over`, field by field; provider tables merge by name.
    pub fn merged(mut self, over: FileConfig) -> FileConfig {
        self.provider = over.provider.or(self.provider);
        self.max_turn_requests = over.max_turn_requests.or(self.max_turn_requests);
        self.system_prompt = over.system_prompt.or(self.system_prompt);
        self.local_model = over.local_model.or(self.local_model);
        self.profile = over.profile.or(self.profile);
        self.mode = over.mode.or(self.mode);
        self.sandbox = over.sandbox.or(self.sandbox);
        self.network.extend(over.network);
        self.limits = self.limits.overlaid(over.limits);
        self.store = over.store.or(self.store);
        self.subagents = over.subagents.or(self.subagents);
        self.task_context = over.task_context.or(self.task_context);
        self.max_subagents = over.max_subagents.or(self.max_subagents);
        self.max_subagent_depth = over.max_subagent_depth.or(self.max_subagent_depth);
        self.permissions.extend(over.permissions);
        self.agents.extend(over.agents);
        self.client.permissions.extend(over.client.permissions);
        self.gateway = over.gateway.or(self.gateway);
        self.prices.extend(over.prices);
        self.budget = over.budget.or(self.budget);
        self.run_budget = over.run_budget.or(self.run_budget);
        self.rate_limits.extend(over.rate_limits);
        self.types.extend(over.types);
        // A later file's server of the same name replaces the earlier one's.
        for server in over.mcp_servers {
            self.mcp_servers.retain(|s| s.name != server.name);
            self.mcp_servers.push(server);
        }
        // A later file's schedule of the same id replaces the earlier one's.
        for schedule in over.schedules {
            self.schedules.retain(|s| s.get("id") != schedule.get("id"));
            self.schedules.push(schedule);
        }
        self.tools.output_bytes = over.tools.output_bytes.or(self.tools.output_bytes);
        self.tools.command_timeout_ms = over.tools.command_timeout_ms.or(self.tools.command_timeout_ms);
        for (name, table) in over.providers {
            let base = self.providers.remove(&name).unwrap_or_default();
            self.providers.insert(
                name,
                ProviderTable {
                    base_url: table.base_url.or(base.base_url),
                    model: table.model.or(base.model),
                    api_key_env: table.api_key_env.or(base.api_key_env),
                    connect_timeout_ms: table.connect_timeout_ms.or(base.connect_timeout_ms),
                    idle_timeout_ms: table.idle_timeout_ms.or(base.idle_timeout_ms),
                    max_retries: table.max_retries.or(base.max_retries),
                    retry_base_delay_ms: table.retry_base_delay_ms.or(base.retry_base_delay_ms),
                    max_tokens: table.max_tokens.or(base.max_tokens),
                    stream_usage: table.stream_usage.or(base.stream_usage),
                    vision: table.vision.or(base.vision),
                    context_window: table.context_window.or(base.context_window),
                },
            );
        }
        self
    }
}

/// Permission flags; they apply after the files, in the order approve-all, allow, ask, deny.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct PermissionFlags {
    /// Allow every tool kind without asking
    #[arg(long)]
    pub approve_all: bool,
    /// Allow tools of this kind without asking (read, edit, delete, move, search, execute, think, fetch, other)
    #[arg(long, value_name = "KIND")]
    pub allow: Vec<ToolKind>,
    /// Ask the client before running tools of this kind
    #[arg(long, value_name = "KIND")]
    pub ask: Vec<ToolKind>,
    /// Never run tools of this kind
    #[arg(long, value_name = "KIND")]
    pub deny: Vec<ToolKind>,
}

/// The permission policy from defaults, files and flags.
pub fn resolve_policy(files: &FileConfig, flags: &PermissionFlags) -> anyhow::Result<PermissionPolicy> {
    let mut policy = PermissionPolicy::default();
    for (kind, decision) in &files.permissions {
        let kind: ToolKind = kind.parse().map_err(|e: String| anyhow::anyhow!("[permissions]: {e}"))?;
        let decision: Decision =
            decision.parse().map_err(|e: String| anyhow::anyhow!("[permissions] {}: {e}", kind.as_str()))?;
        policy.set(kind, decision);
    }
    if flags.approve_all {
        policy.approve_all();
    }
    for (kinds, decision) in
        [(&flags.allow, Decision::Allow), (&flags.ask, Decision::Ask), (&flags.deny, Decision::Deny)]
    {
        for kind in kinds {
            policy.set(*kind, decision);
        }
    }
    Ok(policy)
}

/// `--sandbox`: `on` confines commands' writes with Landlock (the agent itself runs open);
/// `strict` and `workspace` also run the agent in a jail (pier-jail); `off` confines nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SandboxArg {
    On,
    Strict,
    Workspace,
    Off,
}

impl SandboxArg {
    /// The agent's jail level, if the agent runs in one.
    pub fn jail(self) -> Option<pier_jail::Level> {
        match self {
            SandboxArg::Strict => Some(pier_jail::Level::Strict),
            SandboxArg::Workspace => Some(pier_jail::Level::Workspace),
            SandboxArg::On | SandboxArg::Off => None,
        }
    }
}

/// How commands are confined, from the files (`sandbox`) and the flag, which wins.
pub fn resolve_confinement(files: &FileConfig, flag: Option<SandboxArg>) -> anyhow::Result<Confinement> {
    let on = match flag {
        Some(flag) => flag != SandboxArg::Off,
        None => host_level(files)? != pier_jail::Level::Off,
    };
    Ok(if on { Confinement::default() } else { Confinement::off() })
}

/// The level of `pier run` and `pier serve` tasks that give none: pier.toml's `sandbox`, else strict.
pub fn host_level(files: &FileConfig) -> anyhow::Result<pier_jail::Level> {
    match files.sandbox.as_deref() {
        None | Some("on") => Ok(pier_jail::Level::Strict),
        Some(word) => word.parse().map_err(|why: String| anyhow::anyhow!("{why} (in pier.toml)")),
    }
}

/// Tool limits from the files.
pub fn resolve_limits(files: &FileConfig) -> Limits {
    let mut limits = Limits::default();
    if let Some(b) = files.tools.output_bytes {
        limits.output_bytes = b.max(1024);
    }
    if let Some(ms) = files.tools.command_timeout_ms {
        limits.command_timeout = Duration::from_millis(ms.max(1));
    }
    limits
}

/// Flags that override configuration.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ModelFlags {
    /// Named provider from a `[providers.NAME]` table [env: PIER_PROVIDER]
    #[arg(long)]
    pub provider: Option<String>,
    /// OpenAI-compatible base URL, e.g. https://api.deepseek.com/v1 [env: PIER_BASE_URL]
    #[arg(long)]
    pub base_url: Option<String>,
    /// Model name [env: PIER_MODEL]
    #[arg(long)]
    pub model: Option<String>,
}

/// A source of environment variables; the process environment, or a map in tests.
pub trait Env {
    fn var(&self, key: &str) -> Option<String>;
}

pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok().filter(|v| !v.is_empty())
    }
}

impl Env for BTreeMap<&str, &str> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).map(|v| (*v).to_owned())
    }
}

/// The configuration files in reading order: user file, then `./pier.toml`.
pub fn config_files(env: &dyn Env, cwd: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let config_home = env
        .var("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| env.var("HOME").map(|h| Path::new(&h).join(".config")));
    if let Some(dir) = config_home {
        files.push(dir.join("pier").join("config.toml"));
    }
    files.push(cwd.join("pier.toml"));
    files
}

/// Reads and merges the configuration files.
pub fn load_files(env: &dyn Env, cwd: &Path) -> anyhow::Result<FileConfig> {
    let mut config = FileConfig::default();
    for path in config_files(env, cwd) {
        config = config.merged(FileConfig::read(&path)?);
    }
    Ok(config)
}

/// The task types of pier.toml's `[types]` and its `[[mcp_servers]]`, checked as a plan's are.
pub fn types(files: &FileConfig) -> anyhow::Result<pier_host::plan::Shared> {
    let shared = pier_host::plan::Shared::new(files.types.clone())
        .map_err(|e| anyhow::anyhow!("`[types]` in pier.toml: {e}"))?;
    shared
        .with_mcp_servers(files.mcp_servers.clone())
        .map_err(|e| anyhow::anyhow!("`[[mcp_servers]]` in pier.toml: {e}"))
}

/// The text of the types file beside plan file `plan` (`types.toml` in its directory), if there is one.
pub fn types_beside(plan: &Path) -> anyhow::Result<Option<String>> {
    let path = plan.parent().unwrap_or(Path::new(".")).join(pier_host::tasks::TYPES_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot read {}", path.display()))),
    }
}

/// `[[schedules]]` tables as schedules: each table's `plan` names a plan file, read now
/// (relative to `base`) and carried as its text, its path kept as `plan_file`, with the
/// `types.toml` beside it if there is one.
pub fn schedules(tables: &[toml::Table], base: &Path) -> anyhow::Result<Vec<pier_host::schedule::ScheduleSpec>> {
    tables
        .iter()
        .enumerate()
        .map(|(i, table)| {
            let name = table.get("id").and_then(|v| v.as_str()).map_or(format!("#{}", i + 1), |id| format!("`{id}`"));
            let mut value = serde_json::to_value(table).with_context(|| format!("schedule {name}"))?;
            if let Some(file) = value.get("plan").and_then(|p| p.as_str()).map(str::to_owned) {
                let path = base.join(&file);
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("schedule {name}: cannot read its plan {}", path.display()))?;
                value["plan"] = text.into();
                value["plan_file"] = file.into();
                if let Some(types) = types_beside(&path)? {
                    value["types"] = types.into();
                }
            }
            pier_host::schedule::ScheduleSpec::from_value(value)
                .map_err(|p| anyhow::anyhow!("schedule {name}: {}", p.join("; ")))
        })
        .collect()
}

/// The model gateway of a host (`pier run`, `pier serve`), unless pier.toml turns it off:
/// pier's own agent's requests go where this pier's model setting says, every key of pier's
/// environment stays with the gateway. Call within the runtime.
pub fn gateway(files: &FileConfig, env: &dyn Env) -> anyhow::Result<Option<pier_host::gateway::GatewayConfig>> {
    if files.gateway == Some(false) {
        tracing::warn!("gateway = false: agents hold their providers' keys and their spend is unknown");
        return Ok(None);
    }
    let gateway = pier_egress::gateway::Gateway::start().context("cannot start the model gateway")?;
    // A broken provider setting is the agent's to report, when it starts; the host runs on.
    let pier = resolve_model(&ModelFlags::default(), env, files).ok().flatten().map(|c| {
        let provider = env.var("PIER_PROVIDER").or_else(|| files.provider.clone()).unwrap_or_else(|| "pier".into());
        (c.base_url, c.api_key.map(|k| k.expose().to_owned()), provider)
    });
    let named: Vec<String> = files.providers.values().filter_map(|t| t.api_key_env.clone()).collect();
    let withhold: Vec<String> = std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| k.ends_with("_API_KEY") || k.ends_with("_AUTH_TOKEN") || named.contains(k))
        .collect();
    for (name, b) in [("budget", files.budget), ("run_budget", files.run_budget)] {
        if let Some(Err(why)) = b.map(|b| b.check()) {
            bail!("`{name}` in pier.toml: {why}");
        }
    }
    for (provider, limit) in &files.rate_limits {
        if let Err(why) = limit.check() {
            bail!("`[rate_limits.{provider:?}]` in pier.toml: {why}");
        }
    }
    gateway.set_rate_limits(files.rate_limits.clone().into_iter().collect());
    Ok(Some(pier_host::gateway::GatewayConfig {
        gateway,
        pier,
        prices: std::sync::Arc::new(files.prices.clone()),
        withhold: withhold.into(),
        budget: files.budget,
        run_budget: files.run_budget,
        ledger: Default::default(),
    }))
}

/// The host's store: `--store`, else `PIER_STORE`, else `store` in the config files, else
/// the SQLite file `$PIER_HOME/pier.db`.
pub fn store_spec(env: &dyn Env, flag: Option<&str>, files: &FileConfig) -> anyhow::Result<String> {
    if let Some(spec) = flag.map(str::to_owned).or_else(|| env.var("PIER_STORE")).or_else(|| files.store.clone()) {
        if spec.trim().is_empty() {
            bail!("the store is empty: give --store (or PIER_STORE, or `store` in pier.toml) a path or a URL");
        }
        return Ok(spec);
    }
    Ok(pier_home(env)?.join("pier.db").display().to_string())
}

/// `$PIER_HOME`, else `$XDG_DATA_HOME/pier`, else `~/.local/share/pier`.
pub fn pier_home(env: &dyn Env) -> anyhow::Result<PathBuf> {
    if let Some(home) = env.var("PIER_HOME") {
        return Ok(PathBuf::from(home));
    }
    if let Some(data) = env.var("XDG_DATA_HOME") {
        return Ok(Path::new(&data).join("pier"));
    }
    match env.var("HOME") {
        Some(home) => Ok(Path::new(&home).join(".local").join("share").join("pier")),
        None => bail!("cannot find a place for pier's data: set PIER_HOME or HOME"),
    }
}

/// Whether the embedded model is asked for by name: `--model local`, or `PIER_MODEL=local`
/// without a `--model`. `pier agent` and `pier config` decide it here, so they agree.
pub fn wants_local(flags: &ModelFlags, env: &dyn Env) -> bool {
    flags.model.as_deref() == Some("local")
        || (flags.model.is_none() && env.var("PIER_MODEL").as_deref() == Some("local"))
}

/// The embedded model's file someone named, and where they named it: `PIER_LOCAL_MODEL`,
/// else `local_model` in the config files; `None` for the default place.
pub fn named_local_model(env: &dyn Env, files: &FileConfig) -> Option<(PathBuf, &'static str)> {
    match env.var("PIER_LOCAL_MODEL") {
        Some(p) => Some((PathBuf::from(p), "PIER_LOCAL_MODEL")),
        None => files.local_model.clone().map(|p| (p, "local_model in pier.toml")),
    }
}

/// Resolves the model settings; `None` when no model is configured anywhere.
pub fn resolve_model(flags: &ModelFlags, env: &dyn Env, files: &FileConfig) -> anyhow::Result<Option<ModelConfig>> {
    let provider = flags.provider.clone().or_else(|| env.var("PIER_PROVIDER")).or_else(|| files.provider.clone());
    let table = match &provider {
        Some(name) => match files.providers.get(name) {
            Some(t) => t.clone(),
            None => {
                let known: Vec<&str> = files.providers.keys().map(String::as_str).collect();
                bail!(
                    "provider `{name}` is not defined; add a [providers.{name}] table to ./pier.toml or ~/.config/pier/config.toml (defined: {})",
                    if known.is_empty() { "none".to_owned() } else { known.join(", ") }
                );
            }
        },
        None => ProviderTable::default(),
    };
    let Some(model) = flags.model.clone().or_else(|| env.var("PIER_MODEL")).or(table.model.clone()) else {
        return Ok(None);
    };
    let base_url = flags
        .base_url
        .clone()
        .or_else(|| env.var("PIER_BASE_URL"))
        .or(table.base_url.clone())
        .unwrap_or_else(|| "https://api.openai.com/v1".to_owned());
    let key = env
        .var("PIER_API_KEY")
        .or_else(|| table.api_key_env.as_deref().and_then(|k| env.var(k)))
        .or_else(|| env.var("OPENAI_API_KEY"));
    let mut config = ModelConfig::new(base_url, model);
    config.api_key = key.map(Secret::new);
    if let Some(ms) = table.connect_timeout_ms {
        config.connect_timeout = Duration::from_millis(ms);
    }
    if let Some(ms) = table.idle_timeout_ms {
        config.idle_timeout = Duration::from_millis(ms);
    }
    if let Some(n) = table.max_retries {
        config.max_retries = n;
    }
    if let Some(ms) = table.retry_base_delay_ms {
        config.retry_base_delay = Duration::from_millis(ms);
    }
    config.max_tokens = table.max_tokens;
    if let Some(b) = table.stream_usage {
        config.stream_usage = b;
    }
    config.context_window = Some(table.context_window.unwrap_or(DEFAULT_CONTEXT_WINDOW));
    Ok(Some(config))
}

/// Assumed when a provider does not say: the common size of today's hosted models.
const DEFAULT_CONTEXT_WINDOW: u64 = 128_000;

/// Whether the provider `resolve_model` picks takes images.
pub fn resolve_vision(flags: &ModelFlags, env: &dyn Env, files: &FileConfig) -> bool {
    let provider = flags.provider.clone().or_else(|| env.var("PIER_PROVIDER")).or_else(|| files.provider.clone());
    provider.and_then(|p| files.providers.get(&p)).and_then(|t| t.vision).unwrap_or(false)
}

/// A named provider with a model: `(name, config, vision)`.
pub type NamedProvider = (String, ModelConfig, bool);

/// The chosen provider's name, and every named provider with a model, for the editor
/// profile's `model` select.
pub fn named_models(
    flags: &ModelFlags,
    env: &dyn Env,
    files: &FileConfig,
) -> anyhow::Result<(Option<String>, Vec<NamedProvider>)> {
    let chosen = flags.provider.clone().or_else(|| env.var("PIER_PROVIDER")).or_else(|| files.provider.clone());
    let mut out = Vec::new();
    for (name, table) in &files.providers {
        if table.model.is_none() {
            continue;
        }
        let named = ModelFlags { provider: Some(name.clone()), model: None, base_url: None };
        // Only the file speaks for a named provider; PIER_MODEL and friends choose the default one.
        if let Some(config) = resolve_model(&named, &NoEnv(env), files)? {
            out.push((name.clone(), config, table.vision.unwrap_or(false)));
        }
    }
    Ok((chosen, out))
}

/// The environment without the variables that override a provider's own table.
struct NoEnv<'a>(&'a dyn Env);

impl Env for NoEnv<'_> {
    fn var(&self, name: &str) -> Option<String> {
        match name {
            "PIER_MODEL" | "PIER_BASE_URL" | "PIER_PROVIDER" => None,
            other => self.0.var(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> FileConfig {
        match toml::from_str(text) {
            Ok(f) => f,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn nothing_configured_is_none() -> anyhow::Result<()> {
        let env: BTreeMap<&str, &str> = BTreeMap::new();
        assert!(resolve_model(&ModelFlags::default(), &env, &FileConfig::default())?.is_none());
        Ok(())
    }

    #[test]
    fn flags_over_env_over_files() -> anyhow::Result<()> {
        let files = file(
            r#"
            provider = "ds"
            [providers.ds]
            base_url = "https://api.deepseek.com/v1"
            model = "deepseek-chat"
            api_key_env = "DEEPSEEK_API_KEY"
            idle_timeout_ms = 1500
            "#,
        );
        let env = BTreeMap::from([("DEEPSEEK_API_KEY", "sk-ds"), ("PIER_MODEL", "deepseek-reasoner")]);
        let c = resolve_model(&ModelFlags::default(), &env, &files)?;
        let c = c.ok_or_else(|| anyhow::anyhow!("expected a model"))?;
        assert_eq!(c.base_url, "https://api.deepseek.com/v1");
        assert_eq!(c.model, "deepseek-reasoner");
        assert_eq!(c.api_key.as_ref().map(Secret::expose), Some("sk-ds"));
        assert_eq!(c.idle_timeout, Duration::from_millis(1500));
        let flags = ModelFlags {
            model: Some("flag-model".into()),
            base_url: Some("http://localhost:11434/v1".into()),
            provider: None,
        };
        let c = resolve_model(&flags, &env, &files)?.ok_or_else(|| anyhow::anyhow!("expected a model"))?;
        assert_eq!((c.model.as_str(), c.base_url.as_str()), ("flag-model", "http://localhost:11434/v1"));
        Ok(())
    }

    #[test]
    fn project_file_overrides_user_file_per_field() {
        let user = file("provider = \"a\"\n[providers.a]\nmodel = \"m1\"\nbase_url = \"http://u\"\n");
        let project = file("[providers.a]\nmodel = \"m2\"\n");
        let merged = user.merged(project);
        let a = &merged.providers["a"];
        assert_eq!((a.model.as_deref(), a.base_url.as_deref()), (Some("m2"), Some("http://u")));
        assert_eq!(merged.provider.as_deref(), Some("a"));
    }

    #[test]
    fn an_unknown_provider_is_a_clear_error() {
        let env: BTreeMap<&str, &str> = BTreeMap::from([("PIER_PROVIDER", "nope")]);
        let err = resolve_model(&ModelFlags::default(), &env, &FileConfig::default()).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("provider `nope` is not defined")));
    }

    #[test]
    fn permissions_come_from_defaults_then_files_then_flags() -> anyhow::Result<()> {
        let files = file("[permissions]\nexecute = \"deny\"\nedit = \"allow\"\n");
        let p = resolve_policy(&files, &PermissionFlags::default())?;
        assert_eq!((p.decide(ToolKind::Execute), p.decide(ToolKind::Edit)), (Decision::Deny, Decision::Allow));
        assert_eq!(p.decide(ToolKind::Move), Decision::Ask);
        let flags = PermissionFlags { approve_all: true, deny: vec![ToolKind::Delete], ..PermissionFlags::default() };
        let p = resolve_policy(&files, &flags)?;
        assert_eq!((p.decide(ToolKind::Execute), p.decide(ToolKind::Delete)), (Decision::Allow, Decision::Deny));
        let bad = file("[permissions]\nexecute = \"maybe\"\n");
        assert!(resolve_policy(&bad, &PermissionFlags::default()).is_err());
        let bad = file("[permissions]\nlaunch = \"allow\"\n");
        assert!(
            resolve_policy(&bad, &PermissionFlags::default())
                .is_err_and(|e| e.to_string().contains("unknown tool kind"))
        );
        Ok(())
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert!(toml::from_str::<FileConfig>("modle = \"x\"").is_err());
    }

    #[test]
    fn pier_home_defaults() -> anyhow::Result<()> {
        let env = BTreeMap::from([("HOME", "/home/u")]);
        assert_eq!(pier_home(&env)?, PathBuf::from("/home/u/.local/share/pier"));
        let env = BTreeMap::from([("HOME", "/home/u"), ("PIER_HOME", "/p")]);
        assert_eq!(pier_home(&env)?, PathBuf::from("/p"));
        Ok(())
    }
}
