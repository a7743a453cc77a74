//! `pier jail --spec JSON -- PROGRAM ARGS…`: the process between pier and a confined agent.
//!
//! pier starts it (in the attempt's cgroup, with `PR_SET_PDEATHSIG`, the proxy's control
//! socket on descriptor 3); it runs before any runtime or thread starts, and:
//! 1. unshares a user, mount and PID namespace (and a network namespace for `strict`), maps
//!    its own uid and gid, and in the network namespace brings loopback up, binds the proxy's
//!    port and sends the listener to pier ([`crate::netns`]);
//! 2. forks: the child is PID 1 of the new namespace. It builds the jail's root
//!    ([`crate::mounts`]), restricts itself with Landlock ([`crate::rules`]), starts the agent
//!    and reaps everything in the namespace; when the agent exits, PID 1 exits with its
//!    status and the kernel kills whatever is left in the namespace: nothing the agent
//!    started, however it detached, outlives it.
//! 3. The parent (still in pier's PID namespace, so pier can signal it) waits for PID 1 and
//!    passes on SIGTERM/SIGINT/SIGHUP/SIGUSR1; it exits with PID 1's status.
//!
//! Signals are blocked in the only thread and taken with `sigwait`, as in
//! `pier subagent-guard`; std resets the mask of the agent before it execs.

use std::ffi::OsString;
use std::time::Duration;

use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, getgid, getuid};

use crate::spec::Spec;

/// How long the agent gets to end its own work when pier asks it to stop.
const TERM_GRACE: Duration = Duration::from_secs(3);

/// What `pier jail --probe` prints on stderr when a jail can be built here.
pub const PROBE_OK: &str = "pier jail: namespaces ok";

/// The exit status of a jail that could not be built (the reason is on stderr).
pub const SETUP_FAILED: i32 = 125;

/// Runs `program` in the jail `spec` describes; returns the exit code to exit with.
pub fn run(spec: &str, program: &OsString, args: &[OsString]) -> i32 {
    let set = signals();
    if let Err(e) = sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None) {
        return fail(&format!("cannot block signals: {e}"));
    }
    let spec: Spec = match serde_json::from_str(spec) {
        Ok(s) => s,
        Err(e) => {
            return fail(&format!("the jail's spec does not parse ({e}); pier and `pier jail` must be the same build"));
        }
    };
    if let Err(e) = enter(spec.net) {
        return fail(&e);
    }
    if spec.net
        && let Err(e) = crate::netns::hand_over_proxy_port()
    {
        return fail(&e);
    }
    // SAFETY: this process has one thread (the helper runs before any runtime starts), so the
    // child may do anything the parent could.
    #[allow(unsafe_code)]
    let forked = unsafe { nix::unistd::fork() };
    match forked {
        Ok(ForkResult::Child) => {
            let code = match init(&spec, program, args, &set) {
                Ok(code) => code,
                Err(e) => fail(&e),
            };
            std::process::exit(code)
        }
        Ok(ForkResult::Parent { child }) => outer(child, &set),
        Err(e) => fail(&format!("cannot start the jail's first process: {e}")),
    }
}

/// `pier jail --probe`: whether this kernel lets pier build a jail; the reason on stderr if not.
pub fn probe() -> i32 {
    if let Err(e) = enter(true) {
        return fail(&e);
    }
    // SAFETY: as in `run`: one thread.
    #[allow(unsafe_code)]
    let forked = unsafe { nix::unistd::fork() };
    match forked {
        Ok(ForkResult::Child) => {
            let code = match crate::mounts::probe() {
                Ok(()) => 0,
                Err(e) => fail(&e),
            };
            std::process::exit(code)
        }
        Ok(ForkResult::Parent { child }) => match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, 0)) => {
                // The word the prober looks for: a program that merely exits 0 is not a jail.
                eprintln!("{PROBE_OK}");
                0
            }
            Ok(WaitStatus::Exited(_, code)) => code,
            other => fail(&format!("the probe ended as {other:?}")),
        },
        Err(e) => fail(&format!("cannot fork: {e}")),
    }
}

fn signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGCHLD, Signal::SIGALRM, Signal::SIGUSR1] {
        set.add(s);
    }
    set
}

fn fail(message: &str) -> i32 {
    eprintln!("pier jail: {message}");
    SETUP_FAILED
}

/// Unshares the namespaces and maps the ids; with `net`, brings the new namespace's loopback up.
fn enter(net: bool) -> Result<(), String> {
    let (uid, gid) = (getuid(), getgid());
    let mut flags = CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID;
    if net {
        flags |= CloneFlags::CLONE_NEWNET;
    }
    unshare(flags).map_err(|e| {
        format!(
            "cannot create the jail's namespaces ({e}): this kernel or its policy forbids unprivileged user \
             namespaces (see sysctl user.max_user_namespaces and kernel.apparmor_restrict_unprivileged_userns); \
             allow them, or run the task with sandbox = \"off\""
        )
    })?;
    let write = |file: &str, text: String| {
        std::fs::write(file, text).map_err(|e| format!("cannot write {file} in the jail's user namespace: {e}"))
    };
    write("/proc/self/setgroups", "deny".into())?;
    write("/proc/self/uid_map", format!("{uid} {uid} 1"))?;
    write("/proc/self/gid_map", format!("{gid} {gid} 1"))?;
    if net {
        crate::netns::loopback_up()?;
    }
    Ok(())
}

/// PID 1 of the jail: builds its root, confines itself, starts the agent and reaps.
fn init(spec: &Spec, program: &OsString, args: &[OsString], set: &SigSet) -> Result<i32, String> {
    // The outer helper's death (pier killed it, or pier died and it followed) ends the jail.
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(|e| format!("cannot set the parent-death signal: {e}"))?;
    crate::mounts::build(spec)?;
    crate::rules::restrict(spec)?;
    let agent = std::process::Command::new(program)
        .args(args)
        .current_dir(&spec.cwd)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", program.to_string_lossy()))?;
    let agent = Pid::from_raw(agent.id() as i32);
    let mut terminating = false;
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => {
                if let Some(code) = reap(agent) {
                    return Ok(code);
                }
            }
            Ok(Signal::SIGUSR1 | Signal::SIGALRM) => return Ok(128 + Signal::SIGKILL as i32),
            Ok(_) if !terminating => {
                terminating = true;
                // -1 from PID 1: every process of the namespace but PID 1 itself.
                let _ = kill(Pid::from_raw(-1), Signal::SIGTERM);
                nix::unistd::alarm::set(TERM_GRACE.as_secs() as u32);
            }
            Ok(_) => {}
            Err(e) => return Err(format!("cannot wait for signals: {e}")),
        }
    }
}

/// The helper outside the namespace: passes pier's signals to PID 1 and exits with its status.
fn outer(init: Pid, set: &SigSet) -> i32 {
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => match waitpid(init, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(_, code)) => return code,
                Ok(WaitStatus::Signaled(_, signal, _)) => return 128 + signal as i32,
                _ => {}
            },
            Ok(Signal::SIGALRM) => {}
            Ok(signal) => {
                let _ = kill(init, signal);
            }
            Err(_) => {
                let _ = kill(init, Signal::SIGKILL);
            }
        }
    }
}

/// Reaps every exited child; the agent's exit code once it is among them.
fn reap(agent: Pid) -> Option<i32> {
    let mut code = None;
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, status)) if pid == agent => code = Some(status),
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == agent => code = Some(128 + signal as i32),
            Ok(WaitStatus::StillAlive) | Err(_) => return code,
            Ok(_) => {}
        }
    }
}
