//! pier's side of a jail: turns an agent's command into `pier jail … -- AGENT`, prepares
//! what the jail needs before the spawn (the private home and temp directory, the cgroup,
//! the control socket) and, once the helper runs, serves the proxy listener it hands over.
//!
//! Ownership: [`Prepared`] owns everything made for one agent process until it starts;
//! [`Running`] owns it after, and its drop undoes it all (the cgroup's processes killed and
//! the cgroup removed, the proxy stopped, the private directories deleted).

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pier_egress::{Allow, Egress, Serving};

use crate::kernel::Kernel;
use crate::level::{Level, Limits};
use crate::limits::{Breach, Cgroup};
use crate::spec::{CONTROL_FD, PROXY_PORT, Spec};

/// Why a jail could not be prepared or started.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The task asks for what this machine cannot enforce; the message says what.
    #[error("{0}")]
    Unavailable(String),
    /// A file system or cgroup step failed before the spawn.
    #[error("cannot prepare the agent's sandbox: {0}")]
    Prepare(String),
    /// The plan's `network` list does not parse.
    #[error("{0}")]
    Network(String),
}

/// Starts jails for one pier process: cheap to clone.
#[derive(Clone)]
pub struct Jailer {
    pier_exe: PathBuf,
    egress: Egress,
    kernel: &'static Kernel,
}

impl std::fmt::Debug for Jailer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jailer").field("pier_exe", &self.pier_exe).field("kernel", &self.kernel.describe()).finish()
    }
}

/// What one agent process may do.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub level: Level,
    /// The agent's working directory.
    pub cwd: PathBuf,
    /// Read beneath (the task's roots).
    pub roots: Vec<PathBuf>,
    /// Write beneath; `None` is the working directory.
    pub writable: Option<Vec<PathBuf>>,
    /// Hosts (`host[:port]`) the proxy lets the agent reach, besides the model providers'.
    pub network: Vec<String>,
    pub limits: Limits,
    /// pier's own state (its home, the store, the token), hidden wherever a bound tree holds it.
    pub hide: Vec<PathBuf>,
    /// The agent's model traffic goes through pier's model gateway: the proxy lets it reach
    /// only the hosts its own base-URL variables name (the gateway), not the providers.
    pub through_gateway: bool,
}

/// The agent's program, arguments and environment as pier would start it unconfined. Its
/// `Debug` shows the environment's names only: the values can be keys.
#[derive(Clone)]
pub struct Program {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl std::fmt::Debug for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Program")
            .field("program", &self.program)
            .field("args", &crate::shown::Args(&self.args))
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .finish()
    }
}

/// Variables that carry pier's or the user's access to other things; never passed into a jail.
const WITHHELD: &[&str] = &[
    "PIER_STORE",
    "PIER_TOKEN",
    "PIER_TEST_PG",
    "DATABASE_URL",
    "PGPASSWORD",
    "SSH_AUTH_SOCK",
    "GPG_AGENT_INFO",
    "DBUS_SESSION_BUS_ADDRESS",
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_CACHE_HOME",
    "XDG_STATE_HOME",
    "no_proxy",
];

/// Hidden directories of a home that hold more than one program's installation (and often keys).
const GENERAL_DOT_DIRS: &[&str] =
    &[".local", ".config", ".cache", ".ssh", ".gnupg", ".pier", ".aws", ".kube", ".docker"];

/// The hosts every strict jail may reach unless its model traffic goes through pier's gateway:
/// the model providers the known agents call by default.
const PROVIDERS: &[&str] = &["api.openai.com:443", "api.anthropic.com:443", "generativelanguage.googleapis.com:443"];

impl Jailer {
    /// A jailer that re-executes `pier_exe` as the helper; probes the machine once.
    pub fn new(pier_exe: &Path) -> Jailer {
        Jailer { pier_exe: pier_exe.to_owned(), egress: Egress::new(), kernel: Kernel::get(pier_exe) }
    }

    pub fn kernel(&self) -> &'static Kernel {
        self.kernel
    }

    /// The command that runs `agent` under `request`, and what it needs until it starts.
    pub fn prepare(&self, request: &Request, agent: &Program) -> Result<Prepared, JailError> {
        if let Some(reason) = self.kernel.refuses(request.level, &request.limits) {
            return Err(JailError::Unavailable(reason));
        }
        let strict = request.level == Level::Strict;
        let mut allow: Vec<String> = Vec::new();
        if !request.through_gateway {
            allow.extend(PROVIDERS.iter().map(|s| (*s).to_owned()));
        }
        allow.extend(provider_hosts(&agent.env, !request.through_gateway));
        allow.extend(request.network.iter().cloned());
        let allow = Allow::parse(&allow).map_err(|e| JailError::Network(e.to_string()))?;
        let prep = |e: std::io::Error, what: &str| JailError::Prepare(format!("{what}: {e}"));
        let dir =
            tempfile::Builder::new().prefix("pier-jail-").tempdir().map_err(|e| prep(e, "a private directory"))?;
        let (root, home, tmp) = (dir.path().join("root"), dir.path().join("home"), dir.path().join("tmp"));
        for d in [&root, &home, &tmp] {
            std::fs::create_dir(d).map_err(|e| prep(e, "a private directory"))?;
        }
        let canonical = |p: &Path| {
            p.canonicalize().map_err(|e| {
                JailError::Prepare(format!("{} cannot be opened ({e}); create it or fix the path", p.display()))
            })
        };
        let cwd = canonical(&request.cwd)?;
        let mut write = match &request.writable {
            Some(dirs) => dirs.iter().map(|d| canonical(d)).collect::<Result<Vec<_>, _>>()?,
            None => vec![cwd.clone()],
        };
        write.push(home.clone());
        // The agent's own state the user pointed it at in its definition (`[agents.X] env`:
        // `HOME`, `CODEX_HOME`, `CLAUDE_CONFIG_DIR`…): directories it reads and writes as its own.
        let configured: Vec<PathBuf> = agent
            .env
            .iter()
            .map(|(_, v)| Path::new(v))
            .filter(|p| p.is_absolute() && p.is_dir())
            .filter_map(|p| p.canonicalize().ok())
            .filter(|p| p != Path::new("/") && !request.hide.iter().any(|h| h.starts_with(p)))
            .collect();
        write.extend(configured);
        let mut read = vec![cwd.clone()];
        for r in &request.roots {
            read.push(canonical(r)?);
        }
        read.extend(installation(&agent.program, &agent.env));
        // `python3 /x/agent.py`, `node /x/dist/index.js`: the script's installation too.
        for script in agent.args.iter().map(Path::new).filter(|a| a.is_absolute() && a.is_file()) {
            read.extend(installation(script, &agent.env));
        }
        let mut env = agent.env.clone();
        let mut hide = request.hide.clone();
        own_model(&mut env, &mut read, &mut hide);
        // Only what a bound tree holds needs masking; a hidden directory that holds a bound path
        // (pier's home holding the model) is masked by not being bound, and masking it would hide the path.
        hide.retain(|h| read.iter().chain(&write).any(|b| h.starts_with(b) && h != b));
        let spec = Spec { cwd, read, write, hide, root, tmp, net: strict };
        let spec = serde_json::to_string(&spec).map_err(|e| JailError::Prepare(e.to_string()))?;
        if !agent.env.iter().any(|(k, _)| k == "HOME") {
            env.push(("HOME".into(), home.display().to_string()));
        }
        env.push(("TMPDIR".into(), "/tmp".into()));
        env.push(("PIER_HOME".into(), home.join(".pier").display().to_string()));
        if strict {
            let proxy = format!("http://127.0.0.1:{PROXY_PORT}");
            for var in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"] {
                env.push((var.into(), proxy.clone()));
            }
            // Nothing bypasses the proxy: there is no route to bypass it by.
            env.push(("NO_PROXY".into(), String::new()));
            // Node's built-in fetch reads the proxy variables only when told to (Node 22.21+, 24.5+).
            env.push(("NODE_USE_ENV_PROXY".into(), "1".into()));
        }
        let mut args = vec!["jail".to_owned(), "--spec".into(), spec, "--".into(), agent.program.display().to_string()];
        args.extend(agent.args.iter().cloned());
        let cgroup = Cgroup::create(&self.kernel.cgroups, &request.limits).map_err(JailError::Prepare)?;
        let entry = match &cgroup {
            Some(c) => c.entry_files().map_err(JailError::Prepare)?,
            None => Vec::new(),
        };
        let control = if strict {
            let pair = nix::sys::socket::socketpair(
                nix::sys::socket::AddressFamily::Unix,
                nix::sys::socket::SockType::Stream,
                None,
                nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            )
            .map_err(|e| JailError::Prepare(format!("a control socket: {e}")))?;
            Some(pair)
        } else {
            None
        };
        Ok(Prepared {
            program: self.pier_exe.clone(),
            args,
            env,
            env_remove: WITHHELD.iter().map(|s| (*s).to_owned()).collect(),
            dir: Some(dir),
            cgroup,
            entry,
            control,
            allow: Arc::new(allow),
            egress: self.egress.clone(),
        })
    }
}

/// One agent's jail before its helper starts.
pub struct Prepared {
    /// The helper: `pier jail --spec … -- AGENT ARGS…`.
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Set on the helper's command, which passes them on to the agent.
    pub env: Vec<(String, String)>,
    /// Removed from the helper's environment.
    pub env_remove: Vec<String>,
    dir: Option<tempfile::TempDir>,
    cgroup: Option<Cgroup>,
    /// Each `cgroup.procs` of the cgroup, written by the child before it execs.
    entry: Vec<OwnedFd>,
    /// (pier's end, the helper's end).
    control: Option<(OwnedFd, OwnedFd)>,
    allow: Arc<Allow>,
    egress: Egress,
}

impl Prepared {
    /// Sets the helper's environment and what its child does between fork and exec: enter the
    /// cgroup, take the control socket as descriptor 3.
    pub fn configure(&mut self, cmd: &mut tokio::process::Command) {
        for var in &self.env_remove {
            cmd.env_remove(var);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let entry: Vec<i32> = self.entry.iter().map(AsRawFd::as_raw_fd).collect();
        let control = self.control.as_ref().map(|(_, theirs)| theirs.as_raw_fd());
        before_exec(cmd, move || {
            for fd in &entry {
                // "0" moves the writing process itself.
                nix::unistd::write(unsafe_borrow(*fd), b"0")?;
            }
            if let Some(fd) = control {
                dup_to(fd, CONTROL_FD)?;
            }
            Ok(())
        });
    }

    /// After the spawn: the helper's end is closed here, its proxy listener received (within
    /// `timeout`) and served. A helper that fails before handing it over leaves no proxy; its
    /// stderr says why and the agent process ends with it.
    pub async fn started(mut self, label: String, timeout: Duration) -> Running {
        self.entry.clear();
        let mut serving = None;
        if let Some((ours, theirs)) = self.control.take() {
            drop(theirs);
            let received = tokio::time::timeout(
                timeout,
                tokio::task::spawn_blocking(move || crate::netns::receive_listener(&ours)),
            )
            .await;
            match received {
                Ok(Ok(Ok(listener))) => match self.egress.serve(listener, self.allow.clone(), label.clone()) {
                    Ok(s) => serving = Some(s),
                    Err(e) => tracing::warn!(agent = %label, error = %e, "cannot serve the jail's proxy"),
                },
                Ok(Ok(Err(e))) => tracing::warn!(agent = %label, error = %e, "the jail has no proxy"),
                _ => tracing::warn!(agent = %label, "the jail did not hand over its proxy listener in time"),
            }
        }
        let breach = Arc::new(Mutex::new(None));
        let cgroup = self.cgroup.take().map(Arc::new);
        let watch = cgroup.clone().map(|c| tokio::spawn(watch(c, breach.clone(), label)));
        Running { cgroup, serving, watch, breach, _dir: self.dir.take() }
    }
}

/// A started agent's jail; dropping it ends everything the jail holds.
pub struct Running {
    cgroup: Option<Arc<Cgroup>>,
    serving: Option<Serving>,
    watch: Option<tokio::task::JoinHandle<()>>,
    breach: Arc<Mutex<Option<Breach>>>,
    _dir: Option<tempfile::TempDir>,
}

impl Running {
    /// The limit the agent broke, if it broke one (read from the kernel's counters).
    pub fn breach(&self) -> Option<Breach> {
        let seen = self.breach.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        seen.or_else(|| self.cgroup.as_ref().and_then(|c| c.breach()))
    }

    /// Connections the proxy refused so far.
    pub fn refused(&self) -> u64 {
        self.serving.as_ref().map_or(0, Serving::refused)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(w) = self.watch.take() {
            w.abort();
        }
        // The cgroup's drop kills what is left in it and removes it.
        self.cgroup.take();
        self.serving.take();
    }
}

/// Stops the jail as soon as the kernel reports a breach: the agent is stopped, not left
/// to fail slowly at its limit, and the host sees why.
async fn watch(cgroup: Arc<Cgroup>, seen: Arc<Mutex<Option<Breach>>>, label: String) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        if let Some(breach) = cgroup.breach() {
            tracing::warn!(agent = %label, limit = breach.limit, "{}", breach.message);
            metrics::counter!("pier_limit_breaches_total", "limit" => breach.limit).increment(1);
            *seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(breach);
            let c = cgroup.clone();
            let _ = tokio::task::spawn_blocking(move || c.kill()).await;
            return;
        }
    }
}

/// The agent's installation: its program's directory (and the link's), the package tree a
/// Node program lives in (its dependencies beside it), and its script's interpreter.
fn installation(program: &Path, env: &[(String, String)]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let real = program.canonicalize().unwrap_or_else(|_| program.to_owned());
    for p in [program, real.as_path()] {
        if let Some(parent) = p.parent() {
            out.push(parent.to_owned());
        }
        // `…/X/node_modules/.bin/tool` and `…/X/node_modules/pkg/bin/tool.js`: all of X/node_modules.
        let parts: Vec<_> = p.components().collect();
        if let Some(i) = parts.iter().position(|c| c.as_os_str() == "node_modules") {
            out.push(parts[..=i].iter().collect());
        }
    }
    if let Some(interpreter) = interpreter(&real, env) {
        let real_interp = interpreter.canonicalize().unwrap_or(interpreter);
        // `prefix/bin/node`: the prefix holds its libraries too (`prefix/lib/node_modules`).
        if let Some(prefix) = real_interp.parent().and_then(Path::parent) {
            out.push(prefix.to_owned());
        }
    }
    // A version manager's shim (`~/.pyenv/shims/python3`, `~/.nvm/…/bin/node`, `~/.volta`, `~/.asdf`)
    // runs programs from the rest of its tree: the whole hidden directory it lives in (never a
    // home's general ones, which hold other programs' data and keys).
    for p in [program, real.as_path()] {
        let parts: Vec<_> = p.components().collect();
        if let Some(i) = parts.iter().position(|c| {
            let name = c.as_os_str().to_string_lossy();
            name.starts_with('.') && name.len() > 2
        }) && !GENERAL_DOT_DIRS.contains(&parts[i].as_os_str().to_string_lossy().as_ref())
            && i + 1 < parts.len()
        {
            out.push(parts[..=i].iter().collect());
        }
    }
    out.retain(|p| p.is_absolute() && p.exists() && p != Path::new("/"));
    out
}

/// The interpreter named by the script's `#!` line (`/usr/bin/env node` looked up on PATH).
fn interpreter(script: &Path, env: &[(String, String)]) -> Option<PathBuf> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(script).and_then(|mut f| f.read(&mut head)).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = std::str::from_utf8(line.split(|b| *b == b'\n').next()?).ok()?;
    let mut words = line.split_whitespace();
    let first = PathBuf::from(words.next()?);
    if first.file_name().is_some_and(|n| n == "env") {
        let name = words.find(|w| !w.starts_with('-'))?;
        let path =
            env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.clone()).or_else(|| std::env::var("PATH").ok())?;
        return path.split(':').map(|d| Path::new(d).join(name)).find(|p| p.is_file());
    }
    Some(first)
}

/// Hosts of the provider URLs the agent is given (`*_BASE_URL`, `*_API_BASE`): the
/// model endpoints it was configured to call.
fn provider_hosts(agent_env: &[(String, String)], and_ours: bool) -> Vec<String> {
    let ours: Vec<(String, String)> = if and_ours { std::env::vars().collect() } else { Vec::new() };
    agent_env
        .iter()
        .chain(ours.iter())
        .filter(|(k, _)| k.ends_with("_BASE_URL") || k.ends_with("_API_BASE") || k.ends_with("_BASEURL"))
        .filter_map(|(_, v)| {
            let (scheme, rest) = v.split_once("://")?;
            let authority = rest.split(['/', '?', '#']).next()?.rsplit('@').next()?;
            let default = if scheme == "https" { 443 } else { 80 };
            let has_port =
                authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) && !authority.ends_with(']');
            Some(if has_port { authority.to_owned() } else { format!("{authority}:{default}") })
        })
        .collect()
}

/// pier's own agent reads the embedded model from pier's home, which the jail hides: the
/// model file alone is bound read-only and named by `PIER_LOCAL_MODEL`.
fn own_model(env: &mut Vec<(String, String)>, read: &mut Vec<PathBuf>, hide: &mut [PathBuf]) {
    let named = env.iter().find(|(k, _)| k == "PIER_LOCAL_MODEL").map(|(_, v)| PathBuf::from(v));
    let named = named.or_else(|| std::env::var_os("PIER_LOCAL_MODEL").map(PathBuf::from));
    let model = named.or_else(|| hide.iter().map(|h| h.join("models").join("smollm2.q8_0.gguf")).find(|p| p.is_file()));
    // The file itself, not a link to it (a link would lead out of the jail's view).
    if let Some(model) = model.and_then(|m| m.canonicalize().ok()).filter(|m| m.is_file()) {
        read.push(model.clone());
        env.push(("PIER_LOCAL_MODEL".into(), model.display().to_string()));
    }
}

/// Registers `f` to run in the helper's child between fork and exec.
#[allow(unsafe_code)]
fn before_exec(cmd: &mut tokio::process::Command, f: impl FnMut() -> std::io::Result<()> + Send + Sync + 'static) {
    // SAFETY: `f` (in `Prepared::configure`) only calls write(2) and dup2(2) on descriptors it
    // owns a copy of, async-signal-safe, without allocating or taking a lock: sound in the
    // forked child of a multithreaded process.
    unsafe {
        cmd.pre_exec(f);
    }
}

/// `dup2(from, to)`: `to` is then open in the child without close-on-exec.
#[allow(unsafe_code)]
fn dup_to(from: i32, to: i32) -> std::io::Result<()> {
    // SAFETY: dup2 on a descriptor `Prepared` owns; `to` is free in the helper (0-2 are its stdio).
    if unsafe { libc::dup2(from, to) } < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// A descriptor borrowed for one call in the forked child.
#[allow(unsafe_code)]
fn unsafe_borrow(fd: i32) -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: the descriptor is owned by `Prepared`, which outlives the spawn that forks this child.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_programs_debug_names_its_environment_without_the_values() {
        let p = super::Program {
            program: "/bin/agent".into(),
            args: vec!["--acp".into()],
            env: vec![("ANTHROPIC_API_KEY".into(), "sk-ant-secret".into())],
        };
        let shown = format!("{p:?}");
        assert!(shown.contains("ANTHROPIC_API_KEY") && !shown.contains("sk-ant-secret"), "{shown}");
    }
}
