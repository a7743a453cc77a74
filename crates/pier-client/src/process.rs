//! The agent as a child process: its own process group, piped stdio, stderr kept.
//!
//! The group is the unit of teardown. [`AgentProcess::shutdown`] closes the
//! agent's stdin, gives it a moment to exit, then kills the whole group and reaps
//! the agent; dropping an `AgentProcess` kills the group too, so no path out of
//! pier — success, error, panic unwinding — leaves the agent or its children behind.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::registry::AgentCommand;
use crate::{ClientError, ClientEvent};

/// The jail an agent process runs in: who starts it and what it allows.
#[derive(Clone)]
pub struct JailSetup {
    pub jailer: pier_jail::Jailer,
    pub request: pier_jail::Request,
}

impl std::fmt::Debug for JailSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.request.fmt(f)
    }
}

/// How long a jail's helper may take to hand over its proxy listener.
const JAIL_START: Duration = Duration::from_secs(10);

/// How many stderr lines are kept for error messages.
const STDERR_LINES: usize = 40;
/// An agent's stderr is sent on as it is read, the lines read together in one batch of at
/// most this many lines and bytes.
const STDERR_BATCH_LINES: usize = 64;
const STDERR_BATCH_BYTES: usize = 8 << 10;
/// How long a flush waits for the rest of a line already begun in the pipe.
const STDERR_FLUSH_WAIT: Duration = Duration::from_millis(200);

/// A running agent.
pub struct AgentProcess {
    pub name: String,
    child: Child,
    pgid: Option<Pid>,
    /// Led by `pier subagent-guard` ([`AgentCommand::guarded`]).
    guarded: bool,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// The task reading stderr; it ends at the agent's EOF.
    stderr_reader: Option<tokio::task::JoinHandle<()>>,
    /// Asks the stderr reader to send on what the agent has written so far (see
    /// [`AgentProcess::flush_stderr`]).
    flush: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<()>>,
    /// The agent's jail (its cgroup, proxy, private directories), undone on drop after the group is killed.
    jail: Option<pier_jail::Running>,
}

/// The pipes the connection runs over.
pub struct AgentPipes {
    pub stdin: ChildStdin,
    pub stdout: ChildStdout,
}

impl AgentProcess {
    /// Spawns `command` in `cwd`, inside `jail` when given. With `echo_stderr`, the agent's
    /// stderr is also copied to ours; with `stderr_events`, it is also sent there in batches
    /// ([`ClientEvent::Stderr`]), for the host to record. Call it from a long-lived thread (see [`AgentCommand::guarded`]):
    /// a jailed or guarded agent is told when that thread dies.
    pub async fn spawn(
        command: &AgentCommand,
        cwd: &std::path::Path,
        echo_stderr: bool,
        jail: Option<&JailSetup>,
        stderr_events: Option<crate::handler::EventSender>,
    ) -> Result<(AgentProcess, AgentPipes), ClientError> {
        let spawn_error = |message: String| ClientError::Spawn { agent: command.name.clone(), message };
        let mut prepared = match jail {
            Some(j) => {
                let program = pier_jail::Program {
                    program: command.program.clone(),
                    args: command.args.clone(),
                    env: command.env.clone(),
                };
                Some(j.jailer.prepare(&j.request, &program).map_err(|e| spawn_error(e.to_string()))?)
            }
            None => None,
        };
        let mut cmd = match &prepared {
            Some(p) => {
                let mut cmd = tokio::process::Command::new(&p.program);
                cmd.args(&p.args).envs(command.env.iter().map(|(k, v)| (k, v)));
                cmd
            }
            None => {
                let mut cmd = tokio::process::Command::new(&command.program);
                cmd.args(&command.args).envs(command.env.iter().map(|(k, v)| (k, v)));
                cmd
            }
        };
        for var in &command.env_remove {
            cmd.env_remove(var);
        }
        // The command's own variables win over a removal of the same name.
        cmd.envs(command.env.iter().map(|(k, v)| (k, v)));
        cmd.current_dir(cwd)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(p) = prepared.as_mut() {
            p.configure(&mut cmd);
        }
        if command.guarded || prepared.is_some() {
            pier_tools::contain::die_with_parent(cmd.as_std_mut(), Signal::SIGTERM);
        }
        let mut child = cmd.spawn().map_err(|e| spawn_error(format!("{}: {e}", command.program.display())))?;
        let guarded = command.guarded || prepared.is_some();
        let jail = match prepared {
            Some(p) => Some(p.started(command.name.clone(), JAIL_START).await),
            None => None,
        };
        let pgid = child.id().map(|id| Pid::from_raw(id as i32));
        let (Some(stdin), Some(stdout), Some(err)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(ClientError::Spawn { agent: command.name.clone(), message: "its pipes are missing".into() });
        };
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let sink = stderr.clone();
        let (flush, flushes) = tokio::sync::mpsc::channel(1);
        let stderr_reader = tokio::spawn(read_stderr(err, sink, echo_stderr, stderr_events, flushes));
        // Live agent processes, for `pier serve`'s /metrics (a no-op without a recorder).
        metrics::gauge!("pier_agent_processes").increment(1.0);
        Ok((
            AgentProcess {
                name: command.name.clone(),
                child,
                pgid,
                guarded,
                stderr,
                stderr_reader: Some(stderr_reader),
                flush,
                jail,
            },
            AgentPipes { stdin, stdout },
        ))
    }

    /// The agent's process id, which is also its process group id.
    pub fn pid(&self) -> Option<i32> {
        self.pgid.map(Pid::as_raw)
    }

    /// The limit of its jail the agent broke, if it broke one.
    pub fn breach(&self) -> Option<pier_jail::Breach> {
        self.jail.as_ref().and_then(pier_jail::Running::breach)
    }

    /// Sends on, as events, every whole line the agent wrote to stderr before now (what is in
    /// the pipe: written before the answer the caller just read, it belongs to that turn).
    /// Bounded: a reader that does not answer in time is not waited for.
    pub async fn flush_stderr(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.flush.try_send(tx).is_ok() {
            let _ = tokio::time::timeout(STDERR_FLUSH_WAIT * 2, rx).await;
        }
    }

    /// The last lines the agent wrote to stderr.
    pub fn stderr_tail(&self) -> Vec<String> {
        self.stderr.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().cloned().collect()
    }

    /// After the agent closed its end: waits (at most `grace`) for it to exit and for
    /// its last stderr lines, so an error can say how it ended.
    pub async fn settle_exit(&mut self, grace: Duration) {
        let _ = tokio::time::timeout(grace, self.child.wait()).await;
        if let Some(reader) = self.stderr_reader.take() {
            let _ = tokio::time::timeout(grace, reader).await;
        }
    }

    /// Whether the agent has exited, and how.
    pub fn try_exit(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills the whole group at once and reaps the agent.
    pub async fn kill(&mut self) {
        self.end_guarded().await;
        self.kill_group();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }

    /// A guard ends its own group when told (SIGUSR1), reaping what it adopted; the group's
    /// SIGKILL after is then only a fallback for a guard that did not.
    async fn end_guarded(&mut self) {
        if self.guarded
            && let Some(pid) = self.pgid
            && self.child.try_wait().ok().flatten().is_none()
        {
            let _ = nix::sys::signal::kill(pid, Signal::SIGUSR1);
            let _ = tokio::time::timeout(Duration::from_secs(3), self.child.wait()).await;
        }
    }

    /// Waits up to `grace` for the agent to exit by itself (its stdin is already
    /// closed), then kills the group; in every case the group is gone after.
    pub async fn shutdown(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        let status = tokio::time::timeout(grace, self.child.wait()).await.ok().and_then(Result::ok);
        if status.is_none() {
            self.end_guarded().await;
        }
        self.kill_group();
        match status {
            Some(s) => Some(s),
            None => tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await.ok().and_then(Result::ok),
        }
    }

    fn kill_group(&self) {
        if let Some(pgid) = self.pgid {
            // ESRCH just means everything is gone already.
            let _ = killpg(pgid, Signal::SIGKILL);
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        metrics::gauge!("pier_agent_processes").decrement(1.0);
        self.kill_group();
        // After the group: the jail's drop kills what is left in its cgroup and removes its directories.
        self.jail.take();
    }
}

/// Whether the pipe behind `fd` holds bytes to read now (or its writer is gone).
fn readable_now(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
}

/// Reads an agent's stderr to its end: each line kept in the tail (`sink`), echoed with
/// `echo`, and sent to `events` in batches of the lines read together; a flush request sends
/// what the pipe already holds before it is answered. A batch the event queue has no room
/// for is counted as dropped and said with the next.
async fn read_stderr(
    err: tokio::process::ChildStderr,
    sink: Arc<Mutex<VecDeque<String>>>,
    echo: bool,
    events: Option<crate::handler::EventSender>,
    mut flushes: tokio::sync::mpsc::Receiver<tokio::sync::oneshot::Sender<()>>,
) {
    use std::os::fd::AsFd;
    let mut lines = BufReader::new(err).lines();
    let keep = |line: &str| {
        if echo {
            eprintln!("{line}");
        }
        let mut kept = sink.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if kept.len() == STDERR_LINES {
            kept.pop_front();
        }
        kept.push_back(line.to_owned());
    };
    let (mut batch, mut bytes, mut dropped) = (Vec::new(), 0usize, 0u64);
    let mut send = |batch: &mut Vec<String>, bytes: &mut usize| {
        *bytes = 0;
        if batch.is_empty() {
            return;
        }
        let lines = std::mem::take(batch);
        let Some(events) = &events else { return };
        let n = lines.len() as u64;
        if events.send_unless_backlogged(ClientEvent::Stderr { lines, dropped }) {
            dropped = 0;
        } else {
            dropped += n;
        }
    };
    loop {
        tokio::select! {
            // `next_line` is cancel-safe: a line half read when a flush comes is read after it.
            line = lines.next_line() => {
                let Ok(Some(line)) = line else { break };
                keep(&line);
                bytes += line.len();
                batch.push(line);
                if batch.len() >= STDERR_BATCH_LINES || bytes >= STDERR_BATCH_BYTES || lines.get_ref().buffer().is_empty() {
                    send(&mut batch, &mut bytes);
                }
            }
            Some(done) = flushes.recv() => {
                let until = tokio::time::Instant::now() + STDERR_FLUSH_WAIT;
                while !lines.get_ref().buffer().is_empty() || readable_now(lines.get_ref().get_ref().as_fd()) {
                    match tokio::time::timeout_at(until, lines.next_line()).await {
                        Ok(Ok(Some(line))) => {
                            keep(&line);
                            bytes += line.len();
                            batch.push(line);
                        }
                        _ => break,
                    }
                }
                send(&mut batch, &mut bytes);
                let _ = done.send(());
            }
        }
    }
    send(&mut batch, &mut bytes);
}
