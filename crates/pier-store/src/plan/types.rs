//! Task types: `[types.NAME]` (in a plan, or pier.toml's for every plan) says what a kind of
//! task takes — its input's JSON Schema — and how that input becomes the prompt, beside what
//! every task of the kind shares (agent, requires, limits, permissions, priority, concurrency
//! keys). A task says `type = "NAME"` and `input = {…}`; the input is checked against the
//! schema and rendered into the prompt at submit, so a stored task holds the prompt its agent
//! is given (dependency results, `{{tasks.ID.result}}`, are filled in as it starts).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Defaults;

/// The most priorities there are: `priority = 0..=9`, 9 first.
pub const MAX_PRIORITY: u8 = 9;

/// A cap on how many tasks holding `key` run at once, across every node and worker on the
/// store; `key` is rendered from the task's input (`repo:{input.repo}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyKey {
    pub key: String,
    pub limit: u32,
}

/// A declared type, its schema compiled.
pub(super) struct TaskType {
    pub(super) prompt: Option<String>,
    validator: Option<jsonschema::Validator>,
    /// The first-level fields the schema declares (`properties`), when it declares them.
    declared: Option<Vec<String>>,
    pub(super) defaults: Defaults,
}

/// Every declared type of `table` (`[types]`), with what is wrong with each (at `line`).
pub(super) fn parse_types(
    table: BTreeMap<String, toml::Value>,
    line: &dyn Fn(&str) -> usize,
    problems: &mut Vec<super::Problem>,
) -> BTreeMap<String, TaskType> {
    let mut types = BTreeMap::new();
    for (name, value) in table {
        let at = line(&name);
        let mut say =
            |message: String| problems.push(super::Problem { line: at, message: format!("type `{name}`: {message}") });
        let toml::Value::Table(mut fields) = value else {
            say("give a table: [types.NAME] with input, prompt and the fields its tasks share".into());
            continue;
        };
        let prompt = match fields.remove("prompt") {
            None => None,
            Some(toml::Value::String(p)) => Some(p),
            Some(_) => {
                say("prompt: give a string".into());
                None
            }
        };
        let schema = fields.remove("input").map(|s| serde_json::to_value(s).unwrap_or(Value::Null));
        let defaults = match Defaults::deserialize(toml::Value::Table(fields)) {
            Ok(d) => d,
            Err(e) => {
                say(e.message().to_owned());
                Defaults::default()
            }
        };
        for why in super::mcp::problems(&defaults.mcp_servers) {
            say(why);
        }
        let validator = match schema.as_ref().map(jsonschema::validator_for).transpose() {
            Ok(v) => v,
            Err(e) => {
                say(format!("the input schema does not compile: {e}"));
                None
            }
        };
        let declared = schema
            .as_ref()
            .and_then(|s| s.get("properties"))
            .and_then(Value::as_object)
            .map(|p| p.keys().cloned().collect::<Vec<_>>());
        if let (Some(prompt), Some(declared)) = (&prompt, &declared) {
            for field in input_fields(prompt, "{{input.", "}}") {
                let first = field.split('.').next().unwrap_or_default();
                if !declared.iter().any(|d| d == first) {
                    say(format!("the prompt names input field `{field}`, which the input schema does not declare"));
                }
            }
        }
        types.insert(name, TaskType { prompt, validator, declared, defaults });
    }
    types
}

impl TaskType {
    /// What is wrong with `input` for this type: each schema error, at its field.
    pub(super) fn input_problems(&self, input: &Value) -> Vec<String> {
        let Some(validator) = &self.validator else { return Vec::new() };
        validator
            .iter_errors(input)
            .map(|e| {
                let at = e.instance_path().to_string();
                if at.is_empty() { format!("input: {e}") } else { format!("input {at}: {e}") }
            })
            .collect()
    }

    /// Whether the type says what its input holds (a task of it must then give one).
    pub(super) fn takes_input(&self) -> bool {
        self.validator.is_some() || self.declared.is_some()
    }
}

/// The dotted paths after `open` up to `close` in `template` (`{{input.repo}}` → `repo`).
pub(super) fn input_fields(template: &str, open: &str, close: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find(open) {
        let after = &rest[start + open.len()..];
        match after.find(close) {
            Some(end) if !after[..end].contains(['{', '}']) => {
                out.push(after[..end].trim().to_owned());
                rest = &after[end + close.len()..];
            }
            _ => rest = after,
        }
    }
    out
}

/// `template` with each `open`input.PATH`close` replaced by that value of `input` (a string
/// as it is, anything else as JSON); the fields `input` lacks are the error.
pub(super) fn fill(template: &str, open: &str, close: &str, input: &Value) -> Result<String, Vec<String>> {
    let mut out = template.to_owned();
    let mut missing = Vec::new();
    for field in input_fields(template, open, close) {
        let value = field.split('.').try_fold(input, |v, part| v.get(part));
        match value {
            Some(Value::String(s)) => out = out.replace(&format!("{open}{field}{close}"), s),
            Some(v) => out = out.replace(&format!("{open}{field}{close}"), &v.to_string()),
            None if !missing.contains(&field) => missing.push(field),
            None => {}
        }
    }
    if missing.is_empty() { Ok(out) } else { Err(missing) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_renders_strings_bare_and_the_rest_as_json_and_names_what_is_missing() {
        let input = serde_json::json!({"repo": "foo", "n": 3, "deep": {"x": true}});
        let got = fill("r={{input.repo}} n={{input.n}} x={{input.deep.x}}", "{{input.", "}}", &input);
        assert_eq!(got, Ok("r=foo n=3 x=true".to_owned()));
        assert_eq!(fill("repo:{input.repo}", "{input.", "}", &input), Ok("repo:foo".to_owned()));
        assert_eq!(
            fill("{{input.a}} {{input.a}} {{input.b.c}}", "{{input.", "}}", &input),
            Err(vec!["a".into(), "b.c".into()])
        );
    }
}
