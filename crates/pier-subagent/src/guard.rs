//! `pier subagent-guard -- PROGRAM ARGS…`: the leader of a subagent's process group,
//! so that the whole group dies with the parent however the parent dies.
//!
//! The parent starts the guard with `PR_SET_PDEATHSIG(SIGTERM)` in a new process group;
//! the guard starts the agent in that same group, with its stdio, and waits. When the
//! agent exits, the guard exits with its status (the parent then ends the group as it
//! always does). When the parent dies, even by SIGKILL where no destructor of the
//! parent runs, the kernel sends the guard SIGTERM and the guard SIGKILLs its whole
//! group: the agent and everything the agent started that stayed in its group (a node
//! wrapper's real agent, a grandchild pier). Without the guard, a parent-death signal
//! would reach only the agent itself.
//!
//! It runs before any runtime or thread starts: the signals it waits for are blocked
//! in its only thread and taken with `sigwait`, so no handler runs.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;

use nix::sys::signal::{SigSet, SigmaskHow, Signal, killpg, sigprocmask};
use nix::unistd::getpgrp;

/// Runs `program` under the guard; returns the exit code to exit with.
pub fn run(program: &OsString, args: &[OsString]) -> i32 {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGCHLD] {
        set.add(s);
    }
    if let Err(e) = sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None) {
        eprintln!("pier subagent-guard: cannot block signals: {e}");
        return 126;
    }
    // std resets the signal mask of the child before it execs, so the agent starts with
    // the default mask, not the guard's.
    let mut child = match std::process::Command::new(program).args(args).spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("pier subagent-guard: cannot start {}: {e}", program.to_string_lossy());
            return 127;
        }
    };
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => match child.try_wait() {
                Ok(Some(status)) => return status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
                Ok(None) => {}
                Err(e) => {
                    eprintln!("pier subagent-guard: cannot wait for the agent: {e}");
                    end_group();
                }
            },
            Ok(_) => end_group(),
            Err(e) => {
                eprintln!("pier subagent-guard: cannot wait for signals: {e}");
                end_group();
            }
        }
    }
}

/// SIGKILLs the guard's whole group, the guard included.
fn end_group() {
    let _ = killpg(getpgrp(), Signal::SIGKILL);
}
