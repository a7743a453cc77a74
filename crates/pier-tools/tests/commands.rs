//! Issue #16 item 5: a command's processes end with it however they detach, and
//! where the kernel offers Landlock its writes stay inside the roots.

use std::path::Path;
use std::time::{Duration, Instant};

use pier_tools::{Confinement, Limits, ToolContext, ToolOutput, Toolbox, Workspace};
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn cx(dir: &Path, limits: &Limits) -> ToolContext {
    let workspace = Workspace::new(dir).unwrap_or_else(|e| panic!("{e}"));
    ToolContext { workspace, cancel: CancellationToken::new(), limits: limits.clone(), link: Default::default() }
}

async fn run(dir: &Path, limits: Limits, command: &str) -> ToolOutput {
    let toolbox = Toolbox::builtin(limits.clone());
    let tool = toolbox.get("run_command").unwrap_or_else(|| panic!("no run_command"));
    tokio::time::timeout(Duration::from_secs(60), toolbox.run(&tool, json!({"command": command}), cx(dir, &limits)))
        .await
        .unwrap_or_else(|_| panic!("run_command did not finish"))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).unwrap_or("");
    !state.is_empty() && state != "Z"
}

/// Whether `pid` is gone within a bounded poll of /proc (the kernel finishing a SIGKILL); no sleep.
async fn gone(pid: i32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(3);
    while alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        tokio::task::yield_now().await;
    }
    true
}

fn pid_in(path: &Path) -> i32 {
    std::fs::read_to_string(path).unwrap_or_default().trim().parse().unwrap_or_else(|_| panic!("no pid in {path:?}"))
}

/// Three ways to detach; the command waits until each has written its pid, so all run when it exits.
const DETACHING: &str = r#"
setsid -f sh -c 'echo $$ > setsid.pid; exec sleep 300'
sh -c '(sh -c "echo \$\$ > double.pid; exec sleep 300" &)'
perl -e 'if (fork() == 0) { setpgrp(0, 0); open(my $f, ">", "setpgid.pid"); print $f "$$\n"; close $f; exec "sleep", "300" }'
while [ ! -s setsid.pid ] || [ ! -s double.pid ] || [ ! -s setpgid.pid ]; do :; done
echo started
"#;

async fn detached_processes_end_with_the_command(limits: Limits) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let out = run(dir.path(), limits, DETACHING).await;
    assert!(out.success, "{}", out.text);
    for name in ["setsid.pid", "double.pid", "setpgid.pid"] {
        let pid = pid_in(&dir.path().join(name));
        assert!(gone(pid).await, "the process of {name} ({pid}) outlived run_command");
    }
}

/// Issue #16 item 5: `setsid -f`, a double fork and a `setpgid` child are all gone
/// when run_command returns (with the command's cgroup where one can be made).
#[tokio::test]
async fn issue16_detached_processes_do_not_outlive_run_command() {
    detached_processes_end_with_the_command(Limits::default()).await;
}

/// The same without cgroups: the session, the subreaper and the marker find them.
#[tokio::test]
async fn issue16_detached_processes_end_without_cgroups_too() {
    let limits = Limits { confinement: Confinement { cgroups: false, ..Confinement::default() }, ..Limits::default() };
    detached_processes_end_with_the_command(limits).await;
}

/// A directory outside the roots and outside the system temp directory.
fn outside_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap_or_else(|e| panic!("{e}"))
}

/// Issue #16 item 5: under Landlock a command cannot write outside the roots and
/// the temp directory; inside them it can; with the sandbox off it can write there.
#[tokio::test]
async fn issue16_landlock_refuses_writes_outside_the_roots() {
    let Some(abi) = pier_tools::contain::init().landlock_abi else {
        eprintln!("skipped: this kernel has no Landlock ({})", pier_tools::contain::describe(&Confinement::default()));
        return;
    };
    eprintln!("Landlock ABI {abi}");
    let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let outside = outside_dir();
    let target = outside.path().join("escaped");
    let command = format!("echo in > inside.txt && echo tmp > \"$(mktemp)\" && echo out > '{}'", target.display());
    let out = run(root.path(), Limits::default(), &command).await;
    assert!(!out.success, "{}", out.text);
    assert!(out.text.contains("Permission denied"), "{}", out.text);
    assert!(!target.exists(), "a write outside the roots succeeded");
    assert_eq!(std::fs::read_to_string(root.path().join("inside.txt")).unwrap_or_default(), "in\n");

    let off = Limits { confinement: Confinement::off(), ..Limits::default() };
    let out = run(root.path(), off, &command).await;
    assert!(out.success, "{}", out.text);
    assert_eq!(std::fs::read_to_string(&target).unwrap_or_default(), "out\n");
}
