//! What agents can do (seed 001 §2.4, §3.3), used instead of found out by failure.
//!
//! The host keeps each agent spec's `initialize` answer in the store (refreshed whenever
//! a process of that spec starts). A task may declare `requires` from [`REQUIREMENTS`];
//! a plan is checked against the answers of the agents it names before it is stored
//! ([`check`]): an agent that no process of this store has started yet is probed once
//! (started, asked `initialize`, ended). A task whose agent cannot do what it requires is
//! refused with its line and the capability, instead of failing at run time and being
//! retried. Pull-worker tasks require capabilities of the worker instead, matched when a
//! worker asks for a lease.

use std::collections::BTreeMap;

use pier_client::run::LiveAgent;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::config::{HostConfig, blocking};
use pier_store::TaskStore;
use pier_store::plan::{Plan, PlanError, Problem, TaskSpec};
use pier_store::requires::missing;

/// Checks every task with `requires` against its agent's capabilities: from the store, or
/// from a probe of the agent (recorded for next time). The problems carry the task's line.
pub async fn check(plan: &Plan, store: &std::sync::Arc<dyn TaskStore>, config: &HostConfig) -> Result<(), PlanError> {
    let mut problems = Vec::new();
    // One answer per agent spec, whichever task names it first.
    let mut answers: BTreeMap<String, Result<Value, String>> = BTreeMap::new();
    for t in plan.tasks.iter().filter(|t| !t.requires.is_empty() && !t.is_worker()) {
        if !answers.contains_key(&t.agent) {
            let mut answer = capabilities(t, store, config, false).await;
            // A stored answer that falls short may be old (the agent was upgraded since): ask
            // the agent itself before refusing.
            if answer.as_ref().is_ok_and(|(init, cached)| *cached && !missing(init, &t.requires).is_empty()) {
                answer = capabilities(t, store, config, true).await;
            }
            answers.insert(t.agent.clone(), answer.map(|(init, _)| init));
        }
        let line = plan.lines.get(&t.id).copied().unwrap_or(0);
        match &answers[&t.agent] {
            Ok(init) => {
                for (r, pointer) in missing(init, &t.requires) {
                    let message = format!(
                        "task `{}` requires `{r}`, which agent `{}` does not offer (its initialize answer has no \
                         `{pointer}` = true)",
                        t.id, t.agent
                    );
                    problems.push(Problem { line, message });
                }
            }
            Err(why) => problems.push(Problem {
                line,
                message: format!("task `{}` has requirements, and agent `{}` could not be asked: {why}", t.id, t.agent),
            }),
        }
    }
    if problems.is_empty() { Ok(()) } else { Err(PlanError(problems)) }
}

/// The stored `initialize` answer of `t`'s agent (and `true`), or with `fresh` or none
/// stored a new one from a probe (and `false`).
async fn capabilities(
    t: &TaskSpec,
    store: &std::sync::Arc<dyn TaskStore>,
    config: &HostConfig,
    fresh: bool,
) -> Result<(Value, bool), String> {
    let spec = t.agent.clone();
    if !fresh && let Some(known) = blocking(store, move |s| s.agent(&spec)).await.map_err(|e| e.to_string())? {
        return Ok((known.init, true));
    }
    let opts = crate::attempt::attempt_options(t, config)?;
    let (events, _drain) = mpsc::channel(pier_client::run::EVENT_QUEUE);
    let agent = LiveAgent::start(&opts, &events).await.map_err(|e| e.to_string())?;
    let init = agent.init().clone();
    agent.shutdown(&events).await;
    let (spec, answer) = (t.agent.clone(), init.clone());
    blocking(store, move |s| s.record_agent(&spec, &answer)).await.map_err(|e| e.to_string())?;
    Ok((init, false))
}
