//! What the end of an attempt means for its task: one pure function, used for every
//! ending (the host's own attempts, pull workers' reports, attempts lost by anyone).
//!
//! - `end_turn` completes the task with the answer; `refusal` fails it for good;
//!   `max_tokens`/`max_turn_requests` fail it unless the plan retries them; a `cancelled`
//!   stop reason cancels it.
//! - A protocol error is a bug: the task fails, not retried. A business error (crash,
//!   outage, timeout) is retried with backoff until `max_attempts`.
//! - An attempt that reported side effects is never run again behind a person's back
//!   (unless the task is `idempotent`): the task waits in `awaiting_input` for a person.
//! - An attempt stopped by the host or lost with its holder does not count as a failure.

use std::time::Duration;

use agent_client_protocol_schema::v1::StopReason;
use serde_json::Value;

use pier_store::plan::TaskSpec;
use pier_store::{Ending, ErrorClass};

/// How an attempt ended, before anyone decided what it means.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The agent answered the prompt with a stop reason.
    Answered { stop_reason: StopReason, text: String, usage: Option<Value> },
    /// The attempt failed (a crash, a timeout, garbage, an outage), with the error's class.
    Failed { error: String, class: ErrorClass },
    /// The host stopped it (Ctrl-C, shutdown, a lost lease noticed by the attempt itself).
    Interrupted { why: String },
    /// The task's stored numbers cannot run (a store written by an older pier).
    Unusable { error: String },
    /// A budget of the task or its run is spent: the gateway refused the agent's requests.
    OverBudget { why: String },
    /// A provider's rate limit outlasted what the gateway may hold a request: the attempt was
    /// stopped, and the task runs again at `until_ms` without losing an attempt.
    RateLimited { why: String, until_ms: i64 },
    /// A person denied one of the agent's tool calls and the task's `on_deny` is `fail`: the
    /// turn was cancelled.
    Denied { why: String },
}

/// What the decision needs besides the outcome.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub spec: &'a TaskSpec,
    /// The attempt that ended.
    pub attempt: i64,
    /// Failed attempts before this one.
    pub failures: i64,
    /// The side effects the attempt reported.
    pub evidence: &'a [Value],
    /// The backoff before a retry (jittered by the caller).
    pub retry_delay: Duration,
    pub now_ms: i64,
}

pub fn decide(outcome: &Outcome, cx: &Context<'_>) -> Ending {
    match outcome {
        // Not a failure and never retried blindly: a person raises the budget or cancels.
        Outcome::OverBudget { why } => Ending::AskPerson {
            error: Some(why.clone()),
            reason: "a budget is spent; a person raises it (`pier budget`) to resume the task, or cancels it".into(),
            failure: false,
            evidence: cx.evidence.to_vec(),
        },
        // Not the task's failure: it runs again at the reset (a person decides first if the
        // attempt reported side effects, as for any re-run).
        Outcome::RateLimited { why, until_ms } => match rerun(why, Some(why.clone()), false, cx) {
            Ending::Retry { error, reason, failure, .. } => {
                Ending::Retry { error, reason, not_before_ms: (*until_ms).max(cx.now_ms), failure }
            }
            other => other,
        },
        Outcome::Answered { stop_reason: StopReason::EndTurn, text, usage } => {
            Ending::Completed { result: text.clone(), usage: usage.clone() }
        }
        Outcome::Answered { stop_reason: StopReason::Refusal, .. } => Ending::Failed {
            error: "refusal".into(),
            class: ErrorClass::Business,
            reason: "the agent refused; refusals are not retried".into(),
            failure: false,
        },
        Outcome::Answered { stop_reason: StopReason::Cancelled, .. } => {
            Ending::Cancelled { reason: "the agent ended the turn cancelled".into() }
        }
        Outcome::Answered { stop_reason, .. } => {
            let name = pier_client::event::wire_name(stop_reason);
            if cx.spec.retry_on.contains(&name) {
                failed_attempt(name, cx)
            } else {
                Ending::Failed {
                    reason: format!("stop reason {name}; the plan does not retry it"),
                    error: name,
                    class: ErrorClass::Business,
                    failure: false,
                }
            }
        }
        Outcome::Failed { error, class: ErrorClass::Protocol } => Ending::Failed {
            error: error.clone(),
            class: ErrorClass::Protocol,
            reason: format!("attempt {} broke the protocol; protocol errors are bugs and are not retried", cx.attempt),
            failure: true,
        },
        Outcome::Failed { error, class: ErrorClass::Business } => failed_attempt(error.clone(), cx),
        Outcome::Failed { error, class: ErrorClass::Resource } => Ending::Failed {
            error: error.clone(),
            class: ErrorClass::Resource,
            reason: format!(
                "attempt {} went past a resource limit and was stopped; not retried (raise the task's [limits] to let it finish)",
                cx.attempt
            ),
            failure: true,
        },
        Outcome::Interrupted { why } => rerun(why, None, false, cx),
        Outcome::Denied { why } => Ending::Failed {
            error: why.clone(),
            class: ErrorClass::Business,
            reason: format!(
                "attempt {} stopped at a person's denial; on_deny = \"fail\" fails the task and it is not retried",
                cx.attempt
            ),
            failure: true,
        },
        Outcome::Unusable { error } => Ending::Failed {
            error: error.clone(),
            class: ErrorClass::Protocol,
            reason: "the task cannot start; it is not retried".into(),
            failure: true,
        },
    }
}

/// An attempt that failed for a reason another attempt may not meet.
fn failed_attempt(error: String, cx: &Context<'_>) -> Ending {
    if !cx.evidence.is_empty() && !cx.spec.idempotent {
        return rerun(&format!("attempt {} failed", cx.attempt), Some(error), true, cx);
    }
    if cx.failures + 1 < i64::from(cx.spec.max_attempts) {
        let delay = cx.retry_delay.as_millis() as i64;
        Ending::Retry {
            error: Some(error),
            reason: format!("attempt {} failed; retrying in {delay} ms", cx.attempt),
            not_before_ms: cx.now_ms + delay,
            failure: true,
        }
    } else {
        Ending::Failed {
            error,
            class: ErrorClass::Business,
            reason: format!("attempt {} failed and no attempts are left", cx.attempt),
            failure: true,
        }
    }
}

/// The safe re-run decision: again at once if nothing was done (or the task is
/// idempotent), else a person decides.
fn rerun(why: &str, error: Option<String>, failure: bool, cx: &Context<'_>) -> Ending {
    if cx.evidence.is_empty() {
        let reason = format!("{why}; no side effects were reported, so it runs again");
        Ending::Retry { error, reason, not_before_ms: cx.now_ms, failure }
    } else if cx.spec.idempotent {
        let reason = format!("{why}; it reported side effects but the task is idempotent, so it runs again");
        Ending::Retry { error, reason, not_before_ms: cx.now_ms, failure }
    } else {
        let reason = format!("{why}; it reported side effects, so a person must decide whether to run it again");
        Ending::AskPerson { error, reason, failure, evidence: cx.evidence.to_vec() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pier_store::state::TaskState;
    use serde_json::json;

    fn spec(max_attempts: u32, idempotent: bool, retry_on: &[&str]) -> TaskSpec {
        let text = format!(
            "[[tasks]]\nid = \"t\"\nprompt = \"p\"\nmax_attempts = {max_attempts}\nidempotent = {idempotent}\nretry_on = {retry_on:?}\n"
        );
        match pier_store::plan::parse(&text, &|_| Ok(())) {
            Ok(plan) => plan.tasks[0].clone(),
            Err(e) => panic!("{e}"),
        }
    }

    fn answered(r: StopReason) -> Outcome {
        Outcome::Answered { stop_reason: r, text: "done".into(), usage: None }
    }

    fn business() -> Outcome {
        Outcome::Failed { error: "the model is down".into(), class: ErrorClass::Business }
    }

    /// Every row: (outcome, max_attempts, idempotent, retry_on, failures so far, evidence?)
    /// → (state, counts as a failure).
    #[test]
    fn the_table() {
        let effect = [json!({"kind": "edit"})];
        type Row = (Outcome, u32, bool, &'static [&'static str], i64, bool, TaskState, bool);
        let rows: Vec<Row> = vec![
            (answered(StopReason::EndTurn), 1, false, &[], 0, true, TaskState::Completed, false),
            (answered(StopReason::Refusal), 3, false, &[], 0, false, TaskState::Failed, false),
            (answered(StopReason::Cancelled), 3, false, &[], 0, false, TaskState::Cancelled, false),
            (answered(StopReason::MaxTokens), 3, false, &[], 0, false, TaskState::Failed, false),
            (answered(StopReason::MaxTokens), 3, false, &["max_tokens"], 0, false, TaskState::Pending, true),
            (answered(StopReason::MaxTurnRequests), 3, false, &["max_tokens"], 0, false, TaskState::Failed, false),
            (business(), 3, false, &[], 0, false, TaskState::Pending, true),
            (business(), 3, false, &[], 2, false, TaskState::Failed, true),
            (business(), 3, false, &[], 0, true, TaskState::AwaitingInput, true),
            (business(), 3, true, &[], 0, true, TaskState::Pending, true),
            (
                Outcome::Failed { error: "garbage".into(), class: ErrorClass::Protocol },
                3,
                false,
                &[],
                0,
                false,
                TaskState::Failed,
                true,
            ),
            // A limit of the sandbox: another attempt would meet it again, attempts left or not.
            (
                Outcome::Failed { error: "memory limit".into(), class: ErrorClass::Resource },
                3,
                true,
                &[],
                0,
                false,
                TaskState::Failed,
                true,
            ),
            (Outcome::Interrupted { why: "stopped".into() }, 1, false, &[], 0, false, TaskState::Pending, false),
            (Outcome::Interrupted { why: "lost".into() }, 1, false, &[], 0, true, TaskState::AwaitingInput, false),
            (Outcome::Interrupted { why: "lost".into() }, 1, true, &[], 0, true, TaskState::Pending, false),
            (Outcome::Unusable { error: "bad".into() }, 3, false, &[], 0, false, TaskState::Failed, true),
        ];
        for (i, (outcome, max, idem, retry_on, failures, with_effects, state, failure)) in rows.into_iter().enumerate()
        {
            let spec = spec(max, idem, retry_on);
            let evidence: &[Value] = if with_effects { &effect } else { &[] };
            let cx = Context {
                spec: &spec,
                attempt: failures + 1,
                failures,
                evidence,
                retry_delay: Duration::from_millis(250),
                now_ms: 1_000,
            };
            let ending = decide(&outcome, &cx);
            assert_eq!((ending.state(), ending.is_failure()), (state, failure), "row {i}: {outcome:?} -> {ending:?}");
            if let Ending::Retry { not_before_ms, failure: true, .. } = ending {
                assert_eq!(not_before_ms, 1_250, "row {i}: a failed attempt waits for its backoff");
            }
        }
    }
}
