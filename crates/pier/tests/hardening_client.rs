//! Issue #16, the client's half: `pier exec` facing a hostile or broken agent.
//! Client methods follow the policy of their tool kinds (#4), reads and the kept
//! answer are bounded (#6), and signals and `--timeout` end the handshake (#11).
//! Each test drives the real binary with a scripted agent from `tests/fixtures`.

mod support;

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::{Value, json};
use support::{LIMIT, group_alive, must};

struct Env {
    home: tempfile::TempDir,
    work: tempfile::TempDir,
    vars: Vec<(String, String)>,
}

impl Env {
    fn new() -> Env {
        let home = must(tempfile::tempdir(), "home");
        let work = must(tempfile::tempdir(), "work");
        let vars = vec![
            ("HOME".to_owned(), home.path().display().to_string()),
            ("PIER_HOME".to_owned(), home.path().join("data").display().to_string()),
            ("PATH".to_owned(), std::env::var("PATH").unwrap_or_default()),
            ("RUST_LOG".to_owned(), "warn".to_owned()),
        ];
        Env { home, work, vars }
    }

    fn cwd(&self) -> PathBuf {
        must(self.work.path().canonicalize(), "canonical work dir")
    }

    fn command(&self, args: &[&str]) -> tokio::process::Command {
        support::pier_command(self.work.path(), &self.vars, args)
    }

    async fn run(&self, args: &[&str]) -> Output {
        self.run_within(LIMIT, args).await
    }

    async fn run_within(&self, limit: std::time::Duration, args: &[&str]) -> Output {
        let child = must(self.command(args).spawn(), "spawn pier");
        must(must(tokio::time::timeout(limit, child.wait_with_output()).await, "pier exec finished in time"), "wait")
    }
}

fn fixture(name: &str) -> String {
    format!("python3 {}", Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name).display())
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The `result` line of a `--format json` run.
fn result(o: &Output) -> Value {
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap_or_default();
    let v: Value = must(serde_json::from_str(last), "the last line is JSON");
    assert_eq!(v["type"], "result", "{last}");
    v
}

/// Runs `client_calls_agent.py` with `calls` as its prompt; its report (the answers
/// and pier exec's peak RSS) and the whole output.
async fn call_client(env: &Env, flags: &[&str], calls: Value) -> (Value, Output) {
    let agent = fixture("client_calls_agent.py");
    let prompt = calls.to_string();
    let mut args = vec!["exec", "--format", "json", "--agent", &agent];
    args.extend_from_slice(flags);
    args.push(&prompt);
    let o = env.run(&args).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = result(&o)["text"].as_str().unwrap_or_default().to_owned();
    (must(serde_json::from_str(&text), "the agent's report"), o)
}

fn error_message(answer: &Value) -> String {
    answer["error"]["message"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn client_methods_follow_the_rules_of_their_tool_kinds() {
    let env = Env::new();
    let outside = must(tempfile::tempdir(), "outside");
    let secret = outside.path().join("secret");
    must(std::fs::write(&secret, "the outside secret"), "write secret");
    let written = env.cwd().join("planted.txt");
    let calls = json!([
        ["terminal/create", {"sessionId": "s", "command": "cat", "args": [secret]}],
        ["terminal/wait_for_exit", {"sessionId": "s", "terminalId": "$terminal"}],
        ["terminal/output", {"sessionId": "s", "terminalId": "$terminal"}],
        ["fs/write_text_file", {"sessionId": "s", "path": written, "content": "planted"}],
        ["fs/read_text_file", {"sessionId": "s", "path": env.cwd().join("planted.txt")}],
    ]);

    // Default policy (--approve-reads): execute and edit ask, and nobody can be asked.
    let (report, o) = call_client(&env, &[], calls.clone()).await;
    let answers = report["answers"].as_array().cloned().unwrap_or_default();
    let create = error_message(&answers[0]);
    assert!(
        create.contains("terminal/create is refused") && create.contains("execute") && create.contains("--approve-all"),
        "{}",
        answers[0]
    );
    let write = error_message(&answers[3]);
    assert!(write.contains("fs/write_text_file is refused") && write.contains("edit"), "{}", answers[3]);
    assert!(!written.exists(), "nothing was written");
    assert!(!String::from_utf8_lossy(&o.stdout).contains("the outside secret"), "the secret never reached the agent");
    assert!(!error_message(&answers[4]).is_empty(), "the file was not there to read: {}", answers[4]);
    // Reads stay allowed: the refusal is by kind, not of every method.
    must(std::fs::write(env.cwd().join("a.txt"), "readable"), "write a.txt");
    let read = json!([["fs/read_text_file", {"sessionId": "s", "path": env.cwd().join("a.txt")}]]);
    let (report, _) = call_client(&env, &[], read).await;
    assert_eq!(report["answers"][0]["result"]["content"], "readable", "{report}");

    // --approve-all serves both.
    let (report, _) = call_client(&env, &["--approve-all"], calls.clone()).await;
    let answers = report["answers"].as_array().cloned().unwrap_or_default();
    assert!(answers[0]["result"]["terminalId"].is_string(), "{}", answers[0]);
    assert_eq!(answers[2]["result"]["output"], "the outside secret", "{}", answers[2]);
    assert_eq!(answers[3]["result"], json!({}), "{}", answers[3]);
    assert_eq!(answers[4]["result"]["content"], "planted", "{}", answers[4]);

    // So does a rule that allows the kind; --non-interactive fail fails the run instead.
    std::fs::remove_file(&written).unwrap_or_else(|e| panic!("{e}"));
    must(std::fs::write(env.cwd().join("pier.toml"), "[client.permissions]\nedit = \"allow\"\n"), "pier.toml");
    let write_only = json!([["fs/write_text_file", {"sessionId": "s", "path": written, "content": "by rule"}]]);
    let (report, _) = call_client(&env, &[], write_only).await;
    assert_eq!(report["answers"][0]["result"], json!({}), "{report}");
    assert_eq!(std::fs::read_to_string(&written).unwrap_or_default(), "by rule");
    let agent = fixture("client_calls_agent.py");
    let exec_only = json!([["terminal/create", {"sessionId": "s", "command": "true"}]]).to_string();
    let o = env.run(&["exec", "--format", "json", "--non-interactive", "fail", "--agent", &agent, &exec_only]).await;
    assert_eq!(o.status.code(), Some(6), "{}", stderr(&o));
    assert_eq!(result(&o)["error"]["kind"], "permission_required");
}

#[tokio::test]
async fn a_read_of_one_line_of_a_huge_sparse_file_is_bounded() {
    let env = Env::new();
    let huge = env.cwd().join("huge.bin");
    let file = must(std::fs::File::create(&huge), "create");
    must(file.set_len(2 << 30), "a 2 GiB sparse file: one line of zeros");
    drop(file);
    let started = std::time::Instant::now();
    let calls = json!([["fs/read_text_file", {"sessionId": "s", "path": huge, "line": 1, "limit": 1}]]);
    let (report, _) = call_client(&env, &[], calls).await;
    let content = &report["answers"][0]["result"]["content"];
    let length = content["length"].as_u64().unwrap_or(u64::MAX);
    assert!(length < (1 << 20) + 200, "{length} bytes: {report}");
    let tail = content["tail"].as_str().unwrap_or_default();
    assert!(tail.ends_with("KiB; the rest of it was cut]\n"), "{tail:?}");
    let peak_kb = report["peak_kb"].as_u64().unwrap_or(u64::MAX);
    assert!(peak_kb < 64 * 1024, "pier exec peaked at {peak_kb} kB reading one line");
    assert!(started.elapsed() < LIMIT, "answered quickly");
}

#[tokio::test]
async fn a_flood_of_answer_chunks_keeps_pier_exec_bounded_and_the_json_carries_them_all() {
    let env = Env::new();
    let agent = fixture("chunk_flood_agent.py");
    let peak = env.home.path().join("peak");
    let mut env = env;
    env.vars.push(("PIER_TEST_PEAK_FILE".into(), peak.display().to_string()));

    // 600 MB in 8 KiB chunks, nothing rendered: the answer pier keeps is capped. (Parsing
    // 600 MB takes a debug build most of a minute.)
    let slow = std::time::Duration::from_secs(300);
    let o = env.run_within(slow, &["exec", "--format", "quiet", "--agent", &agent, "76800 8192"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let kept = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(kept.len() <= (1 << 20) + 200, "{} bytes kept", kept.len());
    assert!(kept.starts_with("[pier: the first "), "{}", &kept[..100.min(kept.len())]);
    assert!(kept.trim_end().ends_with(&format!("00076799{}", "x".repeat(8184))), "the tail is kept");
    let peak_kb: u64 = std::fs::read_to_string(&peak).unwrap_or_default().trim().parse().unwrap_or(u64::MAX);
    assert!(peak_kb < 100 * 1024, "pier exec peaked at {peak_kb} kB while 600 MB streamed");

    // The NDJSON output still carries every chunk.
    let o = env.run(&["exec", "--format", "json", "--agent", &agent, "384 8192"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let streamed: usize = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["update"]["sessionUpdate"] == "agent_message_chunk")
        .map(|l| l["update"]["content"]["text"].as_str().unwrap_or_default().len())
        .sum();
    assert_eq!(streamed, 384 * 8192);
    let text = result(&o)["text"].as_str().unwrap_or_default().to_owned();
    assert!(text.starts_with("[pier: the first ") && text.len() <= (1 << 20) + 200, "{}", text.len());
}

/// Starts `pier exec` against `mute_agent.py`, which never answers `method`, and
/// returns once the agent has reported that it got it: the child and the agent's group.
async fn stuck_in(env: &mut Env, method: &str, flags: &[&str]) -> (tokio::process::Child, i32) {
    let fifo = env.home.path().join(format!("mute-{}.fifo", method.replace('/', "-")));
    must(nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU), "mkfifo");
    env.vars.push(("PIER_TEST_FIFO".into(), fifo.display().to_string()));
    let agent = format!("{} {method}", fixture("mute_agent.py"));
    let mut args = vec!["exec", "--format", "json", "--agent", &agent];
    args.extend_from_slice(flags);
    args.push("x");
    let child = must(env.command(&args).spawn(), "spawn");
    let reader = tokio::task::spawn_blocking(move || std::fs::read_to_string(&fifo).unwrap_or_default());
    let report = must(must(tokio::time::timeout(LIMIT, reader).await, "the agent reported"), "join");
    let (got, pgid) = report.trim().split_once(' ').unwrap_or_default();
    assert_eq!(got, method);
    (child, pgid.parse().unwrap_or(0))
}

async fn signalled(child: tokio::process::Child, signal: nix::sys::signal::Signal) -> Output {
    let pid = nix::unistd::Pid::from_raw(child.id().map_or(0, |p| p as i32));
    must(nix::sys::signal::kill(pid, signal), "signal pier exec");
    must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "pier exec exited promptly"), "wait")
}

#[tokio::test]
async fn ctrl_c_during_the_handshake_kills_the_agent_and_exits_130() {
    let mut env = Env::new();
    let (child, pgid) = stuck_in(&mut env, "initialize", &[]).await;
    assert!(group_alive(pgid));
    let o = signalled(child, nix::sys::signal::Signal::SIGINT).await;
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["error"]["kind"], "cancelled", "{r}");
    assert!(r["error"]["message"].as_str().is_some_and(|m| m.contains("during initialize")), "{r}");
    assert!(!group_alive(pgid), "the agent's group survived");
}

#[tokio::test]
async fn sigterm_during_session_setup_kills_the_agent_and_exits_143() {
    let mut env = Env::new();
    let (child, pgid) = stuck_in(&mut env, "session/new", &[]).await;
    let o = signalled(child, nix::sys::signal::Signal::SIGTERM).await;
    assert_eq!(o.status.code(), Some(143), "{}", stderr(&o));
    assert!(result(&o)["error"]["message"].as_str().is_some_and(|m| m.contains("during session/new")));
    assert!(!group_alive(pgid), "the agent's group survived");
}

#[tokio::test]
async fn the_handshake_is_bounded_by_timeout() {
    let env = Env::new();
    let agent = format!("{} initialize", fixture("mute_agent.py"));
    let o = env.run(&["exec", "--format", "json", "--timeout", "0.5", "--agent", &agent, "x"]).await;
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["error"]["kind"], "timeout", "{r}");
    assert!(r["error"]["message"].as_str().is_some_and(|m| m.contains("did not answer initialize")), "{r}");
}

/// #16: `pier exec` confines its terminals' writes with Landlock unless `--sandbox off`.
#[tokio::test]
async fn terminals_write_only_beneath_the_roots_unless_the_sandbox_is_off() {
    if pier_tools::contain::init().landlock_abi.is_none() {
        eprintln!("skipped: this kernel has no Landlock");
        return;
    }
    let env = Env::new();
    // Outside the temp directory, where commands may always write.
    let outside = must(tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")), "outside");
    for (flags, name, written) in [(&[][..], "confined.txt", false), (&["--sandbox", "off"][..], "free.txt", true)] {
        let target = outside.path().join(name);
        let script = format!("echo out > '{}'", target.display());
        let calls = json!([
            ["terminal/create", {"sessionId": "s", "command": "sh", "args": ["-c", script]}],
            ["terminal/wait_for_exit", {"sessionId": "s", "terminalId": "$terminal"}],
        ]);
        let mut all = vec!["--approve-all"];
        all.extend_from_slice(flags);
        let (report, _) = call_client(&env, &all, calls).await;
        assert_eq!(target.exists(), written, "{flags:?}: {report}");
    }
}
