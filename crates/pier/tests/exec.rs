//! End-to-end tests of `pier exec` and `pier prompt` driving real agents over pipes:
//! pier's own agent (with a local fake model) and hand-made misbehaving agents.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::Value;
use support::{LIMIT, group_alive, must};
use tokio::process::Command;

const PIER: &str = env!("CARGO_BIN_EXE_pier");

struct Env {
    home: tempfile::TempDir,
    work: tempfile::TempDir,
    vars: Vec<(String, String)>,
}

impl Env {
    fn new(base_url: Option<String>) -> Env {
        let home = must(tempfile::tempdir(), "home");
        let work = must(tempfile::tempdir(), "work");
        let mut vars = vec![
            ("HOME".to_owned(), home.path().display().to_string()),
            ("PIER_HOME".to_owned(), home.path().join("data").display().to_string()),
            ("PATH".to_owned(), std::env::var("PATH").unwrap_or_default()),
            ("RUST_LOG".to_owned(), "warn".to_owned()),
        ];
        if let Some(url) = base_url {
            vars.push(("PIER_BASE_URL".into(), url));
            vars.push(("PIER_MODEL".into(), "fake-model".into()));
            vars.push(("PIER_API_KEY".into(), "sk-test".into()));
        }
        Env { home, work, vars }
    }

    fn cwd(&self) -> PathBuf {
        must(self.work.path().canonicalize(), "canonical work dir")
    }

    fn command(&self, args: &[&str]) -> Command {
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

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The NDJSON lines of a `--format json` run; every line must be a JSON object with a type.
fn lines(o: &Output) -> Vec<Value> {
    stdout(o)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            assert!(v["type"].is_string(), "no type: {l}");
            v
        })
        .collect()
}

fn result(o: &Output) -> Value {
    let all = lines(o);
    let last = all.last().cloned().unwrap_or_default();
    assert_eq!(last["type"], "result", "the last line is the result: {}", stdout(o));
    last
}

async fn fake() -> FakeModel {
    must(FakeModel::start().await, "fake model")
}

/// A marker that finds every process started for one test in /proc.
#[tokio::test]
async fn a_second_ctrl_c_kills_an_agent_that_ignores_the_cancel() {
    let mut env = Env::new(None);
    let fifo = env.home.path().join("stubborn.fifo");
    must(nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU), "mkfifo");
    env.vars.push(("STUBBORN_FIFO".into(), fifo.display().to_string()));
    let marker = format!("marker-stubborn-{}", std::process::id());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/stubborn_agent.py");
    let agent = format!("python3 {} {marker}", script.display());
    let child = must(
        env.command(&["exec", "--format", "json", "--cancel-grace", "600", "--agent", &agent, "go"]).spawn(),
        "spawn",
    );
    let pid = nix::unistd::Pid::from_raw(child.id().map_or(0, |p| p as i32));
    // The agent reports each step on the FIFO; reading it is how the test knows where it is.
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let Ok(file) = std::fs::File::open(&fifo) else { return };
        for line in std::io::BufReader::new(file).lines().map_while(Result::ok) {
            let _ = seen_tx.send(line);
        }
    });
    let mut next =
        async || must(tokio::time::timeout(LIMIT, seen.recv()).await, "the agent reported").unwrap_or_default();
    assert_eq!(next().await, "prompt");
    must(nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT), "first SIGINT");
    assert_eq!(next().await, "cancel", "the first Ctrl-C starts the cancel handshake");
    assert!(!processes_with(&marker).is_empty(), "the agent is still running, ignoring the cancel");
    must(nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT), "second SIGINT");
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit at once"), "wait");
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["error"]["cancelConfirmed"], false, "{r}");
    assert!(r["error"]["message"].as_str().is_some_and(|m| m.contains("interrupted twice")), "{r}");
    assert!(processes_with(&marker).is_empty(), "the agent survived the second Ctrl-C");
    let _ = reader.join();
}

fn processes_with(marker: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let pid: i32 = e.file_name().to_str()?.parse().ok()?;
                    let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
                    let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                    let zombie = stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
                    let cmdline = String::from_utf8_lossy(&cmdline).into_owned();
                    // The agent itself, not the `pier exec` that names it in its arguments.
                    let is_exec = cmdline.split('\0').nth(1) == Some("exec");
                    (!zombie && !is_exec && cmdline.contains(marker)).then_some(pid)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// An agent command line of pier's own agent carrying a unique marker.
fn marked_agent(env: &Env, marker: &str, extra: &str) -> String {
    format!("{PIER} agent --log-file {} {extra}", env.home.path().join(marker).display())
}

#[tokio::test]
async fn exec_text_prints_the_answer_and_exits_zero() {
    let f = fake().await;
    f.push(Reply::text("Paris is the capital of France."));
    let env = Env::new(Some(f.base_url()));
    let o = env.run(&["exec", "What is the capital of France?"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), "Paris is the capital of France.\n");
    assert!(stderr(&o).contains("stop reason end_turn"), "{}", stderr(&o));
    let body = &f.requests()[0].body;
    assert!(body.to_string().contains("What is the capital of France?"));
}

#[tokio::test]
async fn an_update_flood_costs_the_agent_a_blocked_pipe_not_pier_unbounded_memory() {
    // The agent writes 100,000 updates as fast as the pipe takes them; rendering them as
    // JSON is slower than reading them. pier stops reading while it is behind, so its
    // peak RSS (read by the agent from /proc at the end) stays small.
    let env = Env::new(None);
    let agent =
        format!("python3 {}", Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flood_agent.py").display());
    // 100,000 updates through a Python agent and a debug build: a loaded CI machine needs
    // more than the usual bound (this is a bound on a hang, not a timing).
    let o = env.run_within(LIMIT * 4, &["exec", "--agent", &agent, "--format", "json", "100000"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let all = lines(&o);
    let thoughts = all.iter().filter(|l| l["update"]["sessionUpdate"] == "agent_thought_chunk").count();
    assert_eq!(thoughts, 100_000, "every update was delivered");
    let text = result(&o)["text"].as_str().unwrap_or_default().to_owned();
    let peak_kb: u64 = text.trim_start_matches("peak=").parse().unwrap_or(u64::MAX);
    assert!(peak_kb < 40 * 1024, "pier exec peaked at {peak_kb} kB while the agent flooded it");
}

#[tokio::test]
async fn exec_json_is_ndjson_ending_with_a_result() {
    let f = fake().await;
    f.push(Reply::text("42"));
    let env = Env::new(Some(f.base_url()));
    let o = env.run(&["exec", "--format", "json", "answer"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let all = lines(&o);
    let updates: Vec<&Value> = all
        .iter()
        .filter(|l| l["type"] == "session_update" && l["update"]["sessionUpdate"] == "agent_message_chunk")
        .collect();
    let streamed: String = updates.iter().filter_map(|u| u["update"]["content"]["text"].as_str()).collect();
    assert_eq!(streamed, "42", "pier's agent streams its answer as deltas");
    assert!(updates[0]["sessionId"].is_string());
    let r = result(&o);
    assert_eq!(r["stopReason"], "end_turn");
    assert_eq!(r["text"], "42");
    assert_eq!(r["agent"]["name"], "pier");
    assert_eq!(r["exitCode"], 0);
    assert!(r["durationMs"].is_u64());
    assert_eq!(r["sessionId"], updates[0]["sessionId"]);
    assert!(r.get("error").is_none());
}

#[tokio::test]
async fn exec_quiet_prints_only_the_final_text_and_reads_stdin() {
    let f = fake().await;
    f.push(Reply::text("from stdin"));
    let env = Env::new(Some(f.base_url()));
    let mut cmd = env.command(&["exec", "--format", "quiet"]);
    cmd.stdin(Stdio::piped());
    let mut child = must(cmd.spawn(), "spawn");
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        must(stdin.write_all(b"prompt on stdin").await, "write");
    }
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "in time"), "wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), "from stdin\n");
    assert!(f.requests()[0].body.to_string().contains("prompt on stdin"));
}

/// Runs `args` with `input` on stdin; returns the output.
async fn run_with_stdin(env: &Env, args: &[&str], input: &[u8]) -> Output {
    let mut cmd = env.command(args);
    cmd.stdin(Stdio::piped());
    let mut child = must(cmd.spawn(), "spawn");
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        must(stdin.write_all(input).await, "write");
    }
    must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "in time"), "wait")
}

#[tokio::test]
async fn the_argument_the_file_and_stdin_all_reach_the_agent_in_that_order() {
    let f = fake().await;
    let env = Env::new(Some(f.base_url()));
    let file = env.cwd().join("notes.txt");
    must(std::fs::write(&file, "FILE-TEXT"), "write file");
    let file_arg = file.display().to_string();

    // `git diff | pier exec "Review this diff"`: both go along.
    f.push(Reply::text("ok"));
    let o = run_with_stdin(&env, &["exec", "--format", "quiet", "Review this diff"], b"STDIN-DIFF").await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let body = f.requests()[0].body.to_string();
    let at = |needle: &str| body.find(needle).unwrap_or_else(|| panic!("{needle} missing from {body}"));
    assert!(at("Review this diff") < at("STDIN-DIFF"), "{body}");

    // All three, as blocks of their own, in order: pier's own agent takes the file as a resource.
    f.push(Reply::text("ok"));
    let o = run_with_stdin(&env, &["exec", "--format", "quiet", "-f", &file_arg, "Summarise"], b"STDIN-TEXT").await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let body = f.requests()[1].body.to_string();
    let at = |needle: &str| body.find(needle).unwrap_or_else(|| panic!("{needle} missing from {body}"));
    assert!(at("Summarise") < at("FILE-TEXT") && at("FILE-TEXT") < at("STDIN-TEXT"), "{body}");

    // An agent without embeddedContext gets the file as text, under its path.
    f.push(Reply::text("ok"));
    let automation = format!("{PIER} agent --profile automation");
    let args = ["exec", "--agent", &automation, "--format", "quiet", "--no-stdin", "-f", &file_arg, "Summarise"];
    let o = run_with_stdin(&env, &args, b"NOT-SENT").await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let body = f.requests()[2].body.to_string();
    assert!(body.contains("Summarise") && body.contains("FILE-TEXT") && body.contains(&file_arg), "{body}");
    assert!(!body.contains("NOT-SENT"), "--no-stdin leaves stdin out: {body}");
}

#[tokio::test]
async fn exit_codes_follow_the_stop_reason() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Finish("content_filter".into()), Step::Done]));
    f.push(Reply::Stream(vec![Step::Text("cut".into()), Step::Finish("length".into()), Step::Done]));
    let env = Env::new(Some(f.base_url()));
    assert_eq!(env.run(&["exec", "--format", "quiet", "x"]).await.status.code(), Some(3), "refusal");
    assert_eq!(env.run(&["exec", "--format", "quiet", "x"]).await.status.code(), Some(4), "max_tokens");
    f.set_fallback(|_| Reply::tool_call("c", "list_dir", "{\"path\": \".\"}"));
    let agent = format!("{PIER} agent --max-turn-requests 2");
    let o = env.run(&["exec", "--agent", &agent, "--format", "json", "x"]).await;
    assert_eq!(o.status.code(), Some(5), "max_turn_requests: {}", stderr(&o));
    assert_eq!(result(&o)["stopReason"], "max_turn_requests");
    let o = env.run(&["exec"]).await;
    assert_eq!(o.status.code(), Some(2), "no prompt is a usage error");
    assert!(stderr(&o).contains("no prompt"), "{}", stderr(&o));
    let o = env.run(&["exec", "--agent", "definitely-not-an-agent-xyz", "hi"]).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("neither a known agent"), "{}", stderr(&o));
}

#[tokio::test]
async fn permissions_are_decided_unattended_by_policy() {
    let f = fake().await;
    let script = |f: &FakeModel| {
        f.push(Reply::tool_call("w1", "write_file", r#"{"path": "out.txt", "content": "written"}"#));
        f.push(Reply::text("done"));
    };
    let env = Env::new(Some(f.base_url()));
    // Default: edits ask, nobody can be asked: rejected, the turn goes on.
    script(&f);
    let o = env.run(&["exec", "--format", "json", "write it"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let perm = lines(&o).into_iter().find(|l| l["type"] == "permission").unwrap_or_default();
    assert_eq!(perm["outcome"]["optionId"], "reject-once", "{perm}");
    assert_eq!(perm["toolCall"]["kind"], "edit");
    assert!(perm["reason"].as_str().is_some_and(|r| r.contains("--non-interactive deny")), "{perm}");
    assert!(!env.cwd().join("out.txt").exists());
    // --approve-all: allowed once, the file is written.
    script(&f);
    let o = env.run(&["exec", "--format", "json", "--approve-all", "write it"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let perm = lines(&o).into_iter().find(|l| l["type"] == "permission").unwrap_or_default();
    assert_eq!(perm["outcome"]["optionId"], "allow-once");
    assert_eq!(std::fs::read_to_string(env.cwd().join("out.txt")).unwrap_or_default(), "written");
    // --non-interactive fail: the run fails with the permission code.
    std::fs::remove_file(env.cwd().join("out.txt")).unwrap_or_else(|e| panic!("{e}"));
    script(&f);
    let o = env.run(&["exec", "--format", "json", "--non-interactive", "fail", "write it"]).await;
    assert_eq!(o.status.code(), Some(6), "{}", stderr(&o));
    assert_eq!(result(&o)["error"]["kind"], "permission_required");
    assert!(!env.cwd().join("out.txt").exists());
}

#[tokio::test]
async fn ctrl_c_runs_the_cancel_handshake_and_leaves_no_process() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Text("thinking".into()), Step::Hang]));
    let env = Env::new(Some(f.base_url()));
    let marker = format!("marker-ctrl-c-{}", std::process::id());
    let agent = marked_agent(&env, &marker, "");
    let child = must(env.command(&["exec", "--format", "json", "--agent", &agent, "long job"]).spawn(), "spawn");
    let pid = child.id().map_or(0, |p| p as i32);
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "the turn started");
    assert!(!processes_with(&marker).is_empty(), "the agent runs");
    must(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGINT), "SIGINT");
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["stopReason"], "cancelled", "{r}");
    assert_eq!(r["error"]["kind"], "cancelled");
    assert_eq!(r["error"]["cancelConfirmed"], true);
    must(tokio::time::timeout(LIMIT, f.wait_for_disconnects(1)).await, "the model stream was dropped");
    assert!(processes_with(&marker).is_empty(), "an agent process survived");
}

#[tokio::test]
async fn an_idle_timeout_cancels_and_exits_124() {
    let f = fake().await;
    f.push(Reply::Hang);
    let env = Env::new(Some(f.base_url()));
    let o = env.run(&["exec", "--format", "json", "--timeout", "0.5", "slow"]).await;
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["stopReason"], "cancelled");
    assert_eq!(r["error"]["kind"], "timeout");
}

#[tokio::test]
async fn a_failure_in_text_mode_is_one_line_naming_the_cause_and_the_next_step() {
    let f = fake().await;
    f.push(Reply::Hang);
    let env = Env::new(Some(f.base_url()));
    let o = env.run(&["exec", "--timeout", "0.5", "slow"]).await;
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    let err = stderr(&o);
    let last: Vec<&str> = err.lines().filter(|l| l.starts_with("pier: ")).collect();
    assert_eq!(last.len(), 1, "{err}");
    assert!(
        last[0].contains("timed out after 0.5s without any update") && last[0].contains("raise --timeout"),
        "{err}"
    );
    assert!(!err.contains("stop reason none"), "{err}");

    // The whole-turn limit says which limit it was.
    f.push(Reply::Hang);
    let o = env.run(&["exec", "--max-time", "0.4", "slow"]).await;
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    assert!(stderr(&o).contains("time limit of 0.4s") && stderr(&o).contains("--max-time"), "{}", stderr(&o));

    // An agent that cannot be started: its cause, no `stop reason none · 0.0s`.
    let o = env.run(&["exec", "--agent", "/nonexistent/agent", "x"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("/nonexistent/agent") && !err.contains("stop reason"), "{err}");
}

#[tokio::test]
async fn an_agent_that_does_not_confirm_a_cancel_is_killed_after_the_grace() {
    let env = Env::new(None);
    // Answers the handshake, then ignores everything: the prompt never ends.
    let script = env.home.path().join("deaf-agent.sh");
    let body = r#"#!/bin/sh
read line; echo '{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":1}}'
read line; echo '{"jsonrpc":"2.0","id":1,"result":{"sessionId":"s"}}'
echo $$ > "$(dirname "$0")/deaf.pid"
exec sleep 300
"#;
    must(std::fs::write(&script, body), "write script");
    must(std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)), "chmod");
    let agent = script.display().to_string();
    let o = env
        .run(&["exec", "--format", "json", "--agent", &agent, "--max-time", "0.3", "--cancel-grace", "0.3", "x"])
        .await;
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["error"]["cancelConfirmed"], false, "{r}");
    assert!(r["error"]["message"].as_str().is_some_and(|m| m.contains("did not confirm the cancel")), "{r}");
    let pgid = std::fs::read_to_string(env.home.path().join("deaf.pid")).unwrap_or_default();
    assert!(!pgid.trim().is_empty());
    assert!(!group_alive(pgid.trim().parse().unwrap_or(0)), "the agent's group survived");
}

#[tokio::test]
async fn an_agent_killed_mid_turn_is_a_clear_failure() {
    let f = fake().await;
    f.push(Reply::Stream(vec![Step::Hang]));
    let env = Env::new(Some(f.base_url()));
    let marker = format!("marker-killed-{}", std::process::id());
    let agent = marked_agent(&env, &marker, "");
    let child = must(env.command(&["exec", "--format", "json", "--agent", &agent, "x"]).spawn(), "spawn");
    must(tokio::time::timeout(LIMIT, f.wait_for_requests(1)).await, "the turn started");
    for pid in processes_with(&marker) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    let o = must(must(tokio::time::timeout(LIMIT, child.wait_with_output()).await, "exit in time"), "wait");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["error"]["kind"], "agent");
    let msg = r["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("closed the connection during session/prompt") && msg.contains("exited"), "{msg}");
}

#[tokio::test]
async fn an_agent_that_writes_garbage_or_exits_gets_a_clear_error() {
    let env = Env::new(None);
    let o = env.run(&["exec", "--format", "json", "--agent", "sh -c 'echo hello world; sleep 30'", "x"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let r = result(&o);
    let msg = r["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("not a JSON-RPC message") && msg.contains("hello world"), "{msg}");
    assert!(lines(&o).iter().any(|l| l["type"] == "protocol_error"));

    let o = env.run(&["exec", "--format", "json", "--agent", "sh -c 'echo going away >&2; exit 3'", "x"]).await;
    assert_eq!(o.status.code(), Some(1));
    let msg = result(&o)["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(msg.contains("during initialize") && msg.contains("going away"), "{msg}");
}

#[tokio::test]
async fn an_unsupported_protocol_version_is_refused() {
    let env = Env::new(None);
    let agent = r#"sh -c 'read l; echo "{\"jsonrpc\":\"2.0\",\"id\":0,\"result\":{\"protocolVersion\":2}}"; sleep 30'"#;
    let o = env.run(&["exec", "--format", "json", "--agent", agent, "x"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let msg = result(&o)["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(msg.contains("protocol version 2") && msg.contains("R028"), "{msg}");
}

#[tokio::test]
async fn pier_prompt_continues_a_session_with_pier_s_own_agent_and_says_plainly_when_an_agent_cannot() {
    let f = fake().await;
    f.push(Reply::text("first answer"));
    f.push(Reply::text("second answer"));
    let env = Env::new(Some(f.base_url()));
    let o = env.run(&["prompt", "-s", "work", "--format", "json", "hello"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let sid = result(&o)["sessionId"].as_str().unwrap_or_default().to_owned();
    let listed = env.run(&["sessions", "list", "--json"]).await;
    let rec: Value = must(serde_json::from_str(stdout(&listed).trim()), "a record");
    assert_eq!(
        (rec["name"].as_str(), rec["session_id"].as_str(), rec["turns"].as_u64()),
        (Some("work"), Some(sid.as_str()), Some(1))
    );
    // pier's own agent (editor profile) continues the conversation in a new process.
    let o = env.run(&["prompt", "-s", "work", "--format", "json", "again"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(result(&o)["sessionId"], sid.as_str());
    assert_eq!(result(&o)["text"], "second answer");
    let second = f.requests()[1].body.to_string();
    assert!(second.contains("hello") && second.contains("first answer"), "the history went along: {second}");
    let o = env.run(&["sessions", "rm", "work"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&env.run(&["sessions", "list"]).await), "");

    // The automation profile cannot load sessions: refused up front, before any session
    // or record exists that could never be continued.
    let automation = format!("{} agent --profile automation", env!("CARGO_BIN_EXE_pier"));
    let o = env.run(&["prompt", "-s", "auto", "--agent", &automation, "--format", "json", "hello"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let msg = result(&o)["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(msg.contains("cannot continue sessions") && msg.contains("pier exec"), "{msg}");
    assert_eq!(f.requests().len(), 2, "no conversation was started");
    assert_eq!(stdout(&env.run(&["sessions", "list"]).await), "", "no record was stored");
}

#[tokio::test]
async fn pier_prompt_continues_a_session_with_an_agent_that_can() {
    let env = Env::new(None);
    let agent = format!("python3 {}", fixture("resumable_agent.py").display());
    let o = env.run(&["prompt", "-s", "s1", "--format", "json", "--agent", &agent, "one"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(result(&o)["text"], "turn 1: one");
    let o = env.run(&["prompt", "-s", "s1", "--format", "json", "--agent", &agent, "two"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let r = result(&o);
    assert_eq!(r["text"], "turn 2: two", "the session went on where it was");
    // Replayed history is not shown as new output.
    assert_eq!(lines(&o).iter().filter(|l| l["type"] == "session_update").count(), 1);
    let shown = env.run(&["sessions", "show", "s1", "--agent", &agent]).await;
    assert!(stdout(&shown).contains("\"turns\": 2"), "{}", stdout(&shown));
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures").join(name)
}

#[tokio::test]
async fn authentication_uses_an_env_var_method_when_its_variables_are_set() {
    let mut env = Env::new(None);
    let agent = format!("python3 {}", fixture("auth_agent.py").display());
    let o = env.run(&["exec", "--format", "json", "--agent", &agent, "hi"]).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let msg = result(&o)["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(
        msg.contains("requires authentication") && msg.contains("api-key (API key)") && msg.contains("browser"),
        "{msg}"
    );
    env.vars.push(("MY_AGENT_KEY".into(), "secret".into()));
    let o = env.run(&["exec", "--format", "json", "--agent", &agent, "hi"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(result(&o)["text"], "authenticated");
}

#[tokio::test]
async fn exec_text_renders_tool_lines_diffs_once_and_the_plan() {
    let env = Env::new(None);
    let agent = format!("python3 {}", fixture("editor_surface_agent.py").display());
    let o = env.run(&["exec", "--agent", &agent, "go"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // stdout is a pipe: no colour, no in-place rewriting, one line per status change.
    let expected = "\
pondering the edit
plan:
  [x] Read a.txt
  [~] Fix line 5
  [ ] Add notes
· edit  Edit src/a.txt [pending]
… edit  Edit src/a.txt [in_progress]
✓ edit  Edit src/a.txt [completed]
--- a/src/a.txt
+++ b/src/a.txt
@@ -2,7 +2,7 @@
 line 2
 line 3
 line 4
-line 5
+line five
 line 6
 line 7
 line 8
✓ edit  Write notes.md [completed]
--- /dev/null
+++ b/notes.md
@@ -0,0 +1,2 @@
+# Notes
+new
… execute Run ls [in_progress]
✓ execute Run ls [completed]
All done.
";
    assert_eq!(stdout(&o), expected);
    assert!(!stdout(&o).contains('\x1b'), "no escape codes on a pipe");

    // --verbose shows the command's output, once.
    let o = env.run(&["exec", "--verbose", "--agent", &agent, "go"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("✓ execute Run ls [completed]\n  COMMAND-OUTPUT-1\n  COMMAND-OUTPUT-2\nAll done.\n"), "{out}");
    assert_eq!(out.matches("COMMAND-OUTPUT-1").count(), 1, "{out}");
    assert_eq!(out.matches("+line five").count(), 1, "{out}");

    // --format json stays raw: the updates exactly as the agent sent them.
    let o = env.run(&["exec", "--format", "json", "--agent", &agent, "go"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let updates: Vec<Value> =
        lines(&o).into_iter().filter(|l| l["type"] == "session_update").map(|l| l["update"].clone()).collect();
    assert_eq!(updates.len(), 9, "{updates:?}");
    let diff = &updates[2]["content"][0];
    assert_eq!(diff["type"], "diff");
    assert_eq!(diff["path"], format!("{}/src/a.txt", env.cwd().display()));
    assert!(diff["oldText"].as_str().is_some_and(|t| t.contains("line 5\n")), "{diff}");
    assert!(diff["newText"].as_str().is_some_and(|t| t.contains("line five\n")), "{diff}");
    assert_eq!(updates[5]["content"][0]["oldText"], Value::Null);
    assert!(!stdout(&o).contains("@@"), "no rendered diff in json");
}

#[tokio::test]
async fn exec_text_shows_the_diffs_of_pier_editor_profile() {
    let f = fake().await;
    f.push(Reply::Stream(vec![
        Step::ToolCallStart { index: 0, id: "w".into(), name: "write_file".into() },
        Step::ToolCallArgs { index: 0, fragment: r##"{"path": "notes.md", "content": "# Notes\nnew\n"}"##.into() },
        Step::ToolCallStart { index: 1, id: "e".into(), name: "edit_file".into() },
        Step::ToolCallArgs {
            index: 1,
            fragment: r#"{"path": "src/a.txt", "old_text": "two", "new_text": "2"}"#.into(),
        },
        Step::Finish("tool_calls".into()),
        Step::Done,
    ]));
    f.push(Reply::text("Edited."));
    let env = Env::new(Some(f.base_url()));
    must(std::fs::create_dir_all(env.cwd().join("src")), "mkdir");
    must(std::fs::write(env.cwd().join("src/a.txt"), "one\ntwo\nthree\n"), "write a.txt");
    let agent = format!("{PIER} agent --profile editor");
    let o = env.run(&["exec", "--agent", &agent, "--approve-all", "edit"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    for (diff, line) in [
        ("--- /dev/null\n+++ b/notes.md\n@@ -0,0 +1,2 @@\n+# Notes\n+new\n", "✓ edit  Write notes.md [completed]\n"),
        (
            "--- a/src/a.txt\n+++ b/src/a.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+2\n three\n",
            "✓ edit  Edit src/a.txt [completed]\n",
        ),
    ] {
        assert_eq!(out.matches(diff).count(), 1, "{out}");
        assert!(out.contains(&format!("{line}{diff}")), "the diff follows the completed line: {out}");
    }
    assert!(out.ends_with("Edited.\n"), "{out}");
}

fn test_model() -> PathBuf {
    let path = std::env::var("PIER_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-peers/models/smollm2.q8_0.gguf")
    });
    assert!(path.is_file(), "the embedded model is missing at {}; run scripts/test", path.display());
    path
}

#[tokio::test]
async fn a_missing_model_file_is_named_and_the_local_answer_limit_is_configurable() {
    let mut env = Env::new(None);
    env.vars.push(("PIER_LOCAL_MODEL".into(), "/nonexistent/dir/model.gguf".into()));
    let o = env.run(&["exec", "hello"]).await;
    assert_ne!(o.status.code(), Some(0));
    let err = stderr(&o);
    assert!(err.contains("/nonexistent/dir/model.gguf") && err.contains("does not exist"), "{err}");

    // `[providers.local] max_tokens` caps the embedded model's answer.
    let mut env = Env::new(None);
    env.vars.push(("PIER_LOCAL_MODEL".into(), test_model().display().to_string()));
    must(std::fs::write(env.work.path().join("pier.toml"), "[providers.local]\nmax_tokens = 3\n"), "pier.toml");
    let o = env
        .run_within(LIMIT * 3, &["exec", "--format", "json", "Write a 250-word story about a lighthouse keeper."])
        .await;
    assert_eq!(o.status.code(), Some(4), "max_tokens: {}", stderr(&o));
    assert_eq!(result(&o)["stopReason"], "max_tokens");
}
