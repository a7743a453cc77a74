//! The [`Tasks`] handle itself: what it holds, and how its calls reach the store.

use std::sync::Arc;

use pier_store::{Attempt, StoreError, TaskStore};
use tokio_util::sync::CancellationToken;

use crate::config::{HostConfig, Summary};
use crate::host::{Host, Scope};
use crate::host_mcp::Grant;
use crate::person::ActionError;

/// The host's API over one store. Cheap to clone: every clone shares the store, the
/// configuration and the one [`Host`] that drives runs in this process.
#[derive(Clone)]
pub struct Tasks {
    pub(super) store: Arc<dyn TaskStore>,
    pub(super) config: Arc<HostConfig>,
    pub(super) host: Arc<Host>,
    /// When each pull worker was last written as seen, and with what: a worker that asks
    /// for work many times a second is written once in a while, not every time.
    pub(super) seen: Arc<std::sync::Mutex<SeenWorkers>>,
    /// Wakes this process's schedule clock when it changed a schedule.
    pub(crate) schedules_changed: Arc<tokio::sync::Notify>,
    /// The MCP endpoint's tokens of attempts leased to pull workers, oldest first (see
    /// `agent_tools.rs`).
    pub(super) remote_grants: Arc<std::sync::Mutex<std::collections::VecDeque<(Attempt, Grant)>>>,
}

/// Each worker's capabilities and when it was last written as seen.
pub(super) type SeenWorkers = std::collections::HashMap<String, (Vec<String>, std::time::Instant)>;

impl Tasks {
    pub fn new(store: Arc<dyn TaskStore>, config: HostConfig) -> Tasks {
        let host = Arc::new(Host::new(store.clone(), config.clone()));
        Tasks {
            store,
            config: Arc::new(config),
            host,
            seen: Default::default(),
            schedules_changed: Default::default(),
            remote_grants: Default::default(),
        }
    }

    /// Opens the store `spec` names (a PostgreSQL URL, `sqlite://PATH` or a path).
    pub fn open(spec: &str, config: HostConfig) -> Result<Tasks, StoreError> {
        Ok(Tasks::new(pier_store::open(spec)?, config))
    }

    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// Drives the tasks in `scope` until `stop` fires or, for one run, until none of its tasks
    /// can make progress ([`Host::drive`]).
    /// Every node of `pier serve` (`Scope::All`) also runs the schedules' clock meanwhile.
    pub async fn drive(&self, scope: Scope, stop: CancellationToken) -> Result<Summary, StoreError> {
        if scope != Scope::All {
            return self.host.drive(scope, stop).await;
        }
        let clock_stop = stop.child_token();
        let clock = tokio::spawn(crate::clock::run(self.clone(), clock_stop.clone()));
        let result = self.host.drive(scope, stop).await;
        // The host may end on its own (a fatal store error): the clock ends with it.
        clock_stop.cancel();
        let _ = clock.await;
        result
    }

    /// Runs `f` over the store on a blocking thread.
    pub(crate) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn TaskStore) -> Result<T, ActionError> + Send + 'static,
    ) -> Result<T, ActionError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(store.as_ref()))
            .await
            .map_err(|e| ActionError::Store(StoreError::Db(format!("a store call failed: {e}"))))?
    }

    /// Copies the whole store, while it is in use, to the new file `to` (SQLite; a
    /// PostgreSQL store says how to use `pg_dump`).
    pub async fn backup(&self, to: std::path::PathBuf) -> Result<(), ActionError> {
        self.blocking(move |s| Ok(s.backup(&to)?)).await
    }

    /// Whether the store answers a read (`/ready`).
    pub async fn ready(&self) -> Result<(), ActionError> {
        self.blocking(|s| Ok(s.last_seq().map(|_| ())?)).await
    }

    /// Where the log stands: read before a view, so an event is shown twice, never missed.
    pub async fn position(&self) -> Result<i64, ActionError> {
        self.blocking(|s| Ok(s.last_seq()?)).await
    }
}
