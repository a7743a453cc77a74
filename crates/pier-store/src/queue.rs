//! The one order ready tasks start in, whoever starts them: a host's own agents (`pier_host`'s
//! `pick`) and pull workers (the store's [`crate::TaskStore::visit_pending`]).
//!
//! A task's rank is when it became ready, made earlier by [`AGE_MS`] for each level of its
//! priority; the lowest rank goes first, then the one that became ready first. So the higher
//! priority goes first, first come first served within one, and waiting ages a task: one of
//! priority `p` that became ready at `t` goes after one of priority `q` that became ready at
//! `t' > t` only when `t' - t < (q - p) × AGE_MS`. Behind tasks that became ready after it,
//! a task waits at most `(9 - p) × AGE_MS` (9 minutes for priority 0). The rank does not
//! move with the clock, so the store keeps it in an index.

use crate::plan::MAX_PRIORITY;

/// How long a wait counts as one priority level.
pub const AGE_MS: i64 = 60_000;

/// The rank of a task of `priority` that became ready at `ready_ms`.
pub fn rank(priority: u8, ready_ms: i64) -> i64 {
    ready_ms.saturating_sub(i64::from(priority.min(MAX_PRIORITY)) * AGE_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_higher_priority_is_ahead_by_a_minute_a_level_and_no_more() {
        assert!(rank(9, 0) < rank(0, 0));
        assert!(rank(9, 9 * AGE_MS - 1) < rank(0, 0), "just inside the bound the newer 9 goes first");
        assert_eq!(rank(9, 9 * AGE_MS), rank(0, 0), "at it, a tie: the one ready first goes");
        assert!(rank(0, 0) < rank(1, 2 * AGE_MS));
        assert_eq!(rank(200, 0), rank(9, 0), "above 9 counts as 9");
    }
}
