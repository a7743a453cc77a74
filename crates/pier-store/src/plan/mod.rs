//! Plans: a TOML list of tasks with dependencies, checked as a whole before anything runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

pub use pier_jail::{Level, Limits};
use pier_tools::{Rule, ToolKind};
use serde::{Deserialize, Serialize};

mod mcp;
mod types;
pub use mcp::{HOST_SERVER, McpServerSpec};
pub use types::{ConcurrencyKey, MAX_PRIORITY};

/// A validated plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub tasks: Vec<TaskSpec>,
    /// The line of each task's `[[tasks]]` header, for problems found after parsing.
    #[serde(default, skip)]
    pub lines: HashMap<String, usize>,
}

impl Plan {
    /// Every task at `priority`: a priority given at submit, which wins over what the plan,
    /// its types and defaults say. Refused outside 0..=9.
    pub fn at_priority(mut self, priority: u8) -> Result<Plan, PlanError> {
        if priority > 9 {
            let message = format!("priority = {priority}: give 0 to 9");
            return Err(PlanError(vec![Problem { line: 0, message }]));
        }
        for t in &mut self.tasks {
            t.priority = priority;
        }
        Ok(self)
    }
}

/// One task, with the defaults applied.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub id: String,
    pub prompt: String,
    pub agent: String,
    pub depends_on: Vec<String>,
    pub cwd: Option<PathBuf>,
    /// Idle timeout in seconds, reset by progress.
    pub timeout: Option<f64>,
    pub max_time: Option<f64>,
    pub max_attempts: u32,
    /// Stop reasons besides failures that are retried: `max_tokens`, `max_turn_requests`.
    pub retry_on: Vec<String>,
    /// Whether a lost attempt may run again even after side effects.
    pub idempotent: bool,
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// Tool kind → rule (`allow`, `allow_always`, `ask`, `deny`, `deny_always`). Typed, so a
    /// stored rule that does not parse fails the read of its task (naming it), never drops out.
    pub permissions: BTreeMap<ToolKind, Rule>,
    /// Directories besides cwd the agent's fs/terminal calls may use.
    pub roots: Vec<PathBuf>,
    /// When set, the only directories the agent may write to.
    #[serde(default)]
    pub writable: Option<Vec<PathBuf>>,
    /// Run on an agent process of its own, never a warm one another task used.
    #[serde(default)]
    pub fresh_agent: bool,
    /// What the agent must be able to do ([`crate::requires::REQUIREMENTS`]; for a pull-worker
    /// task, capabilities the worker must have besides its `worker:` one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
    /// `sandbox = "strict" | "workspace" | "off"`; `None`: the host's (pier.toml's `[sandbox]`, else strict).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Level>,
    /// Hosts (`host[:port]`) the agent may reach through pier's egress proxy, besides the model providers'.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network: Vec<String>,
    /// Resource limits over the host's (`[limits]` in pier.toml).
    #[serde(default, skip_serializing_if = "Limits::is_empty")]
    pub limits: Limits,
    /// The most this task's model requests may spend over all its attempts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,
    /// The most the model requests of all the run's tasks may spend (the plan's `[budget]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_budget: Option<Budget>,
    /// The task's type (`[types.NAME]`), whose schema its input met.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub task_type: Option<String>,
    /// What the prompt was rendered from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// 0..=9: among ready tasks the higher goes first.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: u8,
    /// The caps this task counts against while it runs, keys rendered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub concurrency: Vec<ConcurrencyKey>,
    /// MCP servers passed to the task's agent (`mcp_servers` on the task, its type or `[defaults]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<McpServerSpec>,
    /// What a person's denial of one of the agent's tool calls does to the task.
    #[serde(default, skip_serializing_if = "OnDeny::is_fail")]
    pub on_deny: OnDeny,
    /// The task of the same run whose agent added this one while it ran (through the host's
    /// MCP tools); `None` for a task of the plan as submitted. Never read from a plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub added_by: Option<String>,
}

/// `on_deny`: what a person's denial of a tool call does to the task under the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDeny {
    /// The task fails at once (its turn is cancelled) and its dependents are cancelled: the
    /// person said the work must not go on as the agent meant to do it.
    #[default]
    Fail,
    /// The agent is told and its turn goes on; the task may still complete.
    Continue,
}

impl OnDeny {
    fn is_fail(&self) -> bool {
        *self == OnDeny::Fail
    }
}

impl std::str::FromStr for OnDeny {
    type Err = String;
    fn from_str(s: &str) -> Result<OnDeny, String> {
        match s {
            "fail" => Ok(OnDeny::Fail),
            "continue" => Ok(OnDeny::Continue),
            other => Err(format!("on_deny = \"{other}\" is not one of \"fail\", \"continue\"")),
        }
    }
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

/// A spending limit: tokens (input and output) and cost (in the price table's currency).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
}

impl Budget {
    /// Why the budget cannot hold, if it cannot: it names nothing, or a limit that is not above 0.
    pub fn check(&self) -> Result<(), String> {
        if self.tokens.is_none() && self.cost.is_none() {
            return Err("a budget needs `tokens` or `cost` (or both)".into());
        }
        if self.tokens == Some(0) {
            return Err("budget tokens = 0: give a number of tokens above 0".into());
        }
        if let Some(c) = self.cost.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(format!("budget cost = {c}: give an amount above 0"));
        }
        Ok(())
    }

    /// Which limit `tokens` and `cost` (spent so far) have reached, in words, if one has.
    pub fn spent(&self, tokens: u64, cost: f64) -> Option<String> {
        if let Some(limit) = self.tokens.filter(|l| tokens >= *l) {
            return Some(format!("{tokens} of {limit} tokens used"));
        }
        if let Some(limit) = self.cost.filter(|l| cost >= *l) {
            return Some(format!("{cost:.4} of {limit:.4} spent"));
        }
        None
    }

    /// This budget with `other`'s limits where it gives them.
    pub fn raised(self, other: Budget) -> Budget {
        Budget { tokens: other.tokens.or(self.tokens), cost: other.cost.or(self.cost) }
    }
}

impl TaskSpec {
    /// Whether pull workers run the task (its agent is `worker` or `worker:CAPABILITY`).
    pub fn is_worker(&self) -> bool {
        crate::requires::is_worker(&self.agent)
    }

    /// Whether a worker with `capabilities` may lease the task: it is a worker task, and the
    /// worker has its `worker:` capability and everything it `requires`.
    pub fn fits_worker(&self, capabilities: &[String]) -> bool {
        let has = |c: &str| c.is_empty() || capabilities.iter().any(|mine| mine == c);
        crate::requires::worker_capability(&self.agent).is_some_and(has) && self.requires.iter().all(|r| has(r))
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Defaults {
    agent: Option<String>,
    max_attempts: Option<u32>,
    timeout: Option<f64>,
    max_time: Option<f64>,
    cwd: Option<PathBuf>,
    retry_on: Option<Vec<String>>,
    idempotent: Option<bool>,
    #[serde(default)]
    permissions: BTreeMap<String, String>,
    #[serde(default)]
    roots: Vec<PathBuf>,
    writable: Option<Vec<PathBuf>>,
    fresh_agent: Option<bool>,
    requires: Option<Vec<String>>,
    sandbox: Option<String>,
    #[serde(default)]
    network: Vec<String>,
    #[serde(default)]
    limits: Limits,
    budget: Option<Budget>,
    priority: Option<u8>,
    #[serde(default)]
    concurrency: Vec<ConcurrencyKey>,
    #[serde(default)]
    mcp_servers: Vec<McpServerSpec>,
    on_deny: Option<String>,
}

impl Defaults {
    /// These (a type's) over `plan`'s: a field given here wins; lists and caps add up.
    fn over(self, plan: &Defaults) -> Defaults {
        let mut permissions = plan.permissions.clone();
        permissions.extend(self.permissions);
        let mut roots = plan.roots.clone();
        roots.extend(self.roots);
        let mut network = plan.network.clone();
        network.extend(self.network);
        let mut concurrency = plan.concurrency.clone();
        concurrency.extend(self.concurrency);
        Defaults {
            agent: self.agent.or_else(|| plan.agent.clone()),
            max_attempts: self.max_attempts.or(plan.max_attempts),
            timeout: self.timeout.or(plan.timeout),
            max_time: self.max_time.or(plan.max_time),
            cwd: self.cwd.or_else(|| plan.cwd.clone()),
            retry_on: self.retry_on.or_else(|| plan.retry_on.clone()),
            idempotent: self.idempotent.or(plan.idempotent),
            permissions,
            roots,
            writable: self.writable.or_else(|| plan.writable.clone()),
            fresh_agent: self.fresh_agent.or(plan.fresh_agent),
            requires: self.requires.or_else(|| plan.requires.clone()),
            sandbox: self.sandbox.or_else(|| plan.sandbox.clone()),
            network,
            limits: plan.limits.overlaid(self.limits),
            budget: self.budget.or(plan.budget),
            priority: self.priority.or(plan.priority),
            concurrency,
            mcp_servers: mcp::merged(&plan.mcp_servers, self.mcp_servers),
            on_deny: self.on_deny.or_else(|| plan.on_deny.clone()),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskDef {
    id: String,
    prompt: Option<String>,
    #[serde(rename = "type")]
    task_type: Option<String>,
    input: Option<toml::Value>,
    priority: Option<u8>,
    #[serde(default)]
    concurrency: Vec<ConcurrencyKey>,
    agent: Option<String>,
    #[serde(default)]
    depends_on: Vec<String>,
    cwd: Option<PathBuf>,
    timeout: Option<f64>,
    max_time: Option<f64>,
    max_attempts: Option<u32>,
    retry_on: Option<Vec<String>>,
    idempotent: Option<bool>,
    #[serde(default)]
    metadata: BTreeMap<String, toml::Value>,
    #[serde(default)]
    permissions: BTreeMap<String, String>,
    #[serde(default)]
    roots: Vec<PathBuf>,
    writable: Option<Vec<PathBuf>>,
    fresh_agent: Option<bool>,
    requires: Option<Vec<String>>,
    sandbox: Option<String>,
    #[serde(default)]
    network: Vec<String>,
    #[serde(default)]
    limits: Limits,
    budget: Option<Budget>,
    #[serde(default)]
    mcp_servers: Vec<McpServerSpec>,
    on_deny: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    #[serde(default)]
    defaults: Defaults,
    /// The run's budget.
    budget: Option<Budget>,
    #[serde(default)]
    types: BTreeMap<String, toml::Value>,
    #[serde(default)]
    tasks: Vec<toml::Spanned<TaskDef>>,
}

/// One thing wrong with a plan, at a line (1-based; 0 when not tied to one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.line > 0 { write!(f, "line {}: {}", self.line, self.message) } else { f.write_str(&self.message) }
    }
}

/// Every problem of a refused plan.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the plan was refused:\n{}", .0.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
pub struct PlanError(pub Vec<Problem>);

/// Line numbers of a plan's text, found by binary search (a plan of 100,000 tasks
/// is mapped in one pass, not one pass per task).
struct Lines {
    /// The offset of every `\n`.
    newlines: Vec<usize>,
    /// The offset of every `[[tasks]]`.
    headers: Vec<usize>,
}

impl Lines {
    fn new(text: &str) -> Lines {
        let newlines = text.match_indices('\n').map(|(i, _)| i).collect();
        let headers = text.match_indices("[[tasks]]").map(|(i, _)| i).collect();
        Lines { newlines, headers }
    }

    /// The 1-based line of `offset`.
    fn of(&self, offset: usize) -> usize {
        self.newlines.partition_point(|&n| n < offset) + 1
    }

    /// The line of the `[[tasks]]` header that opens the table starting near `offset`.
    fn header(&self, offset: usize) -> usize {
        match self.headers.partition_point(|&h| h <= offset) {
            0 => self.of(offset),
            n => self.of(self.headers[n - 1]),
        }
    }
}

/// Why a run id cannot address a run, if it cannot: it is empty, blank, or has a
/// `/` or a control character (it is a path segment of every route).
pub fn check_run_id(id: &str) -> Result<(), String> {
    if id.trim().is_empty() {
        Err("the run id is empty; give one with letters or digits, or leave it out".into())
    } else if id.contains('/') || id.chars().any(char::is_control) {
        Err(format!("the run id {id:?} has a `/` or a control character"))
    } else {
        Ok(())
    }
}

/// The longest time a plan may give in seconds (`timeout`, `max_time`): 30 days.
pub const MAX_SECONDS: f64 = 30.0 * 24.0 * 3600.0;
/// The most attempts a plan may give a task.
pub const MAX_ATTEMPTS: u32 = 1000;

/// Why a number of seconds is unusable, if it is: not a finite positive number of at most [`MAX_SECONDS`].
pub fn check_seconds(field: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 && value <= MAX_SECONDS {
        Ok(())
    } else {
        Err(format!("{field} = {value:?}: give a number of seconds above 0 and at most {MAX_SECONDS} (30 days)"))
    }
}

/// Why a number of attempts is unusable, if it is.
pub fn check_attempts(value: u32) -> Result<(), String> {
    if (1..=MAX_ATTEMPTS).contains(&value) {
        Ok(())
    } else {
        Err(format!("max_attempts = {value}: give a whole number from 1 to {MAX_ATTEMPTS}"))
    }
}

/// Every problem of the numbers a task (or the defaults) gives.
fn number_problems(timeout: Option<f64>, max_time: Option<f64>, max_attempts: Option<u32>) -> Vec<String> {
    let mut out = Vec::new();
    for (field, value) in [("timeout", timeout), ("max_time", max_time)] {
        if let Some(Err(why)) = value.map(|v| check_seconds(field, v)) {
            out.push(why);
        }
    }
    if let Some(Err(why)) = max_attempts.map(check_attempts) {
        out.push(why);
    }
    out
}

/// The names of a cycle, shortened when long: the first ids, how many were left out, the last.
fn cycle_text(cycle: &[String]) -> String {
    const SHOWN: usize = 10;
    if cycle.len() <= 2 * SHOWN {
        return format!("{} -> {}", cycle.join(" -> "), cycle[0]);
    }
    format!(
        "{} -> ... ({} more) -> {} -> {} ({} tasks)",
        cycle[..SHOWN].join(" -> "),
        cycle.len() - 2 * SHOWN,
        cycle[cycle.len() - SHOWN..].join(" -> "),
        cycle[0],
        cycle.len()
    )
}

/// Parses and checks a plan. `agent_known` says whether an agent name or command resolves.
pub fn parse(text: &str, agent_known: &dyn Fn(&str) -> Result<(), String>) -> Result<Plan, PlanError> {
    parse_typed(text, &Shared::default(), agent_known)
}

/// The task types every plan may use (pier.toml's `[types]`), their schemas compiled once; a
/// plan's own of the same name win. With the MCP servers every task's agent is given
/// (pier.toml's `[[mcp_servers]]`), beneath a plan's `[defaults]`.
#[derive(Clone, Default)]
pub struct Shared {
    types: std::sync::Arc<BTreeMap<String, std::sync::Arc<types::TaskType>>>,
    mcp_servers: std::sync::Arc<Vec<McpServerSpec>>,
}

/// A types file: `[types.NAME]` tables and nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TypesFile {
    #[serde(default)]
    types: BTreeMap<String, toml::Value>,
}

impl Shared {
    /// The `[types]` table of a configuration file, checked as a plan's would be.
    pub fn new(table: BTreeMap<String, toml::Value>) -> Result<Shared, PlanError> {
        Shared::checked(table, &|_| 0)
    }

    fn checked(table: BTreeMap<String, toml::Value>, line: &dyn Fn(&str) -> usize) -> Result<Shared, PlanError> {
        let mut problems = Vec::new();
        let types = types::parse_types(table, line, &mut problems);
        let types = types.into_iter().map(|(name, ty)| (name, std::sync::Arc::new(ty))).collect();
        if problems.is_empty() {
            Ok(Shared { types: std::sync::Arc::new(types), mcp_servers: Default::default() })
        } else {
            Err(PlanError(problems))
        }
    }

    /// These types with `servers` given to every task's agent, checked.
    pub fn with_mcp_servers(self, servers: Vec<McpServerSpec>) -> Result<Shared, PlanError> {
        let problems: Vec<Problem> =
            mcp::problems(&servers).into_iter().map(|message| Problem { line: 0, message }).collect();
        if !problems.is_empty() {
            return Err(PlanError(problems));
        }
        Ok(Shared { mcp_servers: std::sync::Arc::new(servers), ..self })
    }

    /// The types of a types file (`types.toml` beside a plan), each problem with its line.
    pub fn parse_file(text: &str) -> Result<Shared, PlanError> {
        let file: TypesFile = toml::from_str(text).map_err(|e| {
            let line = e.span().map_or(0, |s| Lines::new(text).of(s.start));
            PlanError(vec![Problem { line, message: e.message().to_owned() }])
        })?;
        let index = Lines::new(text);
        Shared::checked(file.types, &|name| type_line(text, &index, name))
    }

    /// These types with `over`'s beside them, `over`'s winning on a name.
    pub fn with(&self, over: &Shared) -> Shared {
        let mut types = (*self.types).clone();
        types.extend(over.types.iter().map(|(name, ty)| (name.clone(), ty.clone())));
        Shared { types: std::sync::Arc::new(types), mcp_servers: self.mcp_servers.clone() }
    }
}

/// The line of type `name`'s header in `text`, or 0.
fn type_line(text: &str, index: &Lines, name: &str) -> usize {
    [format!("[types.{name}]"), format!("[types.\"{name}\"]")]
        .iter()
        .find_map(|header| text.find(header.as_str()))
        .map_or(0, |at| index.of(at))
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("types", &self.types.keys().collect::<Vec<_>>()).finish()
    }
}

/// [`parse`] with the task types of `shared` beside the plan's own.
pub fn parse_typed(
    text: &str,
    shared: &Shared,
    agent_known: &dyn Fn(&str) -> Result<(), String>,
) -> Result<Plan, PlanError> {
    let file: PlanFile = toml::from_str(text).map_err(|e| {
        let line = e.span().map_or(0, |s| Lines::new(text).of(s.start));
        PlanError(vec![Problem { line, message: e.message().to_owned() }])
    })?;
    let mut d = file.defaults;
    let index = Lines::new(text);
    let mut problems = Vec::new();
    let own = types::parse_types(file.types, &|name| type_line(text, &index, name), &mut problems);
    let declared: BTreeMap<&str, &types::TaskType> = shared
        .types
        .iter()
        .map(|(name, ty)| (name.as_str(), ty.as_ref()))
        .chain(own.iter().map(|(name, ty)| (name.as_str(), ty)))
        .collect();
    let defaults_line = text.find("[defaults]").map_or(0, |at| index.of(at));
    for why in number_problems(d.timeout, d.max_time, d.max_attempts).into_iter().chain(mcp::problems(&d.mcp_servers)) {
        problems.push(Problem { line: defaults_line, message: format!("[defaults]: {why}") });
    }
    // pier.toml's servers beneath the plan's (checked where pier.toml is read).
    d.mcp_servers = mcp::merged(&shared.mcp_servers, std::mem::take(&mut d.mcp_servers));
    let mut tasks = Vec::new();
    let mut lines = HashMap::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for spanned in file.tasks {
        let line = index.header(spanned.span().start);
        let t = spanned.into_inner();
        if let Some(first) = seen.insert(t.id.clone(), line) {
            problems.push(Problem { line, message: format!("duplicate task id `{}` (first at line {first})", t.id) });
        }
        lines.entry(t.id.clone()).or_insert(line);
        let mut say = |message: String| problems.push(Problem { line, message });
        let mut spec = typed_spec(t, &d, &declared, agent_known, &mut say);
        spec.run_budget = file.budget;
        tasks.push(spec);
    }
    if let Some(Err(why)) = file.budget.map(|b| b.check()) {
        let line = text.find("[budget]").map_or(0, |at| index.of(at));
        problems.push(Problem { line, message: format!("[budget]: {why}") });
    }
    if tasks.is_empty() {
        problems.push(Problem { line: 0, message: "the plan has no [[tasks]]".into() });
    }
    problems.extend(graph_problems(&tasks, &lines));
    if problems.is_empty() { Ok(Plan { tasks, lines }) } else { Err(PlanError(problems)) }
}

/// A task with its type's fields and the defaults applied, its input checked and rendered
/// into its prompt and concurrency keys; what is wrong with it alone goes to `say`.
fn typed_spec(
    mut t: TaskDef,
    d: &Defaults,
    declared: &BTreeMap<&str, &types::TaskType>,
    agent_known: &dyn Fn(&str) -> Result<(), String>,
    say: &mut dyn FnMut(String),
) -> TaskSpec {
    let id = t.id.clone();
    let of_type = match t.task_type.as_deref().map(|name| (name, declared.get(name))) {
        None => None,
        Some((_, Some(ty))) => Some(ty),
        Some((name, None)) => {
            let known: Vec<&str> = declared.keys().copied().collect();
            let known = if known.is_empty() {
                "none is declared".to_owned()
            } else {
                format!("declared: {}", known.join(", "))
            };
            say(format!("task `{id}`: unknown type `{name}` ({known})"));
            None
        }
    };
    let input = t.input.take().map(toml_to_json);
    if let (Some(ty), Some(input)) = (of_type, &input) {
        for why in ty.input_problems(input) {
            say(format!("task `{id}`: {why}"));
        }
    }
    if let (Some(ty), None) = (of_type, &input)
        && ty.takes_input()
    {
        let name = t.task_type.as_deref().unwrap_or_default();
        say(format!("task `{id}`: type `{name}` takes an input; give input = {{ ... }}"));
    }
    let template = t.prompt.take().or_else(|| of_type.and_then(|ty| ty.prompt.clone()));
    let prompt = match (template, &input) {
        (None, _) => {
            say(format!("task `{id}`: give a prompt (or a type whose prompt it renders)"));
            String::new()
        }
        (Some(p), None) => p,
        (Some(p), Some(input)) => types::fill(&p, "{{input.", "}}", input).unwrap_or_else(|missing| {
            say(format!("task `{id}`: the prompt names input field(s) the input lacks: {}", missing.join(", ")));
            p
        }),
    };
    let typed_defaults = of_type.map(|ty| ty.defaults.clone().over(d));
    let d = typed_defaults.as_ref().unwrap_or(d);
    let priority = t.priority.or(d.priority).unwrap_or(0);
    if priority > MAX_PRIORITY {
        say(format!("task `{id}`: priority = {priority}: give a whole number from 0 to {MAX_PRIORITY} (9 goes first)"));
    }
    let mut keys: Vec<ConcurrencyKey> = Vec::new();
    for key in d.concurrency.iter().chain(&t.concurrency) {
        let rendered = match &input {
            Some(input) => types::fill(&key.key, "{input.", "}", input).unwrap_or_else(|missing| {
                say(format!(
                    "task `{id}`: concurrency key `{}` names input field(s) the input lacks: {}",
                    key.key,
                    missing.join(", ")
                ));
                key.key.clone()
            }),
            None if !types::input_fields(&key.key, "{input.", "}").is_empty() => {
                say(format!("task `{id}`: concurrency key `{}` names the input, and the task has none", key.key));
                key.key.clone()
            }
            None => key.key.clone(),
        };
        if key.limit == 0 {
            say(format!("task `{id}`: concurrency key `{}`: limit = 0 would never run it; give 1 or more", key.key));
        }
        if rendered.trim().is_empty() {
            say(format!("task `{id}`: a concurrency key is empty"));
        }
        // The same key twice holds at the smaller limit.
        match keys.iter_mut().find(|k| k.key == rendered) {
            Some(k) => k.limit = k.limit.min(key.limit),
            None => keys.push(ConcurrencyKey { key: rendered, limit: key.limit }),
        }
    }
    keys.sort_by(|a, b| a.key.cmp(&b.key));
    let task_type = t.task_type.take();
    let mut spec = task_spec(t, prompt, d, agent_known, say);
    spec.task_type = task_type;
    spec.input = input;
    spec.priority = priority;
    spec.concurrency = keys;
    spec
}

/// A task with the defaults applied; what is wrong with it alone goes to `say`.
fn task_spec(
    t: TaskDef,
    prompt: String,
    d: &Defaults,
    agent_known: &dyn Fn(&str) -> Result<(), String>,
    say: &mut dyn FnMut(String),
) -> TaskSpec {
    for why in number_problems(t.timeout, t.max_time, t.max_attempts) {
        say(format!("task `{}`: {why}", t.id));
    }
    if t.id.trim().is_empty() {
        say("a task has an empty id".into());
    }
    let agent = t.agent.or_else(|| d.agent.clone()).unwrap_or_else(|| "pier".to_owned());
    if let Err(why) = agent_known(&agent) {
        say(format!("task `{}`: {why}", t.id));
    }
    let mut permissions = BTreeMap::new();
    for (kind, rule) in d.permissions.iter().chain(&t.permissions) {
        match (kind.parse::<ToolKind>(), rule.parse::<Rule>()) {
            (Ok(kind), Ok(rule)) => {
                permissions.insert(kind, rule);
            }
            (Err(_), _) => say(format!("task `{}`: unknown tool kind `{kind}`", t.id)),
            (_, Err(_)) => say(format!("task `{}`: unknown permission rule `{rule}`", t.id)),
        }
    }
    let mut roots = d.roots.clone();
    roots.extend(t.roots);
    let sandbox = match t.sandbox.as_deref().or(d.sandbox.as_deref()).map(str::parse::<Level>).transpose() {
        Ok(level) => level,
        Err(why) => {
            say(format!("task `{}`: {why}", t.id));
            None
        }
    };
    let mut network = d.network.clone();
    network.extend(t.network);
    if let Err(why) = pier_jail::check_network(&network) {
        say(format!("task `{}`: {why}", t.id));
    }
    let limits = d.limits.overlaid(t.limits);
    if let Err(why) = limits.check() {
        say(format!("task `{}`: {why}", t.id));
    }
    let budget = t.budget.or(d.budget);
    if let Some(Err(why)) = budget.map(|b| b.check()) {
        say(format!("task `{}`: {why}", t.id));
    }
    let on_deny = match t.on_deny.as_deref().or(d.on_deny.as_deref()).map(str::parse::<OnDeny>).transpose() {
        Ok(on_deny) => on_deny.unwrap_or_default(),
        Err(why) => {
            say(format!("task `{}`: {why}", t.id));
            OnDeny::default()
        }
    };
    // The task's own servers: `[defaults]`' and a type's are checked once, where they are given.
    for why in mcp::problems(&t.mcp_servers) {
        say(format!("task `{}`: {why}", t.id));
    }
    let mcp_servers = mcp::merged(&d.mcp_servers, t.mcp_servers);
    TaskSpec {
        id: t.id,
        prompt,
        agent,
        depends_on: t.depends_on,
        cwd: t.cwd.or_else(|| d.cwd.clone()),
        timeout: t.timeout.or(d.timeout),
        max_time: t.max_time.or(d.max_time),
        max_attempts: t.max_attempts.or(d.max_attempts).unwrap_or(3),
        retry_on: t.retry_on.or_else(|| d.retry_on.clone()).unwrap_or_default(),
        idempotent: t.idempotent.or(d.idempotent).unwrap_or(false),
        fresh_agent: t.fresh_agent.or(d.fresh_agent).unwrap_or(false),
        metadata: t.metadata.into_iter().map(|(k, v)| (k, toml_to_json(v))).collect(),
        permissions,
        roots,
        writable: t.writable.or_else(|| d.writable.clone()),
        requires: t.requires.or_else(|| d.requires.clone()).unwrap_or_default(),
        sandbox,
        network,
        limits,
        budget,
        run_budget: None,
        mcp_servers,
        on_deny,
        ..TaskSpec::default()
    }
}

/// What is wrong with the tasks together: unknown or own dependencies, results used without
/// depending on them, cycles.
fn graph_problems(tasks: &[TaskSpec], lines: &HashMap<String, usize>) -> Vec<Problem> {
    let mut problems = Vec::new();
    let ids: HashSet<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
    for t in tasks {
        let line = lines.get(&t.id).copied().unwrap_or(0);
        for dep in &t.depends_on {
            if !ids.contains(dep.as_str()) {
                problems.push(Problem { line, message: format!("task `{}` depends on unknown task `{dep}`", t.id) });
            }
            if dep == &t.id {
                problems.push(Problem { line, message: format!("task `{}` depends on itself", t.id) });
            }
        }
        for reference in references(&t.prompt) {
            if !t.depends_on.contains(&reference) {
                problems.push(Problem {
                    line,
                    message: format!(
                        "task `{}` uses {{{{tasks.{reference}.result}}}} but does not depend on `{reference}`",
                        t.id
                    ),
                });
            }
        }
        for why in crate::requires::unknown_requirements(&t.agent, &t.requires) {
            problems.push(Problem { line, message: format!("task `{}`: {why}", t.id) });
        }
    }
    for cycle in cycles(tasks) {
        let line = lines.get(&cycle[0]).copied().unwrap_or(0);
        problems.push(Problem { line, message: format!("dependency cycle: {}", cycle_text(&cycle)) });
    }
    problems
}

fn toml_to_json(v: toml::Value) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// The task ids a prompt references as `{{tasks.ID.result}}`.
pub fn references(prompt: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = prompt;
    while let Some(start) = rest.find("{{tasks.") {
        let after = &rest[start + 8..];
        match after.find(".result}}") {
            Some(end) if !after[..end].contains('}') => {
                out.push(after[..end].to_owned());
                rest = &after[end + 9..];
            }
            _ => rest = after,
        }
    }
    out
}

/// The prompt with every `{{tasks.ID.result}}` replaced by that task's result.
pub fn render(prompt: &str, results: &HashMap<String, String>) -> String {
    let mut out = prompt.to_owned();
    for id in references(prompt) {
        let value = results.get(&id).cloned().unwrap_or_default();
        out = out.replace(&format!("{{{{tasks.{id}.result}}}}"), &value);
    }
    out
}

/// Each dependency cycle once, as the ids along it. Iterative (an explicit stack),
/// so a plan of any depth cannot overflow the thread's stack.
fn cycles(tasks: &[TaskSpec]) -> Vec<Vec<String>> {
    let mut deps: HashMap<&str, Vec<&str>> = HashMap::new();
    for t in tasks {
        // With duplicate ids (reported separately) the first definition counts.
        deps.entry(t.id.as_str()).or_insert_with(|| t.depends_on.iter().map(String::as_str).collect());
    }
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        /// On the current path, at this position of `path`.
        Active(usize),
        Done,
    }
    let mut marks: HashMap<&str, Mark> = HashMap::new();
    let mut found = Vec::new();
    // The current path, and for each of its ids the index of the next dependency to look at.
    let mut path: Vec<&str> = Vec::new();
    let mut next: Vec<usize> = Vec::new();
    for t in tasks {
        if marks.contains_key(t.id.as_str()) {
            continue;
        }
        marks.insert(&t.id, Mark::Active(0));
        path.push(&t.id);
        next.push(0);
        while let (Some(&id), Some(i)) = (path.last(), next.last_mut()) {
            let edges = deps.get(id).map(Vec::as_slice).unwrap_or(&[]);
            let Some(&dep) = edges.get(*i) else {
                marks.insert(id, Mark::Done);
                path.pop();
                next.pop();
                continue;
            };
            *i += 1;
            if !deps.contains_key(dep) || dep == id {
                continue;
            }
            match marks.get(dep) {
                Some(Mark::Active(pos)) => found.push(path[*pos..].iter().map(|s| (*s).to_owned()).collect()),
                Some(Mark::Done) => {}
                None => {
                    marks.insert(dep, Mark::Active(path.len()));
                    path.push(dep);
                    next.push(0);
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(_: &str) -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn parses_the_example_plan_with_defaults() {
        let text = r#"
[defaults]
agent = "pier"
max_attempts = 3

[[tasks]]
id = "fetch"
prompt = "List the files in this repository."

[[tasks]]
id = "summary"
depends_on = ["fetch"]
prompt = "Summarise: {{tasks.fetch.result}}"
metadata = { owner = "docs", priority = 2 }
"#;
        let plan = parse(text, &ok).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plan.tasks.len(), 2);
        assert_eq!(plan.tasks[1].depends_on, ["fetch"]);
        assert_eq!(plan.tasks[1].max_attempts, 3);
        assert_eq!(plan.tasks[1].metadata["priority"], 2);
        let results = HashMap::from([("fetch".to_owned(), "a.rs b.rs".to_owned())]);
        assert_eq!(render(&plan.tasks[1].prompt, &results), "Summarise: a.rs b.rs");
    }

    #[test]
    fn every_problem_is_listed_by_line() {
        let text = r#"[[tasks]]
id = "a"
prompt = "x"
depends_on = ["c"]

[[tasks]]
id = "b"
prompt = "uses {{tasks.a.result}}"
depends_on = ["ghost"]

[[tasks]]
id = "c"
prompt = "y"
depends_on = ["a"]
agent = "nope"

[[tasks]]
id = "a"
prompt = "dup"
"#;
        let known = |a: &str| if a == "nope" { Err("unknown agent `nope`".to_owned()) } else { Ok(()) };
        let err = parse(text, &known).err().unwrap_or_else(|| panic!("accepted"));
        let got: Vec<String> = err.0.iter().map(ToString::to_string).collect();
        assert!(got.contains(&"line 11: task `c`: unknown agent `nope`".to_owned()), "{got:#?}");
        assert!(got.contains(&"line 17: duplicate task id `a` (first at line 1)".to_owned()), "{got:#?}");
        assert!(got.contains(&"line 1: dependency cycle: a -> c -> a".to_owned()), "{got:#?}");
        assert!(got.contains(&"line 6: task `b` depends on unknown task `ghost`".to_owned()), "{got:#?}");
        assert!(got.iter().any(|p| p.starts_with("line 6: task `b` uses {{tasks.a.result}}")), "{got:#?}");
        assert!(got.iter().any(|p| p.contains("dependency cycle")), "{got:#?}");
    }

    #[test]
    fn syntax_errors_and_unknown_fields_have_lines() {
        let err = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\ncolour = \"red\"\n", &ok).err();
        let err = err.unwrap_or_else(|| panic!("accepted"));
        assert_eq!(err.0[0].line, 4, "{err}");
        assert!(parse("tasks = [", &ok).is_err());
        assert!(parse("", &ok).is_err_and(|e| e.to_string().contains("no [[tasks]]")));
    }

    #[test]
    fn bad_numbers_are_refused_with_their_lines() {
        let text = "[defaults]\nmax_time = inf\n\n[[tasks]]\nid = \"a\"\nprompt = \"x\"\ntimeout = -1.0\n\n\
                    [[tasks]]\nid = \"b\"\nprompt = \"y\"\ntimeout = 1e300\nmax_attempts = 0\n\n\
                    [[tasks]]\nid = \"c\"\nprompt = \"z\"\nmax_time = nan\n";
        let err = parse(text, &ok).err().unwrap_or_else(|| panic!("accepted"));
        let got: Vec<String> = err.0.iter().map(ToString::to_string).collect();
        for (line, wanted) in [
            (1, "[defaults]: max_time = inf"),
            (4, "task `a`: timeout = -1"),
            (9, "task `b`: timeout = 1e300"),
            (9, "task `b`: max_attempts = 0"),
            (15, "task `c`: max_time = NaN"),
        ] {
            assert!(got.iter().any(|p| p.starts_with(&format!("line {line}: {wanted}"))), "{wanted}: {got:#?}");
        }
        let negative = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\nmax_attempts = -3\n", &ok).err();
        assert_eq!(negative.map(|e| e.0[0].line), Some(4));
    }

    #[test]
    fn a_chain_and_a_cycle_of_20_000_tasks_are_checked_without_recursion() {
        // 100,000 go through `pier serve` in crates/pier/tests/hardening_host.rs.
        const N: usize = 20_000;
        let chain = |cycle: bool| {
            let mut text = String::with_capacity(N * 64);
            for i in 0..N {
                let dep = if i + 1 < N {
                    format!("t{}", i + 1)
                } else if cycle {
                    "t0".into()
                } else {
                    String::new()
                };
                text.push_str(&format!("[[tasks]]\nid = \"t{i}\"\nprompt = \"p\"\n"));
                if !dep.is_empty() {
                    text.push_str(&format!("depends_on = [\"{dep}\"]\n"));
                }
            }
            text
        };
        // Run on a small stack, as a server's worker thread has: recursion would overflow it.
        let checked = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || (parse(&chain(false), &ok).map(|p| p.tasks.len()), parse(&chain(true), &ok).err()))
            .unwrap_or_else(|e| panic!("{e}"))
            .join()
            .unwrap_or_else(|_| panic!("the check overflowed its stack"));
        assert_eq!(checked.0.ok(), Some(N));
        let problems = checked.1.unwrap_or_else(|| panic!("the cycle was accepted")).0;
        assert_eq!(problems.len(), 1, "{:?}", problems.first());
        assert!(problems[0].message.starts_with("dependency cycle: t0 -> t1 -> "), "{}", problems[0]);
        assert!(problems[0].message.ends_with("-> t19999 -> t0 (20000 tasks)"), "{}", problems[0]);
        assert_eq!(problems[0].line, 1);
    }
}
