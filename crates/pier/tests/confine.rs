//! Agents run confined (issue #29): a hostile agent inside a `pier run` task tries each escape
//! with its own system calls; under `sandbox = "strict"` none works and the host, its store and
//! the other tasks are untouched; with `sandbox = "off"` every one works, so the test can fail.

mod support;

use std::collections::HashMap;
use std::path::Path;

use support::host::{Host, lines, stderr};
use support::must;

/// A loopback listener standing for a service of the host (its database, its HTTP API), and
/// one standing for a host not on the task's allowlist: each counts who reached it.
struct Listener {
    port: u16,
    reached: tokio::sync::watch::Receiver<usize>,
    _task: tokio::task::JoinHandle<()>,
}

async fn listener() -> Listener {
    let l = must(tokio::net::TcpListener::bind("127.0.0.1:0").await, "bind");
    let port = must(l.local_addr(), "addr").port();
    let (tx, reached) = tokio::sync::watch::channel(0);
    let task = tokio::spawn(async move {
        while let Ok((conn, _)) = l.accept().await {
            tx.send_modify(|n| *n += 1);
            drop(conn);
        }
    });
    Listener { port, reached, _task: task }
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name).display().to_string()
}

/// Processes of this machine whose command line holds `needle` (the daemon's token).
fn processes_with(needle: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

struct Outcome {
    /// escape name → "ok" or "blocked (…)".
    report: HashMap<String, String>,
    tasks: HashMap<String, pier_host::TaskRow>,
    daemons: Vec<i32>,
    loopback_reached: usize,
    blocked_reached: usize,
    outside_written: bool,
    stderr: String,
    /// `pier show` of the escape task.
    shown: String,
}

async fn hostile_run(level: &str) -> Outcome {
    let h = Host::new(None);
    let (service, blocked) = (listener().await, listener().await);
    for dir in ["work", "other", "data"] {
        must(std::fs::create_dir_all(h.path(dir)), "dir");
    }
    h.write("other/secret.txt", "another task's secret");
    h.write("data/serve.token", "the server's token");
    let token = format!("{:016x}", fastrand::u64(..));
    let targets = serde_json::json!({
        "secret": h.path("other/secret.txt"),
        "token": h.path("data/serve.token"),
        "store": h.path("data/pier.db"),
        "outside": h.path("other/escaped.txt"),
        "listener": ["127.0.0.1", service.port],
        "blocked": format!("127.0.0.1:{}", blocked.port),
        "pier_pid": std::process::id(),
        "daemon": token,
    });
    let hostile = format!("python3 {}", fixture("hostile_agent.py"));
    let plan = h.write(
        "plan.toml",
        &format!(
            "[defaults]\nagent = \"{hostile}\"\nsandbox = \"{level}\"\nmax_attempts = 1\ncwd = \"work\"\n\n\
             [[tasks]]\nid = \"escape\"\nprompt = '''{targets}'''\nnetwork = [\"example.invalid:443\"]\n\n\
             [[tasks]]\nid = \"hog\"\nprompt = '''{{\"hog\": 536870912}}'''\nlimits = {{ memory = \"64M\" }}\n\n\
             [[tasks]]\nid = \"forks\"\nprompt = '''{{\"forks\": 64}}'''\nlimits = {{ pids = 16 }}\n\n\
             [[tasks]]\nid = \"bystander\"\nagent = \"python3 {pid}\"\ncwd = \"other\"\nprompt = \"x\"\n",
            pid = fixture("pid_agent.py"),
        ),
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "confine"]).await;
    let shown = h.run(&["show", "confine", "escape"]).await;
    let store = h.store();
    let run = lines(&o).last().and_then(|l| l["run"].as_str().map(str::to_owned)).unwrap_or_default();
    let tasks: HashMap<String, pier_host::TaskRow> =
        must(pier_host::TaskStore::tasks(&store, &run), "tasks").into_iter().map(|t| (t.id.clone(), t)).collect();
    let report = tasks
        .get("escape")
        .and_then(|t| t.result.clone())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect();
    let daemons = processes_with(&format!("hostile-daemon-{token}"));
    let outcome = Outcome {
        report,
        tasks,
        daemons: daemons.clone(),
        loopback_reached: *service.reached.borrow(),
        blocked_reached: *blocked.reached.borrow(),
        outside_written: h.path("other/escaped.txt").exists(),
        stderr: stderr(&o),
        shown: String::from_utf8_lossy(&shown.stdout).into_owned(),
    };
    for pid in daemons {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    assert_eq!(
        std::fs::read_to_string(h.path("other/secret.txt")).unwrap_or_default(),
        "another task's secret",
        "the other task's files are untouched"
    );
    outcome
}

const ESCAPES: &[&str] = &[
    "read_secret",
    "read_token",
    "read_store",
    "write_outside",
    "connect_loopback",
    "reach_blocked_host",
    "signal_host",
    "start_daemon",
];

#[tokio::test]
async fn under_strict_a_hostile_agent_escapes_nothing_and_the_host_goes_on() {
    let o = hostile_run("strict").await;
    let escape = &o.tasks["escape"];
    assert_eq!(escape.state, pier_host::TaskState::Completed, "{:?} {}", escape.error, o.stderr);
    for name in ESCAPES.iter().filter(|n| **n != "start_daemon") {
        let said = o.report.get(*name).cloned().unwrap_or_default();
        assert!(said.starts_with("blocked"), "{name} worked under strict: {said} (report {:?})", o.report);
    }
    assert!(!o.outside_written, "nothing was written outside the workspace");
    assert_eq!((o.loopback_reached, o.blocked_reached), (0, 0), "no connection reached the host's listeners");
    assert!(o.daemons.is_empty(), "the setsid daemon did not outlive its attempt: {:?}", o.daemons);
    let hog = &o.tasks["hog"];
    assert_eq!(hog.state, pier_host::TaskState::Failed, "{}", o.stderr);
    let error = hog.error.clone().unwrap_or_default();
    assert!(error.contains("memory limit (64M)"), "the failure names the limit: {error}");
    let forks = &o.tasks["forks"];
    assert_eq!(forks.state, pier_host::TaskState::Failed, "{}", o.stderr);
    let error = forks.error.clone().unwrap_or_default();
    assert!(error.contains("limit of 16 processes"), "the failure names the limit: {error}");
    assert_eq!(o.tasks["bystander"].state, pier_host::TaskState::Completed, "the other task ran: {}", o.stderr);
    assert!(o.shown.contains("sandbox: strict; network also to example.invalid:443"), "{}", o.shown);
    assert!(o.shown.contains("this machine enforces landlock"), "{}", o.shown);
}

#[tokio::test]
async fn under_workspace_files_are_confined_and_the_network_is_the_machine_s() {
    let o = hostile_run("workspace").await;
    for name in ["read_secret", "read_token", "read_store", "write_outside", "signal_host"] {
        let said = o.report.get(name).cloned().unwrap_or_default();
        assert!(said.starts_with("blocked"), "{name} worked under workspace: {said}");
    }
    for name in ["connect_loopback", "reach_blocked_host"] {
        assert_eq!(o.report.get(name).map(String::as_str), Some("ok"), "{name}: {:?}", o.report);
    }
    assert!(!o.outside_written && o.daemons.is_empty());
}

#[tokio::test]
async fn with_sandbox_off_every_escape_of_the_same_agent_works() {
    let o = hostile_run("off").await;
    for name in ESCAPES {
        let said = o.report.get(*name).cloned().unwrap_or_default();
        assert_eq!(said, "ok", "{name} (report {:?}) {}", o.report, o.stderr);
    }
    assert!(o.outside_written);
    assert!(o.loopback_reached >= 1 && o.blocked_reached >= 1);
    assert!(!o.daemons.is_empty(), "unconfined, the setsid daemon outlived its attempt");
    assert_eq!(o.tasks["hog"].state, pier_host::TaskState::Completed, "no limit applies with sandbox = off");
    assert_eq!(o.tasks["forks"].state, pier_host::TaskState::Completed, "no limit applies with sandbox = off");
}

/// The real peers each answer a task under `strict`: their model traffic leaves the jail only
/// through pier's proxy, to the fake model the plan's `network` names; pier's own agent and the
/// TypeScript SDK example agent (no model) run confined too.
#[tokio::test]
async fn the_real_peers_answer_tasks_confined_with_model_traffic_through_the_proxy() {
    use pier_fake_model::{FakeModel, Reply};
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| Reply::text("Hello from the jail."));
    let h = Host::new(Some(f.base_url()));
    let fake = f.base_url().split("://").nth(1).and_then(|r| r.split('/').next()).unwrap_or_default().to_owned();
    let mut agents = String::new();
    for name in ["codex", "claude", "gemini"] {
        let scratch = h.path(&format!("peer-{name}"));
        must(std::fs::create_dir_all(&scratch), "scratch");
        let peer =
            must(pier_fake_model::peers::setup(name, &support::interop_bin(), &scratch, &f.base_url()), "peer setup");
        let mut words = peer.command.split_whitespace();
        let program = words.next().unwrap_or_default();
        let args: Vec<String> = words.map(|w| format!("{w:?}")).collect();
        let env: Vec<String> = peer.env.iter().map(|(k, v)| format!("{k} = {v:?}")).collect();
        agents.push_str(&format!(
            "[agents.{name}]\ncommand = {program:?}\nargs = [{}]\nenv = {{ {} }}\n\n",
            args.join(", "),
            env.join(", ")
        ));
    }
    h.write("pier.toml", &agents);
    let sdk = support::sdk_agent();
    let plan = h.write(
        "plan.toml",
        &format!(
            "[defaults]\nsandbox = \"strict\"\nnetwork = [\"{fake}\"]\nmax_attempts = 1\ntimeout = 60\n\n\
             [[tasks]]\nid = \"codex\"\nagent = \"codex\"\nprompt = \"Say hello.\"\n\n\
             [[tasks]]\nid = \"claude\"\nagent = \"claude\"\nprompt = \"Say hello.\"\n\n\
             [[tasks]]\nid = \"gemini\"\nagent = \"gemini\"\nprompt = \"Say hello.\"\n\n\
             [[tasks]]\nid = \"pier\"\nagent = \"pier\"\nprompt = \"Say hello.\"\n\n\
             [[tasks]]\nid = \"sdk\"\nagent = \"{sdk}\"\nprompt = \"fix the config\"\npermissions = {{ edit = \"allow\" }}\n"
        ),
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--concurrency", "5"]).await;
    let run = lines(&o).last().and_then(|l| l["run"].as_str().map(str::to_owned)).unwrap_or_default();
    let tasks: HashMap<String, pier_host::TaskRow> =
        must(pier_host::TaskStore::tasks(&h.store(), &run), "tasks").into_iter().map(|t| (t.id.clone(), t)).collect();
    for id in ["codex", "claude", "gemini", "pier"] {
        let t = &tasks[id];
        assert_eq!(t.state, pier_host::TaskState::Completed, "{id}: {:?}\n{}", t.error, stderr(&o));
        assert!(t.result.as_deref().unwrap_or_default().contains("Hello from the jail."), "{id}: {:?}", t.result);
    }
    let sdk = &tasks["sdk"];
    assert!(sdk.result.as_deref().is_some_and(|r| r.contains("successfully updated the configuration")), "{sdk:?}");
    assert!(f.requests().len() >= 4, "each model-driven peer reached the fake through the proxy");
}

/// `pier exec --sandbox strict` runs the agent it drives in the same jail; by default it
/// stays open, as documented.
#[tokio::test]
async fn pier_exec_with_sandbox_strict_jails_the_agent_it_drives() {
    let h = Host::new(None);
    must(std::fs::create_dir_all(h.path("work")), "dir");
    h.write("secret.txt", "a secret beside the workspace");
    let prompt = serde_json::json!({"secret": h.path("secret.txt")}).to_string();
    let hostile = format!("python3 {}", fixture("hostile_agent.py"));
    let work = h.path("work").display().to_string();
    for (flag, expect) in [(Some("strict"), "read_secret=blocked"), (None, "read_secret=ok")] {
        let mut args = vec!["exec", "--agent", hostile.as_str(), "--cwd", work.as_str()];
        if let Some(level) = flag {
            args.extend(["--sandbox", level]);
        }
        args.push(prompt.as_str());
        let o = h.run(&args).await;
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains(expect), "{flag:?}: {out}\n{}", stderr(&o));
    }
}

/// `pier agent --sandbox strict` runs itself in the jail a host task gets, so the commands it
/// runs (and the subagents it starts, its descendants as well) are inside: a secret beside the
/// workspace, a loopback service and the test's own process are out of reach, while its model
/// traffic leaves through the proxy. `--sandbox on` (Landlock for writes only) reaches all three,
/// so the test can fail.
#[tokio::test]
async fn pier_agent_with_sandbox_strict_runs_its_commands_in_the_jail() {
    use pier_fake_model::{FakeModel, Reply};
    use support::{Options, PierProcess, stop_reason};
    let service = listener().await;
    let outside = must(tempfile::tempdir(), "outside");
    let secret = outside.path().join("secret.txt");
    must(std::fs::write(&secret, "a secret beside the workspace"), "secret");
    let command = format!(
        "cat {secret}; python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)' && echo connected; \
         kill -0 {pid} && echo signalled; true",
        secret = secret.display(),
        port = service.port,
        pid = std::process::id()
    );
    let mut reached = 0;
    for (level, jailed) in [("strict", true), ("on", false)] {
        let f = must(FakeModel::start().await, "fake");
        f.push(Reply::tool_call("c1", "run_command", &serde_json::json!({ "command": command }).to_string()));
        f.push(Reply::text("done"));
        let opts = Options { capture_stderr: true, ..Options::model(f.base_url()) };
        let (mut p, sid) = PierProcess::start(opts.arg("--sandbox").arg(level).arg("--allow").arg("execute")).await;
        let id = p.prompt(&sid, "try to get out").await;
        let (_, response) = p.read_until_response(id).await;
        assert_eq!(stop_reason(&response), "end_turn", "{level}: {response}\n{}", p.stderr());
        let requests = f.requests();
        assert_eq!(requests.len(), 2, "{level}: both model requests arrived (through the proxy when jailed)");
        let result = requests[1].body["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["role"] == "tool")
            .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
            .collect::<String>();
        assert_eq!(result.contains("a secret beside the workspace"), !jailed, "{level}: {result}");
        assert_eq!(result.contains("connected"), !jailed, "{level}: {result}");
        assert_eq!(result.contains("signalled"), !jailed, "{level}: {result}");
        if !jailed {
            reached = *service.reached.borrow();
        } else {
            assert_eq!(*service.reached.borrow(), 0, "nothing in the jail reached the loopback service");
        }
    }
    assert!(reached > 0, "with --sandbox on the command reached the service");
}
