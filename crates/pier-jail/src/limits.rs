//! An attempt's resource limits as a cgroup of its own: cgroup v2 where pier's own cgroup
//! delegates the controllers, the v1 hierarchies (`memory`, `pids`, `cpu`) otherwise. pier
//! creates it before the helper starts; the helper's child enters it between fork and exec
//! (a write of "0" to each `cgroup.procs`), so every process of the jail is counted from its
//! first instruction and cannot leave (the cgroup tree is not in the jail's view).
//!
//! A breach is read from the kernel's own counters, never guessed from an exit status:
//! `memory.events`' `oom_kill` (v1: `memory.oom_control`) and `pids.events`' `max`.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::level::{Limits, show_bytes};

/// Which limit an attempt broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breach {
    /// `memory` or `pids`.
    pub limit: &'static str,
    pub message: String,
}

/// How the machine enforces limits (found once by [`crate::kernel`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupKind {
    /// cgroup v2 under this directory, with these controllers delegated.
    V2 { base: PathBuf, controllers: Vec<String> },
    /// cgroup v1: each controller's directory (pier's own cgroup in that hierarchy).
    V1 { bases: Vec<(String, PathBuf)> },
    /// No cgroup can be created here.
    None,
}

impl CgroupKind {
    /// Which of `memory`, `pids`, `cpu` can be limited.
    pub fn controllers(&self) -> Vec<&str> {
        match self {
            CgroupKind::V2 { controllers, .. } => controllers.iter().map(String::as_str).collect(),
            CgroupKind::V1 { bases } => bases.iter().map(|(c, _)| c.as_str()).collect(),
            CgroupKind::None => Vec::new(),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            CgroupKind::V2 { controllers, .. } => format!("cgroup v2: {}", controllers.join(", ")),
            CgroupKind::V1 { .. } => format!("cgroup v1: {}", self.controllers().join(", ")),
            CgroupKind::None => "no cgroups (limits cannot be enforced)".into(),
        }
    }

    /// Whether every limit set in `limits` can be enforced; the first that cannot, by name.
    pub fn missing(&self, limits: &Limits) -> Option<&'static str> {
        let have = self.controllers();
        [("memory", limits.memory.is_some()), ("pids", limits.pids.is_some()), ("cpu", limits.cpu.is_some())]
            .into_iter()
            .find(|(name, wanted)| *wanted && !have.contains(name))
            .map(|(name, _)| name)
    }
}

/// Finds where cgroups can be created for the limits pier knows.
pub(crate) fn probe() -> CgroupKind {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if let Some(kind) = probe_v2(&own, &mounts) {
        return kind;
    }
    let mut bases = Vec::new();
    for controller in ["memory", "pids", "cpu"] {
        let Some(rel) = own.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, names, path) = (f.next()?, f.next()?, f.next()?);
            names.split(',').any(|n| n == controller).then(|| path.trim_start_matches('/').to_owned())
        }) else {
            continue;
        };
        let Some(mount) = mounts.lines().find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mut r = right.split(' ');
            let (fstype, _, options) = (r.next()?, r.next()?, r.next()?);
            (fstype == "cgroup" && options.split(',').any(|o| o == controller))
                .then(|| left.split(' ').nth(4).map(PathBuf::from))?
        }) else {
            continue;
        };
        let base = mount.join(rel);
        if writable_dir(&base) {
            bases.push((controller.to_owned(), base));
        }
    }
    if bases.is_empty() { CgroupKind::None } else { CgroupKind::V1 { bases } }
}

fn probe_v2(own: &str, mounts: &str) -> Option<CgroupKind> {
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?.trim().trim_start_matches('/').to_owned();
    let mount = mounts.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        right.starts_with("cgroup2 ").then(|| left.split(' ').nth(4).map(PathBuf::from))?
    })?;
    let base = mount.join(rel);
    let delegated = std::fs::read_to_string(base.join("cgroup.subtree_control")).ok()?;
    let controllers: Vec<String> =
        delegated.split_whitespace().filter(|c| ["memory", "pids", "cpu"].contains(c)).map(str::to_owned).collect();
    (!controllers.is_empty() && writable_dir(&base)).then_some(CgroupKind::V2 { base, controllers })
}

fn writable_dir(base: &Path) -> bool {
    let probe = base.join(format!("pier-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).is_ok() && std::fs::remove_dir(&probe).is_ok()
}

/// One attempt's cgroup(s): removed, with everything in them killed, on drop.
#[derive(Debug)]
pub(crate) struct Cgroup {
    v2: bool,
    /// (controller, directory); on v2 one directory for all.
    dirs: Vec<(String, PathBuf)>,
    limits: Limits,
}

impl Cgroup {
    /// Creates the cgroup of one attempt with `limits`; `None` when there are none.
    pub fn create(kind: &CgroupKind, limits: &Limits) -> Result<Option<Cgroup>, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        if limits.is_empty() {
            return Ok(None);
        }
        if let Some(missing) = kind.missing(limits) {
            return Err(format!("the {missing} limit cannot be enforced here ({})", kind.describe()));
        }
        let name = format!("pier-jail-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut group = Cgroup { v2: matches!(kind, CgroupKind::V2 { .. }), dirs: Vec::new(), limits: *limits };
        match kind {
            CgroupKind::V2 { base, .. } => {
                let dir = base.join(&name);
                std::fs::create_dir(&dir).map_err(|e| format!("cannot create the cgroup {}: {e}", dir.display()))?;
                group.dirs.push(("".into(), dir));
            }
            CgroupKind::V1 { bases } => {
                for (controller, base) in bases {
                    let wanted = match controller.as_str() {
                        "memory" => limits.memory.is_some(),
                        "pids" => limits.pids.is_some(),
                        _ => limits.cpu.is_some(),
                    };
                    if wanted {
                        let dir = base.join(&name);
                        std::fs::create_dir(&dir)
                            .map_err(|e| format!("cannot create the cgroup {}: {e}", dir.display()))?;
                        group.dirs.push((controller.clone(), dir));
                    }
                }
            }
            CgroupKind::None => return Err("no cgroup can be created here".into()),
        }
        group.write_limits()?;
        Ok(Some(group))
    }

    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs.iter().find(|(c, _)| self.v2 || c == controller).map(|(_, d)| d.as_path())
    }

    fn write(&self, controller: &str, file: &str, value: &str) -> Result<(), String> {
        let Some(dir) = self.dir(controller) else { return Ok(()) };
        std::fs::write(dir.join(file), value).map_err(|e| format!("cannot set {file} = {value}: {e}"))
    }

    fn write_limits(&self) -> Result<(), String> {
        let l = self.limits;
        if let Some(m) = l.memory {
            if self.v2 {
                self.write("memory", "memory.max", &m.to_string())?;
                // Swap would let the attempt go past its limit slowly instead of being stopped.
                let _ = self.write("memory", "memory.swap.max", "0");
            } else {
                self.write("memory", "memory.limit_in_bytes", &m.to_string())?;
                let _ = self.write("memory", "memory.memsw.limit_in_bytes", &m.to_string());
            }
        }
        if let Some(p) = l.pids {
            self.write("pids", "pids.max", &p.to_string())?;
        }
        if let Some(c) = l.cpu {
            let quota = ((c * 100_000.0).round() as u64).max(1_000);
            if self.v2 {
                self.write("cpu", "cpu.max", &format!("{quota} 100000"))?;
            } else {
                self.write("cpu", "cpu.cfs_period_us", "100000")?;
                self.write("cpu", "cpu.cfs_quota_us", &quota.to_string())?;
            }
        }
        Ok(())
    }

    /// Each `cgroup.procs`, open for the helper's child to write itself into.
    pub fn entry_files(&self) -> Result<Vec<OwnedFd>, String> {
        self.dirs
            .iter()
            .map(|(_, d)| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(d.join("cgroup.procs"))
                    .map(OwnedFd::from)
                    .map_err(|e| format!("cannot open {}: {e}", d.join("cgroup.procs").display()))
            })
            .collect()
    }

    /// The limit the attempt broke, read from the kernel's counters.
    pub fn breach(&self) -> Option<Breach> {
        let count = |controller: &str, file: &str, key: &str| -> u64 {
            let Some(dir) = self.dir(controller) else { return 0 };
            std::fs::read_to_string(dir.join(file))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
                .unwrap_or(0)
        };
        if let Some(m) = self.limits.memory {
            let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
            if count("memory", file, "oom_kill ") > 0 {
                return Some(Breach {
                    limit: "memory",
                    message: format!("the agent went past its memory limit ({}) and was stopped", show_bytes(m)),
                });
            }
        }
        if let Some(p) = self.limits.pids
            && count("pids", "pids.events", "max ") > 0
        {
            return Some(Breach {
                limit: "pids",
                message: format!("the agent went past its limit of {p} processes and was stopped"),
            });
        }
        None
    }

    /// Kills every process of the cgroup, repeatedly until none is left (bounded).
    pub fn kill(&self) {
        let until = Instant::now() + Duration::from_secs(2);
        loop {
            let mut live = 0;
            for (_, dir) in &self.dirs {
                if self.v2 {
                    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
                }
                for pid in std::fs::read_to_string(dir.join("cgroup.procs"))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse::<i32>().ok())
                {
                    live += 1;
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
                }
            }
            if live == 0 || Instant::now() > until {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        self.kill();
        let until = Instant::now() + Duration::from_secs(2);
        for (_, dir) in &self.dirs {
            // A killed process leaves its cgroup only once the kernel has reaped it.
            while std::fs::remove_dir(dir).is_err() && dir.exists() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}
