//! A headless ACP client: start any agent, hold one session, send a prompt,
//! serve the agent's client methods in a sandbox, decide its permission requests
//! unattended, and end every run with every process gone.
//!
//! - [`registry`]: which program an agent name means.
//! - [`process`]: the agent process and its group.
//! - [`handler`]: the client side of the connection.
//! - [`policy`]: permission rules and the choice among offered options.
//! - [`sandbox`], [`fs`], [`terminal`]: the client methods.
//! - [`run`]: one run: handshake, session, prompt, cancel handshake, teardown.
//! - [`store`]: named sessions that survive a restart.
//! - [`event`]: what happens in a run, typed once at this edge ([`ClientEvent`], [`Evidence`]).

pub mod elicit;
pub mod event;
pub mod fs;
pub mod handler;
pub mod partial;
pub mod policy;
pub mod process;
mod redacted;
pub mod registry;
pub mod run;
pub mod sandbox;
pub mod store;
pub mod terminal;
mod turn;

pub use event::{ClientEvent, Evidence, SideEffects};
pub use partial::Partial;
pub use policy::{ClientPolicy, NonInteractive, Rule};
pub use registry::{AgentCommand, AgentDef};
pub use run::{Ending, RunOptions, RunOutcome, SessionTarget, TimeLimit};

/// Why a run could not do its job.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The command line or configuration is wrong; exit code 2.
    #[error("{0}")]
    Usage(String),
    /// The agent could not be started.
    #[error("could not start agent `{agent}`: {message}")]
    Spawn { agent: String, message: String },
    /// The agent failed or went away: a crash, a model outage, a tool failure. Worth
    /// another attempt.
    #[error("agent `{agent}`: {message}")]
    Agent { agent: String, message: String },
    /// The agent broke the protocol: garbage on stdout, a malformed or refused handshake,
    /// -32700/-32600/-32601/-32602 for a request pier sent correctly. A bug, so another
    /// attempt would meet it again (seed 001 §5.2).
    #[error("agent `{agent}` broke the protocol: {message}")]
    Protocol { agent: String, message: String },
}

impl ClientError {
    pub fn usage(msg: impl Into<String>) -> ClientError {
        ClientError::Usage(msg.into())
    }

    /// Whether another attempt could succeed: false for a protocol error, a usage error
    /// or an agent that cannot be started, which would meet the same fault again.
    pub fn is_retryable(&self) -> bool {
        matches!(self, ClientError::Agent { .. })
    }
}
