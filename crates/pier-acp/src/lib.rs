//! The ACP v1 protocol core: the only crate in pier that touches JSON-RPC.
//!
//! - [`frame`]: newline-delimited framing with a size bound.
//! - [`message`]: JSON-RPC 2.0 envelopes, parsed and encoded.
//! - [`connection`]: a bidirectional connection: request correlation, concurrent
//!   dispatch, `$/cancel_request`, and the close recipe.
//! - [`error`]: the errors this crate returns and JSON-RPC error builders.
//!
//! Wire payloads are the types of `agent-client-protocol-schema` (v1), re-exported
//! as [`schema`]; this crate never copies them.

pub mod connection;
pub mod error;
pub mod frame;
pub mod message;
pub mod stdio;

pub use agent_client_protocol_schema::v1 as schema;
pub use connection::{CloseReason, Connection, ConnectionConfig, Handler, Outgoing, RequestCx};
pub use error::RequestError;

/// The `_meta` key under which a task host names the task a session runs for: run, task,
/// attempt, idempotency key, dependencies and the task's metadata (namespaced, as ACP asks
/// of `_meta` keys). pier's host sends it with `session/new` and `session/prompt`; pier's
/// agent reads it.
pub const TASK_META_KEY: &str = "pier.dev/task";

/// The `_meta` key (value `true`, with `session/new`, `session/load` or `session/resume`) by
/// which a client that answers form questions asks pier's agent to offer its model `ask_user`
/// in the automation profile, which offers no human-facing questions of its own (seed 003).
/// pier's host sends it: it parks the task until a person answers. The editor profile offers
/// `ask_user` to any client that answers form questions.
pub const ASK_META_KEY: &str = "pier.dev/askPerson";

/// The `_meta` key of an MCP server's entry (in `mcpServers`) that sets how long one of its
/// calls may take, in seconds (pier's agent; at most a day).
pub const MCP_CALL_TIMEOUT_META_KEY: &str = "pier.dev/callTimeoutSecs";
