//! Commands that cannot outlive their turn nor write outside the roots: how
//! `run_command` and pier-client's `terminal/create` start and end a process.
//!
//! # The guarantee
//!
//! [`spawn`] starts the command in a new session (`setsid`), so its process group
//! and session id are its own pid, and marks its environment with a
//! `PIER_COMMAND_ID` unique to it. Where a cgroup v2 directory can be created next
//! to pier's own (`/sys/fs/cgroup`, writable), the child moves itself into a fresh
//! cgroup before it execs; cgroup membership is inherited by every fork and cannot
//! be left without write access to the cgroup tree. Before the first command
//! without a cgroup, pier makes itself a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`, once), so a process that detaches (`setsid -f`, a
//! double fork) is reparented to pier, not to init, and can be found. (With a
//! cgroup pier need not be a subreaper, and is not: a subreaper also adopts the
//! orphans of pier's other children — agents, MCP servers — and would have to
//! reap them, which it cannot tell from the children tokio waits for.)
//!
//! [`Contained::end`] (called when the command's shell exits, on timeout, on
//! cancel, at a terminal's release, and by `Drop`) SIGKILLs, repeatedly until none
//! is left (bounded by two seconds): every process of the command's cgroup; its
//! process group and session; every process whose parent chain leads to the
//! shell; every child of pier that carries the command's `PIER_COMMAND_ID`; and
//! every descendant of those. It then reaps the killed processes pier adopted.
//!
//! So: with a cgroup, no process the command started survives `end`, however it
//! detached. Without one, a process survives only if it both left the session
//! (`setsid`) and cleared its environment (`env -i`) and was orphaned: that is
//! the only gap, and it needs a command written to escape.
//!
//! # Landlock
//!
//! Where the kernel offers Landlock and [`Confinement::landlock`] is on, the child
//! restricts itself before it execs (the way codex's Linux sandbox does): every
//! *write* access right of ABI 5 is handled, and allowed only beneath the
//! workspace's roots, the system temp directory (`$TMPDIR` and `/tmp`), `/dev/shm`
//! and the terminal and null devices. Reads and execution stay open; the network
//! is not restricted. A write elsewhere fails with `EACCES`.

use std::collections::HashSet;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use landlock::{ABI, AccessFs, Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, path_beneath_rules};
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// The environment variable that marks a command's processes.
pub const MARKER_VAR: &str = "PIER_COMMAND_ID";

/// How commands are confined. The binary sets it from `--sandbox` / `sandbox = "off"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    /// Restrict the command's writes to the roots and the temp directory with Landlock, where available.
    pub landlock: bool,
    /// Put each command in a cgroup of its own, where one can be created.
    pub cgroups: bool,
}

impl Default for Confinement {
    fn default() -> Self {
        Confinement { landlock: true, cgroups: true }
    }
}

impl Confinement {
    /// No Landlock: `--sandbox off`. Commands still end with their turn.
    pub fn off() -> Confinement {
        Confinement { landlock: false, ..Confinement::default() }
    }
}

/// What the machine offers, found once.
#[derive(Debug, Clone)]
pub struct Machine {
    /// The kernel's Landlock ABI, `None` where Landlock is unavailable.
    pub landlock_abi: Option<u32>,
    /// The cgroup v2 directory commands' cgroups are created in, if writable.
    pub cgroup_base: Option<PathBuf>,
}

/// Probes Landlock and cgroups, once; later calls return the same.
pub fn init() -> &'static Machine {
    static MACHINE: OnceLock<Machine> = OnceLock::new();
    MACHINE.get_or_init(|| Machine { landlock_abi: landlock_abi(), cgroup_base: cgroup_base() })
}

/// Makes pier a child subreaper, once; whether it is one.
pub fn become_subreaper() -> bool {
    static SUBREAPER: OnceLock<bool> = OnceLock::new();
    *SUBREAPER.get_or_init(|| nix::sys::prctl::set_child_subreaper(true).is_ok())
}

/// One line for pier's start-up log: which confinement commands get. Without
/// cgroups, this makes pier a child subreaper already.
pub fn describe(confinement: &Confinement) -> String {
    let m = init();
    let landlock = match (confinement.landlock, m.landlock_abi) {
        (false, _) => "landlock off (--sandbox off): commands may write anywhere the user can".to_owned(),
        (true, Some(abi)) => format!("landlock ABI {abi}: command writes confined to the roots and the temp dir"),
        (true, None) => "landlock unavailable: commands may write anywhere the user can".to_owned(),
    };
    let ending = match (&m.cgroup_base, confinement.cgroups) {
        (Some(base), true) => format!("a cgroup per command under {}", base.display()),
        _ if become_subreaper() => "no cgroups: pier is a child subreaper and kills each command's session, group, \
                                    descendants and marked orphans"
            .to_owned(),
        _ => "no cgroups and no subreaper: a command's orphans that leave its session survive it".to_owned(),
    };
    format!("{landlock}; {ending}")
}

/// A started command's processes, ended by [`Contained::end`] or on drop.
#[derive(Debug)]
pub struct Contained {
    shell: Option<Pid>,
    marker: String,
    cgroup: Option<PathBuf>,
}

/// Starts `cmd` contained: in a new session, marked, in its own cgroup where
/// possible, and under Landlock (writes beneath `writable` and the temp dirs) when
/// `confinement` asks and the kernel offers it. `cmd` must not set a process group.
pub fn spawn(
    cmd: &mut tokio::process::Command,
    confinement: &Confinement,
    writable: &[PathBuf],
) -> std::io::Result<(tokio::process::Child, Contained)> {
    spawn_marked(cmd, confinement, writable, new_marker())
}

/// A fresh `PIER_COMMAND_ID`: 32 hex digits.
pub fn new_marker() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// Whether `marker` is one [`new_marker`] could have made.
pub fn is_marker(marker: &str) -> bool {
    marker.len() == 32 && marker.bytes().all(|b| b.is_ascii_hexdigit())
}

/// [`spawn`] with the command's `PIER_COMMAND_ID` chosen by the caller: one who started the
/// command through someone else (a client's terminal running `pier command-guard`) can end
/// what is left of it by that marker ([`end_marked`]).
pub fn spawn_marked(
    cmd: &mut tokio::process::Command,
    confinement: &Confinement,
    writable: &[PathBuf],
    marker: String,
) -> std::io::Result<(tokio::process::Child, Contained)> {
    let machine = init();
    cmd.env(MARKER_VAR, &marker);
    let cgroup = match (&machine.cgroup_base, confinement.cgroups) {
        (Some(base), true) => new_cgroup(base),
        _ => None,
    };
    if cgroup.is_none() {
        become_subreaper();
    }
    let procs: Option<OwnedFd> = match &cgroup {
        Some(dir) => std::fs::OpenOptions::new().write(true).open(dir.join("cgroup.procs")).ok().map(OwnedFd::from),
        None => None,
    };
    let mut ruleset = match (confinement.landlock, machine.landlock_abi) {
        (true, Some(_)) => Some(landlock_ruleset(writable).map_err(std::io::Error::other)?),
        _ => None,
    };
    // Runs in the child between fork and exec: only async-signal-safe system calls, no allocation.
    before_exec(cmd, move || {
        nix::unistd::setsid()?;
        if let Some(fd) = &procs {
            // "0" moves the writing process itself.
            nix::unistd::write(fd, b"0")?;
        }
        if let Some(ruleset) = ruleset.take() {
            ruleset.restrict_self().map_err(|_| std::io::Error::from_raw_os_error(libc::EPERM))?;
        }
        Ok(())
    });
    let child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            if let Some(dir) = &cgroup {
                let _ = std::fs::remove_dir(dir);
            }
            return Err(e);
        }
    };
    let shell = child.id().map(|id| Pid::from_raw(id as i32));
    Ok((child, Contained { shell, marker, cgroup }))
}

impl Contained {
    /// Kills every process of the command (see the module doc for which) and reaps
    /// those pier adopted. Blocks for at most about two seconds; idempotent.
    pub fn end(&mut self) {
        let Some(shell) = self.shell.take() else { return };
        let me = nix::unistd::getpid();
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut adopted: HashSet<i32> = HashSet::new();
        loop {
            let _ = killpg(shell, Signal::SIGKILL);
            let mut live = 0usize;
            if let Some(dir) = &self.cgroup {
                // cgroup.kill (Linux 5.14) kills the whole cgroup at once; the loop covers older kernels.
                let _ = std::fs::write(dir.join("cgroup.kill"), "1");
                for pid in read_pids(&dir.join("cgroup.procs")) {
                    live += 1;
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            for p in self.tree(shell, me) {
                if p.ppid == me.as_raw() && p.pid != shell.as_raw() {
                    adopted.insert(p.pid);
                }
                if !p.zombie {
                    live += 1;
                    let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL);
                }
            }
            if live == 0 {
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!(live, "processes of a command were still alive two seconds after SIGKILL");
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        // Adopted processes are pier's children now: reap them (never the shell, which its owner waits for).
        for pid in adopted {
            loop {
                match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    _ => break,
                }
            }
        }
        if let Some(dir) = self.cgroup.take() {
            while !remove_cgroup(&dir, 0) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// The processes of the command that are visible through /proc: its session or
    /// group, pier's children carrying its marker, and the descendants of those and
    /// of the shell.
    fn tree(&self, shell: Pid, me: Pid) -> Vec<ProcStat> {
        let procs = scan_proc();
        let shell = shell.as_raw();
        let needle = format!("{MARKER_VAR}={}\0", self.marker).into_bytes();
        let mut members: HashSet<i32> = procs
            .iter()
            .filter(|p| p.pid != me.as_raw() && p.pid > 1)
            .filter(|p| {
                p.sid == shell
                    || p.pgid == shell
                    || p.pid == shell
                    || (p.ppid == me.as_raw() && environ_has(p.pid, &needle))
            })
            .map(|p| p.pid)
            .collect();
        members.insert(shell);
        loop {
            let before = members.len();
            for p in &procs {
                if members.contains(&p.ppid) && p.pid != me.as_raw() {
                    members.insert(p.pid);
                }
            }
            if members.len() == before {
                break;
            }
        }
        procs.into_iter().filter(|p| members.contains(&p.pid)).collect()
    }
}

impl Drop for Contained {
    fn drop(&mut self) {
        self.end();
    }
}

/// Removes cgroup `dir` and the cgroups a command made inside it (a `pier command-guard` run in
/// a terminal's cgroup makes its own there), deepest first; true once `dir` is gone. Its
/// processes are dead already (`cgroup.kill` reaches every cgroup below).
fn remove_cgroup(dir: &Path, depth: usize) -> bool {
    if depth < 8
        && let Ok(entries) = std::fs::read_dir(dir)
    {
        for child in entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
            remove_cgroup(&child.path(), depth + 1);
        }
    }
    std::fs::remove_dir(dir).is_ok() || !dir.exists()
}

/// SIGKILLs, until none is left (bounded by two seconds), every process this user may
/// signal whose environment carries `marker` as its `PIER_COMMAND_ID`, and their
/// descendants: what is left of a command started through someone else (a client's
/// terminal), whatever became of the process that started it. The number killed.
pub fn end_marked(marker: &str) -> usize {
    if !is_marker(marker) {
        return 0;
    }
    let needle = format!("{MARKER_VAR}={marker}\0").into_bytes();
    let me = nix::unistd::getpid().as_raw();
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut killed = HashSet::new();
    loop {
        let procs = scan_proc();
        let mut members: HashSet<i32> = procs
            .iter()
            .filter(|p| p.pid != me && p.pid > 1 && !p.zombie && environ_has(p.pid, &needle))
            .map(|p| p.pid)
            .collect();
        loop {
            let before = members.len();
            for p in &procs {
                if members.contains(&p.ppid) && p.pid != me && !p.zombie {
                    members.insert(p.pid);
                }
            }
            if members.len() == before {
                break;
            }
        }
        if members.is_empty() {
            break;
        }
        for pid in &members {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
            killed.insert(*pid);
        }
        if Instant::now() > deadline {
            tracing::warn!(live = members.len(), "processes of a command were still alive two seconds after SIGKILL");
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    killed.len()
}

/// One line of `/proc/PID/stat`, the fields this needs.
#[derive(Debug)]
struct ProcStat {
    pid: i32,
    ppid: i32,
    pgid: i32,
    sid: i32,
    zombie: bool,
}

fn scan_proc() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command name may hold spaces and parentheses: fields start after the last ')'.
            let rest = &stat[stat.rfind(')')? + 1..];
            let mut f = rest.split_whitespace();
            let state = f.next()?;
            let ppid = f.next()?.parse().ok()?;
            let pgid = f.next()?.parse().ok()?;
            let sid = f.next()?.parse().ok()?;
            Some(ProcStat { pid, ppid, pgid, sid, zombie: state == "Z" || state == "X" })
        })
        .collect()
}

fn environ_has(pid: i32, needle: &[u8]) -> bool {
    let mut env = Vec::new();
    match std::fs::File::open(format!("/proc/{pid}/environ")) {
        Ok(f) => {
            if f.take(1 << 20).read_to_end(&mut env).is_err() {
                return false;
            }
        }
        Err(_) => return false,
    }
    // Each entry is NUL-terminated; match whole entries.
    env.split(|&b| b == 0).any(|entry| entry.len() + 1 == needle.len() && needle.starts_with(entry))
}

fn read_pids(path: &Path) -> Vec<i32> {
    std::fs::read_to_string(path).map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect()).unwrap_or_default()
}

/// pier's own cgroup v2 directory, if pier may create cgroups in it.
fn cgroup_base() -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?.trim().trim_start_matches('/').to_owned();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = mounts.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        right.starts_with("cgroup2 ").then(|| left.split(' ').nth(4).map(PathBuf::from))?
    })?;
    let base = mount.join(rel);
    let probe = new_cgroup(&base)?;
    std::fs::remove_dir(&probe).ok()?;
    Some(base)
}

fn new_cgroup(base: &Path) -> Option<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = base.join(format!("pier-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir(&dir).ok()?;
    Some(dir)
}

/// The Landlock ruleset of a command: writes allowed beneath `writable`, the temp directories and the usual devices.
fn landlock_ruleset(writable: &[PathBuf]) -> Result<RulesetCreated, landlock::RulesetError> {
    let abi = ABI::V5;
    let write = AccessFs::from_write(abi);
    let mut dirs: Vec<PathBuf> = writable.to_vec();
    dirs.push(std::env::temp_dir());
    dirs.extend(["/tmp", "/var/tmp", "/dev/shm"].map(PathBuf::from));
    let devices = ["/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/ptmx", "/dev/pts"];
    Ruleset::default()
        .handle_access(write)?
        .create()?
        .add_rules(path_beneath_rules(dirs, write))?
        .add_rules(path_beneath_rules(devices, write))
}

/// The kernel's Landlock ABI version, `None` where Landlock is unavailable.
#[allow(unsafe_code)]
fn landlock_abi() -> Option<u32> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute pointer, size 0 and the VERSION flag, the kernel
    // reads no memory and only returns the ABI version (or an error).
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(v).ok().filter(|v| *v > 0)
}

/// Registers `f` to run in the child after fork, before exec.
#[allow(unsafe_code)]
fn before_exec(cmd: &mut tokio::process::Command, f: impl FnMut() -> std::io::Result<()> + Send + Sync + 'static) {
    // SAFETY: `f` (the closure in `spawn`) only calls setsid, write and the two
    // system calls of `RulesetCreated::restrict_self` (prctl and
    // landlock_restrict_self), all async-signal-safe, allocates nothing, and
    // touches no lock: it is sound in the forked child of a multithreaded process.
    unsafe {
        cmd.pre_exec(f);
    }
}

/// Makes the kernel send `signal` to the child when the thread that spawned it dies, even
/// by SIGKILL, where no destructor of pier runs (`PR_SET_PDEATHSIG`). Spawn from a thread
/// that lives as long as the child should (a runtime worker or the main thread, never a
/// `spawn_blocking` thread, which exits when idle).
#[allow(unsafe_code)]
pub fn die_with_parent(cmd: &mut std::process::Command, signal: Signal) {
    use std::os::unix::process::CommandExt;
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // calls are allowed: prctl(2) and getppid(2) are plain system calls that neither allocate nor
    // take locks (the error path builds an io::Error from an errno, no allocation either).
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(signal).map_err(std::io::Error::from)?;
            // pier may have died between fork and prctl; then nobody would ever send the signal.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::from(nix::errno::Errno::ESRCH));
            }
            Ok(())
        });
    }
}
