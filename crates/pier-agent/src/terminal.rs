//! `run_command` through the client's terminal (editor profile, a client that advertised
//! `terminal`): the command runs in `terminal/create`, so the editor shows its output as it
//! grows, and the call embeds the terminal until it is released. The confinement is
//! `run_command`'s own: the terminal runs `pier command-guard`, which starts the shell as
//! [`pier_tools::contain`] starts it (new session, own cgroup, Landlock on writes beneath the
//! session's roots) and kills what the command started when the shell exits or the terminal is
//! killed; what a killed guard leaves is ended here by the command's marker.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use agent_client_protocol_schema::v1::{
    CreateTerminalRequest, CreateTerminalResponse, KillTerminalRequest, ReleaseTerminalRequest, TerminalExitStatus,
    TerminalOutputRequest, TerminalOutputResponse, WaitForTerminalExitRequest, WaitForTerminalExitResponse,
};
use futures::future::BoxFuture;
use pier_acp::Connection;
use pier_tools::command::RunCommand;
use pier_tools::{Preview, Scope, Tool, ToolContent, ToolContext, ToolError, ToolOutput, Workspace};
use serde::Deserialize;
use serde_json::{Value, json};

/// How long a killed terminal's command gets to be seen exiting (well inside the engine's wait
/// for a cancelled tool, so the release still happens in the call).
const KILL_WAIT: Duration = Duration::from_secs(2);

/// `run_command` of one session whose client runs its commands.
pub struct TerminalCommand {
    conn: Connection,
    session_id: Arc<OnceLock<String>>,
    /// The `pier` binary the terminal runs as the command's guard.
    pier_exe: PathBuf,
    /// The local `run_command`, whose name, description and arguments this one has.
    local: RunCommand,
}

impl TerminalCommand {
    /// The tool, and the cell to put the session id in once the session exists.
    pub fn new(conn: Connection, pier_exe: PathBuf) -> (TerminalCommand, Arc<OnceLock<String>>) {
        let session_id = Arc::new(OnceLock::new());
        (TerminalCommand { conn, session_id: session_id.clone(), pier_exe, local: RunCommand }, session_id)
    }
}

#[derive(Deserialize)]
struct Args {
    command: String,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

impl Tool for TerminalCommand {
    fn spec(&self) -> &pier_tools::ToolSpec {
        self.local.spec()
    }
    fn preview(&self, args: &Value, ws: &Workspace) -> Preview {
        self.local.preview(args, ws)
    }
    fn scope(&self, args: &Value) -> Scope {
        self.local.scope(args)
    }
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        let (conn, session_id, exe) = (self.conn.clone(), self.session_id.get().cloned(), self.pier_exe.clone());
        Box::pin(async move {
            let args: Args = serde_json::from_value(args)
                .map_err(|e| ToolError::new(format!("invalid arguments for run_command: {e}")))?;
            let session_id = session_id.ok_or_else(|| ToolError::new("the session is not ready to run commands"))?;
            let timeout = args
                .timeout_ms
                .map_or(cx.limits.command_timeout, Duration::from_millis)
                .min(cx.limits.max_command_timeout);
            let marker = pier_tools::contain::new_marker();
            let mut guard = vec!["command-guard".to_owned(), "--marker".into(), marker.clone()];
            if !cx.limits.confinement.landlock {
                guard.push("--no-landlock".into());
            }
            if !cx.limits.confinement.cgroups {
                guard.push("--no-cgroups".into());
            }
            for dir in cx.workspace.write_roots() {
                guard.push("--writable".into());
                guard.push(dir.display().to_string());
            }
            guard.extend(["--".into(), args.command.clone()]);
            let limit = (cx.limits.command_capture_bytes as u64).saturating_mul(2);
            let create = CreateTerminalRequest::new(session_id.clone(), exe.display().to_string())
                .args(guard)
                .cwd(cx.workspace.root().to_owned())
                .output_byte_limit(limit);
            let created: CreateTerminalResponse = conn
                .request("terminal/create", &create)
                .await
                .map_err(|e| ToolError::new(format!("the client could not start the command in a terminal: {e}")))?;
            let id = created.terminal_id.0.to_string();
            let mut run = Running { conn, session_id, id: id.clone(), marker, released: false };
            // The editor shows the terminal in the call from now until it is released.
            cx.link.progress(vec![ToolContent::Terminal { terminal_id: id.clone() }]);
            let ending = run.wait(timeout, &cx).await;
            let output = run.output().await;
            run.release().await;
            Ok(output_of(&args.command, &id, ending, output))
        })
    }
}

/// How the wait for the command ended.
enum Ending {
    Exited(TerminalExitStatus),
    TimedOut(Duration),
    Cancelled,
    /// The client failed the wait: why.
    Lost(String),
}

/// A command running in a client's terminal. Dropped before it was released (the call itself
/// dropped: its turn gone), it kills and releases the terminal on its way out.
struct Running {
    conn: Connection,
    session_id: String,
    id: String,
    marker: String,
    released: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let (conn, session_id, id, marker) =
            (self.conn.clone(), self.session_id.clone(), self.id.clone(), self.marker.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let kill = KillTerminalRequest::new(session_id.clone(), id.clone());
                let _ = tokio::time::timeout(KILL_WAIT, conn.request::<_, Value>("terminal/kill", &kill)).await;
                let release = ReleaseTerminalRequest::new(session_id, id);
                let _ = tokio::time::timeout(KILL_WAIT, conn.request::<_, Value>("terminal/release", &release)).await;
                let _ = tokio::task::spawn_blocking(move || pier_tools::contain::end_marked(&marker)).await;
            });
        }
    }
}

impl Running {
    async fn wait(&self, timeout: Duration, cx: &ToolContext) -> Ending {
        let req = WaitForTerminalExitRequest::new(self.session_id.clone(), self.id.clone());
        // Dropping the request (timeout, cancel) withdraws it from the client.
        let waited = self.conn.request::<_, WaitForTerminalExitResponse>("terminal/wait_for_exit", &req);
        let ending = tokio::select! {
            r = waited => match r {
                Ok(r) => return Ending::Exited(r.exit_status),
                Err(e) => Ending::Lost(e.to_string()),
            },
            _ = tokio::time::sleep(timeout) => Ending::TimedOut(timeout),
            _ = cx.cancel.cancelled() => Ending::Cancelled,
        };
        let kill = KillTerminalRequest::new(self.session_id.clone(), self.id.clone());
        if let Err(e) = self.conn.request::<_, Value>("terminal/kill", &kill).await {
            tracing::warn!(error = %e, "the client could not kill a command's terminal");
        }
        let again = self.conn.request::<_, WaitForTerminalExitResponse>("terminal/wait_for_exit", &req);
        let _ = tokio::time::timeout(KILL_WAIT, again).await;
        ending
    }

    async fn output(&self) -> Option<TerminalOutputResponse> {
        let req = TerminalOutputRequest::new(self.session_id.clone(), self.id.clone());
        match self.conn.request::<_, TerminalOutputResponse>("terminal/output", &req).await {
            Ok(out) => Some(out),
            Err(e) => {
                tracing::warn!(error = %e, "the client did not give a command's output");
                None
            }
        }
    }

    /// Releases the terminal and ends whatever of the command is still alive.
    async fn release(&mut self) {
        self.released = true;
        let req = ReleaseTerminalRequest::new(self.session_id.clone(), self.id.clone());
        if let Err(e) = self.conn.request::<_, Value>("terminal/release", &req).await {
            tracing::warn!(error = %e, "the client could not release a command's terminal");
        }
        let marker = self.marker.clone();
        let _ = tokio::task::spawn_blocking(move || pier_tools::contain::end_marked(&marker)).await;
    }
}

/// What the model reads and the call shows: the ending, then the output.
fn output_of(command: &str, id: &str, ending: Ending, output: Option<TerminalOutputResponse>) -> ToolOutput {
    let status = match &ending {
        Ending::Exited(s) => Some(s.clone()),
        _ => output.as_ref().and_then(|o| o.exit_status.clone()),
    };
    let (code, signal) = status.map_or((None, None), |s| (s.exit_code, s.signal));
    let mut text = match &ending {
        Ending::TimedOut(t) => format!("timed out after {} ms; the command's processes were killed", t.as_millis()),
        Ending::Cancelled => "cancelled; the command's processes were killed".to_owned(),
        Ending::Lost(why) => format!("the client's terminal failed ({why}); the command's processes were killed"),
        Ending::Exited(_) => match (code, &signal) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("killed by signal {s}"),
            (None, None) => "ended without an exit code".to_owned(),
        },
    };
    let truncated = output.as_ref().is_some_and(|o| o.truncated);
    match &output {
        Some(o) if !o.output.is_empty() => {
            text.push_str("\noutput:\n");
            if o.truncated {
                text.push_str("[earlier output dropped]\n");
            }
            text.push_str(&o.output);
        }
        Some(_) => {}
        None => text.push_str("\n(the client did not give the output)"),
    }
    let raw = json!({
        "command": command,
        "exit_code": code,
        "signal": signal,
        "timed_out": matches!(ending, Ending::TimedOut(_)),
        "cancelled": matches!(ending, Ending::Cancelled),
        "terminal_id": id,
        "output_truncated": truncated,
        // What a reopened session shows in place of the terminal, released by then.
        "output": output.as_ref().map(|o| o.output.as_str()),
    });
    let mut out = ToolOutput::ok(text, raw);
    out.content = vec![ToolContent::Terminal { terminal_id: id.to_owned() }];
    out.success = matches!(ending, Ending::Exited(_)) && code == Some(0);
    out
}
