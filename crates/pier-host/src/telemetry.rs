//! The host's counters and gauges, through the `metrics` facade: nothing is recorded until
//! a process installs a recorder (`pier serve` installs the Prometheus one), so `pier run`
//! and the tests pay a no-op. One function per metric, so names and labels live here only.

use crate::decide::Outcome;
use pier_store::Ending;

/// Attempts started (a claim that won: by this node's host, or by a pull worker through it).
pub fn attempt_started() {
    metrics::counter!("pier_attempts_total").increment(1);
}

/// An attempt's ending, applied: a retry is counted by the class of what went wrong.
pub fn attempt_ended(outcome: &Outcome, ending: &Ending) {
    if matches!(ending, Ending::Retry { .. }) {
        let class = match outcome {
            Outcome::Failed { class, .. } => match class {
                pier_store::ErrorClass::Protocol => "protocol",
                pier_store::ErrorClass::Business => "business",
                pier_store::ErrorClass::Resource => "resource",
            },
            Outcome::Interrupted { .. } => "interrupted",
            Outcome::Answered { .. } => "stop_reason",
            Outcome::Unusable { .. } => "unusable",
            Outcome::OverBudget { .. } => "budget",
            Outcome::RateLimited { .. } => "rate_limited",
            Outcome::Denied { .. } => "denied",
        };
        metrics::counter!("pier_retries_total", "class" => class).increment(1);
    }
}

/// An attempt whose lease was gone when it renewed or ended it (another holder has the task).
pub fn lease_lost() {
    metrics::counter!("pier_lease_losses_total").increment(1);
}
