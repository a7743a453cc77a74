//! Warm agents: processes that answered a task cleanly wait here for the next task
//! that would start the very same process (same command, directories, permissions).
//!
//! Starting an agent costs a process, a runtime and a handshake, which for short tasks
//! is most of the work (and for a Node or Python agent, hundreds of milliseconds).
//! Each task still gets a session of its own; an agent whose turn ended in anything
//! but an answer (a cancel, a timeout, a crash, a protocol breach) is never reused.
//! The pool owns its idle agents; [`AgentPool::drain`] ends them all, and dropping
//! the pool kills their process groups.

use std::sync::Mutex;

use pier_client::run::{LiveAgent, RunOptions};
use tokio::sync::mpsc;

use crate::gateway::Lease;

/// An idle agent: its key, the process, and its account at the model gateway (which goes
/// with the process: its placeholder key is in the process's environment).
type Idle = (String, LiveAgent, Option<Lease>);

pub struct AgentPool {
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
}

impl AgentPool {
    pub fn new(max_idle: usize) -> AgentPool {
        AgentPool { idle: Mutex::new(Vec::new()), max_idle }
    }

    /// What must be equal for two tasks to share an agent process: everything the
    /// process or its connection was started with. Per-turn settings (timeouts, the
    /// asker) are not part of it.
    pub fn key(opts: &RunOptions) -> String {
        format!(
            "{:?}",
            (
                &opts.agent,
                &opts.cwd,
                &opts.allow_dirs,
                opts.fs,
                opts.terminal,
                &opts.policy,
                opts.interactive,
                &opts.writable,
                &opts.jail
            )
        )
    }

    /// A warm agent for `key` with its gateway account, if one is idle and still able to take a turn.
    pub async fn take(&self, key: &str) -> Option<(LiveAgent, Option<Lease>)> {
        loop {
            let (agent, lease) = {
                let mut idle = self.lock();
                let i = idle.iter().rposition(|(k, ..)| k == key)?;
                let (_, agent, lease) = idle.remove(i);
                (agent, lease)
            };
            let mut agent = agent;
            if agent.reusable() {
                return Some((agent, lease));
            }
            end(agent).await;
        }
    }

    /// Keeps `agent` for a later task if it can take another turn; otherwise, or when
    /// the pool is full, an agent is ended (the longest idle one, to make room).
    pub async fn give_back(&self, key: String, mut agent: LiveAgent, lease: Option<Lease>) {
        if !agent.reusable() {
            end(agent).await;
            return;
        }
        let evicted = {
            let mut idle = self.lock();
            idle.push((key, agent, lease));
            (idle.len() > self.max_idle).then(|| idle.remove(0).1)
        };
        if let Some(old) = evicted {
            end(old).await;
        }
    }

    /// Ends every idle agent.
    pub async fn drain(&self) {
        let idle = std::mem::take(&mut *self.lock());
        for (_, agent, _) in idle {
            end(agent).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

async fn end(agent: LiveAgent) {
    // Nothing reads events of an agent between tasks.
    let (events, _) = mpsc::channel(1);
    agent.shutdown(&events).await;
}
