//! Issue #16 (items 2 and 3): the file tools stay beneath their roots against a
//! hostile repository, a planted temporary name, a directory swapped for a
//! symlink while they run, and FIFOs.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pier_tools::{Limits, ToolContext, ToolError, ToolOutput, Toolbox, Workspace};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

struct Fixture {
    _dir: tempfile::TempDir,
    toolbox: Toolbox,
    cx: ToolContext,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let workspace = Workspace::new(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let cx = ToolContext {
        workspace,
        cancel: CancellationToken::new(),
        limits: Limits::default(),
        link: Default::default(),
    };
    Fixture { _dir: dir, toolbox: Toolbox::builtin(Limits::default()), cx }
}

impl Fixture {
    fn root(&self) -> &Path {
        self.cx.workspace.root()
    }
    async fn call(&self, name: &str, args: Value) -> Result<ToolOutput, ToolError> {
        let tool = self.toolbox.get(name).unwrap_or_else(|| panic!("no tool {name}"));
        self.toolbox.run(&tool, args, self.cx.clone()).await
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// Issue #16 item 2: a symlink planted at the old predictable temporary name
/// (`.NAME.pier-<pid>.tmp`) pointing outside is never followed.
#[tokio::test]
async fn issue16_a_symlink_at_the_temporary_name_is_not_followed() {
    let f = fixture();
    let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(outside.path().join("victim"), "safe").unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(f.root().join("edit.txt"), "old text\n").unwrap_or_else(|e| panic!("{e}"));
    let pid = std::process::id();
    for (name, target) in [("new.txt", "victim"), ("edit.txt", "created-outside")] {
        std::os::unix::fs::symlink(outside.path().join(target), f.root().join(format!(".{name}.pier-{pid}.tmp")))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    f.call("write_file", json!({"path": "new.txt", "content": "pwned"})).await.unwrap_or_else(|e| panic!("{e}"));
    f.call("edit_file", json!({"path": "edit.txt", "old_text": "old", "new_text": "pwned"}))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(read(&outside.path().join("victim")), "safe");
    assert_eq!(names(outside.path()), ["victim"]);
    assert_eq!(read(&f.root().join("new.txt")), "pwned");
    assert_eq!(read(&f.root().join("edit.txt")), "pwned text\n");
    // The planted links are left alone, and no temporary file is left behind.
    let pier_tmp: Vec<String> = names(f.root()).into_iter().filter(|n| n.contains(".pier-")).collect();
    assert_eq!(pier_tmp, [format!(".edit.txt.pier-{pid}.tmp"), format!(".new.txt.pier-{pid}.tmp")]);
}

/// Issue #16 item 3: with a directory swapped for a symlink to the outside in a
/// loop, no write lands outside and no read returns the outside file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue16_a_directory_swapped_for_a_symlink_never_leads_outside() {
    let f = fixture();
    let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(outside.path().join("f"), "OUTSIDE").unwrap_or_else(|e| panic!("{e}"));
    let sub = f.root().join("sub");
    std::fs::create_dir(&sub).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(sub.join("f"), "inside").unwrap_or_else(|e| panic!("{e}"));
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    // `sub` is exchanged atomically (renameat2 RENAME_EXCHANGE) with a symlink to the
    // outside and back, so it always exists: as the real directory or as the link.
    let link = f.root().join("link");
    std::os::unix::fs::symlink(outside.path(), &link).unwrap_or_else(|e| panic!("{e}"));
    let swapper = {
        let (stop, swaps, sub, link) = (stop.clone(), swaps.clone(), sub.clone(), link.clone());
        std::thread::spawn(move || {
            let exchange = || {
                nix::fcntl::renameat2(
                    nix::fcntl::AT_FDCWD,
                    &sub,
                    nix::fcntl::AT_FDCWD,
                    &link,
                    nix::fcntl::RenameFlags::RENAME_EXCHANGE,
                )
                .unwrap_or_else(|e| panic!("exchange: {e}"))
            };
            // Each state is held about as long as a tool call, so a check in one state and a
            // use in the other are likely (pacing the adversary, not synchronising).
            let hold = || {
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(100) {
                    std::hint::spin_loop();
                }
            };
            while !stop.load(Ordering::Relaxed) {
                exchange();
                hold();
                exchange();
                hold();
                swaps.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let (mut wrote, mut read_ok, mut outside_reads) = (0, 0, 0);
    // Until the swapper has swapped 1,000 times (and at least 300 rounds), bounded by time.
    let started = Instant::now();
    let mut i = 0;
    while (i < 300 || swaps.load(Ordering::Relaxed) < 1000) && started.elapsed() < Duration::from_secs(20) {
        i += 1;
        if f.call("write_file", json!({"path": "sub/f", "content": format!("write {i}")})).await.is_ok() {
            wrote += 1;
        }
        match f.call("read_file", json!({"path": "sub/f"})).await {
            Ok(out) if out.text.contains("OUTSIDE") => outside_reads += 1,
            Ok(_) => read_ok += 1,
            Err(_) => {}
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap_or_else(|_| panic!("the swapper panicked"));
    let swaps = swaps.load(Ordering::Relaxed);
    let landed = names(outside.path());
    eprintln!("{swaps} swaps; {wrote} writes and {read_ok} reads succeeded; {outside_reads} outside reads; {landed:?}");
    assert_eq!(read(&outside.path().join("f")), "OUTSIDE", "a write landed outside");
    assert_eq!(landed, ["f"], "a file was created outside");
    assert_eq!(outside_reads, 0, "reads returned the outside file");
    assert!(swaps > 0);
}

/// Issue #16 item 3: reading a FIFO is refused at once instead of hanging the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue16_a_fifo_is_refused_promptly() {
    let f = fixture();
    let fifo = f.root().join("pipe");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap_or_else(|e| panic!("{e}"));
    for (tool, args) in [
        ("read_file", json!({"path": "pipe"})),
        ("edit_file", json!({"path": "pipe", "old_text": "a", "new_text": "b"})),
        ("write_file", json!({"path": "pipe", "content": "x"})),
    ] {
        let started = Instant::now();
        match tokio::time::timeout(Duration::from_secs(10), f.call(tool, args)).await {
            Ok(Err(e)) => assert!(e.0.contains("FIFO"), "{tool}: {e}"),
            Ok(Ok(out)) => panic!("{tool} read a FIFO: {}", out.text),
            Err(_) => {
                // Release the blocked reader so the test can end, then fail.
                let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
                panic!("{tool} hung on a FIFO for {:?}", started.elapsed());
            }
        }
    }
    // grep and list_dir pass it by.
    let out = f.call("grep", json!({"pattern": "x"})).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(out.text.contains("no matches"), "{}", out.text);
    let out = f.call("list_dir", json!({"path": "."})).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(out.text.contains("pipe"), "{}", out.text);
}

/// grep and list_dir walk through directory handles: a symlinked directory that
/// leads out is listed as a symlink and never searched.
#[tokio::test]
async fn grep_and_list_dir_do_not_follow_symlinks_out() {
    let f = fixture();
    let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(outside.path().join("secret"), "needle outside").unwrap_or_else(|e| panic!("{e}"));
    std::os::unix::fs::symlink(outside.path(), f.root().join("out")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::create_dir(f.root().join("src")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(f.root().join("src/a.rs"), "needle inside\n").unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(f.root().join(".gitignore"), "ignored/\n").unwrap_or_else(|e| panic!("{e}"));
    std::fs::create_dir(f.root().join("ignored")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(f.root().join("ignored/b.rs"), "needle ignored\n").unwrap_or_else(|e| panic!("{e}"));
    let out = f.call("grep", json!({"pattern": "needle"})).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.text, "src/a.rs:1: needle inside");
    let out = f.call("grep", json!({"pattern": "needle", "path": "src/a.rs"})).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.text, "src/a.rs:1: needle inside");
    let out = f.call("list_dir", json!({"path": "."})).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(out.text.contains("out -> "), "{}", out.text);
    assert!(!out.text.contains("ignored"), "{}", out.text);
    assert!(f.call("list_dir", json!({"path": "out"})).await.is_err());
}
