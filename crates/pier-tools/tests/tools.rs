//! Each built-in tool on real files and real processes in temporary directories.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use pier_tools::{
    Limits, PlanStatus, Preview, Tool, ToolContent, ToolContext, ToolError, ToolKind, ToolOutput, Toolbox, Workspace,
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

struct Fixture {
    dir: tempfile::TempDir,
    toolbox: Toolbox,
    cx: ToolContext,
}

fn fixture_with(limits: Limits) -> Fixture {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let workspace = Workspace::new(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let cx =
        ToolContext { workspace, cancel: CancellationToken::new(), limits: limits.clone(), link: Default::default() };
    Fixture { dir, toolbox: Toolbox::builtin(limits), cx }
}

fn fixture() -> Fixture {
    fixture_with(Limits::default())
}

impl Fixture {
    fn root(&self) -> &Path {
        self.cx.workspace.root()
    }
    fn write(&self, rel: &str, content: &[u8]) {
        let path = self.root().join(rel);
        if let Some(p) = path.parent() {
            std::fs::create_dir_all(p).unwrap_or_else(|e| panic!("{e}"));
        }
        std::fs::write(path, content).unwrap_or_else(|e| panic!("{e}"));
    }
    fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.root().join(rel)).unwrap_or_else(|e| panic!("{e}"))
    }
    async fn call(&self, name: &str, args: Value) -> Result<ToolOutput, ToolError> {
        let tool = self.toolbox.get(name).unwrap_or_else(|| panic!("no tool {name}"));
        tokio::time::timeout(Duration::from_secs(30), self.toolbox.run(&tool, args, self.cx.clone()))
            .await
            .unwrap_or_else(|_| panic!("{name} did not finish"))
    }
    async fn ok(&self, name: &str, args: Value) -> ToolOutput {
        match self.call(name, args.clone()).await {
            Ok(o) => o,
            Err(e) => panic!("{name} {args} failed: {e}"),
        }
    }
    async fn err(&self, name: &str, args: Value) -> String {
        match self.call(name, args.clone()).await {
            Ok(o) => panic!("{name} {args} succeeded: {}", o.text),
            Err(e) => e.0,
        }
    }
}

#[test]
fn the_builtin_tools_have_the_specified_names_kinds_and_parameters() {
    let f = fixture();
    let got: Vec<(&str, ToolKind)> = f.toolbox.tools().iter().map(|t| (t.name(), t.kind())).collect();
    assert_eq!(
        got,
        vec![
            ("read_file", ToolKind::Read),
            ("list_dir", ToolKind::Read),
            ("grep", ToolKind::Search),
            ("write_file", ToolKind::Edit),
            ("edit_file", ToolKind::Edit),
            ("run_command", ToolKind::Execute),
            ("update_plan", ToolKind::Think),
        ]
    );
    let params = |name: &str| -> Vec<String> {
        let t = f.toolbox.get(name).unwrap_or_else(|| panic!("{name}"));
        let p = t.parameters();
        let mut keys: Vec<String> =
            p["properties"].as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        keys.sort();
        keys
    };
    assert_eq!(params("read_file"), ["limit", "line", "path"]);
    assert_eq!(params("list_dir"), ["path"]);
    assert_eq!(params("grep"), ["glob", "path", "pattern"]);
    assert_eq!(params("write_file"), ["content", "path"]);
    assert_eq!(params("edit_file"), ["new_text", "old_text", "path", "replace_all"]);
    assert_eq!(params("run_command"), ["command", "timeout_ms"]);
    assert_eq!(params("update_plan"), ["entries"]);
}

#[tokio::test]
async fn read_file_reads_pages_and_refuses_binaries() {
    let f = fixture();
    let text: String = (1..=10).map(|i| format!("line {i}\n")).collect();
    f.write("a.txt", text.as_bytes());
    let out = f.ok("read_file", json!({"path": "a.txt"})).await;
    assert_eq!(out.text, text);
    assert_eq!(out.raw["total_lines"], 10);
    let out = f.ok("read_file", json!({"path": "a.txt", "line": 3, "limit": 2})).await;
    assert_eq!(out.text, "line 3\nline 4\n[showing lines 3-4 of 10; call read_file with line=5 to read more]");
    assert_eq!(out.locations[0].line, Some(3));
    assert!(f.err("read_file", json!({"path": "a.txt", "line": 50})).await.contains("past the end"));
    f.write("bin", b"\x7fELF\x00\x01\x02");
    assert!(f.err("read_file", json!({"path": "bin"})).await.contains("binary"));
    f.write("latin1", b"caf\xe9\n");
    assert!(f.err("read_file", json!({"path": "latin1"})).await.contains("binary"));
    f.write("empty", b"");
    assert!(f.ok("read_file", json!({"path": "empty"})).await.text.contains("empty"));
    std::fs::create_dir(f.root().join("d")).unwrap_or_else(|e| panic!("{e}"));
    assert!(f.err("read_file", json!({"path": "d"})).await.contains("list_dir"));
    assert!(f.err("read_file", json!({"path": "missing"})).await.contains("cannot read"));
    assert!(f.err("read_file", json!({"path": "../x"})).await.contains("outside the session directory"));
    assert!(f.err("read_file", json!({"nope": 1})).await.contains("invalid arguments for read_file"));
}

#[tokio::test]
async fn read_file_pages_a_large_file_within_the_output_cap() {
    let f = fixture_with(Limits { output_bytes: 1024, ..Limits::default() });
    let text: String = (1..=5000).map(|i| format!("{i:04} {}\n", "x".repeat(60))).collect();
    f.write("big.txt", text.as_bytes());
    let out = f.ok("read_file", json!({"path": "big.txt"})).await;
    assert!(out.text.len() < 1400, "{}", out.text.len());
    assert!(out.text.contains("of 5000; call read_file with line="), "{}", out.text);
    let next = out.raw["last_line"].as_u64().unwrap_or(0) + 1;
    let out = f.ok("read_file", json!({"path": "big.txt", "line": next, "limit": 1})).await;
    assert!(out.text.starts_with(&format!("{next:04} ")), "{}", out.text);
}

#[tokio::test]
async fn list_dir_shows_types_and_sizes_and_respects_gitignore() {
    let f = fixture();
    f.write(".gitignore", b"target/\n*.log\n");
    f.write("src/main.rs", b"fn main() {}\n");
    f.write("target/debug/x", b"");
    f.write("run.log", b"noise");
    f.write(".git/HEAD", b"ref");
    f.write("README.md", b"hello");
    std::os::unix::fs::symlink("README.md", f.root().join("link")).unwrap_or_else(|e| panic!("{e}"));
    let out = f.ok("list_dir", json!({"path": "."})).await;
    let lines: Vec<&str> = out.text.lines().collect();
    assert_eq!(
        lines,
        [".gitignore  (14 bytes)", "README.md  (5 bytes)", "link -> README.md  (symlink)", "src/  (dir)"]
    );
    let out = f.ok("list_dir", json!({"path": "src"})).await;
    assert_eq!(out.text, "main.rs  (13 bytes)");
    assert!(f.err("list_dir", json!({"path": "README.md"})).await.contains("not a directory"));
    assert!(f.err("list_dir", json!({"path": "/"})).await.contains("outside"));
}

#[tokio::test]
async fn grep_searches_the_tree_with_globs_gitignore_and_a_cap() {
    let f = fixture_with(Limits { grep_max_matches: 3, ..Limits::default() });
    f.write(".gitignore", b"ignored/\n");
    f.write("src/a.rs", b"fn alpha() {}\nfn beta() {}\n");
    f.write("src/b.py", b"def alpha(): pass\n");
    f.write("ignored/c.rs", b"fn alpha() {}\n");
    f.write("data.bin", b"alpha\x00\x01");
    let out = f.ok("grep", json!({"pattern": "alpha"})).await;
    let mut lines: Vec<&str> = out.text.lines().collect();
    lines.sort();
    assert_eq!(lines, ["src/a.rs:1: fn alpha() {}", "src/b.py:1: def alpha(): pass"]);
    let out = f.ok("grep", json!({"pattern": "fn \\w+", "glob": "*.rs"})).await;
    assert_eq!(out.text, "src/a.rs:1: fn alpha() {}\nsrc/a.rs:2: fn beta() {}");
    let out = f.ok("grep", json!({"pattern": "alpha", "path": "src/b.py"})).await;
    assert_eq!(out.text, "src/b.py:1: def alpha(): pass");
    assert!(f.ok("grep", json!({"pattern": "zzz"})).await.text.starts_with("no matches"));
    f.write("many.txt", b"x\nx\nx\nx\nx\n");
    let out = f.ok("grep", json!({"pattern": "^x$", "path": "many.txt"})).await;
    assert_eq!(out.text.lines().count(), 4, "{}", out.text);
    assert!(out.text.contains("stopped at 3 matches"));
    assert!(f.err("grep", json!({"pattern": "("})).await.contains("invalid pattern"));
    assert!(f.err("grep", json!({"pattern": "x", "path": "../.."})).await.contains("outside"));
}

#[tokio::test]
async fn write_file_creates_and_replaces_recording_old_and_new_text() {
    let f = fixture();
    let out = f.ok("write_file", json!({"path": "new/dir/f.txt", "content": "one\n"})).await;
    assert_eq!(f.read("new/dir/f.txt"), "one\n");
    let path = f.root().join("new/dir/f.txt");
    assert_eq!(out.content, vec![ToolContent::Diff { path: path.clone(), old_text: None, new_text: "one\n".into() }]);
    let out = f.ok("write_file", json!({"path": "new/dir/f.txt", "content": "two\n"})).await;
    assert_eq!(out.content, vec![ToolContent::Diff { path, old_text: Some("one\n".into()), new_text: "two\n".into() }]);
    assert!(out.text.starts_with("Replaced"));
    // No temporary files are left behind.
    let names: Vec<String> = std::fs::read_dir(f.root().join("new/dir"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["f.txt"]);
    f.write("bin", b"\xff\xfe");
    assert!(f.err("write_file", json!({"path": "bin", "content": "x"})).await.contains("not a UTF-8 text file"));
    assert!(f.err("write_file", json!({"path": "../escape.txt", "content": "x"})).await.contains("outside"));
}

#[tokio::test]
async fn writes_through_symlinks_that_leave_the_directory_are_refused() {
    let f = fixture();
    let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(outside.path().join("victim"), "safe").unwrap_or_else(|e| panic!("{e}"));
    std::os::unix::fs::symlink(outside.path(), f.root().join("out")).unwrap_or_else(|e| panic!("{e}"));
    std::os::unix::fs::symlink(outside.path().join("victim"), f.root().join("v")).unwrap_or_else(|e| panic!("{e}"));
    for path in ["out/victim", "v", "out/new"] {
        let msg = f.err("write_file", json!({"path": path, "content": "pwned"})).await;
        assert!(msg.contains("outside the session directory"), "{path}: {msg}");
        let msg = f.err("edit_file", json!({"path": path, "old_text": "safe", "new_text": "pwned"})).await;
        assert!(msg.contains("outside the session directory"), "{path}: {msg}");
    }
    assert!(f.err("read_file", json!({"path": "v"})).await.contains("outside"));
    assert_eq!(std::fs::read_to_string(outside.path().join("victim")).unwrap_or_default(), "safe");
    assert!(!outside.path().join("new").exists());
}

#[tokio::test]
async fn edit_file_replaces_exactly_once_or_fails_clearly() {
    let f = fixture();
    f.write("f.rs", b"let a = 1;\nlet b = 2;\nlet a = 1;\n");
    let msg = f.err("edit_file", json!({"path": "f.rs", "old_text": "let a = 1;", "new_text": "x"})).await;
    assert!(msg.contains("matches 2 times"), "{msg}");
    let msg = f.err("edit_file", json!({"path": "f.rs", "old_text": "nope", "new_text": "x"})).await;
    assert!(msg.contains("not found"), "{msg}");
    assert!(f.err("edit_file", json!({"path": "f.rs", "old_text": "", "new_text": "x"})).await.contains("empty"));
    assert!(
        f.err("edit_file", json!({"path": "g.rs", "old_text": "a", "new_text": "x"})).await.contains("does not exist")
    );
    assert_eq!(f.read("f.rs"), "let a = 1;\nlet b = 2;\nlet a = 1;\n", "failed edits change nothing");
    let out = f.ok("edit_file", json!({"path": "f.rs", "old_text": "let b = 2;", "new_text": "let b = 3;"})).await;
    assert_eq!(f.read("f.rs"), "let a = 1;\nlet b = 3;\nlet a = 1;\n");
    assert_eq!(out.locations[0].line, Some(2));
    match &out.content[..] {
        [ToolContent::Diff { old_text: Some(old), new_text, .. }] => {
            assert_eq!(
                (old.as_str(), new_text.as_str()),
                ("let a = 1;\nlet b = 2;\nlet a = 1;\n", "let a = 1;\nlet b = 3;\nlet a = 1;\n")
            );
        }
        other => panic!("{other:?}"),
    }
    let out =
        f.ok("edit_file", json!({"path": "f.rs", "old_text": "let a", "new_text": "let z", "replace_all": true})).await;
    assert_eq!(f.read("f.rs"), "let z = 1;\nlet b = 3;\nlet z = 1;\n");
    assert_eq!(out.raw["replacements"], 2);
}

#[tokio::test]
async fn run_command_reports_exit_codes_and_both_streams() {
    let f = fixture();
    f.write("x.txt", b"content");
    let out = f.ok("run_command", json!({"command": "cat x.txt; echo oops >&2; exit 3"})).await;
    assert!(!out.success);
    assert_eq!(out.text, "exit code 3\nstdout:\ncontent\nstderr:\noops\n");
    assert_eq!(out.raw["exit_code"], 3);
    let out = f.ok("run_command", json!({"command": "pwd"})).await;
    assert!(out.success);
    assert_eq!(out.text, format!("exit code 0\nstdout:\n{}\n", f.root().display()));
    let out = f.ok("run_command", json!({"command": "kill -TERM $$"})).await;
    assert!(out.text.starts_with("killed by signal 15 (SIGTERM)"), "{}", out.text);
    assert_eq!(out.raw["signal"], "SIGTERM");
}

#[tokio::test]
async fn run_command_keeps_the_head_and_tail_of_long_output() {
    let f = fixture_with(Limits { command_capture_bytes: 100, ..Limits::default() });
    let out = f.ok("run_command", json!({"command": "seq 1 10000"})).await;
    assert!(out.text.starts_with("exit code 0\nstdout:\n1\n2\n3\n"), "{}", out.text);
    assert!(out.text.contains("bytes elided ...]"));
    assert!(out.text.ends_with("9999\n10000\n"), "{}", out.text);
    assert_eq!(out.raw["stdout_bytes"], 48894);
}

fn group_alive(pgid: i32) -> bool {
    // A zombie awaiting its reaper is dead for our purposes.
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten().any(|e| {
                let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                let after = stat.rsplit_once(')').map(|(_, rest)| rest.trim().to_owned()).unwrap_or_default();
                let fields: Vec<&str> = after.split_whitespace().collect();
                fields.len() > 2 && fields[2] == pgid.to_string() && fields[0] != "Z"
            })
        })
        .unwrap_or(false)
}

/// Whether the group is gone, allowing the kernel the moment it takes to finish a
/// SIGKILL: the orphans of a killed group are not our children, so nothing tells us
/// when they have exited. Bounded; no sleep.
async fn group_gone(pgid: i32) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while group_alive(pgid) {
        if std::time::Instant::now() > deadline {
            return false;
        }
        tokio::task::yield_now().await;
    }
    true
}

fn pid_from(path: &Path) -> i32 {
    std::fs::read_to_string(path).unwrap_or_default().trim().parse().unwrap_or_else(|_| panic!("no pid in {path:?}"))
}

#[tokio::test]
async fn a_timeout_kills_the_whole_process_group() {
    let f = fixture();
    let out = f.ok("run_command", json!({"command": "echo $$ > pid; sleep 300 & sleep 300", "timeout_ms": 300})).await;
    assert!(!out.success);
    assert!(out.text.starts_with("timed out after 300 ms"), "{}", out.text);
    assert_eq!(out.raw["timed_out"], true);
    assert!(group_gone(pid_from(&f.root().join("pid"))).await, "a process of the group survived");
}

#[tokio::test]
async fn background_processes_do_not_outlive_the_command() {
    let f = fixture();
    let out = f.ok("run_command", json!({"command": "echo $$ > pid; (sleep 300 &) ; echo started"})).await;
    assert!(out.success, "{}", out.text);
    assert!(group_gone(pid_from(&f.root().join("pid"))).await);
}

#[tokio::test]
async fn cancellation_kills_the_group_promptly() {
    let f = fixture();
    let fifo = f.root().join("ready");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap_or_else(|e| panic!("{e}"));
    let tool = f.toolbox.get("run_command").unwrap_or_else(|| panic!("run_command"));
    let cx = f.cx.clone();
    let cancel = cx.cancel.clone();
    let running = tokio::spawn(async move {
        let toolbox = Toolbox::builtin(Limits::default());
        toolbox.run(&tool, json!({"command": "echo $$ > ready; sleep 300"}), cx).await
    });
    // Opening the FIFO waits for the command to write its pid: it is running now.
    let pgid: i32 = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(group_alive(pgid));
    cancel.cancel();
    let out = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .unwrap_or_else(|_| panic!("cancellation was not prompt"))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.text.starts_with("cancelled"), "{}", out.text);
    assert!(group_gone(pgid).await, "a process of the group survived");
}

#[tokio::test]
async fn update_plan_takes_the_whole_plan() {
    let f = fixture();
    let out = f
        .ok(
            "update_plan",
            json!({"entries": [
                {"content": "read the code", "priority": "high", "status": "completed"},
                {"content": "fix the bug", "priority": "medium", "status": "in_progress"},
            ]}),
        )
        .await;
    let plan = out.plan.unwrap_or_default();
    assert_eq!(plan.len(), 2);
    assert_eq!(plan[1].status, PlanStatus::InProgress);
    assert_eq!(out.text, "Plan updated: 2 steps (1 completed, 1 in progress, 0 pending)");
    let msg =
        f.err("update_plan", json!({"entries": [{"content": "x", "priority": "urgent", "status": "pending"}]})).await;
    assert!(msg.contains("invalid arguments for update_plan"), "{msg}");
}

struct Panics;

/// What the model reads of [`Panics`].
const PANICS_DESCRIPTION: &str = "panics";

/// The arguments [`Panics`] takes (JSON schema).
fn panics_parameters() -> Value {
    json!({})
}

impl Tool for Panics {
    pier_tools::tool_spec!("panics", ToolKind::Other, PANICS_DESCRIPTION, panics_parameters);
    fn preview(&self, _: &Value, _: &Workspace) -> Preview {
        Preview { title: "panics".into(), locations: vec![], content: vec![] }
    }
    fn run(&self, _: Value, _: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async { panic!("boom") })
    }
}

#[tokio::test]
async fn a_panicking_tool_is_a_failure_not_a_crash() {
    let f = fixture();
    let tool: Arc<dyn Tool> = Arc::new(Panics);
    let r = f.toolbox.run(&tool, json!({}), f.cx.clone()).await;
    assert_eq!(r.err().map(|e| e.0), Some("the panics tool crashed: boom".to_owned()));
}

#[tokio::test]
async fn output_to_the_model_is_capped() {
    let f = fixture_with(Limits { output_bytes: 200, command_capture_bytes: 10_000, ..Limits::default() });
    let out = f.ok("run_command", json!({"command": "seq 1 2000"})).await;
    assert!(out.text.contains("[output truncated: 200 of"), "{}", out.text);
    assert!(out.text.len() < 300);
    let _ = &f.dir;
}
