//! Agents run confined: every agent process pier starts reads, writes, connects and lives
//! only where its task allows.
//!
//! pier re-executes itself as a small helper (`pier jail`, [`helper`]) between itself and the
//! agent rather than confining the child between fork and exec: building a jail needs
//! namespaces (`unshare(CLONE_NEWUSER)` is refused to a multithreaded process, and pier runs a
//! runtime), mounts and Landlock rules built from paths (allocation, which is unsound in the
//! forked child of a multithreaded process) and a reaper as PID 1 of the jail. The helper is
//! single-threaded and starts before any runtime, so each step is plain code. It costs one
//! exec of pier per agent start (measured in docs/benchmarks.md).
//!
//! - [`level`]: what a task asks for (`sandbox = "strict" | "workspace" | "off"`, `[limits]`).
//! - [`launch`]: pier's side, [`Jailer::prepare`] → [`Prepared`] → [`Running`].
//! - `helper`, `mounts`, `rules`, `netns`: the helper's side (namespaces, the root it pivots
//!   into, Landlock, the proxy's listener handed to pier).
//! - `limits`: the attempt's cgroup and the breach it reports.
//! - [`kernel`]: what this machine enforces, probed once and said.

pub mod helper;
pub mod kernel;
pub mod launch;
pub mod level;
mod limits;
mod mounts;
mod netns;
mod rules;
pub mod shown;
mod spec;

pub use kernel::Kernel;
pub use launch::{JailError, Jailer, Prepared, Program, Request, Running};
pub use level::{Level, Limits};
pub use limits::{Breach, CgroupKind};
pub use spec::PROXY_PORT;

/// Whether a plan's `network = [...]` entries parse (`host`, `host:port`, `[v6]:port`).
pub fn check_network(entries: &[String]) -> Result<(), String> {
    pier_egress::Allow::parse(entries).map(|_| ()).map_err(|e| e.to_string())
}
