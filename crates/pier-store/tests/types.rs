//! Issue #32: task types with inputs — checked against the type's schema and rendered into
//! the prompt and concurrency keys at submit, every problem at once with its line.

use pier_store::plan::{ConcurrencyKey, Shared, parse, parse_typed};

const TYPED: &str = r#"
[defaults]
priority = 1
concurrency = [{ key = "provider:anthropic", limit = 2 }]

[types.review]
prompt = "Review {{input.repo}} at depth {{input.depth}}; before: {{tasks.fetch.result}}"
agent = "worker:review"
requires = ["fs"]
priority = 5
concurrency = [{ key = "repo:{input.repo}", limit = 1 }]
input = { type = "object", required = ["repo", "depth"], properties = { repo = { type = "string" }, depth = { type = "integer", minimum = 1 } } }

[[tasks]]
id = "fetch"
prompt = "fetch"

[[tasks]]
id = "r1"
type = "review"
depends_on = ["fetch"]
input = { repo = "foo", depth = 2 }

[[tasks]]
id = "r2"
type = "review"
priority = 9
depends_on = ["fetch"]
input = { repo = "bar", depth = 1 }
"#;

#[test]
fn a_typed_task_gets_its_type_fields_and_its_input_rendered() {
    let plan = parse(TYPED, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    let r1 = &plan.tasks[1];
    assert_eq!(r1.prompt, "Review foo at depth 2; before: {{tasks.fetch.result}}");
    assert_eq!(r1.task_type.as_deref(), Some("review"));
    assert_eq!(r1.input, Some(serde_json::json!({"repo": "foo", "depth": 2})));
    assert_eq!(r1.agent, "worker:review");
    assert_eq!(r1.requires, vec!["fs".to_owned()]);
    assert_eq!(r1.priority, 5, "the type's priority over the plan's");
    assert_eq!(plan.tasks[2].priority, 9, "the task's over the type's");
    assert_eq!(plan.tasks[0].priority, 1, "the plan's default");
    let keys = |k: &[(&str, u32)]| {
        k.iter().map(|(key, limit)| ConcurrencyKey { key: (*key).into(), limit: *limit }).collect::<Vec<_>>()
    };
    assert_eq!(
        r1.concurrency,
        keys(&[("provider:anthropic", 2), ("repo:foo", 1)]),
        "the plan's and the type's keys add up"
    );
    assert_eq!(plan.tasks[2].concurrency, keys(&[("provider:anthropic", 2), ("repo:bar", 1)]));
    assert_eq!(plan.tasks[0].concurrency, keys(&[("provider:anthropic", 2)]));
    // A stored spec reads back whole.
    let back: pier_store::TaskSpec =
        serde_json::from_value(serde_json::to_value(r1).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&back, r1);
}

#[test]
fn every_problem_of_typed_tasks_is_refused_at_once_with_its_line() {
    let text = r#"
[types.review]
prompt = "Review {{input.repo}} in {{input.branch}}"
input = { type = "object", required = ["repo"], properties = { repo = { type = "string" }, n = { type = "integer" } } }

[types.broken]
prompt = "x"
input = { type = "no-such-type" }

[[tasks]]
id = "bad-input"
type = "review"
input = { repo = 5, n = "x" }

[[tasks]]
id = "no-input"
type = "review"

[[tasks]]
id = "unknown"
type = "nope"
input = { a = 1 }

[[tasks]]
id = "keys"
prompt = "p {{input.missing}}"
input = { a = 1 }
priority = 10
concurrency = [{ key = "k", limit = 0 }, { key = "repo:{input.repo}", limit = 1 }]
"#;
    let err = parse(text, &|_| Ok(())).err().unwrap_or_else(|| panic!("a bad plan was taken"));
    let lines: Vec<String> = err.0.iter().map(ToString::to_string).collect();
    let has = |line: usize, words: &[&str]| {
        assert!(
            lines.iter().any(|l| l.starts_with(&format!("line {line}:")) && words.iter().all(|w| l.contains(w))),
            "no problem at line {line} with {words:?} in:\n{}",
            lines.join("\n")
        );
    };
    has(2, &["type `review`", "input field `branch`", "does not declare"]);
    has(6, &["type `broken`", "does not compile"]);
    has(10, &["task `bad-input`", "/repo", "string"]);
    has(10, &["task `bad-input`", "/n", "integer"]);
    has(15, &["task `no-input`", "takes an input"]);
    has(19, &["task `unknown`", "unknown type `nope`", "declared: broken, review"]);
    has(24, &["task `keys`", "input field(s) the input lacks: missing"]);
    has(24, &["task `keys`", "priority = 10"]);
    has(24, &["task `keys`", "limit = 0"]);
    has(24, &["task `keys`", "repo:{input.repo}", "lacks: repo"]);
}

#[test]
fn shared_types_serve_every_plan_and_a_plans_own_win() {
    let table: toml::Table = toml::from_str(
        r#"
[greet]
prompt = "hello {{input.who}}"
input = { type = "object", required = ["who"] }
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let shared = Shared::new(table.into_iter().collect()).unwrap_or_else(|e| panic!("{e}"));
    let plan = "[[tasks]]\nid = \"a\"\ntype = \"greet\"\ninput = { who = \"you\" }\n";
    let parsed = parse_typed(plan, &shared, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(parsed.tasks[0].prompt, "hello you");
    let own = format!("[types.greet]\nprompt = \"hi {{{{input.who}}}}\"\n\n{plan}");
    let parsed = parse_typed(&own, &shared, &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(parsed.tasks[0].prompt, "hi you");
    let bad: toml::Table = toml::from_str("[x]\ninput = { type = 5 }\n").unwrap_or_else(|e| panic!("{e}"));
    assert!(Shared::new(bad.into_iter().collect()).is_err(), "a shared type whose schema does not compile is refused");
}

/// A server given wrong in `[defaults]` or a type is refused once, where it is given, not once
/// per task that would get it; a task's own are refused under the task.
#[test]
fn a_wrong_mcp_server_is_refused_once_where_it_is_given() {
    let plan = "[defaults]\nmcp_servers = [{ name = \"d\" }]\n\n\
                [types.t]\nprompt = \"x\"\nmcp_servers = [{ name = \"ty\", url = \"ftp://x\" }]\n\n\
                [[tasks]]\nid = \"a\"\ntype = \"t\"\ninput = {}\n\n[[tasks]]\nid = \"b\"\ntype = \"t\"\ninput = {}\n\n\
                [[tasks]]\nid = \"c\"\nprompt = \"x\"\nmcp_servers = [{ name = \"own\", command = \"x\", url = \"http://y\" }]\n";
    let Err(e) = parse(plan, &|_| Ok(())) else { panic!("a plan with wrong servers was accepted") };
    let messages: Vec<&str> = e.0.iter().map(|p| p.message.as_str()).collect();
    let count = |needle: &str| messages.iter().filter(|m| m.contains(needle)).count();
    assert_eq!(count("MCP server `d` gives neither"), 1, "{messages:#?}");
    assert_eq!(count("url `ftp://x`"), 1, "{messages:#?}");
    assert_eq!(count("task `c`: MCP server `own` gives both"), 1, "{messages:#?}");
}
