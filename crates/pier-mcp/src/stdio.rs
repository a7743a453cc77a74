//! A stdio MCP server's process: spawned with pipes, its stderr kept in a bounded tail, stopped
//! and reaped exactly once.
//!
//! Given a guard (`pier subagent-guard`, as the `pier` binary passes itself), the server runs
//! under it, as a subagent does: the guard leads a process group of its own, adopts what the
//! server orphans, and ends the whole tree (a `setsid` child of an `npx` launcher included)
//! when told (SIGUSR1), when the server exits, and when pier dies (`PR_SET_PDEATHSIG(SIGTERM)`).
//! Without one, the server stays in pier's process group, so a signal to the agent's group
//! reaches it, and it gets `PR_SET_PDEATHSIG(SIGKILL)`, so a SIGKILLed agent leaves no server
//! behind (but a child that left the group can outlive it). The parent death
//! signal fires when the *thread* that spawned the child exits: servers must be started from a
//! thread that lives as long as the session (a runtime worker or the main thread, never a
//! `spawn_blocking` thread, which exits when idle).
//!
//! We spawn the process ourselves instead of using rmcp's `TokioChildProcess`: that transport
//! kills from its `Drop` with `tokio::spawn` (which panics outside a runtime), waits 3 s + 3 s on
//! shutdown, and keeps the child out of our reach, so we could neither signal it by pid without a
//! reuse race nor guarantee it is reaped.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;

/// Bytes of a server's stderr kept for error messages.
const STDERR_TAIL_BYTES: usize = 4 * 1024;

/// How long a guard told to end its tree gets before it is killed itself.
const GUARD_GRACE: Duration = Duration::from_secs(3);

/// How long we wait for the stderr reader to drain after the process is gone.
const STDERR_DRAIN: Duration = Duration::from_millis(500);

/// What to spawn; env values are added to the inherited environment.
pub(crate) struct Spawn<'a> {
    pub command: &'a Path,
    pub args: &'a [String],
    pub env: Vec<(OsString, OsString)>,
    pub cwd: &'a Path,
    /// The `pier` binary, whose `subagent-guard` leads the server's tree.
    pub guard: Option<&'a Path>,
}

/// A running (or exited, not yet reaped) server process. Dropping it kills and reaps it.
pub(crate) struct ChildProcess {
    pid: u32,
    /// Whether `pid` is the server's guard, which ends the tree itself on SIGUSR1.
    guarded: bool,
    /// `None` once the child has been stopped and reaped by [`ChildProcess::stop`]. An async
    /// lock, because [`ChildProcess::settle`] awaits the exit while holding it.
    child: tokio::sync::Mutex<Option<Child>>,
    stderr: Arc<StderrTail>,
    stderr_reader: Mutex<Option<JoinHandle<()>>>,
}

impl ChildProcess {
    /// Spawns the server and hands back its stdout and stdin for the MCP transport.
    pub(crate) fn spawn(spec: Spawn<'_>) -> std::io::Result<(ChildProcess, ChildStdout, ChildStdin)> {
        let mut cmd = match spec.guard {
            Some(pier) => {
                let mut cmd = Command::new(pier);
                cmd.args(["subagent-guard", "--"]).arg(spec.command).args(spec.args).process_group(0);
                cmd
            }
            None => {
                let mut cmd = Command::new(spec.command);
                cmd.args(spec.args);
                cmd
            }
        };
        cmd.envs(spec.env)
            .current_dir(spec.cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // The last line of defence: if every owner forgets the child, tokio still kills it.
            .kill_on_drop(true);
        // A guard takes SIGTERM as the news of pier's death, and ends its tree after a grace.
        let death = if spec.guard.is_some() { Signal::SIGTERM } else { Signal::SIGKILL };
        pier_tools::contain::die_with_parent(cmd.as_std_mut(), death);
        let mut child = cmd.spawn()?;
        let pid = child.id().ok_or_else(|| std::io::Error::other("the process exited before it could be tracked"))?;
        let (Some(stdout), Some(stdin), Some(stderr)) = (child.stdout.take(), child.stdin.take(), child.stderr.take())
        else {
            return Err(std::io::Error::other("the process's pipes were not opened"));
        };
        let tail = Arc::new(StderrTail::default());
        let reader = tokio::spawn(read_stderr(stderr, tail.clone()));
        let process = ChildProcess {
            pid,
            guarded: spec.guard.is_some(),
            child: tokio::sync::Mutex::new(Some(child)),
            stderr: tail,
            stderr_reader: Mutex::new(Some(reader)),
        };
        Ok((process, stdout, stdin))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The last bytes the server wrote to stderr, trimmed.
    pub(crate) fn stderr_tail(&self) -> String {
        self.stderr.text()
    }

    /// How the process ended, if it has; `None` while it runs (or while another caller holds it).
    pub(crate) fn exit_status(&self) -> Option<ExitStatus> {
        let mut guard = self.child.try_lock().ok()?;
        guard.as_mut().and_then(|child| child.try_wait().ok().flatten())
    }

    /// For a server whose connection is gone: waits (at most `wait`) for its process to exit and
    /// its stderr to reach end of file, so that the reason we give names the exit status and the
    /// server's last words. A server closes stdout an instant before it exits; without this, which
    /// of the two an error message saw depended on the scheduler.
    pub(crate) async fn settle(&self, wait: Duration) -> Option<ExitStatus> {
        let deadline = tokio::time::Instant::now() + wait;
        let status = {
            let mut guard = self.child.lock().await;
            match guard.as_mut() {
                Some(child) => tokio::time::timeout_at(deadline, child.wait()).await.ok().and_then(Result::ok),
                None => None,
            }
        };
        let mut closed = self.stderr.closed.subscribe();
        let _ = tokio::time::timeout_at(deadline, closed.wait_for(|closed| *closed)).await;
        status
    }

    /// SIGTERM, then SIGKILL after `grace`; the process is reaped before this returns. Waits
    /// (briefly) for the stderr reader so that the tail holds the server's last words.
    pub(crate) async fn stop(&self, grace: Duration) {
        let child = self.child.lock().await.take();
        if let Some(mut child) = child {
            // Signalling by pid is safe while we hold the unreaped child: the pid cannot be reused.
            if matches!(child.try_wait(), Ok(None)) {
                // SIGTERM and a grace to end its own work (a guard passes it to the whole
                // tree); then a guard is told to end the tree at once (SIGUSR1), and last, the
                // process is killed.
                let pid = i32::try_from(self.pid).ok().map(Pid::from_raw);
                if let Some(pid) = pid {
                    let _ = kill(pid, Signal::SIGTERM);
                }
                if tokio::time::timeout(grace, child.wait()).await.is_err() {
                    if let (true, Some(pid)) = (self.guarded, pid) {
                        let _ = kill(pid, Signal::SIGUSR1);
                    }
                    if !self.guarded || tokio::time::timeout(GUARD_GRACE, child.wait()).await.is_err() {
                        let _ = child.kill().await;
                    }
                }
            }
            // `try_wait` may have seen an exit without reaping on every platform; make sure.
            let _ = child.wait().await;
        }
        let reader = self.stderr_reader.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(reader) = reader {
            let abort = reader.abort_handle();
            if tokio::time::timeout(STDERR_DRAIN, reader).await.is_err() {
                // A grandchild may hold the pipe open; the tail we have is enough.
                abort.abort();
            }
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let child = self.child.get_mut().take();
        if let Some(mut child) = child {
            if self.guarded {
                // Told first, the guard ends the tree itself; the SIGKILL below (for a guard
                // that does not) comes once it had its moment, or at once without a runtime.
                if let (Ok(pid), Ok(None)) = (i32::try_from(self.pid), child.try_wait()) {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGUSR1);
                }
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move {
                        if tokio::time::timeout(GUARD_GRACE, child.wait()).await.is_err() {
                            let _ = child.kill().await;
                        }
                    });
                    if let Some(reader) = self.stderr_reader.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
                        reader.abort();
                    }
                    return;
                }
            }
            let _ = child.start_kill();
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        let _ = child.wait().await;
                    });
                }
                // Without a runtime, dropping the child (`kill_on_drop`) hands it to tokio's
                // orphan queue, which reaps it the next time any runtime handles SIGCHLD.
                Err(_) => drop(child),
            }
        }
        if let Some(reader) = self.stderr_reader.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            reader.abort();
        }
    }
}

/// The last [`STDERR_TAIL_BYTES`] of a stream, and whether the stream has ended.
struct StderrTail {
    ring: Mutex<VecDeque<u8>>,
    closed: tokio::sync::watch::Sender<bool>,
}

impl Default for StderrTail {
    fn default() -> Self {
        StderrTail { ring: Mutex::default(), closed: tokio::sync::watch::Sender::new(false) }
    }
}

impl StderrTail {
    fn push(&self, bytes: &[u8]) {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let bytes = &bytes[bytes.len().saturating_sub(STDERR_TAIL_BYTES)..];
        let overflow = (ring.len() + bytes.len()).saturating_sub(STDERR_TAIL_BYTES);
        ring.drain(..overflow);
        ring.extend(bytes);
    }

    fn text(&self) -> String {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let bytes: Vec<u8> = ring.iter().copied().collect();
        String::from_utf8_lossy(&bytes).trim().to_string()
    }
}

async fn read_stderr(mut stderr: tokio::process::ChildStderr, tail: Arc<StderrTail>) {
    let mut buf = [0u8; 4096];
    loop {
        match stderr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => tail.push(&buf[..n]),
        }
    }
    tail.closed.send_replace(true);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_tail_keeps_the_last_bytes() {
        let tail = StderrTail::default();
        tail.push(&vec![b'a'; STDERR_TAIL_BYTES - 2]);
        tail.push(b"bcde");
        let text = tail.text();
        assert_eq!(text.len(), STDERR_TAIL_BYTES);
        assert!(text.ends_with("bcde"));
        assert!(text.starts_with("aa"));
        tail.push(&vec![b'z'; STDERR_TAIL_BYTES * 2]);
        assert_eq!(tail.text(), "z".repeat(STDERR_TAIL_BYTES));
    }
}
