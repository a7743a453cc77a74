//! Interop run: `pier exec` against codex-acp, claude-agent-acp and gemini-cli,
//! each with its model traffic sent to a local fake server speaking its
//! provider's API. Run by `scripts/interop.sh`, which installs the agents; writes
//! a Markdown report.
//!
//! ```sh
//! cargo run -p pier --example interop -- --peers target/interop --out docs/interop.md [codex claude gemini]
//! ```

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::{Value, json};

struct Agent {
    name: &'static str,
    /// The agent's shell tool and how to call it with a command.
    shell_call: fn(&str) -> (String, String),
}

fn codex_shell(cmd: &str) -> (String, String) {
    ("exec_command".into(), json!({"cmd": cmd}).to_string())
}
fn claude_shell(cmd: &str) -> (String, String) {
    ("Bash".into(), json!({"command": cmd, "description": "Create a marker file"}).to_string())
}
fn gemini_shell(cmd: &str) -> (String, String) {
    ("run_shell_command".into(), json!({"command": cmd, "description": "Create a marker file"}).to_string())
}

const AGENTS: &[Agent] = &[
    Agent { name: "codex", shell_call: codex_shell },
    Agent { name: "claude", shell_call: claude_shell },
    Agent { name: "gemini", shell_call: gemini_shell },
];

struct Run {
    code: Option<i32>,
    result: Value,
    permissions: Vec<Value>,
    stderr: String,
    elapsed: Duration,
}

async fn exec(
    pier: &Path,
    s: &pier_fake_model::peers::Setup,
    work: &Path,
    args: &[&str],
    prompt: &str,
) -> std::io::Result<Run> {
    let started = Instant::now();
    let mut cmd = tokio::process::Command::new(pier);
    cmd.arg("exec").arg("--agent").arg(&s.command).arg("--format").arg("json").args(args).arg(prompt);
    cmd.current_dir(work).envs(s.env.iter().map(|(k, v)| (k, v))).env("PIER_HOME", work.join(".pier-home"));
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(180), cmd.output()).await.map_err(std::io::Error::other)??;
    let lines: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    Ok(Run {
        code: out.status.code(),
        result: lines.last().cloned().unwrap_or_default(),
        permissions: lines.iter().filter(|l| l["type"] == "permission").cloned().collect(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: started.elapsed(),
    })
}

fn summary(r: &Run) -> String {
    let err = r.result["error"]["message"].as_str().unwrap_or("").lines().next().unwrap_or("").to_owned();
    format!(
        "exit {} · stopReason {} · {:.1}s{}",
        r.code.map_or("signal".into(), |c| c.to_string()),
        r.result["stopReason"].as_str().unwrap_or("none"),
        r.elapsed.as_secs_f64(),
        if err.is_empty() { String::new() } else { format!(" · {err}") }
    )
}

struct Row {
    agent: String,
    version: String,
    turn: (bool, String),
    permission: (bool, String),
    cancel: (bool, String),
}

async fn run_agent(agent: &Agent, pier: &Path, peers: &Path) -> std::io::Result<Row> {
    let scratch = tempfile::tempdir()?;
    let work = scratch.path().join("work");
    std::fs::create_dir_all(&work)?;
    let fake = FakeModel::start().await?;
    let s =
        pier_fake_model::peers::setup(agent.name, &peers.join("node_modules/.bin"), scratch.path(), &fake.base_url())?;

    // 1. A plain turn.
    fake.push(Reply::text("Interop OK."));
    let turn = exec(pier, &s, &work, &[], "Reply with the words Interop OK.").await?;
    let version = turn.result["agent"]["version"].as_str().map_or("?".into(), str::to_owned);
    let turn_ok = turn.code == Some(0) && turn.result["text"].as_str().is_some_and(|t| t.contains("Interop OK"));
    let first_tools: Vec<String> = fake
        .requests()
        .iter()
        .find(|r| !r.auxiliary)
        .map(|r| {
            let tools = r.body["tools"].as_array().cloned().unwrap_or_default();
            tools
                .iter()
                .filter_map(|t| {
                    t["name"].as_str().or(t["function"]["name"].as_str()).map(str::to_owned).or_else(|| {
                        t["functionDeclarations"]
                            .as_array()
                            .map(|d| d.iter().filter_map(|f| f["name"].as_str()).collect::<Vec<_>>().join(","))
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    eprintln!("{}: tools offered to the model: {}", agent.name, first_tools.join(" "));
    if std::env::var_os("INTEROP_DEBUG").is_some() {
        for r in fake.requests() {
            eprintln!("{}: request {} (auxiliary: {}): {}", agent.name, r.path, r.auxiliary, r.body);
        }
    }
    if !turn_ok {
        eprintln!("{}: turn failed: {}\n{}", agent.name, turn.result, turn.stderr);
    }

    // 2. A shell tool call that needs permission, allowed by --approve-all.
    let marker = work.join("pier-interop-ran");
    let (tool, args) = (agent.shell_call)(&format!("touch {}", marker.display()));
    fake.push(Reply::tool_call("call_interop_1", &tool, &args));
    fake.push(Reply::text("The marker file exists now."));
    fake.set_fallback(|_| Reply::text("The marker file exists now."));
    let perm = exec(pier, &s, &work, &["--approve-all"], "Create the marker file with the shell.").await?;
    let asked = perm.permissions.first().cloned();
    let perm_ok = perm.code == Some(0) && asked.is_some() && marker.exists();
    let perm_detail = match &asked {
        Some(p) => format!(
            "asked ({} options: {}), answered `{}`, command ran: {} · {}",
            p["toolCall"]["kind"].as_str().unwrap_or("?"),
            p["options"]
                .as_array()
                .map(|o| o.iter().filter_map(|o| o["kind"].as_str()).collect::<Vec<_>>().join("/"))
                .unwrap_or_default(),
            p["outcome"]["optionId"].as_str().unwrap_or("?"),
            marker.exists(),
            summary(&perm)
        ),
        None => format!("no permission request; command ran: {} · {}", marker.exists(), summary(&perm)),
    };
    if !perm_ok {
        eprintln!("{}: permission scenario: {}\n{}", agent.name, perm.result, perm.stderr);
    }
    // 2b. The same request rejected by --deny-all: the command must not run.
    fake.clear_script();
    let denied_marker = work.join("pier-interop-denied");
    let (tool, args) = (agent.shell_call)(&format!("touch {}", denied_marker.display()));
    fake.push(Reply::tool_call("call_interop_2", &tool, &args));
    fake.push(Reply::text("Understood, I did not run it."));
    let deny = exec(pier, &s, &work, &["--deny-all"], "Create the other marker file with the shell.").await?;
    let denied = deny.permissions.first().cloned();
    // An agent may go on (exit 0) or end the turn cancelled (codex treats its reject option as abort).
    let reject_kind = denied.as_ref().and_then(|p| {
        let chosen = p["outcome"]["optionId"].as_str()?;
        p["options"].as_array()?.iter().find(|o| o["optionId"] == chosen)?["kind"].as_str().map(str::to_owned)
    });
    let deny_ok = matches!(deny.code, Some(0) | Some(130))
        && reject_kind.as_deref() == Some("reject_once")
        && !denied_marker.exists();
    if !deny_ok {
        eprintln!("{}: deny scenario: {}\n{}", agent.name, deny.result, deny.stderr);
    }
    let perm_ok = perm_ok && deny_ok;
    let perm_detail = format!(
        "{perm_detail}; with `--deny-all`: answered `{}` ({}), command ran: {} · {}",
        denied.as_ref().and_then(|p| p["outcome"]["optionId"].as_str()).unwrap_or("(not asked)"),
        reject_kind.as_deref().unwrap_or("?"),
        denied_marker.exists(),
        summary(&deny)
    );

    // 3. A cancel while the model is mid-answer.
    fake.clear_script();
    fake.set_fallback(|_| Reply::Stream(vec![Step::Text("Working on it".into()), Step::Hang]));
    let cancel = exec(pier, &s, &work, &["--max-time", "8", "--cancel-grace", "10"], "Write a long essay.").await?;
    let confirmed = cancel.result["error"]["cancelConfirmed"] == true && cancel.result["stopReason"] == "cancelled";
    if !confirmed {
        eprintln!("{}: cancel scenario: {}\n{}", agent.name, cancel.result, cancel.stderr);
    }
    Ok(Row {
        agent: agent.name.to_owned(),
        version,
        turn: (turn_ok, summary(&turn)),
        permission: (perm_ok, perm_detail),
        cancel: (confirmed, format!("{} (`--max-time 8`, confirmed: {confirmed})", summary(&cancel))),
    })
}

fn mark(ok: bool) -> &'static str {
    if ok { "pass" } else { "FAIL" }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let peers = PathBuf::from(flag("--peers").unwrap_or_else(|| "target/interop".into())).canonicalize()?;
    let out = flag("--out").map(PathBuf::from);
    let wanted: Vec<&str> =
        args.iter().filter(|a| AGENTS.iter().any(|g| g.name == a.as_str())).map(String::as_str).collect();
    let exe = std::env::current_exe()?;
    let pier = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("pier"))
        .ok_or_else(|| std::io::Error::other("no target dir"))?;
    if let Some(bench) = flag("--startup").map(std::path::absolute).transpose()? {
        // Benchmark B3 (bench/run.sh): each agent set up as for the interop check, its
        // model pointed at the fake server, timed by `pier-bench startup`.
        let n = flag("--n").unwrap_or_else(|| "20".into());
        for agent in AGENTS.iter().filter(|a| wanted.is_empty() || wanted.contains(&a.name)) {
            let scratch = tempfile::tempdir()?;
            let work = scratch.path().join("work");
            std::fs::create_dir_all(&work)?;
            let fake = FakeModel::start().await?;
            fake.set_fallback(|_| Reply::text("ok"));
            let s = pier_fake_model::peers::setup(
                agent.name,
                &peers.join("node_modules/.bin"),
                scratch.path(),
                &fake.base_url(),
            )?;
            let mut cmd = tokio::process::Command::new(&bench);
            cmd.args(["startup", "--n", n.as_str(), "--"])
                .args(s.command.split(' '))
                .current_dir(&work)
                .envs(s.env.iter().map(|(k, v)| (k, v)))
                .stderr(std::process::Stdio::inherit());
            let out = cmd.output().await?;
            let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            println!("{{\"agent\":\"{}\",\"result\":{}}}", agent.name, if line.is_empty() { "null" } else { &line });
        }
        return Ok(());
    }
    let mut rows = Vec::new();
    for agent in AGENTS.iter().filter(|a| wanted.is_empty() || wanted.contains(&a.name)) {
        eprintln!("== {}", agent.name);
        rows.push(run_agent(agent, &pier, &peers).await?);
    }
    let mut md = String::from("| agent | version | turn | permission | cancel |\n|---|---|---|---|---|\n");
    for r in &rows {
        md.push_str(&format!(
            "| {} | {} | {}: {} | {}: {} | {}: {} |\n",
            r.agent,
            r.version,
            mark(r.turn.0),
            r.turn.1,
            mark(r.permission.0),
            r.permission.1,
            mark(r.cancel.0),
            r.cancel.1
        ));
    }
    print!("{md}");
    if let Some(out) = out {
        let existing = std::fs::read_to_string(&out).unwrap_or_default();
        let start = "<!-- interop table -->";
        let end = "<!-- /interop table -->";
        let body = match (existing.find(start), existing.find(end)) {
            (Some(a), Some(b)) if a < b => format!("{}{start}\n{md}{}", &existing[..a], &existing[b..]),
            _ => format!("{existing}\n{start}\n{md}{end}\n"),
        };
        std::fs::write(&out, body)?;
    }
    Ok(())
}
