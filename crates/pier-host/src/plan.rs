//! Plans: a TOML list of tasks with dependencies, checked as a whole before anything runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A validated plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub tasks: Vec<TaskSpec>,
}

/// One task, with the defaults applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Tool kind → rule (`allow`, `allow_always`, `ask`, `deny`, `deny_always`).
    pub permissions: BTreeMap<String, String>,
    /// Directories besides cwd the agent's fs/terminal calls may use.
    pub roots: Vec<PathBuf>,
    /// When set, the only directories the agent may write to.
    #[serde(default)]
    pub writable: Option<Vec<PathBuf>>,
    /// Run on an agent process of its own, never a warm one another task used.
    #[serde(default)]
    pub fresh_agent: bool,
}

#[derive(Debug, Default, Deserialize)]
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskDef {
    id: String,
    prompt: String,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    #[serde(default)]
    defaults: Defaults,
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

/// The line of the `[[tasks]]` header that opens the table starting near `offset`.
fn header_line(text: &str, offset: usize) -> usize {
    let end = (offset + 9).min(text.len());
    let end = (0..=end).rev().find(|i| text.is_char_boundary(*i)).unwrap_or(0);
    match text[..end].rfind("[[tasks]]") {
        Some(at) => line_of(text, at),
        None => line_of(text, offset),
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// Parses and checks a plan. `agent_known` says whether an agent name or command resolves.
pub fn parse(text: &str, agent_known: &dyn Fn(&str) -> Result<(), String>) -> Result<Plan, PlanError> {
    let file: PlanFile = toml::from_str(text).map_err(|e| {
        let line = e.span().map_or(0, |s| line_of(text, s.start));
        PlanError(vec![Problem { line, message: e.message().to_owned() }])
    })?;
    let d = file.defaults;
    let mut problems = Vec::new();
    let mut tasks = Vec::new();
    let mut lines = HashMap::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for spanned in file.tasks {
        let line = header_line(text, spanned.span().start);
        let t = spanned.into_inner();
        if t.id.trim().is_empty() {
            problems.push(Problem { line, message: "a task has an empty id".into() });
        }
        if let Some(first) = seen.insert(t.id.clone(), line) {
            problems.push(Problem { line, message: format!("duplicate task id `{}` (first at line {first})", t.id) });
        }
        lines.entry(t.id.clone()).or_insert(line);
        let agent = t.agent.or_else(|| d.agent.clone()).unwrap_or_else(|| "pier".to_owned());
        if let Err(why) = agent_known(&agent) {
            problems.push(Problem { line, message: format!("task `{}`: {why}", t.id) });
        }
        let mut permissions = d.permissions.clone();
        permissions.extend(t.permissions);
        let mut roots = d.roots.clone();
        roots.extend(t.roots);
        tasks.push(TaskSpec {
            id: t.id,
            prompt: t.prompt,
            agent,
            depends_on: t.depends_on,
            cwd: t.cwd.or_else(|| d.cwd.clone()),
            timeout: t.timeout.or(d.timeout),
            max_time: t.max_time.or(d.max_time),
            max_attempts: t.max_attempts.or(d.max_attempts).unwrap_or(3).max(1),
            retry_on: t.retry_on.or_else(|| d.retry_on.clone()).unwrap_or_default(),
            idempotent: t.idempotent.or(d.idempotent).unwrap_or(false),
            fresh_agent: t.fresh_agent.or(d.fresh_agent).unwrap_or(false),
            metadata: t.metadata.into_iter().map(|(k, v)| (k, toml_to_json(v))).collect(),
            permissions,
            roots,
            writable: t.writable.or_else(|| d.writable.clone()),
        });
    }
    if tasks.is_empty() {
        problems.push(Problem { line: 0, message: "the plan has no [[tasks]]".into() });
    }
    let ids: HashSet<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
    for t in &tasks {
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
        for rule in t.permissions.values() {
            if !matches!(rule.as_str(), "allow" | "allow_always" | "ask" | "deny" | "deny_always") {
                problems.push(Problem { line, message: format!("task `{}`: unknown permission rule `{rule}`", t.id) });
            }
        }
        for kind in t.permissions.keys() {
            if kind.parse::<pier_tools::ToolKind>().is_err() {
                problems.push(Problem { line, message: format!("task `{}`: unknown tool kind `{kind}`", t.id) });
            }
        }
    }
    for cycle in cycles(&tasks) {
        let line = lines.get(&cycle[0]).copied().unwrap_or(0);
        problems.push(Problem { line, message: format!("dependency cycle: {} -> {}", cycle.join(" -> "), cycle[0]) });
    }
    if problems.is_empty() { Ok(Plan { tasks }) } else { Err(PlanError(problems)) }
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

/// The id of the option a permission request offered, named by its id or its kind
/// (`allow_once`, `reject_once`, …); an error lists what was offered.
pub fn offered_option(request: &serde_json::Value, wanted: &str) -> Result<String, String> {
    let options = request["options"].as_array().cloned().unwrap_or_default();
    options
        .iter()
        .find(|o| o["optionId"] == wanted)
        .or_else(|| options.iter().find(|o| o["kind"] == wanted))
        .and_then(|o| o["optionId"].as_str().map(str::to_owned))
        .ok_or_else(|| {
            let offered: Vec<String> = options
                .iter()
                .map(|o| format!("{} ({})", o["optionId"].as_str().unwrap_or("?"), o["kind"].as_str().unwrap_or("?")))
                .collect();
            format!("the agent offered no option `{wanted}`; it offered: {}", offered.join(", "))
        })
}

/// Each dependency cycle once, as the ids along it.
fn cycles(tasks: &[TaskSpec]) -> Vec<Vec<String>> {
    let mut deps: HashMap<&str, Vec<&str>> = HashMap::new();
    for t in tasks {
        // With duplicate ids (reported separately) the first definition counts.
        deps.entry(t.id.as_str()).or_insert_with(|| t.depends_on.iter().map(String::as_str).collect());
    }
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Active,
        Done,
    }
    let mut marks: HashMap<&str, Mark> = HashMap::new();
    let mut found = Vec::new();
    fn visit<'a>(
        id: &'a str,
        deps: &HashMap<&'a str, Vec<&'a str>>,
        marks: &mut HashMap<&'a str, Mark>,
        stack: &mut Vec<&'a str>,
        found: &mut Vec<Vec<String>>,
    ) {
        marks.insert(id, Mark::Active);
        stack.push(id);
        for &dep in deps.get(id).map(Vec::as_slice).unwrap_or(&[]) {
            if !deps.contains_key(dep) || dep == id {
                continue;
            }
            match marks.get(dep) {
                Some(Mark::Active) => {
                    if let Some(pos) = stack.iter().position(|s| *s == dep) {
                        found.push(stack[pos..].iter().map(|s| (*s).to_owned()).collect());
                    }
                }
                Some(Mark::Done) => {}
                None => visit(dep, deps, marks, stack, found),
            }
        }
        stack.pop();
        marks.insert(id, Mark::Done);
    }
    for t in tasks {
        if !marks.contains_key(t.id.as_str()) {
            visit(&t.id, &deps, &mut marks, &mut Vec::new(), &mut found);
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
}
