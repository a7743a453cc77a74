//! `pier subagent-guard -- PROGRAM ARGS…`: the leader of a subagent's process group,
//! so that the whole group dies with the parent however the parent dies, and nothing
//! the agent leaves behind becomes the parent's to reap.
//!
//! The parent starts the guard with `PR_SET_PDEATHSIG(SIGTERM)` in a new process group;
//! the guard makes itself a child subreaper and starts the agent in that same group,
//! with its stdio, and waits:
//! - When the agent exits, the guard SIGKILLs what is left of its group (a helper the
//!   agent started and orphaned), reaps everything it adopted, and exits with the
//!   agent's status (the parent then ends the group as it always does).
//! - When the parent ends the agent (SIGUSR1: a cancel not confirmed in time, a kill),
//!   the guard SIGKILLs the rest of its group, reaps it, and exits.
//! - When the parent dies, even by SIGKILL where no destructor of the parent runs, the
//!   kernel sends the guard SIGTERM: the guard passes SIGTERM to its group, so an agent
//!   that ends its own work on SIGTERM can (pier's own agent cancels its turns, which
//!   ends the commands they run, in sessions and cgroups of their own), waits for the
//!   agent at most [`TERM_GRACE`], then SIGKILLs the group and reaps it.
//!
//! A grandchild agent (a child pier's own subagent) has a guard of its own, in a group of
//! its own, told of its parent's death the same way.
//!
//! It runs before any runtime or thread starts: the signals it waits for are blocked
//! in its only thread and taken with `sigwait`, so no handler runs.

use std::ffi::OsString;
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, killpg, sigprocmask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, getpgrp, getpid};

/// How long an agent gets to end its own work after the parent died.
pub const TERM_GRACE: Duration = Duration::from_secs(3);

/// Runs `program` under the guard; returns the exit code to exit with.
pub fn run(program: &OsString, args: &[OsString]) -> i32 {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGCHLD, Signal::SIGALRM, Signal::SIGUSR1] {
        set.add(s);
    }
    if let Err(e) = sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None) {
        eprintln!("pier subagent-guard: cannot block signals: {e}");
        return 126;
    }
    // Orphans of the agent's tree come to the guard, which reaps them, not to the parent.
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        eprintln!("pier subagent-guard: cannot become a subreaper: {e}");
    }
    // std resets the signal mask of the child before it execs, so the agent starts with
    // the default mask, not the guard's.
    let agent = match std::process::Command::new(program).args(args).spawn() {
        Ok(child) => Pid::from_raw(child.id() as i32),
        Err(e) => {
            eprintln!("pier subagent-guard: cannot start {}: {e}", program.to_string_lossy());
            return 127;
        }
    };
    let mut terminating = false;
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => {
                if let Some(code) = reap(agent) {
                    end_rest(Duration::from_secs(2));
                    return code;
                }
            }
            Ok(Signal::SIGUSR1) => {
                // The parent ends the agent now: the group goes, and nothing is left unreaped.
                end_rest(Duration::from_secs(2));
                return 128 + Signal::SIGKILL as i32;
            }
            Ok(Signal::SIGALRM) => {
                // The agent did not end in its grace: end everything but the guard (a SIGKILL
                // to the group would end the guard first, and leave what left the group).
                end_rest(Duration::from_secs(2));
                return 128 + Signal::SIGKILL as i32;
            }
            Ok(_) if !terminating => {
                terminating = true;
                // The group at once; then what left it (a second SIGTERM to the others is harmless).
                let _ = killpg(getpgrp(), Signal::SIGTERM);
                for pid in own_processes() {
                    let _ = kill(pid, Signal::SIGTERM);
                }
                nix::unistd::alarm::set(TERM_GRACE.as_secs() as u32);
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("pier subagent-guard: cannot wait for signals: {e}");
                let _ = killpg(getpgrp(), Signal::SIGKILL);
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

/// After the agent exited: SIGKILLs the rest of the group and every descendant of the
/// guard (a child that left the group with `setsid`, as `npx` and `uvx` launchers do, is
/// still one: its parent's, or, orphaned, the subreaper guard's), and reaps what the guard
/// adopted, for at most `bound`.
fn end_rest(bound: Duration) {
    let until = Instant::now() + bound;
    loop {
        let others = own_processes();
        for pid in &others {
            let _ = kill(*pid, Signal::SIGKILL);
        }
        let _ = reap(Pid::from_raw(0));
        if others.is_empty() || Instant::now() >= until {
            // Whatever is still a child of ours is reaped here (it was killed above).
            while let Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) =
                waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG))
            {}
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The guard's own: the live processes of its group and those below it in the tree of
/// parents (the guard itself left out), from one pass over `/proc`.
fn own_processes() -> Vec<Pid> {
    let (me, group) = (getpid().as_raw(), getpgrp().as_raw());
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    // (pid, parent, group) of every live process.
    let mut live = Vec::new();
    for pid in entries.flatten().filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok())) {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis: state, ppid, pgrp, ...
        let rest = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let number = |i: usize| fields.get(i).and_then(|f| f.parse::<i32>().ok());
        if let (Some(state), Some(ppid), Some(pgrp)) = (fields.first(), number(1), number(2))
            && *state != "Z"
        {
            live.push((pid, ppid, pgrp));
        }
    }
    let mut found = vec![me];
    let mut i = 0;
    while let Some(&parent) = found.get(i) {
        found.extend(live.iter().filter(|(_, ppid, _)| *ppid == parent).map(|(pid, ..)| *pid));
        i += 1;
    }
    for (pid, _, pgrp) in &live {
        if *pgrp == group && !found.contains(pid) {
            found.push(*pid);
        }
    }
    found.into_iter().filter(|p| *p != me).map(Pid::from_raw).collect()
}
