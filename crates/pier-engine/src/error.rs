//! The errors of the engine.

/// Why a session operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A turn is already running on this session. The running turn is unharmed.
    #[error("a prompt is already in flight on this session; wait for its response or send session/cancel")]
    Busy,
    /// The model request failed; carries the provider's message. Not retried here
    /// (the provider retried what it could).
    #[error("{0}")]
    Model(#[from] pier_model::ModelError),
    /// The session's directory cannot be used.
    #[error("the session directory cannot be used: {0}")]
    Workspace(String),
    /// No stored session has this id.
    #[error("there is no session `{0}`; list the stored ones with session/list")]
    UnknownSession(String),
    /// The session log could not be written; the turn's record would be lost.
    #[error("the session log could not be written ({0}); check that PIER_HOME is writable and has space")]
    Log(String),
}
