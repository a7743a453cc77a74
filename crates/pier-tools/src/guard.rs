//! `pier command-guard`: a command run through someone else's process (an ACP client's
//! `terminal/create`) confined as `run_command` confines its own ([`crate::contain`]: a new
//! session, its own cgroup where one can be made, Landlock on writes), its output going to
//! the guard's own stdout and stderr (the client's terminal). When the shell exits, or the
//! guard is told to stop (SIGTERM, SIGINT, SIGHUP: a client's `terminal/kill`), everything the
//! command started is killed before the guard exits; a guard killed outright leaves the rest
//! to whoever knows the command's marker ([`crate::contain::end_marked`]).

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::signal::unix::{SignalKind, signal};

use crate::contain::{self, Confinement};

/// What the guard runs.
#[derive(Debug, Clone)]
pub struct Guarded {
    /// Given to `sh -c`.
    pub command: String,
    pub confinement: Confinement,
    /// Where the command may write (with Landlock).
    pub writable: Vec<PathBuf>,
    /// Its `PIER_COMMAND_ID` ([`contain::is_marker`]).
    pub marker: String,
}

/// Runs `g` to its end: the shell's exit code, 128 + the signal that ended it (or that told
/// the guard to stop), 127 when it could not start.
pub async fn run(g: Guarded) -> i32 {
    if !contain::is_marker(&g.marker) {
        eprintln!("pier command-guard: --marker takes 32 hex digits");
        return 2;
    }
    // Watched before the shell starts: a stop that comes at once still ends the command.
    let stops = [SignalKind::terminate(), SignalKind::interrupt(), SignalKind::hangup()].map(signal);
    let [Ok(mut term), Ok(mut int), Ok(mut hup)] = stops else {
        eprintln!("pier command-guard: could not watch for signals");
        return 2;
    };
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c").arg(&g.command).stdin(Stdio::null()).stdout(Stdio::inherit()).stderr(Stdio::inherit());
    let (mut child, mut contained) = match contain::spawn_marked(&mut cmd, &g.confinement, &g.writable, g.marker) {
        Ok(started) => started,
        Err(e) => {
            eprintln!("pier command-guard: could not start sh: {e}");
            return 127;
        }
    };
    let code = tokio::select! {
        status = child.wait() => match status {
            Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
            Err(_) => 1,
        },
        _ = term.recv() => 128 + libc::SIGTERM,
        _ = int.recv() => 128 + libc::SIGINT,
        _ = hup.recv() => 128 + libc::SIGHUP,
    };
    // Nothing the command started outlives it, however it ended.
    let _ = tokio::task::spawn_blocking(move || contained.end()).await;
    let _ = child.wait().await;
    code
}
