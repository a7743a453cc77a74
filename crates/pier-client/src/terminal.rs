//! `terminal/*`: commands the agent runs through the client, each contained
//! (`pier_tools::contain`: its own session and cgroup, Landlock on writes), with
//! output kept up to `outputByteLimit` (cut from the start at a character
//! boundary, R107). Every process a terminal's command starts, however it
//! detaches, is killed when the command exits, at `terminal/kill`, at release and
//! when the client shuts down.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use agent_client_protocol_schema::v1::{
    CreateTerminalRequest, CreateTerminalResponse, Error, TerminalExitStatus, TerminalOutputResponse,
};
use nix::sys::signal::Signal;
use pier_acp::error::{internal, invalid_params};
use pier_tools::contain::Contained;
use tokio::io::AsyncRead;
use tokio::sync::watch;

use crate::sandbox::Sandbox;

/// Output kept when the agent sets no limit.
const DEFAULT_LIMIT: usize = 1024 * 1024;

struct Output {
    bytes: Vec<u8>,
    truncated: bool,
    limit: usize,
}

impl Output {
    fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > self.limit {
            let mut cut = self.bytes.len() - self.limit;
            // Never split a UTF-8 character: skip continuation bytes.
            while cut < self.bytes.len() && (self.bytes[cut] & 0b1100_0000) == 0b1000_0000 {
                cut += 1;
            }
            self.bytes.drain(..cut);
            self.truncated = true;
        }
    }
}

struct Terminal {
    contained: Arc<Mutex<Contained>>,
    output: Arc<Mutex<Output>>,
    exit: watch::Receiver<Option<TerminalExitStatus>>,
}

impl Terminal {
    fn kill(&self) {
        lock(&self.contained).end();
    }
}

/// The terminals of one client.
#[derive(Default)]
pub struct Terminals {
    next: AtomicU64,
    live: Mutex<HashMap<String, Arc<Terminal>>>,
    /// The last output of the most recently released terminals (at most [`KEPT_RELEASED`]), so
    /// that a tool call embedding one still shows what it printed after the agent let it go.
    released: Mutex<std::collections::VecDeque<(String, TerminalOutputResponse)>>,
    /// Counts chunks of output any terminal received: a command printing in one of the
    /// agent's terminals is the agent at work, so a turn's idle timer starts afresh.
    pub activity: Arc<watch::Sender<u64>>,
}

/// Released terminals whose last output is kept for showing.
const KEPT_RELEASED: usize = 32;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn exit_status(status: std::process::ExitStatus) -> TerminalExitStatus {
    let mut s = TerminalExitStatus::new();
    s.exit_code = status.code().map(|c| c as u32);
    s.signal =
        status.signal().map(|sig| Signal::try_from(sig).map(|s| s.as_str().to_owned()).unwrap_or(sig.to_string()));
    s
}

async fn pump(r: impl AsyncRead + Unpin, out: Arc<Mutex<Output>>, activity: Arc<watch::Sender<u64>>) {
    pier_tools::command::read_into(r, |chunk| {
        lock(&out).push(chunk);
        activity.send_modify(|n| *n = n.wrapping_add(1));
    })
    .await;
}

impl Terminals {
    pub async fn create(
        &self,
        sandbox: &Sandbox,
        default_cwd: &std::path::Path,
        req: CreateTerminalRequest,
    ) -> Result<CreateTerminalResponse, Error> {
        let cwd = match &req.cwd {
            Some(dir) => sandbox.resolve(dir)?,
            None => default_cwd.to_owned(),
        };
        if req.command.is_empty() {
            return Err(invalid_params("the command is empty"));
        }
        let env: Vec<(String, String)> = req.env.iter().map(|v| (v.name.clone(), v.value.clone())).collect();
        // A jailed agent's command runs in a jail of its own with the agent's rules (the helper
        // builds it, so Landlock, which forbids mounts, is the jail's to apply, not contain's).
        let mut prepared = match sandbox.jail() {
            Some(j) => {
                let mut request = j.request.clone();
                request.cwd = cwd.clone();
                let program = pier_jail::Program {
                    program: req.command.clone().into(),
                    args: req.args.clone(),
                    env: env.clone(),
                };
                Some(
                    j.jailer
                        .prepare(&request, &program)
                        .map_err(|e| internal(format!("cannot start `{}`: {e}", req.command)))?,
                )
            }
            None => None,
        };
        let mut cmd = match &prepared {
            Some(p) => {
                let mut cmd = tokio::process::Command::new(&p.program);
                cmd.args(&p.args);
                cmd
            }
            None => {
                let mut cmd = tokio::process::Command::new(&req.command);
                cmd.args(&req.args);
                cmd
            }
        };
        cmd.envs(env)
            .current_dir(&cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let confinement = match prepared.as_mut() {
            Some(p) => {
                p.configure(&mut cmd);
                pier_tools::Confinement { landlock: false, ..sandbox.confinement().clone() }
            }
            None => sandbox.confinement().clone(),
        };
        let (mut child, contained) = pier_tools::contain::spawn(&mut cmd, &confinement, &sandbox.write_roots())
            .map_err(|e| internal(format!("cannot start `{}`: {e}", req.command)))?;
        drop(cmd);
        let jail = match prepared {
            Some(p) => Some(p.started(format!("terminal `{}`", req.command), std::time::Duration::from_secs(10)).await),
            None => None,
        };
        let contained = Arc::new(Mutex::new(contained));
        let limit = req.output_byte_limit.map_or(DEFAULT_LIMIT, |l| l as usize);
        let output = Arc::new(Mutex::new(Output { bytes: Vec::new(), truncated: false, limit }));
        let (tx, exit) = watch::channel(None);
        let readers = [
            child.stdout.take().map(|r| tokio::spawn(pump(r, output.clone(), self.activity.clone()))),
            child.stderr.take().map(|r| tokio::spawn(pump(r, output.clone(), self.activity.clone()))),
        ];
        let ending = contained.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            // Nothing the command started outlives it.
            let _ = tokio::task::spawn_blocking(move || lock(&ending).end()).await;
            drop(jail);
            for r in readers.into_iter().flatten() {
                let _ = tokio::time::timeout(std::time::Duration::from_secs(2), r).await;
            }
            let _ = tx.send(Some(match status {
                Ok(s) => exit_status(s),
                Err(_) => TerminalExitStatus::new(),
            }));
        });
        let id = format!("term-{}", self.next.fetch_add(1, Ordering::SeqCst) + 1);
        lock(&self.live).insert(id.clone(), Arc::new(Terminal { contained, output, exit }));
        Ok(CreateTerminalResponse::new(id))
    }

    fn get(&self, id: &str) -> Result<Arc<Terminal>, Error> {
        lock(&self.live)
            .get(id)
            .cloned()
            .ok_or_else(|| invalid_params(format!("no terminal `{id}`; it was never created or was released")))
    }

    pub fn output(&self, id: &str) -> Result<TerminalOutputResponse, Error> {
        let t = self.get(id)?;
        let out = lock(&t.output);
        let status = t.exit.borrow().clone();
        Ok(TerminalOutputResponse::new(String::from_utf8_lossy(&out.bytes).into_owned(), out.truncated)
            .exit_status(status))
    }

    pub async fn wait_for_exit(&self, id: &str) -> Result<TerminalExitStatus, Error> {
        let mut rx = self.get(id)?.exit.clone();
        let status = rx.wait_for(Option::is_some).await.map_err(|_| internal("the terminal's watcher stopped"))?;
        Ok(status.clone().unwrap_or_else(TerminalExitStatus::new))
    }

    pub fn kill(&self, id: &str) -> Result<(), Error> {
        self.get(id)?.kill();
        Ok(())
    }

    pub fn release(&self, id: &str) -> Result<(), Error> {
        let last = self.output(id).ok();
        let t = lock(&self.live).remove(id).ok_or_else(|| invalid_params(format!("no terminal `{id}`")))?;
        t.kill();
        if let Some(last) = last {
            let mut released = lock(&self.released);
            if released.len() == KEPT_RELEASED {
                released.pop_front();
            }
            released.push_back((id.to_owned(), last));
        }
        Ok(())
    }

    /// What terminal `id` has printed so far (and how it ended), live or recently released.
    pub fn shown(&self, id: &str) -> Option<TerminalOutputResponse> {
        self.output(id)
            .ok()
            .or_else(|| lock(&self.released).iter().rev().find(|(r, _)| r == id).map(|(_, o)| o.clone()))
    }

    /// Kills every terminal; called at shutdown.
    pub fn kill_all(&self) {
        for (_, t) in lock(&self.live).drain() {
            t.kill();
        }
    }
}

impl Drop for Terminals {
    fn drop(&mut self) {
        self.kill_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_cut_from_the_start_on_a_char_boundary() {
        let mut o = Output { bytes: Vec::new(), truncated: false, limit: 5 };
        o.push("ab".as_bytes());
        assert!(!o.truncated);
        o.push("cdéf".as_bytes()); // 7 bytes in all: é is two
        assert!(o.truncated);
        assert_eq!(String::from_utf8(o.bytes.clone()).ok().as_deref(), Some("cdéf"));
        o.push("é".as_bytes());
        assert_eq!(String::from_utf8(o.bytes.clone()).ok().as_deref(), Some("éfé"));
        o.push(b"x");
        assert_eq!(String::from_utf8(o.bytes).ok().as_deref(), Some("féx"));
    }
}
