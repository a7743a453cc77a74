//! What people and pull workers do to tasks from outside the host: answer a question,
//! decide a re-run, report a leased attempt. One function each, shared by the CLI
//! (`pier approve`/`pier deny`) and the HTTP routes, so the two cannot disagree.

use serde::Deserialize;
use serde_json::Value;

use crate::decide::{Context, Outcome, decide};
use pier_store::ErrorCode;
use pier_store::plan::PlanError;
use pier_store::state::TaskState;
use pier_store::{
    Attempt, Ending, ErrorClass, Idem, Question, QuestionRequest, Reported, StoreError, TaskRow, TaskStore, now_ms,
    offered_option, option_kind,
};

/// The task a person names, or which of run and task is unknown.
pub(crate) fn task_of(store: &dyn TaskStore, run: &str, task: &str) -> Result<TaskRow, StoreError> {
    if !store.run_exists(run)? {
        return Err(StoreError::UnknownRun(run.to_owned()));
    }
    store.task(run, task)?.ok_or_else(|| StoreError::UnknownTask(task.to_owned()))
}

/// Why an outside action was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ActionError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The option asked for is not among those the agent offered.
    #[error("{0}")]
    BadOption(String),
    /// The request is malformed (an unknown status, a report on a task no worker runs).
    #[error("{message}")]
    Refused { code: ErrorCode, message: String },
    /// A plan refused whole: every problem with its line.
    #[error(transparent)]
    Plan(#[from] PlanError),
}

impl ActionError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ActionError::Store(e) => e.code(),
            ActionError::BadOption(_) => ErrorCode::BadRequest,
            ActionError::Refused { code, .. } => *code,
            ActionError::Plan(_) => ErrorCode::BadPlan,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ActionError {
        ActionError::Refused { code: ErrorCode::BadRequest, message: message.into() }
    }
}

/// A person's retry of a failed or cancelled task (`pier retry`, `POST …/retry`), with
/// `dependents` also the cancelled tasks below it: each is `pending` again, with its whole
/// `max_attempts`; the run's host (or the next `pier run --resume`) starts a new attempt.
pub(crate) fn retry(
    store: &dyn TaskStore,
    run: &str,
    task: &str,
    dependents: bool,
    by: &str,
) -> Result<Vec<TaskRow>, ActionError> {
    let row = task_of(store, run, task)?;
    if !row.state.retryable() {
        return Err(ActionError::Refused {
            code: ErrorCode::BadTransition,
            message: format!(
                "task `{task}` of run `{run}` is {}; only a failed or cancelled task can be retried",
                row.state.as_str()
            ),
        });
    }
    // A task below a failed one would only be cancelled again: retry from the top.
    for dep in &row.spec.depends_on {
        if let Some(d) = store.task(run, dep)?
            && d.state.retryable()
        {
            return Err(ActionError::Refused {
                code: ErrorCode::BadTransition,
                message: format!(
                    "task `{task}` depends on `{dep}`, which is {}; retry that with --with-dependents",
                    d.state.as_str()
                ),
            });
        }
    }
    Ok(store.retry(run, task, dependents, by)?)
}

/// A person's message to a running task (`pier say`, `POST …/messages`): queued and sent as
/// the next prompt on the task's session when its current turn ends, or, with `interrupt`,
/// sent at once after the current turn is cancelled through the handshake. Returns the
/// message's number.
pub(crate) fn say(
    store: &dyn TaskStore,
    run: &str,
    task: &str,
    text: &str,
    interrupt: bool,
    by: &str,
) -> Result<i64, ActionError> {
    // A pull worker's attempt takes its messages through the worker API (`pier worker` does).
    let row = task_of(store, run, task)?;
    if text.trim().is_empty() {
        return Err(ActionError::Refused { code: ErrorCode::BadRequest, message: "the message is empty".into() });
    }
    if text.len() > MAX_MESSAGE_BYTES {
        return Err(ActionError::Refused {
            code: ErrorCode::BadRequest,
            message: format!("the message is {} bytes; at most {MAX_MESSAGE_BYTES} go to an agent", text.len()),
        });
    }
    store.say(run, task, text, interrupt, by)?.ok_or_else(|| ActionError::Refused {
        code: ErrorCode::NotRunning,
        message: format!(
            "task `{task}` is {}: a message goes to a running task's session, and this one has ended or is \
             finishing its last answer",
            store.task(run, task).ok().flatten().map_or(row.state, |t| t.state).as_str()
        ),
    })
}

/// Longest message a person may send a task, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// How a person answers an agent's question.
#[derive(Debug, Clone)]
pub enum Input {
    /// `pier answer TASK field=value …`.
    Pairs(Vec<(String, String)>),
    /// The HTTP route's `content`.
    Json(serde_json::Map<String, Value>),
    Decline,
}

/// A person's answer to the question a task waits on (`awaiting_input`): checked against
/// the fields the agent asked for, recorded (an event), and handed to the waiting attempt;
/// refused unless the open question is number `expect` (when given): the
/// one the person saw.
pub(crate) fn answer_input_to(
    store: &dyn TaskStore,
    run: &str,
    task: &str,
    expect: Option<i64>,
    input: Input,
    by: &str,
) -> Result<Value, ActionError> {
    let row = task_of(store, run, task)?;
    let refused = |message: String| ActionError::Refused { code: ErrorCode::BadRequest, message };
    let Some(question) = store.open_question(run, task)?.filter(|q| q.request.elicitation().is_some()) else {
        let why = format!("task `{task}` of run `{run}` is {} and asks no question", row.state.as_str());
        return Err(too_late(store, run, task, why));
    };
    if expect.is_some_and(|n| n != question.n) {
        let why = format!(
            "task `{task}` no longer waits on what you answered (someone answered it already, or it was withdrawn); nothing was applied"
        );
        return Err(too_late(store, run, task, why));
    }
    let Some(request) = question.request.elicitation() else {
        return Err(refused("the question is not a form".into()));
    };
    let schema = pier_client::elicit::form_schema(request)
        .ok_or_else(|| refused("the question is not a form; it cannot be answered here".into()))?;
    let answer = match input {
        Input::Decline => serde_json::json!({"action": "decline"}),
        Input::Pairs(pairs) => {
            let content = pier_client::elicit::check_pairs(schema, &pairs).map_err(refused)?;
            serde_json::json!({"action": "accept", "content": content})
        }
        Input::Json(map) => {
            let content = pier_client::elicit::check(schema, &map).map_err(refused)?;
            serde_json::json!({"action": "accept", "content": content})
        }
    };
    if !store.answer(run, task, &question, &answer.to_string(), by)? {
        return Err(too_late(store, run, task, "the question was answered already".into()));
    }
    Ok(answer)
}

/// `already answered: OPTION by WHO at TIME`, of the task's last answered question, if any: what
/// a person who answers again is told instead of a bare refusal.
fn answered_before(store: &dyn TaskStore, run: &str, task: &str) -> Result<Option<String>, ActionError> {
    let Some(e) = store.events_of_kind(run, Some(task), "answer")?.pop() else { return Ok(None) };
    let option = e.data["option"].as_str().unwrap_or("?");
    // A form's answer is its JSON: its action says what was done.
    let said = serde_json::from_str::<serde_json::Value>(option)
        .ok()
        .and_then(|v| v["action"].as_str().map(str::to_owned))
        .unwrap_or_else(|| option.to_owned());
    let by = e.data["by"].as_str().unwrap_or("someone");
    Ok(Some(format!("already answered: {said} by {by} at {}", pier_store::schedule::rfc3339(e.at_ms))))
}

/// The refusal `why` of an answer that came too late, with what was answered, by whom and
/// when, if the task's last question was answered.
fn too_late(store: &dyn TaskStore, run: &str, task: &str, why: String) -> ActionError {
    let message = match answered_before(store, run, task) {
        Ok(Some(said)) => format!("{why} — {said}"),
        _ => why,
    };
    ActionError::Refused { code: ErrorCode::BadTransition, message }
}

/// What an answer did.
#[derive(Debug, Clone, PartialEq)]
pub enum Answered {
    /// The open question got this option; the waiting attempt goes on.
    Option(String),
    /// The task had no live attempt: a person decided whether it runs again.
    Rerun(Box<TaskRow>),
}

/// A person's answer to a task in `awaiting_input`: the open question if there is one
/// (`option`, else allow_once/reject_once), else the re-run decision; refused unless what the task waits on is still what the person saw:
/// `expect` is the question's number (0: the re-run decision, no question). A form
/// submitted twice, or after someone else answered, is refused and applies nothing.
pub(crate) fn answer_to(
    store: &dyn TaskStore,
    run: &str,
    task: &str,
    expect: Option<i64>,
    allow: bool,
    option: Option<&str>,
    by: &str,
) -> Result<Answered, ActionError> {
    let row = task_of(store, run, task)?;
    if row.state != TaskState::AwaitingInput {
        let why = format!("task `{task}` of run `{run}` is {}, not awaiting_input", row.state.as_str());
        return Err(too_late(store, run, task, why));
    }
    let open = store.open_question(run, task)?;
    if let Some(n) = expect
        && open.as_ref().map_or(0, |q| q.n) != n
    {
        let why = format!(
            "task `{task}` no longer waits on what you answered (someone answered it already, or it was withdrawn); nothing was applied"
        );
        return Err(too_late(store, run, task, why));
    }
    match open {
        Some(Question { request: QuestionRequest::Elicitation(_), .. }) => Err(ActionError::Refused {
            code: ErrorCode::BadRequest,
            message: format!(
                "task `{task}` asks a question, not for a permission: answer it with `pier answer {task} FIELD=VALUE \
                 …` (or `--decline`)"
            ),
        }),
        Some(question) => {
            let request = question
                .request
                .permission()
                .ok_or_else(|| ActionError::BadOption("the question offers no options".into()))?;
            let wanted = match (option, allow) {
                (Some(o), _) => o.to_owned(),
                (None, true) => "allow_once".to_owned(),
                (None, false) => "reject_once".to_owned(),
            };
            let option = offered_option(request, &wanted).map_err(ActionError::BadOption)?;
            let (chosen, kind) = (option.option_id.0.to_string(), option_kind(option.kind));
            // Approving picks an allow option and denying a reject one, whatever was named.
            if kind.starts_with("allow") != allow {
                let verb = if allow { "approve" } else { "deny" };
                return Err(ActionError::BadOption(format!(
                    "`{wanted}` is a {kind} option; {verb} takes {} options",
                    if allow { "allow" } else { "reject" }
                )));
            }
            if !store.answer(run, task, &question, &chosen, by)? {
                return Err(too_late(store, run, task, "the question was answered already".into()));
            }
            Ok(Answered::Option(chosen))
        }
        None => Ok(Answered::Rerun(Box::new(store.decide_rerun(run, task, allow, by)?))),
    }
}

/// A pull worker's report on the attempt it leased.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub worker: String,
    pub attempt: i64,
    /// `completed`, `failed` or `cancelled`.
    pub status: String,
    pub idempotency_key: String,
    /// Accepted for older workers; the lease, not the version, fences a report.
    #[serde(default, rename = "version")]
    pub _version: Option<i64>,
    #[serde(default)]
    pub result: Option<String>,
    #[serde(default)]
    pub error: Option<String>,
    /// Of a failure: `protocol` (not retried) or `business` (retried) [default: business].
    #[serde(default)]
    pub class: Option<ErrorClass>,
    /// What the worker's agent spent: one entry per model request (or per model, summed),
    /// recorded as `model_request` events with the ending, in its commit.
    #[serde(default)]
    pub usage: Option<WorkerUsage>,
    /// Of `stopped`: the turn's stop reason (`max_tokens`, `refusal`…), decided as a local one.
    #[serde(default)]
    pub stop_reason: Option<String>,
    /// What the attempt showed (its text and tool calls), kept with the ending in its commit.
    #[serde(default)]
    pub output: Option<Value>,
    /// The side effects the attempt reported: a failed or interrupted attempt with some is not
    /// run again behind a person's back.
    #[serde(default)]
    pub evidence: Vec<Value>,
    /// The worker's agent can still be told more: refused (409 `messages_waiting`, nothing
    /// written) while a person's message waits, which the worker then takes and sends.
    #[serde(default)]
    pub unless_messages: bool,
    /// The attempt's last progress batch, not sent on its own: its events and side effects are
    /// written in the ending's commit, ahead of it (once, with the report's key).
    #[serde(default)]
    pub progress: Option<crate::tasks::Progress>,
    /// The worker's next task, leased in the ending's commit.
    #[serde(default)]
    pub next: Option<NextLease>,
}

/// What a worker asks of its next lease, with its report.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NextLease {
    pub capabilities: Vec<String>,
    #[serde(default)]
    pub agents: Vec<String>,
    pub ttl_ms: Option<i64>,
}

/// What a report is decided and priced with beside the report itself.
pub(crate) struct Reporting<'a> {
    /// The report as sent: its idempotency key's request.
    pub body: &'a Value,
    pub retry_base: std::time::Duration,
    pub prices: Option<&'a std::collections::BTreeMap<String, crate::gateway::Price>>,
}

/// A worker's usage: one entry or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum WorkerUsage {
    One(UsageLine),
    Many(Vec<UsageLine>),
}

/// The most entries one report may carry.
const MAX_USAGE_LINES: usize = 10_000;

/// Tokens a worker's agent spent on one model request (or one model, summed).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageLine {
    #[serde(default)]
    pub provider: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub input: u64,
    #[serde(default)]
    pub cached_input: u64,
    #[serde(default)]
    pub output: u64,
    #[serde(default)]
    pub reasoning: u64,
    /// As the worker priced it; else from the host's `[prices]`, else unknown.
    #[serde(default)]
    pub cost: Option<f64>,
}

impl WorkerUsage {
    /// The `model_request` events of `attempt`'s report (`worker` named as their node).
    fn events(
        &self,
        attempt: i64,
        worker: &str,
        agent: &str,
        prices: Option<&std::collections::BTreeMap<String, crate::gateway::Price>>,
    ) -> Result<Vec<(String, Value)>, ActionError> {
        let lines = match self {
            WorkerUsage::One(l) => std::slice::from_ref(l),
            WorkerUsage::Many(ls) => ls.as_slice(),
        };
        if lines.len() > MAX_USAGE_LINES {
            return Err(ActionError::bad_request(format!(
                "the report's usage has {} entries; send at most {MAX_USAGE_LINES} (sum them per model)",
                lines.len()
            )));
        }
        let mut out = Vec::with_capacity(lines.len());
        for (i, l) in lines.iter().enumerate() {
            if l.cost.is_some_and(|c| !c.is_finite() || c < 0.0) {
                return Err(ActionError::bad_request(format!("usage[{i}].cost must be a number of at least 0")));
            }
            let tokens = pier_store::Tokens {
                input: l.input,
                cached_input: l.cached_input,
                output: l.output,
                reasoning: l.reasoning,
            };
            let priced = l.model.as_ref().and_then(|m| prices?.get(m)).map(|p| p.cost(&tokens));
            let request = pier_store::ModelRequest {
                attempt,
                provider: l.provider.clone().unwrap_or_else(|| "unknown".into()),
                model: l.model.clone(),
                status: 200,
                latency_ms: 0,
                held_ms: 0,
                streamed: false,
                tokens: Some(tokens),
                cost: l.cost.or(priced),
                complete: true,
                error: None,
                node: format!("worker:{worker}"),
                agent: agent.to_owned(),
            };
            out.push((pier_store::MODEL_REQUEST.to_owned(), serde_json::to_value(&request).map_err(StoreError::from)?));
        }
        Ok(out)
    }
}

/// Applies a worker's report: only the holder of the live lease ends a task, only a
/// worker task is ended this way, and the ending is decided by the same rule as the
/// host's own attempts. A repeat of a report (same key, same body) gets the first answer.
pub(crate) fn report(
    store: &dyn TaskStore,
    run: &str,
    task: &str,
    report: &Report,
    cx: &Reporting<'_>,
    next: Option<&pier_store::NextClaim>,
) -> Result<Reported, ActionError> {
    let Reporting { body, retry_base, prices } = *cx;
    let row = store.task(run, task)?.ok_or_else(|| StoreError::UnknownTask(task.to_owned()))?;
    // A task naming an agent is a worker's to end only while that worker holds it (it leased
    // it with `agents`); a host node's attempt never is (node ids have a `:`, workers' names
    // may not). The lease fences the ending either way; a task no one holds is the store's to
    // answer (a repeat of a report that ended it gets its first answer, anything else
    // `lease_lost`).
    let leased_by_worker = !report.worker.contains(':') && row.lease_owner.as_deref() == Some(report.worker.as_str());
    if !row.spec.is_worker() && row.lease_owner.is_some() && !leased_by_worker {
        return Err(ActionError::Refused {
            code: ErrorCode::NotAWorkerTask,
            message: format!(
                "task `{task}` is run by agent `{}`, not by a pull worker; only its host ends it",
                row.spec.agent
            ),
        });
    }
    let attempt =
        Attempt { run: run.to_owned(), task: task.to_owned(), n: report.attempt, owner: report.worker.clone() };
    let outcome = match report.status.as_str() {
        "completed" => None,
        "failed" => Some(Outcome::Failed {
            error: report.error.clone().unwrap_or_else(|| "the worker reported a failure".into()),
            class: report.class.unwrap_or(ErrorClass::Business),
        }),
        "stopped" => {
            let name = report.stop_reason.as_deref().unwrap_or_default();
            let stop_reason = serde_json::from_value(Value::String(name.to_owned())).map_err(|_| {
                ActionError::bad_request(format!(
                    "`stopped` needs the turn's stop_reason (end_turn, max_tokens, max_turn_requests, refusal, cancelled), not `{name}`"
                ))
            })?;
            let text = report.result.clone().unwrap_or_default();
            Some(Outcome::Answered { stop_reason, text, usage: None })
        }
        "interrupted" => Some(Outcome::Interrupted { why: format!("worker {} stopped the attempt", report.worker) }),
        "denied" => Some(Outcome::Denied {
            why: report.error.clone().unwrap_or_else(|| "a person denied a tool call; on_deny = \"fail\"".into()),
        }),
        "cancelled" => None,
        other => {
            return Err(ActionError::Refused {
                code: ErrorCode::BadTransition,
                message: format!(
                    "a worker reports completed, stopped, failed, denied, interrupted or cancelled, not `{other}`"
                ),
            });
        }
    };
    if report.evidence.len() > MAX_USAGE_LINES {
        return Err(ActionError::bad_request(format!("a report carries at most {MAX_USAGE_LINES} side effects")));
    }
    let ending = match (report.status.as_str(), &outcome) {
        ("completed", _) => Ending::Completed { result: report.result.clone().unwrap_or_default(), usage: None },
        (_, Some(outcome)) => {
            let cx = Context {
                spec: &row.spec,
                attempt: report.attempt,
                failures: row.failures,
                evidence: &report.evidence,
                retry_delay: crate::attempt::backoff(retry_base, row.failures as u32),
                now_ms: now_ms(),
            };
            decide(outcome, &cx)
        }
        _ => Ending::Cancelled { reason: format!("worker {} cancelled it", report.worker) },
    };
    let (mut events, evidence) = match report.progress.clone() {
        Some(batch) => {
            let (_, events, evidence) = batch.rows()?;
            (events, evidence)
        }
        None => Default::default(),
    };
    if let Some(u) = &report.usage {
        events.extend(u.events(report.attempt, &report.worker, &row.spec.agent, prices)?);
    }
    let idem = Idem::worker_report(&attempt, &report.idempotency_key, body)
        .with_events(events)
        .with_evidence(evidence)
        .with_output(report.output.as_ref().map(Value::to_string))
        .unless_messages(report.unless_messages);
    // A report asking for its next task answers with it, a repeat too (found or not).
    let reported = match report.next {
        Some(_) => store.report_and_claim(&attempt, &ending, &idem, next),
        None => store.finish(&attempt, &ending, Some(&idem)).map(|task| Reported { task, next: None, repeat: false }),
    };
    match reported {
        Ok(reported) => {
            if let Some(outcome) = &outcome {
                crate::telemetry::attempt_ended(outcome, &ending);
            }
            Ok(reported)
        }
        Err(e) => {
            if matches!(e, StoreError::LeaseLost { .. }) {
                crate::telemetry::lease_lost();
            }
            Err(e.into())
        }
    }
}
