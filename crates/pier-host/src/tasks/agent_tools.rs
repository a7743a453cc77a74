//! What an agent asks of its host while it runs (the tools of the host's MCP endpoint, `pier
//! serve`'s `/mcp`): a finished task's result, a person's answer, a follow-up task in its run.
//! Each is asked as the attempt a token was granted to ([`crate::host_mcp`]), and each is
//! fenced on that attempt holding its task: an attempt that lost its task asks nothing.

use agent_client_protocol_schema::v1::{
    CreateElicitationRequest, ElicitationFormMode, ElicitationSchema, ElicitationSessionScope, StringPropertySchema,
};
use pier_store::{Added, Attempt, StoreError, TaskState};
use serde::Serialize;
use serde_json::Value;

use super::handle::Tasks;
use super::remote::{MAX_WAIT, lost};
use super::submit::{check_sandbox, one_task_plan, parse_plan};
use crate::person::ActionError;

/// A task of the caller's run as its result tool shows it.
#[derive(Debug, Clone, Serialize)]
pub struct TaskResult {
    pub task: String,
    pub state: &'static str,
    /// Set once it completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What a person said to an agent's question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PersonSaid {
    Answer(String),
    Declined,
}

/// A task an agent adds to its run: of a declared type, with its input.
#[derive(Debug, Clone)]
pub struct FollowUp {
    pub task_type: String,
    pub input: Value,
    /// The new task's id; by default the type's name and a random suffix.
    pub id: Option<String>,
    /// Tasks of the run it waits for (the caller's own id among them makes it wait for the caller).
    pub depends_on: Vec<String>,
    pub priority: Option<u8>,
}

/// The follow-up as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowedUp {
    pub run: String,
    pub task: String,
    /// False when a task of that id and spec was there already (a call sent again).
    pub added: bool,
}

/// The most tokens of pull workers' attempts kept at once: one whose attempt was never
/// reported (its worker died) is forgotten when this many newer ones exist. Each tool's call is
/// fenced on the attempt holding its task anyway, so a forgotten attempt's token opens nothing.
const MAX_REMOTE_GRANTS: usize = 4096;

impl Tasks {
    /// `leased` with a token of its attempt at the host's MCP endpoint, when this host serves
    /// one (the attempt's token already given, if it has one): the pull worker gives its agent
    /// `{server}/mcp` with it.
    pub(super) fn with_mcp_token(&self, mut leased: super::Leased) -> super::Leased {
        let Some(mcp) = &self.config.mcp else { return leased };
        let t = &leased.task;
        let Some(owner) = t.lease_owner.clone() else { return leased };
        let attempt = Attempt { run: t.run_id.clone(), task: t.id.clone(), n: t.attempt, owner };
        let mut grants = self.remote_grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A repeated report answers what the first did: the same lease, the same token.
        if let Some((_, grant)) = grants.iter().find(|(a, _)| *a == attempt) {
            leased.mcp_token = Some(grant.token().to_owned());
            return leased;
        }
        let grant = mcp.grant(&attempt);
        leased.mcp_token = Some(grant.token().to_owned());
        grants.push_back((attempt, grant));
        while grants.len() > MAX_REMOTE_GRANTS {
            grants.pop_front();
        }
        leased
    }

    /// Revokes the tokens of `row`'s attempts on pull workers up to its current one (reported).
    pub(super) fn revoke_remote(&self, row: &pier_store::TaskRow) {
        let mut grants = self.remote_grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        grants.retain(|(a, _)| !(a.run == row.run_id && a.task == row.id && a.n <= row.attempt));
    }

    /// The attempt `token` (from the host's MCP endpoint) was granted to, while it runs here.
    pub fn mcp_caller(&self, token: &str) -> Option<Attempt> {
        self.config.mcp.as_ref()?.caller(token)
    }

    /// Task `task` of `caller`'s run: its state, and its result once it completed.
    pub async fn result_for(&self, caller: &Attempt, task: &str) -> Result<TaskResult, ActionError> {
        let (a, id) = (caller.clone(), task.to_owned());
        let row = self
            .blocking(move |s| {
                // Asked only by an attempt that holds its task: a token that outlived its attempt reads nothing.
                let now = pier_store::now_ms();
                let held = s
                    .task(&a.run, &a.task)?
                    .and_then(|t| t.held())
                    .is_some_and(|h| h.attempt == a && h.expires_at_ms >= now);
                if !held {
                    return Err(ActionError::Store(StoreError::LeaseLost {
                        task: a.task.clone(),
                        attempt: a.n,
                        owner: a.owner.clone(),
                    }));
                }
                Ok(s.task(&a.run, &id)?)
            })
            .await
            .map_err(|e| match e {
                ActionError::Store(StoreError::LeaseLost { .. }) => lost(caller),
                other => other,
            })?;
        let row = row.ok_or_else(|| ActionError::Store(StoreError::UnknownTask(task.to_owned())))?;
        let done = row.state == TaskState::Completed;
        Ok(TaskResult {
            task: row.id,
            state: row.state.as_str(),
            result: row.result.filter(|_| done),
            error: row.error.filter(|_| row.state.retryable()),
        })
    }

    /// Parks `caller`'s task on `question` for a person (the task waits in `awaiting_input`,
    /// as for an agent's elicitation) and waits for the answer: one of `options` when any
    /// are given, else free text. A question the attempt stops waiting for (the call dropped,
    /// its turn cancelled) is withdrawn.
    pub async fn ask_for(
        &self,
        caller: &Attempt,
        question: &str,
        options: Vec<String>,
    ) -> Result<PersonSaid, ActionError> {
        if question.trim().is_empty() {
            return Err(ActionError::bad_request("the question is empty: say what the person is asked"));
        }
        let answer = StringPropertySchema::new().enum_values((!options.is_empty()).then_some(options));
        let schema = ElicitationSchema::new().property("answer", answer, true);
        let scope = ElicitationSessionScope::new(format!("pier-mcp:{}:{}:{}", caller.run, caller.task, caller.n));
        let request = CreateElicitationRequest::new(ElicitationFormMode::new(scope, schema), question.to_owned());
        let request = pier_store::QuestionRequest::Elicitation(Box::new(request));
        let n = self.park_on(caller, request).await?;
        // Waiting for a person is not the agent's idleness: its attempt's idle timer stops.
        let _asking = self.config.mcp.as_ref().and_then(|m| m.asking_for(caller)).map(|c| c.start());
        let mut pending =
            crate::attempt::OpenQuestion { store: self.store.clone(), attempt: caller.clone(), n: Some(n) };
        loop {
            if let Some(answer) = self.wait_answer(caller, n, MAX_WAIT).await? {
                pending.n = None;
                let answer: Value = serde_json::from_str(&answer).unwrap_or(Value::Null);
                return Ok(match answer["action"].as_str() {
                    Some("accept") => match &answer["content"]["answer"] {
                        Value::String(s) => PersonSaid::Answer(s.clone()),
                        Value::Null => PersonSaid::Answer(String::new()),
                        other => PersonSaid::Answer(other.to_string()),
                    },
                    _ => PersonSaid::Declined,
                });
            }
        }
    }

    /// Adds a task of a declared type (pier.toml's `[types]`) to `caller`'s run, checked as
    /// a submitted one is (its input against the type's schema, its agent, its sandbox), its
    /// `added_by` the caller's task; a run's budget covers it as it covers the caller.
    pub async fn add_follow_up(&self, caller: &Attempt, f: FollowUp) -> Result<FollowedUp, ActionError> {
        let id =
            f.id.clone()
                .unwrap_or_else(|| format!("{}-{}", f.task_type, &uuid::Uuid::new_v4().simple().to_string()[..8]));
        let text = one_task_plan(&f.task_type, &f.input, f.priority, Some(&id))?;
        let config = &self.config;
        let mut plan = parse_plan(&text, &config.agents, &config.pier_exe, &config.types)?;
        check_sandbox(&plan, config)?;
        crate::caps::check(&plan, &self.store, config).await?;
        let Some(mut spec) = plan.tasks.pop() else {
            return Err(ActionError::bad_request("the follow-up made no task"));
        };
        let (run, task) = (caller.run.clone(), caller.task.clone());
        let of_caller = self.blocking(move |s| Ok(s.task(&run, &task)?)).await?.ok_or_else(|| lost(caller))?;
        spec.depends_on = f.depends_on;
        spec.added_by = Some(caller.task.clone());
        spec.run_budget = of_caller.spec.run_budget;
        if let Some(why) = looser(&config.sandbox, &spec, &of_caller.spec) {
            return Err(ActionError::bad_request(format!(
                "task `{}` would be less confined than task `{}`, which adds it: {why}; a follow-up gets at most its adder's reach",
                spec.id, caller.task
            )));
        }
        let a = caller.clone();
        let added = self.blocking(move |s| Ok(s.add_task(&a, &spec)?)).await;
        match added {
            Ok(added) => Ok(FollowedUp { run: caller.run.clone(), task: id, added: added == Added::Added }),
            Err(ActionError::Store(StoreError::LeaseLost { .. })) => Err(lost(caller)),
            Err(e) => Err(e),
        }
    }
}

/// How `follow_up` would reach further than `adder` (a weaker sandbox, a host the adder may not
/// reach, a resource limit the adder has and it has not or has higher), if it would.
fn looser(
    sandbox: &crate::SandboxConfig,
    follow_up: &pier_store::TaskSpec,
    adder: &pier_store::TaskSpec,
) -> Option<String> {
    let (level, network, limits) = sandbox.for_task(follow_up);
    let (max_level, max_network, max_limits) = sandbox.for_task(adder);
    if level > max_level {
        return Some(format!("sandbox {level:?} where it runs {max_level:?}").to_lowercase());
    }
    if let Some(host) = network.iter().find(|h| !max_network.contains(h)) {
        return Some(format!("network host `{host}` it may not reach"));
    }
    let over = |have: Option<f64>, max: Option<f64>| max.is_some_and(|m| have.is_none_or(|h| h > m));
    let limits_over = [
        ("memory", over(limits.memory.map(|v| v as f64), max_limits.memory.map(|v| v as f64))),
        ("pids", over(limits.pids.map(|v| v as f64), max_limits.pids.map(|v| v as f64))),
        ("cpu", over(limits.cpu, max_limits.cpu)),
    ];
    limits_over.iter().find(|(_, o)| *o).map(|(name, _)| format!("a higher `{name}` limit"))
}

#[cfg(test)]
mod tests {
    use super::looser;
    use pier_store::TaskSpec;
    use pier_store::plan::{Level, Limits};

    fn spec(sandbox: Option<Level>, network: &[&str], limits: Limits) -> TaskSpec {
        TaskSpec {
            id: "t".into(),
            sandbox,
            network: network.iter().map(|h| (*h).to_owned()).collect(),
            limits,
            ..TaskSpec::default()
        }
    }

    #[test]
    fn a_follow_up_reaches_no_further_than_its_adder() {
        let sandbox = crate::SandboxConfig::new(std::path::Path::new("/bin/true"));
        let strict =
            spec(Some(Level::Strict), &["a.example:443"], Limits { memory: Some(1 << 30), ..Limits::default() });
        let same = strict.clone();
        assert_eq!(looser(&sandbox, &same, &strict), None);
        let tighter = spec(None, &[], Limits { memory: Some(1 << 20), pids: Some(10), cpu: None });
        assert_eq!(looser(&sandbox, &tighter, &strict), None, "the host's strict default, fewer hosts, lower limits");
        let open = spec(Some(Level::Off), &[], strict.limits);
        assert!(looser(&sandbox, &open, &strict).is_some_and(|w| w.contains("off")));
        let other_host = spec(Some(Level::Strict), &["b.example:443"], strict.limits);
        assert!(looser(&sandbox, &other_host, &strict).is_some_and(|w| w.contains("b.example:443")));
        let unlimited = spec(Some(Level::Strict), &[], Limits::default());
        assert!(looser(&sandbox, &unlimited, &strict).is_some_and(|w| w.contains("memory")));
    }
}
