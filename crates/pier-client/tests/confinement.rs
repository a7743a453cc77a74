//! Issue #16 items 2, 3 and 5 on the client's methods: `fs/*` open files beneath
//! a root's handle (no planted temporary name followed, no FIFO hang), and a
//! terminal's detached processes end with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use pier_acp::schema::Error;
use pier_acp::{Connection, ConnectionConfig, Handler, RequestCx, RequestError};
use pier_client::ClientPolicy;
use pier_client::handler::{ClientHandler, ClientState, event_channel};
use pier_client::sandbox::Sandbox;
use serde_json::{Value, json};

struct Quiet;
impl Handler for Quiet {
    fn request(&self, _: RequestCx, _: String, _: Value) -> BoxFuture<'static, Result<Value, Error>> {
        Box::pin(async { Err(Error::method_not_found()) })
    }
    fn notification(&self, _: &Connection, _: &str, _: Value) {}
}

struct Setup {
    dir: tempfile::TempDir,
    agent: Connection,
    _state: Arc<ClientState>,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let cwd = dir.path().canonicalize().unwrap_or_else(|e| panic!("{e}"));
    let sandbox = Sandbox::new(&cwd, &[]).unwrap_or_else(|e| panic!("{e}"));
    let (tx, _events) = event_channel();
    let mut policy = ClientPolicy::default();
    policy.approve_all();
    let state = Arc::new(ClientState::new(sandbox, cwd, true, true, policy, false, tx));
    let (a, b) = tokio::io::duplex(1 << 20);
    let (ar, aw) = tokio::io::split(a);
    let (br, bw) = tokio::io::split(b);
    let _client = Connection::spawn(ar, aw, Arc::new(ClientHandler(state.clone())), ConnectionConfig::default());
    let agent = Connection::spawn(br, bw, Arc::new(Quiet), ConnectionConfig::default());
    Setup { dir, agent, _state: state }
}

impl Setup {
    fn root(&self) -> PathBuf {
        self.dir.path().canonicalize().unwrap_or_else(|e| panic!("{e}"))
    }
    async fn call(&self, method: &str, params: Value) -> Result<Value, Error> {
        match tokio::time::timeout(Duration::from_secs(10), self.agent.request::<_, Value>(method, &params)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(RequestError::Remote(e))) => Err(e),
            Ok(Err(e)) => panic!("{method}: {e}"),
            Err(_) => panic!("{method} did not answer"),
        }
    }
}

fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).unwrap_or("");
    !state.is_empty() && state != "Z"
}

/// Bounded poll of /proc while the kernel finishes a SIGKILL; no sleep.
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

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Issue #16 item 2: `fs/write_text_file` does not follow a symlink planted at the old temporary name.
#[tokio::test]
async fn issue16_write_text_file_ignores_a_planted_temporary_name() {
    let s = setup();
    let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(outside.path().join("victim"), "safe").unwrap_or_else(|e| panic!("{e}"));
    let planted = s.root().join(format!(".f.txt.pier-{}.tmp", std::process::id()));
    std::os::unix::fs::symlink(outside.path().join("victim"), planted).unwrap_or_else(|e| panic!("{e}"));
    let target = s.root().join("f.txt");
    let r = s.call("fs/write_text_file", json!({"sessionId": "s", "path": target, "content": "pwned"})).await;
    assert_eq!(r.ok(), Some(json!({})));
    assert_eq!(read(&outside.path().join("victim")), "safe");
    assert_eq!(read(&target), "pwned");
}

/// Issue #16 item 3: `fs/read_text_file` of a FIFO is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue16_read_text_file_refuses_a_fifo() {
    let s = setup();
    let fifo = s.root().join("pipe");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap_or_else(|e| panic!("{e}"));
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        s.agent.request::<_, Value>("fs/read_text_file", &json!({"sessionId": "s", "path": fifo})),
    )
    .await;
    match r {
        Ok(Err(RequestError::Remote(e))) => assert!(e.message.contains("FIFO") || format!("{e:?}").contains("FIFO")),
        Ok(other) => panic!("a FIFO was read: {other:?}"),
        Err(_) => {
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
            panic!("fs/read_text_file hung on a FIFO");
        }
    }
}

/// Issue #16 item 5: a process a terminal's command detaches (`setsid`) does not outlive the terminal.
#[tokio::test]
async fn issue16_a_detached_process_does_not_outlive_its_terminal() {
    let s = setup();
    let script = "setsid sh -c 'echo $$ > detached.pid; exec sleep 300' & \
                  while [ ! -s detached.pid ]; do :; done; echo ready";
    let create = json!({"sessionId": "s", "command": "sh", "args": ["-c", script], "cwd": s.root()});
    let id = s.call("terminal/create", create).await.unwrap_or_default()["terminalId"].clone();
    let exit = s.call("terminal/wait_for_exit", json!({"sessionId": "s", "terminalId": id})).await;
    assert_eq!(exit.ok().map(|v| v["exitCode"].clone()), Some(json!(0)));
    let pid: i32 = read(&s.root().join("detached.pid")).trim().parse().unwrap_or_else(|e| panic!("{e}"));
    let released = s.call("terminal/release", json!({"sessionId": "s", "terminalId": id})).await;
    assert!(released.is_ok(), "{released:?}");
    assert!(gone(pid).await, "the detached process {pid} outlived its terminal");
}
