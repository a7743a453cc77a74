//! What the launcher tells the helper: the one message between pier and `pier jail`,
//! passed as a JSON argument (it holds paths only, no secret).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The descriptor the helper sends the proxy's listener on (a Unix socket pier holds the other end of).
pub(crate) const CONTROL_FD: i32 = 3;

/// The port of the proxy inside the jail's network namespace, where nothing else can hold it.
pub const PROXY_PORT: u16 = 3128;

/// One jail: the view of the file system and which namespaces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Spec {
    /// The agent's working directory (inside `write` or `read`).
    pub cwd: PathBuf,
    /// Bound read-only at their own paths (the task's roots, the agent's installation).
    pub read: Vec<PathBuf>,
    /// Bound read-write at their own paths (the task's writable paths, the private home and tmp).
    pub write: Vec<PathBuf>,
    /// pier's own state: masked with an empty directory or file wherever a bound tree holds it.
    pub hide: Vec<PathBuf>,
    /// An empty directory, the mount point the new root is built on.
    pub root: PathBuf,
    /// The attempt's private temp directory, also mounted at `/tmp`.
    pub tmp: PathBuf,
    /// An own network namespace with only loopback, and the proxy's listener sent to pier.
    pub net: bool,
}
