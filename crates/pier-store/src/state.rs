//! The task state machine, checked in one place.
//!
//! ```text
//! pending ──► running ──► completed | failed | cancelled
//!    │          │  ▲
//!    │          ▼  │
//!    │     awaiting_input ──► cancelled | failed | pending
//!    │          
//!    └──► cancelled              running ──► pending   (lease lost, retry)
//! ```

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Pending,
    Running,
    AwaitingInput,
    Completed,
    Failed,
    Cancelled,
}

impl TaskState {
    pub const ALL: [TaskState; 6] = [
        TaskState::Pending,
        TaskState::Running,
        TaskState::AwaitingInput,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Pending => "pending",
            TaskState::Running => "running",
            TaskState::AwaitingInput => "awaiting_input",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<TaskState> {
        TaskState::ALL.into_iter().find(|t| t.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, TaskState::Completed | TaskState::Failed | TaskState::Cancelled)
    }

    /// Whether `self → to` is legal.
    /// Whether a person may retry the task (`pier retry`): the one way out of an ending,
    /// taken only by that explicit action, never by the scheduler or a worker's report.
    pub fn retryable(self) -> bool {
        matches!(self, TaskState::Failed | TaskState::Cancelled)
    }

    pub fn can_move_to(self, to: TaskState) -> bool {
        use TaskState::*;
        matches!(
            (self, to),
            (Pending, Running)
                | (Pending, Cancelled)
                | (Running, Completed)
                | (Running, Failed)
                | (Running, Cancelled)
                | (Running, AwaitingInput)
                | (Running, Pending)
                | (AwaitingInput, Running)
                | (AwaitingInput, Pending)
                | (AwaitingInput, Failed)
                | (AwaitingInput, Cancelled)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::TaskState::*;
    use super::*;

    #[test]
    fn the_legal_moves_and_nothing_else() {
        let legal: Vec<(TaskState, TaskState)> = TaskState::ALL
            .iter()
            .flat_map(|&a| TaskState::ALL.iter().map(move |&b| (a, b)))
            .filter(|(a, b)| a.can_move_to(*b))
            .collect();
        assert_eq!(
            legal,
            vec![
                (Pending, Running),
                (Pending, Cancelled),
                (Running, Pending),
                (Running, AwaitingInput),
                (Running, Completed),
                (Running, Failed),
                (Running, Cancelled),
                (AwaitingInput, Pending),
                (AwaitingInput, Running),
                (AwaitingInput, Failed),
                (AwaitingInput, Cancelled),
            ]
        );
        for t in [Completed, Failed, Cancelled] {
            assert!(TaskState::ALL.iter().all(|&to| !t.can_move_to(to)), "{t:?} is terminal");
        }
        assert!(!Pending.can_move_to(Completed), "a worker cannot jump from pending to completed");
    }
}
