//! The README and docs/ hold to the binary: every TOML example is a configuration or a plan
//! pier accepts, every JSON example parses, every `pier` command names a real subcommand and
//! real flags, every `cargo run`/`scripts/` command names what exists, and the examples that
//! can run offline (the quick start, the example plan, on the embedded model) run.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use support::must;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// Every fenced block of the README and docs/*.md: (file, language, text).
fn blocks() -> Vec<(String, String, String)> {
    let mut files = vec![PathBuf::from(ROOT).join("README.md")];
    for e in must(std::fs::read_dir(PathBuf::from(ROOT).join("docs")), "docs").flatten() {
        if e.path().extension().is_some_and(|x| x == "md") {
            files.push(e.path());
        }
    }
    let mut out = Vec::new();
    for f in files {
        let text = must(std::fs::read_to_string(&f), "read doc");
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if let Some(lang) = line.strip_prefix("```") {
                let body: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("```")).collect();
                out.push((f.display().to_string(), lang.trim().to_owned(), body.join("\n")));
            }
        }
    }
    assert!(out.len() > 10, "the docs' code blocks were not found");
    out
}

fn model() -> PathBuf {
    let path = std::env::var("PIER_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(ROOT).join("target/test-peers/models/smollm2.q8_0.gguf"));
    assert!(path.is_file(), "the embedded model is missing at {}; run scripts/test", path.display());
    path
}

/// A directory with `$PIER_HOME/models` holding the embedded model, and its environment.
fn offline_home() -> (tempfile::TempDir, Vec<(String, String)>) {
    let dir = must(tempfile::tempdir(), "dir");
    let models = dir.path().join("data/models");
    must(std::fs::create_dir_all(&models), "models");
    must(std::os::unix::fs::symlink(model(), models.join("smollm2.q8_0.gguf")), "link the model");
    let vars = vec![
        ("HOME".to_owned(), dir.path().display().to_string()),
        ("PIER_HOME".to_owned(), dir.path().join("data").display().to_string()),
        ("PATH".to_owned(), std::env::var("PATH").unwrap_or_default()),
    ];
    (dir, vars)
}

async fn pier(
    dir: &Path,
    vars: &[(String, String)],
    args: &[&str],
    limit: std::time::Duration,
) -> std::process::Output {
    let o = support::pier_command(dir, vars, args).output();
    must(must(tokio::time::timeout(limit, o).await, "pier in time"), "pier")
}

#[tokio::test]
async fn every_toml_example_is_a_configuration_or_a_plan_pier_accepts_and_every_json_example_parses() {
    let dir = must(tempfile::tempdir(), "dir");
    let vars = vec![("HOME".to_owned(), dir.path().display().to_string())];
    let mut checked = 0;
    for (file, lang, text) in blocks() {
        match lang.as_str() {
            "toml" if text.contains("[[tasks]]") => {
                let parsed = pier_host::plan::parse(&text, &|_| Ok(()));
                assert!(parsed.is_ok(), "{file}: the example plan is refused: {:?}\n{text}", parsed.err());
                checked += 1;
            }
            "toml" if text.contains("[[user]]") => {
                let parsed = pier_server::access::Users::parse(&text);
                assert!(parsed.is_ok(), "{file}: the example users file is refused: {:?}\n{text}", parsed.err());
                checked += 1;
            }
            "toml" => {
                must(std::fs::write(dir.path().join("pier.toml"), &text), "pier.toml");
                let o = pier(dir.path(), &vars, &["config"], support::LIMIT).await;
                let err = String::from_utf8_lossy(&o.stderr);
                assert_eq!(o.status.code(), Some(0), "{file}: pier refuses the example configuration: {err}\n{text}");
                checked += 1;
            }
            "json" => {
                // One document, or one JSON-RPC frame per line.
                let whole = serde_json::from_str::<serde_json::Value>(&text).is_ok();
                let lines = text.lines().all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok());
                assert!(whole || lines, "{file}: a JSON example does not parse:\n{text}");
                checked += 1;
            }
            _ => {}
        }
    }
    assert!(checked >= 7, "only {checked} examples checked");
}

/// The `pier` invocations of one shell line: each a list of arguments after `pier`.
fn pier_invocations(line: &str) -> Vec<Vec<String>> {
    let Ok(words) = shell_words::split(line) else { return Vec::new() };
    let words: Vec<String> = words.into_iter().take_while(|w| !w.starts_with('#')).collect();
    let mut out = Vec::new();
    for segment in words.split(|w| matches!(w.as_str(), "|" | "&&" | "&" | ";" | "||")) {
        // Environment assignments come before the command.
        let command: Vec<&String> = segment.iter().skip_while(|w| w.contains('=') && !w.starts_with('-')).collect();
        match command.first().map(|w| w.as_str()) {
            Some("pier") => out.push(command[1..].iter().map(|w| (*w).clone()).collect()),
            // `cargo run … -p pier -- ARGS`.
            Some("cargo") if command.windows(2).any(|p| p[0] == "-p" && p[1] == "pier") => {
                if let Some(at) = command.iter().position(|w| *w == "--") {
                    out.push(command[at + 1..].iter().map(|w| (*w).clone()).collect());
                }
            }
            _ => {}
        }
    }
    out
}

#[tokio::test]
async fn every_pier_command_in_the_docs_names_a_real_subcommand_and_real_flags() {
    let dir = must(tempfile::tempdir(), "dir");
    let mut helps: HashMap<Vec<String>, String> = HashMap::new();
    let mut checked = 0;
    for (file, lang, text) in blocks() {
        if lang != "sh" {
            continue;
        }
        for line in text.lines() {
            for args in pier_invocations(line) {
                // The subcommand path: `models install`, `sessions list`, or one word.
                let mut path: Vec<String> = args.iter().take(1).cloned().collect();
                assert!(!path.is_empty(), "{file}: a bare `pier` in: {line}");
                let mut help = String::new();
                for depth in 0..2 {
                    if !helps.contains_key(&path) {
                        let mut a: Vec<&str> = path.iter().map(String::as_str).collect();
                        a.push("--help");
                        let o = pier(dir.path(), &[], &a, support::LIMIT).await;
                        assert_eq!(
                            o.status.code(),
                            Some(0),
                            "{file}: `pier {}` is not a command: {line}",
                            path.join(" ")
                        );
                        helps.insert(path.clone(), String::from_utf8_lossy(&o.stdout).into_owned());
                    }
                    help = helps[&path].clone();
                    match args.get(depth + 1) {
                        Some(next) if help.contains("Commands:") && help.contains(&format!("  {next} ")) => {
                            path.push(next.clone())
                        }
                        _ => break,
                    }
                }
                for flag in args.iter().filter_map(|a| a.trim_start_matches('[').strip_prefix("--")) {
                    let name = flag.split(['=', ']']).next().unwrap_or("");
                    assert!(
                        help.contains(&format!("--{name}")),
                        "{file}: `pier {}` has no --{name}: {line}",
                        path.join(" ")
                    );
                }
                checked += 1;
            }
            // Other commands name files, crates and examples that exist.
            if let Some(script) = line.split_whitespace().find(|w| w.starts_with("scripts/")) {
                assert!(Path::new(ROOT).join(script).is_file(), "{file}: {script} does not exist");
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            for pair in words.windows(2) {
                match pair {
                    ["-p", krate] => {
                        assert!(Path::new(ROOT).join("crates").join(krate).is_dir(), "{file}: no crate {krate}: {line}")
                    }
                    ["--example", name] => {
                        let krate = words.windows(2).find(|p| p[0] == "-p").map(|p| p[1]).unwrap_or("pier");
                        let example =
                            Path::new(ROOT).join("crates").join(krate).join("examples").join(format!("{name}.rs"));
                        assert!(example.is_file(), "{file}: no example {}: {line}", example.display());
                    }
                    _ => {}
                }
            }
        }
    }
    assert!(checked >= 25, "only {checked} pier commands checked");
}

#[tokio::test]
async fn the_quick_start_answers_offline_on_the_embedded_model() {
    let (dir, vars) = offline_home();
    let o = pier(dir.path(), &vars, &["exec", "What is the capital of France?"], support::LIMIT * 3).await;
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("Paris"), "{}", String::from_utf8_lossy(&o.stdout));
}

#[tokio::test]
async fn the_readme_plan_runs_whole_on_the_embedded_model() {
    let (file, _, plan) = blocks()
        .into_iter()
        .find(|(_, lang, text)| lang == "toml" && text.starts_with("# plan.toml"))
        .unwrap_or_else(|| panic!("the README has no plan example"));
    let (dir, vars) = offline_home();
    must(std::fs::write(dir.path().join("plan.toml"), &plan), "plan");
    let o =
        pier(dir.path(), &vars, &["run", "plan.toml", "--run-id", "readme", "--format", "json"], support::LIMIT * 9)
            .await;
    assert_eq!(
        o.status.code(),
        Some(0),
        "{file}'s plan: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let o = pier(dir.path(), &vars, &["show", "readme", "story", "--format", "json"], support::LIMIT).await;
    let shown: serde_json::Value = must(serde_json::from_slice(&o.stdout), "show json");
    let story = shown["task"]["result"].as_str().unwrap_or_default();
    // A story, not one cut at a small fixed limit.
    assert!(story.split_whitespace().count() > 120, "{story}");
}
