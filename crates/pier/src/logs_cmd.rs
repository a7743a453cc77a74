//! `pier logs RUN TASK [--follow]`: a task's agent as a terminal shows it — what it said, its
//! tool calls and how they ended, what it wrote to stderr, and each attempt's start and end —
//! read from the log (the host records an agent's stderr as `agent_stderr` events), from the
//! local store or a `pier serve`. With `--follow`, it goes on until the task has ended.

use std::io::Write;

use agent_client_protocol_schema::v1::{ContentBlock, SessionUpdate, ToolCallStatus};
use pier_host::{AgentEvent, Entry, Event, EventFilter, Follow, LogEvent};

use crate::run_cmd::open_tasks;

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    /// The run
    run: String,
    /// The task
    task: String,
    /// Keep printing as the agent goes on, until the task has ended
    #[arg(long, short = 'f')]
    follow: bool,
    /// Only this attempt [default: every attempt]
    #[arg(long)]
    attempt: Option<i64>,
    /// Also its thoughts
    #[arg(long)]
    thoughts: bool,
    /// The store [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long)]
    store: Option<String>,
    /// Read from a running `pier serve` instead of the local store [env: PIER_SERVER]
    #[arg(long)]
    server: Option<String>,
}

/// What has been printed: whether the last text left a line open, and whether the task ended.
#[derive(Default)]
struct Printer {
    open_line: bool,
    ended: bool,
    /// Each tool call's title, for its updates (which seldom repeat it).
    titles: std::collections::HashMap<String, String>,
}

impl Printer {
    fn line(&mut self, out: &mut impl Write, text: &str) {
        if self.open_line {
            let _ = writeln!(out);
            self.open_line = false;
        }
        let _ = writeln!(out, "{text}");
    }

    fn see(&mut self, e: &Event, args: &LogsArgs, out: &mut impl Write) {
        match e.entry() {
            Entry::Agent { attempt, .. } if args.attempt.is_some_and(|n| n != attempt) => {}
            Entry::Agent { event, .. } => match *event {
                AgentEvent::SessionUpdate { update } => self.update(update, args, out),
                AgentEvent::AgentStderr { lines, dropped } => {
                    for l in &lines {
                        self.line(out, &format!("stderr| {l}"));
                    }
                    if dropped > 0 {
                        self.line(out, &format!("stderr| ({dropped} lines dropped)"));
                    }
                }
                AgentEvent::Permission { tool_call, reason, .. } => {
                    let title = tool_call.fields.title.as_deref().unwrap_or("a tool call");
                    self.line(out, &format!("? permission for {title}: {reason}"));
                }
                AgentEvent::Elicitation { request, .. } => self.line(out, &format!("? asked: {}", request.message)),
                AgentEvent::ClientCall { .. } => {}
                AgentEvent::ProtocolError { message } => self.line(out, &format!("! protocol error: {message}")),
            },
            Entry::Host(LogEvent::Transition { from, to, attempt, reason, error, .. }) => {
                if args.attempt.is_some_and(|n| n != attempt) {
                    return;
                }
                let mut text = format!("── attempt {attempt}: {} → {} ({reason})", from.as_str(), to.as_str());
                if let Some(err) = error {
                    text.push_str(&format!(": {}", err.lines().next().unwrap_or("")));
                }
                self.line(out, &text);
                self.ended = to.is_terminal();
            }
            _ => {}
        }
    }

    fn update(&mut self, update: SessionUpdate, args: &LogsArgs, out: &mut impl Write) {
        match update {
            SessionUpdate::AgentMessageChunk(c) => {
                if let ContentBlock::Text(t) = c.content {
                    let _ = write!(out, "{}", t.text);
                    self.open_line = !t.text.ends_with('\n');
                }
            }
            SessionUpdate::AgentThoughtChunk(c) if args.thoughts => {
                if let ContentBlock::Text(t) = c.content {
                    self.line(out, &format!("(thinking) {}", t.text.trim_end()));
                }
            }
            SessionUpdate::ToolCall(call) => {
                self.titles.insert(call.tool_call_id.0.to_string(), call.title.clone());
                let kind = serde_json::to_value(call.kind).ok().and_then(|v| v.as_str().map(str::to_owned));
                self.line(out, &format!("▸ [{}] {}", kind.as_deref().unwrap_or("other"), call.title));
            }
            SessionUpdate::ToolCallUpdate(u) => {
                let how = match u.fields.status {
                    Some(ToolCallStatus::Completed) => "✓ completed",
                    Some(ToolCallStatus::Failed) => "✗ failed",
                    _ => return,
                };
                let id = u.tool_call_id.0.to_string();
                let title = u.fields.title.clone().or_else(|| self.titles.get(&id).cloned()).unwrap_or(id);
                self.line(out, &format!("  {how}: {title}"));
            }
            _ => {}
        }
    }
}

/// `pier logs`.
#[allow(clippy::print_stdout)]
pub async fn logs(args: LogsArgs) -> anyhow::Result<()> {
    let mut printer = Printer::default();
    let mut out = std::io::stdout();
    if args.server.is_some() || std::env::var("PIER_SERVER").is_ok_and(|s| !s.is_empty()) {
        use crate::serve_cmd::segment;
        // The task exists (an unknown one is refused, not followed forever), and has it ended?
        let path = format!("/runs/{}/tasks/{}", segment(&args.run), segment(&args.task));
        let shown = crate::serve_cmd::get(args.server.clone(), &path).await?;
        let ended =
            shown["task"]["state"].as_str().and_then(pier_host::TaskState::parse).is_some_and(|s| s.is_terminal());
        let follow = args.follow && !ended;
        let query = format!("task={}&merge=deltas", segment(&args.task));
        let stop = tokio_util::sync::CancellationToken::new();
        let done = stop.clone();
        let reading = crate::serve_cmd::events(args.server.clone(), Some(args.run.clone()), 0, follow, &query, |e| {
            printer.see(e, &args, &mut out);
            let _ = out.flush();
            if follow && printer.ended {
                done.cancel();
            }
        });
        tokio::select! {
            r = reading => r?,
            () = stop.cancelled() => {}
        }
        if printer.open_line {
            println!();
        }
        return Ok(());
    }
    let tasks = open_tasks(&args.store)?;
    // The task exists, and whether it has ended already (then there is nothing to follow).
    let view = tasks.task(&args.run, &args.task).await?;
    let live = args.follow && !view.row.state.is_terminal();
    let only = EventFilter { task: Some(args.task.clone()), ..Default::default() };
    let mut follower = tasks.follow(Follow { run: Some(args.run.clone()), after: 0, live, only, merge: true });
    while let Some(batch) = follower.next_batch().await {
        for e in &batch? {
            printer.see(e, &args, &mut out);
        }
        let _ = out.flush();
        if live && printer.ended {
            break;
        }
    }
    if printer.open_line {
        println!();
    }
    Ok(())
}
