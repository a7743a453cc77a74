//! Issue #16 item 6 (read_file): a 1.5 GB file of one line is answered with
//! bounded memory. Alone in its test binary, so the process's peak RSS is this
//! test's own.

use std::time::{Duration, Instant};

use pier_tools::{Limits, ToolContext, Toolbox, Workspace};
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn issue16_read_file_streams_a_huge_single_line() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("one-line.txt");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{e}"));
        // Text first, so the binary sniff passes; the rest of the one line is a sparse hole.
        file.write_all(&[b'a'; 16 * 1024]).unwrap_or_else(|e| panic!("{e}"));
        file.set_len(1_500_000_000).unwrap_or_else(|e| panic!("{e}"));
    }
    let before = peak_rss_kib();
    let workspace = Workspace::new(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let cx = ToolContext {
        workspace,
        cancel: CancellationToken::new(),
        limits: Limits::default(),
        link: Default::default(),
    };
    let toolbox = Toolbox::builtin(Limits::default());
    let tool = toolbox.get("read_file").unwrap_or_else(|| panic!("no read_file"));
    let started = Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(120), toolbox.run(&tool, json!({"path": "one-line.txt"}), cx))
        .await
        .unwrap_or_else(|_| panic!("read_file did not finish"))
        .unwrap_or_else(|e| panic!("{e}"));
    let peak = peak_rss_kib();
    eprintln!("{:?}, peak RSS {before} -> {peak} KiB, {} bytes of output", started.elapsed(), out.text.len());
    assert!(out.text.starts_with(&"a".repeat(2000)), "the line's head is shown");
    assert!(out.text.contains("[… line cut: 1499998000 more bytes]"), "{}", &out.text[2000..]);
    assert!(out.text.len() < 4096, "{} bytes", out.text.len());
    assert_eq!(out.raw["total_lines"], 1);
    assert!(peak < 200 * 1024, "peak RSS {peak} KiB");
}
