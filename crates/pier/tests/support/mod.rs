//! Drives the real `pier` binary over pipes.
//!
//! Every byte `pier agent` writes to stdout is checked: each line must be one
//! JSON-RPC 2.0 frame (a request, a notification or a response). Anything else
//! fails the test at the next read, whatever the test was about.

#![allow(dead_code)]

pub mod browser;
pub mod host;
pub mod serve;

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// Bound on every wait in these tests.
pub const LIMIT: Duration = Duration::from_secs(20);

pub struct PierProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    frames: mpsc::UnboundedReceiver<Result<Value, String>>,
    next_id: i64,
    pub pid: i32,
    stderr: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    pub home: tempfile::TempDir,
    pub workdir: tempfile::TempDir,
    data: PathBuf,
}

/// How to start `pier agent`.
#[derive(Default)]
pub struct Options {
    pub base_url: Option<String>,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Contents of `./pier.toml` in the agent's working directory.
    pub pier_toml: Option<String>,
    /// Collect stderr into [`PierProcess::stderr`] instead of passing it through.
    pub capture_stderr: bool,
    /// `PIER_HOME`, to share sessions with an earlier process [default: a fresh one].
    pub pier_home: Option<PathBuf>,
    /// A descriptor limit (soft and hard) to run pier under.
    pub nofile: Option<u32>,
}

impl Options {
    pub fn model(base_url: String) -> Options {
        Options { base_url: Some(base_url), ..Options::default() }
    }
    pub fn arg(mut self, a: &str) -> Options {
        self.args.push(a.to_owned());
        self
    }
    pub fn env(mut self, k: &str, v: &str) -> Options {
        self.env.push((k.to_owned(), v.to_owned()));
        self
    }
}

/// A `pier.toml` with fast retries and timeouts, for the provider `fake`.
pub fn fast_toml(base_url: &str, idle_ms: u64, retries: u32) -> String {
    format!(
        "provider = \"fake\"\n[providers.fake]\nbase_url = \"{base_url}\"\nmodel = \"fake-model\"\nidle_timeout_ms = {idle_ms}\nmax_retries = {retries}\nretry_base_delay_ms = 5\n"
    )
}

/// Checks that a stdout line is exactly one JSON-RPC 2.0 frame.
pub fn check_frame(line: &str) -> Result<Value, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("stdout carried a non-JSON line ({e}): {line:?}"))?;
    let obj = v.as_object().ok_or_else(|| format!("stdout carried a non-object: {line}"))?;
    if obj.get("jsonrpc") != Some(&json!("2.0")) {
        return Err(format!("stdout frame without jsonrpc 2.0: {line}"));
    }
    let is_request = obj.get("method").is_some_and(Value::is_string);
    let is_response = obj.contains_key("id") && (obj.contains_key("result") ^ obj.contains_key("error"));
    if !(is_request || is_response) {
        return Err(format!("stdout frame is neither a message nor a response: {line}"));
    }
    for key in obj.keys() {
        if !["jsonrpc", "id", "method", "params", "result", "error"].contains(&key.as_str()) {
            return Err(format!("stdout frame has a stray field {key}: {line}"));
        }
    }
    Ok(v)
}

impl PierProcess {
    pub async fn spawn(opts: Options) -> PierProcess {
        let home = must(tempfile::tempdir(), "temp home");
        let workdir = must(tempfile::tempdir(), "temp workdir");
        if let Some(toml) = &opts.pier_toml {
            must(std::fs::write(workdir.path().join("pier.toml"), toml), "write pier.toml");
        }
        let mut cmd = match opts.nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c").arg(format!("ulimit -n {n} && exec \"$0\" \"$@\"")).arg(env!("CARGO_BIN_EXE_pier"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_pier")),
        };
        cmd.arg("agent")
            .args(&opts.args)
            .current_dir(workdir.path())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", home.path())
            .env("PIER_HOME", opts.pier_home.clone().unwrap_or_else(|| home.path().join("data")))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(if opts.capture_stderr { Stdio::piped() } else { Stdio::inherit() })
            .process_group(0)
            .kill_on_drop(true);
        if let Some(url) = &opts.base_url {
            cmd.env("PIER_BASE_URL", url).env("PIER_MODEL", "fake-model").env("PIER_API_KEY", "sk-test");
        }
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let mut child = must(cmd.spawn(), "spawn pier");
        let pid = child.id().map_or(0, |p| p as i32);
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let sink = stderr.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    sink.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(&buf[..n]);
                }
            });
        }
        let (tx, frames) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let Some(stdout) = stdout else { return };
            let mut reader = BufReader::new(stdout);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let result = if line.last() != Some(&b'\n') {
                    Err(format!("stdout ended with an unterminated line: {:?}", String::from_utf8_lossy(&line)))
                } else {
                    match std::str::from_utf8(&line[..line.len() - 1]) {
                        Ok(text) => check_frame(text),
                        Err(_) => Err("stdout carried invalid UTF-8".to_owned()),
                    }
                };
                if tx.send(result).is_err() {
                    return;
                }
            }
        });
        let data = opts.pier_home.clone().unwrap_or_else(|| home.path().join("data"));
        PierProcess { child, stdin, frames, next_id: 0, pid, stderr, home, workdir, data }
    }

    /// What the process wrote to stderr so far (with `capture_stderr`).
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    pub fn cwd(&self) -> PathBuf {
        self.workdir.path().to_owned()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.data.clone()
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        let stdin = self.stdin.as_mut().unwrap_or_else(|| panic!("stdin already closed"));
        must(stdin.write_all(bytes).await, "write to pier");
        must(stdin.flush().await, "flush to pier");
    }

    pub async fn send(&mut self, v: &Value) {
        let mut bytes = must(serde_json::to_vec(v), "encode");
        bytes.push(b'\n');
        self.send_raw(&bytes).await;
    }

    pub async fn request(&mut self, method: &str, params: Value) -> i64 {
        self.next_id += 1;
        let id = self.next_id;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})).await;
        id
    }

    pub async fn notify(&mut self, method: &str, params: Value) {
        self.send(&json!({"jsonrpc": "2.0", "method": method, "params": params})).await;
    }

    /// The next frame from stdout.
    pub async fn next_frame(&mut self) -> Value {
        match tokio::time::timeout(LIMIT, self.frames.recv()).await {
            Err(_) => panic!("no frame from pier within {LIMIT:?}"),
            Ok(None) => panic!("pier closed stdout"),
            Ok(Some(Err(violation))) => panic!("{violation}"),
            Ok(Some(Ok(v))) => v,
        }
    }

    /// Frames up to the response with `id`: the notifications before it, and it.
    pub async fn read_until_response(&mut self, id: impl Into<Value>) -> (Vec<Value>, Value) {
        let id = id.into();
        let mut notes = Vec::new();
        loop {
            let frame = self.next_frame().await;
            if frame.get("method").is_none() && frame.get("id") == Some(&id) {
                return (notes, frame);
            }
            notes.push(frame);
        }
    }

    /// Sends a request and returns its response.
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.request(method, params).await;
        self.read_until_response(id).await.1
    }

    pub async fn initialize(&mut self) -> Value {
        let r = self.call("initialize", json!({"protocolVersion": 1, "clientCapabilities": {}})).await;
        assert!(r.get("result").is_some(), "initialize failed: {r}");
        r
    }

    pub async fn new_session(&mut self) -> String {
        let cwd = self.cwd();
        let r = self.call("session/new", json!({"cwd": cwd, "mcpServers": []})).await;
        match r.pointer("/result/sessionId").and_then(Value::as_str) {
            Some(id) => id.to_owned(),
            None => panic!("session/new failed: {r}"),
        }
    }

    pub async fn start(opts: Options) -> (PierProcess, String) {
        let mut p = PierProcess::spawn(opts).await;
        p.initialize().await;
        let sid = p.new_session().await;
        (p, sid)
    }

    pub async fn prompt(&mut self, sid: &str, text: &str) -> i64 {
        self.request("session/prompt", json!({"sessionId": sid, "prompt": [{"type": "text", "text": text}]})).await
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// SIGKILLs pier itself (no destructor of its runs): what it started must end anyway.
    pub fn sigkill(&mut self) {
        let _ = self.child.start_kill();
    }

    /// Waits for the process to exit, after which stdout must have ended cleanly.
    pub async fn wait_exit(&mut self) -> ExitStatus {
        let status = match tokio::time::timeout(LIMIT, self.child.wait()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => panic!("wait: {e}"),
            Err(_) => panic!("pier did not exit within {LIMIT:?}"),
        };
        // Drain what is left: every remaining line must still be a frame.
        while let Ok(Some(frame)) = tokio::time::timeout(LIMIT, self.frames.recv()).await {
            if let Err(violation) = frame {
                panic!("{violation}");
            }
        }
        status
    }

    /// True if any process of pier's process group is still alive.
    pub fn group_alive(&self) -> bool {
        process_exists(-self.pid)
    }
}

#[allow(unsafe_code)]
fn process_exists(pid: i32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only reports whether the target exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// The binary under test; `PIER_TEST_EXE` names another build (an older commit's, to show
/// that a regression test fails there, or a copy when the target directory is shared).
pub fn pier_exe() -> String {
    std::env::var("PIER_TEST_EXE").unwrap_or_else(|_| env!("CARGO_BIN_EXE_pier").to_owned())
}

/// `pier ARGS` run in `dir` with exactly `vars` for its environment, in its own
/// process group, stdin closed, stdout and stderr piped; killed if dropped.
pub fn pier_command(dir: &Path, vars: &[(String, String)], args: &[&str]) -> Command {
    let mut cmd = command(Path::new(&pier_exe()), dir, vars);
    cmd.args(args);
    cmd
}

/// `program` run in `dir` with exactly `vars` for its environment, in its own
/// process group, stdin closed, stdout and stderr piped; killed if dropped.
pub fn command(program: &Path, dir: &Path, vars: &[(String, String)]) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(dir)
        .env_clear()
        .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    cmd
}

pub fn must<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: {e}"),
    }
}

/// The texts of the `agent_message_chunk` updates among `notes`, for session `sid`.
pub fn agent_texts(notes: &[Value], sid: &str) -> Vec<String> {
    notes
        .iter()
        .filter(|n| n["method"] == "session/update" && n["params"]["sessionId"] == sid)
        .filter(|n| n["params"]["update"]["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|n| n["params"]["update"]["content"]["text"].as_str().map(str::to_owned))
        .collect()
}

pub fn stop_reason(response: &Value) -> &str {
    response
        .pointer("/result/stopReason")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no stopReason in {response}"))
}

pub fn error_code(response: &Value) -> i64 {
    response.pointer("/error/code").and_then(Value::as_i64).unwrap_or_else(|| panic!("not an error: {response}"))
}

pub fn read_log(dir: &Path, sid: &str) -> Vec<Value> {
    let path = dir.join("sessions").join(format!("{sid}.jsonl"));
    let text = must(std::fs::read_to_string(&path), "read the session log");
    text.lines().map(|l| must(serde_json::from_str(l), "a log line is JSON")).collect()
}

/// The TypeScript SDK's example agent as a command line; `scripts/test` installs it.
pub fn sdk_agent() -> String {
    let path = std::env::var("PIER_TEST_SDK_AGENT").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/test-peers/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js")
    });
    assert!(
        path.is_file(),
        "the TypeScript SDK example agent is not installed at {}; run scripts/test, which installs it",
        path.display()
    );
    format!("node {}", path.display())
}

/// Where `scripts/test` installs codex-acp, claude-agent-acp and gemini-cli (npm's `.bin`).
pub fn interop_bin() -> PathBuf {
    let bin = std::env::var("PIER_TEST_INTEROP_BIN").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-peers/node_modules/.bin")
    });
    assert!(bin.join("codex-acp").exists(), "{} has no codex-acp; run scripts/test, which installs it", bin.display());
    bin
}

/// A fake-model reply that echoes the last user message as `done: TEXT`.
pub fn echo(body: &Value) -> pier_fake_model::Reply {
    let text = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_owned();
    pier_fake_model::Reply::text(&format!("done: {text}"))
}

/// Whether a live (non-zombie) process is in process group `pgid`.
pub fn group_alive(pgid: i32) -> bool {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten().any(|e| {
                let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                let fields: Vec<String> = stat
                    .rsplit_once(')')
                    .map(|(_, rest)| rest.split_whitespace().map(str::to_owned).collect())
                    .unwrap_or_default();
                fields.len() > 2 && fields[2] == pgid.to_string() && fields[0] != "Z"
            })
        })
        .unwrap_or(false)
}
