//! `run_command`: `sh -c <command>` in the session directory, contained
//! ([`crate::contain`]: its own session and cgroup, Landlock on writes), with a
//! timeout and bounded output.
//!
//! Everything the command started is killed: on timeout, on cancellation, when
//! the tool's future is dropped, and also after the shell exits normally (so a
//! command cannot leave background processes behind, however they detached), and
//! the shell is reaped.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use nix::sys::signal::Signal;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::output::HeadTail;
use crate::{Location, Preview, Scope, Tool, ToolContext, ToolError, ToolKind, ToolOutput, Workspace};

pub struct RunCommand;

/// The tool's name.
pub const NAME: &str = "run_command";

#[derive(Deserialize)]
struct Args {
    command: String,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

/// How long output readers may drain after the group is gone.
const DRAIN: Duration = Duration::from_secs(2);

/// What the model reads of [`RunCommand`].
const RUN_COMMAND_DESCRIPTION: &str = "Run a shell command (`sh -c`) in the session directory. Returns the exit code and the output; long output \
         keeps its beginning and end. Background processes do not outlive the command. Default timeout 120 s.";

/// The arguments [`RunCommand`] takes (JSON schema).
fn run_command_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The shell command"},
            "timeout_ms": {"type": "integer", "minimum": 1, "description": "Timeout in milliseconds (default 120000)"}
        },
        "required": ["command"]
    })
}

impl Tool for RunCommand {
    crate::tool_spec!("run_command", ToolKind::Execute, RUN_COMMAND_DESCRIPTION, run_command_parameters);
    fn preview(&self, args: &Value, ws: &Workspace) -> Preview {
        let command = args.get("command").and_then(Value::as_str).unwrap_or("?");
        let short: String = command.chars().take(120).collect();
        Preview {
            title: format!("Run `{short}`"),
            locations: vec![Location { path: ws.root().to_owned(), line: None }],
            content: Vec::new(),
        }
    }
    fn scope(&self, args: &Value) -> Scope {
        match args.get("command").and_then(Value::as_str).and_then(programs) {
            Some(names) if !names.is_empty() => Scope::Names(names),
            _ => Scope::Unscoped,
        }
    }
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let args: Args = crate::parse_args("run_command", args)?;
            let timeout = args
                .timeout_ms
                .map_or(cx.limits.command_timeout, Duration::from_millis)
                .min(cx.limits.max_command_timeout);
            run(&args.command, timeout, &cx).await
        })
    }
}

enum Ending {
    Exited(std::process::ExitStatus),
    TimedOut,
    Cancelled,
}

async fn run(command: &str, timeout: Duration, cx: &ToolContext) -> Result<ToolOutput, ToolError> {
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .current_dir(cx.workspace.root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let writable = cx.workspace.write_roots();
    // Dropped with the future: `Contained`'s drop ends every process of the command.
    let (mut child, contained) = crate::contain::spawn(&mut cmd, &cx.limits.confinement, &writable)
        .map_err(|e| ToolError::new(format!("could not start sh: {e}")))?;
    drop(cmd);
    let mut contained = Some(contained);
    let keep = cx.limits.command_capture_bytes;
    let stdout = Arc::new(Mutex::new(HeadTail::new(keep)));
    let stderr = Arc::new(Mutex::new(HeadTail::new(keep)));
    let readers = [
        child.stdout.take().map(|r| tokio::spawn(capture(r, stdout.clone()))),
        child.stderr.take().map(|r| tokio::spawn(capture(r, stderr.clone()))),
    ];

    // While it runs, its output so far is shown on the call, at most every
    // `PROGRESS_EVERY` and only when it grew (the head and tail kept, as at the end).
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut shown = 0;
    let ending = loop {
        tokio::select! {
            status = child.wait() => break match status {
                Ok(s) => Ending::Exited(s),
                Err(e) => return Err(ToolError::new(format!("waiting for the command failed: {e}"))),
            },
            _ = &mut deadline => break Ending::TimedOut,
            _ = cx.cancel.cancelled() => break Ending::Cancelled,
            _ = tick.tick() => {
                let (out, err) = (lock(&stdout), lock(&stderr));
                let total = out.total() + err.total();
                if total != shown {
                    shown = total;
                    let text = streams(String::from("running"), &out, &err);
                    cx.link.progress(vec![crate::ToolContent::Text { text }]);
                }
            }
        }
    };
    // Whatever happened, nothing the command started may outlive the call.
    if let Some(mut c) = contained.take() {
        let _ = tokio::task::spawn_blocking(move || c.end()).await;
    }
    let status = match ending {
        Ending::Exited(s) => Some(s),
        Ending::TimedOut | Ending::Cancelled => child.wait().await.ok(),
    };
    for reader in readers.into_iter().flatten() {
        if tokio::time::timeout(DRAIN, reader).await.is_err() {
            tracing::warn!("command output did not close after the command's processes were killed");
        }
    }

    let out = lock(&stdout);
    let err = lock(&stderr);
    let (code, signal) = match status {
        Some(s) => (s.code(), s.signal()),
        None => (None, None),
    };
    let text = match ending {
        Ending::TimedOut => {
            format!("timed out after {} ms; the command's processes were killed", timeout.as_millis())
        }
        Ending::Cancelled => "cancelled; the command's processes were killed".to_owned(),
        Ending::Exited(_) => match (code, signal) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("killed by signal {s} ({})", signal_name(s)),
            (None, None) => "ended without an exit code".to_owned(),
        },
    };
    let text = streams(text, &out, &err);
    let success = matches!(ending, Ending::Exited(_)) && code == Some(0);
    let raw = json!({
        "command": command,
        "exit_code": code,
        "signal": signal.map(signal_name),
        "timed_out": matches!(ending, Ending::TimedOut),
        "cancelled": matches!(ending, Ending::Cancelled),
        "stdout_bytes": out.total(),
        "stderr_bytes": err.total(),
    });
    let mut output = ToolOutput::ok(text.clone(), raw);
    // An editor shows the command's output inside the tool call.
    output.content = vec![crate::ToolContent::Text { text }];
    output.success = success;
    Ok(output)
}

/// How often, at most, a running command's output is shown on its call.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// `head` followed by each stream that said something, under its name.
fn streams(mut head: String, out: &HeadTail, err: &HeadTail) -> String {
    for (name, stream) in [("stdout", out), ("stderr", err)] {
        if stream.total() > 0 {
            head.push_str(&format!("\n{name}:\n{}", stream.render()));
        }
    }
    head
}

fn lock(m: &Mutex<HeadTail>) -> std::sync::MutexGuard<'_, HeadTail> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reads `r` to its end (or its first error), handing each chunk to `sink`: how a
/// child's output is captured, here and by the client's terminals.
pub async fn read_into(mut r: impl AsyncRead + Unpin, mut sink: impl FnMut(&[u8])) {
    let mut buf = vec![0u8; 8192];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            break;
        }
        sink(&buf[..n]);
    }
}

async fn capture(r: impl AsyncRead + Unpin, sink: Arc<Mutex<HeadTail>>) {
    read_into(r, |chunk| lock(&sink).push(chunk)).await;
}

fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map(|s| s.as_str().to_owned()).unwrap_or_else(|_| format!("signal {sig}"))
}

/// The programs a shell command runs: the first word of each simple command of a
/// list or pipeline, after any `env` and `VAR=value` prefix, by base name. `None`
/// when the command has a shape whose programs cannot be known from its text
/// (substitutions, subshells, groups, functions, a program named by a variable).
pub fn programs(command: &str) -> Option<Vec<String>> {
    if ["$(", "`", "<(", ">(", "${"].iter().any(|s| command.contains(s)) {
        return None;
    }
    let mut names: Vec<String> = Vec::new();
    for segment in split_list(command)? {
        let words = shell_words::split(&segment).ok()?;
        let mut words = words.iter().map(String::as_str).peekable();
        let mut program = None;
        while let Some(w) = words.next() {
            if is_assignment(w) {
                continue;
            }
            if w == "env" {
                while let Some(next) = words.peek() {
                    if next.starts_with('-') || is_assignment(next) {
                        words.next();
                    } else {
                        break;
                    }
                }
                continue;
            }
            program = Some(w);
            break;
        }
        let Some(program) = program else { continue };
        if program.is_empty()
            || program.starts_with(['$', '(', '{'])
            || ["(", ")", "{", "}", "!", "if", "for", "while", "until", "case", "function"].contains(&program)
        {
            return None;
        }
        let base = program.rsplit('/').next().unwrap_or(program).to_owned();
        if !names.contains(&base) {
            names.push(base);
        }
    }
    Some(names)
}

fn is_assignment(word: &str) -> bool {
    match word.split_once('=') {
        Some((name, _)) => {
            !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit())
        }
        None => false,
    }
}

/// Splits a command at `;`, `&`, `|`, `&&`, `||` and newlines outside quotes.
fn split_list(command: &str) -> Option<Vec<String>> {
    let (mut out, mut cur) = (Vec::new(), String::new());
    let (mut single, mut double, mut escaped) = (false, false, false);
    for c in command.chars() {
        if escaped {
            cur.push(c);
            escaped = false;
            continue;
        }
        match c {
            '\\' if !single => {
                cur.push(c);
                escaped = true;
            }
            '\'' if !double => {
                single = !single;
                cur.push(c);
            }
            '"' if !single => {
                double = !double;
                cur.push(c);
            }
            ';' | '&' | '|' | '\n' if !single && !double => {
                // `>&2` and `2>&1` are redirections, not list operators.
                if c == '&' && (cur.ends_with('>') || cur.ends_with('<')) {
                    cur.push(c);
                } else if !cur.trim().is_empty() {
                    out.push(std::mem::take(&mut cur));
                } else {
                    cur.clear();
                }
            }
            _ => cur.push(c),
        }
    }
    if single || double {
        return None;
    }
    if !cur.trim().is_empty() {
        out.push(cur);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::programs;

    fn p(s: &str) -> Option<Vec<String>> {
        programs(s)
    }

    fn v(names: &[&str]) -> Option<Vec<String>> {
        Some(names.iter().map(|s| (*s).to_owned()).collect())
    }

    #[test]
    fn programs_of_simple_lists_and_pipelines() {
        assert_eq!(p("git status"), v(&["git"]));
        assert_eq!(p("FOO=1 BAR=x /usr/bin/git log --oneline"), v(&["git"]));
        assert_eq!(p("env -i PATH=/bin cargo test"), v(&["cargo"]));
        assert_eq!(p("git diff | grep -v x && ls; git log"), v(&["git", "grep", "ls"]));
        assert_eq!(p("echo 'a && rm -rf /' >&2"), v(&["echo"]));
        assert_eq!(p("make 2>&1 | tee out.txt"), v(&["make", "tee"]));
    }

    #[test]
    fn shapes_that_hide_programs_are_unscoped() {
        for bad in ["echo $(rm x)", "echo `id`", "(cd x && rm y)", "{ rm x; }", "$CMD arg", "echo 'unclosed"] {
            assert_eq!(p(bad), None, "{bad}");
        }
    }
}
