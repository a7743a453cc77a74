//! Issue #16: no plan, however odd its numbers, reaches a panic — neither the plan
//! check nor the function that turns a stored task into an attempt's settings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pier_host::HostConfig;
use pier_host::attempt::{attempt_limits, attempt_options};
use pier_host::plan::{TaskSpec, parse};
use proptest::prelude::*;

/// Any TOML value, numbers favoured.
fn toml_value() -> impl Strategy<Value = String> {
    let number = prop_oneof![
        any::<f64>().prop_map(|f| format!("{f:?}")),
        any::<i64>().prop_map(|i| i.to_string()),
        Just("inf".to_owned()),
        Just("-inf".to_owned()),
        Just("nan".to_owned()),
        Just("-0.0".to_owned()),
        Just("1e300".to_owned()),
        Just("0".to_owned()),
        Just("-1".to_owned()),
        Just("4294967296".to_owned()),
    ];
    let leaf = prop_oneof![
        number,
        "[a-z{}. ]{0,12}".prop_map(|s| format!("{s:?}")),
        any::<bool>().prop_map(|b| b.to_string()),
        Just("1979-05-27T07:32:00Z".to_owned()),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec(inner, 0..3).prop_map(|v| {
                let fields: Vec<String> = v.iter().enumerate().map(|(i, x)| format!("k{i} = {x}")).collect();
                format!("{{ {} }}", fields.join(", "))
            }),
        ]
    })
}

const FIELDS: &[&str] = &[
    "agent",
    "depends_on",
    "cwd",
    "timeout",
    "max_time",
    "max_attempts",
    "retry_on",
    "idempotent",
    "metadata",
    "permissions",
    "roots",
    "writable",
    "fresh_agent",
    "sandbox",
    "network",
    "limits",
    "priority",
    "concurrency",
    "input",
];

fn config() -> HostConfig {
    HostConfig {
        pier_exe: PathBuf::from("/bin/true"),
        agents: BTreeMap::new(),
        base_dir: PathBuf::from("/tmp"),
        concurrency: 1,
        owner: "test".into(),
        node: "test".into(),
        lease_ttl: Duration::from_secs(15),
        retry_base: Duration::from_secs(1),
        cancel_grace: Duration::from_secs(1),
        default_idle_timeout: Duration::from_secs(600),
        sandbox: pier_host::SandboxConfig::new(Path::new("/bin/true")),
        gateway: None,
        types: Default::default(),
        mcp: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_plans_never_panic_and_accepted_ones_start(
        defaults in prop::collection::vec((0..FIELDS.len(), toml_value()), 0..4),
        tasks in prop::collection::vec(prop::collection::vec((0..FIELDS.len(), toml_value()), 0..6), 1..4),
    ) {
        let mut text = String::from("[defaults]\n");
        let mut seen = std::collections::HashSet::new();
        for (f, v) in &defaults {
            if FIELDS[*f] != "depends_on" && FIELDS[*f] != "metadata" && seen.insert(*f) {
                text.push_str(&format!("{} = {v}\n", FIELDS[*f]));
            }
        }
        for (i, fields) in tasks.iter().enumerate() {
            text.push_str(&format!("\n[[tasks]]\nid = \"t{i}\"\nprompt = \"p\"\n"));
            let mut seen = std::collections::HashSet::new();
            for (f, v) in fields {
                if seen.insert(*f) {
                    text.push_str(&format!("{} = {v}\n", FIELDS[*f]));
                }
            }
        }
        if let Ok(plan) = parse(&text, &|_| Ok(())) {
            for t in &plan.tasks {
                // An accepted plan's numbers always give an attempt its settings.
                prop_assert!(attempt_limits(t, Duration::from_secs(600)).is_ok(), "{text}");
                let _ = attempt_options(t, &config());
            }
        }
    }

    /// A task as an older pier may have stored it: any numbers at all.
    #[test]
    fn any_stored_numbers_give_settings_or_an_error(
        timeout in prop::option::of(any::<f64>()),
        max_time in prop::option::of(any::<f64>()),
        max_attempts in any::<u32>(),
        cpu in prop::option::of(any::<f64>()),
        memory in prop::option::of(any::<u64>()),
    ) {
        let spec = TaskSpec {
            id: "t".into(),
            prompt: "p".into(),
            agent: "pier".into(),
            depends_on: vec![],
            cwd: None,
            timeout,
            max_time,
            max_attempts,
            retry_on: vec![],
            idempotent: false,
            metadata: BTreeMap::new(),
            permissions: BTreeMap::new(),
            roots: vec![],
            writable: None,
            fresh_agent: false,
            requires: vec![],
            sandbox: None,
            network: vec![],
            limits: pier_host::plan::Limits { cpu, memory, pids: None },
            budget: None,
            run_budget: None,
            ..TaskSpec::default()
        };
        let _ = attempt_options(&spec, &config());
        for bad in [-1.0, 0.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e300] {
            let spec = TaskSpec { timeout: Some(bad), ..spec.clone() };
            let err = attempt_limits(&spec, Duration::from_secs(1)).err();
            prop_assert!(err.is_some_and(|e| e.contains("timeout")), "{bad} was accepted");
        }
    }
}
