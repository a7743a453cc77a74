//! Why a store operation was refused or failed.

/// Why a store operation was refused or failed. `code()` is stable.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("illegal transition of task `{task}`: {from} -> {to}")]
    IllegalTransition { task: String, from: &'static str, to: &'static str },
    /// The attempt named is not the one holding the task (any more): another owner, a
    /// later attempt, an expired lease, or a task that ended.
    #[error("task `{task}` is not held by attempt {attempt} of `{owner}` (any more); stop working on it")]
    LeaseLost { task: String, attempt: i64, owner: String },
    /// A person cancelled the task the attempt holds: it asks nothing more, and its ending
    /// (whatever it reports) is a cancel.
    #[error("task `{task}` is being cancelled ({reason}); stop its agent and report its ending")]
    CancelRequested { task: String, reason: String },
    #[error("idempotency key `{key}` was used before with another request; use a new key for a new request")]
    IdempotencyConflict { key: String },
    #[error("unknown task `{0}`")]
    UnknownTask(String),
    #[error("unknown run `{0}`")]
    UnknownRun(String),
    #[error("run `{0}` already exists")]
    RunExists(String),
    #[error("schedule `{0}` already exists with another spec; delete it first, or give this one another id")]
    ScheduleExists(String),
    /// A row that must be unique was written twice (two writers racing to create it).
    #[error("the store refused a duplicate: {0}")]
    Duplicate(String),
    /// A row that does not decode: the store was damaged or edited; nothing is written.
    #[error("the store is corrupt: task `{task}` of run `{run}`: {what}")]
    Corrupt { run: String, task: String, what: String },
    /// The disk (or file system) holding the store is full; nothing of the failed write was kept.
    #[error("the disk is full: cannot write the store {path}; free some space and resume")]
    Full { path: String },
    /// The disk filled as a run was being created: nothing of it was stored.
    #[error(
        "the disk is full: cannot write the store {path}; nothing of the run was stored: free some space and submit it again"
    )]
    FullBeforeRun { path: String },
    /// The store's file does not read whole (damaged pages, not a database): refused at open,
    /// before anything was written to it.
    #[error(
        "the store {path} is damaged ({what}); nothing was written to it: move it aside and restore a copy (`pier store backup` makes them)"
    )]
    Damaged { path: String, what: String },
    #[error("the store failed: {0}")]
    Db(String),
    /// An ending asked to wait for the task's inbox found a message there: nothing of it was
    /// written, and the attempt's agent is to be told the message instead.
    #[error("a message waits for task `{task}`; send it to the agent before ending the attempt")]
    MessagesWaiting { task: String },
    /// A task an attempt asked to add to its run cannot join it (its id is taken by another
    /// task, a task it depends on is unknown or ended badly, the run is full): nothing was added.
    #[error("task `{task}` cannot be added to the run: {why}")]
    NotAdded { task: String, why: String },
    /// A task's inbox holds as many unsent messages as it takes: nothing was queued.
    #[error("{waiting} messages already wait for task `{task}`; send more once its agent has taken them")]
    InboxFull { task: String, waiting: i64 },
}

impl StoreError {
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode;
        match self {
            StoreError::IllegalTransition { .. } => ErrorCode::BadTransition,
            StoreError::LeaseLost { .. } => ErrorCode::LeaseLost,
            StoreError::CancelRequested { .. } => ErrorCode::CancelRequested,
            StoreError::IdempotencyConflict { .. } => ErrorCode::IdempotencyConflict,
            StoreError::UnknownTask(_) => ErrorCode::UnknownTask,
            StoreError::UnknownRun(_) => ErrorCode::UnknownRun,
            StoreError::RunExists(_) => ErrorCode::RunExists,
            StoreError::ScheduleExists(_) => ErrorCode::ScheduleExists,
            StoreError::Duplicate(_) => ErrorCode::Duplicate,
            StoreError::Corrupt { .. } => ErrorCode::StoreCorrupt,
            StoreError::Full { .. } | StoreError::FullBeforeRun { .. } => ErrorCode::DiskFull,
            StoreError::Damaged { .. } => ErrorCode::StoreCorrupt,
            StoreError::Db(_) => ErrorCode::Store,
            StoreError::MessagesWaiting { .. } => ErrorCode::MessagesWaiting,
            StoreError::InboxFull { .. } => ErrorCode::TooManyRequests,
            StoreError::NotAdded { .. } => ErrorCode::BadPlan,
        }
    }

    /// Whether the operation lost a race (another writer moved the task first): the caller
    /// re-reads and decides again; nothing is wrong with the store.
    pub fn is_race(&self) -> bool {
        matches!(self, StoreError::IllegalTransition { .. } | StoreError::LeaseLost { .. })
    }
}
