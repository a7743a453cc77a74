//! `pier events`, and how events are shown on a terminal: a line per event that matters to
//! a person, or the live view of `pier run` (counts, running tasks and their tools, what
//! waits on a person). Events are read through their typed entry ([`pier_host::Entry`]).

use std::collections::BTreeMap;
use std::io::Write;

use pier_host::{AgentEvent, Entry, Event, EventFilter, Follow, LogEvent, TaskState};

use crate::run_cmd::{EventFormat, open_tasks};
use crate::waiting::waiting_for;

#[derive(Debug, clap::Args)]
pub struct EventsArgs {
    /// Only this run's events
    #[arg(long)]
    run: Option<String>,
    /// Start after this sequence number
    #[arg(long, default_value_t = 0)]
    after: i64,
    /// Keep printing new events as they are committed
    #[arg(long)]
    follow: bool,
    #[arg(long, value_enum, default_value = "text")]
    format: EventFormat,
    /// The store [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long)]
    store: Option<String>,
    /// Read from a running `pier serve` instead of the local store [env: PIER_SERVER]
    #[arg(long)]
    server: Option<String>,
    /// Only this task's events
    #[arg(long)]
    task: Option<String>,
    /// Only events of these types (comma-separated: transition, question, answer, session_update, …)
    #[arg(long = "type", value_name = "TYPE[,TYPE…]", value_delimiter = ',')]
    types: Vec<String>,
    /// Only events from this long ago (30s, 5m, 2h, 1d) or since this time (2026-12-07T10:00:00Z)
    #[arg(long, value_name = "DURATION|TIME")]
    since: Option<String>,
    /// An agent's text deltas merged per message (one event with the whole text)
    #[arg(long)]
    merge_deltas: bool,
}

/// Which events `pier events` prints: the host's one filter, from the flags.
fn filter_of(args: &EventsArgs) -> anyhow::Result<EventFilter> {
    let since_ms = match args.since.as_deref() {
        None => None,
        Some(text) => Some(EventFilter::since(text, pier_host::store::now_ms()).map_err(|e| anyhow::anyhow!("--{e}"))?),
    };
    Ok(EventFilter { task: args.task.clone(), types: args.types.clone(), since_ms })
}

/// A transition's line: from, to, why, its error's first line.
fn transition_text(seq: i64, task: &str, t: &LogEvent) -> String {
    let LogEvent::Transition { from, to, reason, error, .. } = t else { return String::new() };
    let mut line = format!("[{seq}] {task}: {} -> {} ({reason})", from.as_str(), to.as_str());
    if let Some(err) = error {
        line.push_str(&format!(" error: {}", err.lines().next().unwrap_or("")));
    }
    line
}

/// The line a person reads for event `e` (whose entry is `entry`), if it is one a person reads.
pub fn event_text(e: &Event, entry: Entry) -> Option<String> {
    let task = e.task.as_deref().unwrap_or("-");
    match entry {
        Entry::Host(t @ LogEvent::Transition { .. }) => {
            let mut line = transition_text(e.seq, task, &t);
            // Parked on evidence (not on a question, which has an event of its own).
            if let LogEvent::Transition { to: TaskState::AwaitingInput, evidence: Some(_), .. } = t {
                line.push_str(&format!("; {}", waiting_for(&e.run, task, None)));
            }
            Some(line)
        }
        Entry::Host(LogEvent::RunCreated { tasks, .. }) => {
            Some(format!("[{}] run {} created with {tasks} tasks", e.seq, e.run))
        }
        Entry::Host(LogEvent::Question { request, .. }) => {
            Some(format!("[{}] {task}: {}", e.seq, waiting_for(&e.run, task, Some(&request))))
        }
        Entry::Host(LogEvent::Message { n, by, interrupt, .. }) => Some(format!(
            "[{}] {task}: message {n} from {by}{}",
            e.seq,
            if interrupt { ", interrupting" } else { ", for its next prompt" }
        )),
        Entry::Host(LogEvent::CancelRequested { reason, .. }) => {
            Some(format!("[{}] {task}: cancelled by a person ({reason}); its attempt is stopping", e.seq))
        }
        Entry::Agent { event, .. } => match *event {
            AgentEvent::Permission { outcome, reason, .. } => {
                let chosen = match outcome {
                    agent_client_protocol_schema::v1::RequestPermissionOutcome::Selected(s) => {
                        s.option_id.0.to_string()
                    }
                    agent_client_protocol_schema::v1::RequestPermissionOutcome::Cancelled => "cancelled".into(),
                    _ => "?".into(),
                };
                Some(format!("[{}] {task}: permission {chosen} ({reason})", e.seq))
            }
            _ => None,
        },
        _ => None,
    }
}

/// The live view of `pier run` on a terminal: event lines scroll above a block that
/// shows the counts by state and each running task with its current tool.
pub struct LiveView {
    started: std::time::Instant,
    states: BTreeMap<String, TaskState>,
    running: BTreeMap<String, (std::time::Instant, String)>,
    /// Tasks waiting on a person, with what they wait for.
    waiting: BTreeMap<String, String>,
    height: usize,
}

impl LiveView {
    /// A view of tasks in these states (a resumed run shows where its tasks are).
    pub fn new(states: impl IntoIterator<Item = (String, TaskState)>) -> LiveView {
        LiveView {
            started: std::time::Instant::now(),
            states: states.into_iter().collect(),
            running: BTreeMap::new(),
            waiting: BTreeMap::new(),
            height: 0,
        }
    }

    pub fn see(&mut self, e: &Event, out: &mut String) {
        let task = e.task.clone().unwrap_or_default();
        // Decoded once: the view's update and the line both read it.
        let entry = e.entry();
        match &entry {
            Entry::Host(LogEvent::TaskCreated { .. }) => {
                self.states.insert(task, TaskState::Pending);
                return;
            }
            Entry::Host(LogEvent::Transition { to, evidence, .. }) => {
                if *to == TaskState::Running {
                    self.running.insert(task.clone(), (std::time::Instant::now(), String::new()));
                } else {
                    self.running.remove(&task);
                }
                if *to != TaskState::AwaitingInput {
                    self.waiting.remove(&task);
                } else if evidence.is_some() {
                    self.waiting.insert(task.clone(), waiting_for(&e.run, &task, None));
                }
                self.states.insert(task, *to);
            }
            Entry::Host(LogEvent::Question { request, .. }) => {
                self.waiting.insert(task.clone(), waiting_for(&e.run, &task, Some(request)));
            }
            Entry::Agent { event, .. } => {
                if let AgentEvent::SessionUpdate { update } = event.as_ref() {
                    if let (Some(title), Some(running)) = (tool_title(update), self.running.get_mut(&task)) {
                        running.1 = title;
                    }
                    return;
                }
            }
            _ => {}
        }
        if let Some(line) = event_text(e, entry) {
            out.push_str(&line);
            out.push('\n');
        }
    }

    /// Clears the old block, writes `lines`, draws the block again.
    pub fn draw(&mut self, lines: &str) {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for s in self.states.values() {
            *counts.entry(s.as_str()).or_default() += 1;
        }
        let summary: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let mut block = vec![format!("── {:.0}s · {}", self.started.elapsed().as_secs_f64(), summary.join(" · "))];
        for (task, (since, tool)) in self.running.iter().take(12) {
            block.push(format!("  ▸ {task} ({:.1}s) {tool}", since.elapsed().as_secs_f64()));
        }
        for (task, what) in self.waiting.iter().take(6) {
            block.push(format!("  ? {task} {what}"));
        }
        let mut out = String::new();
        if self.height > 0 {
            out.push_str(&format!("\x1b[{}A\x1b[J", self.height));
        }
        out.push_str(lines);
        for l in &block {
            let short: String = l.chars().take(120).collect();
            out.push_str(&short);
            out.push('\n');
        }
        self.height = block.len();
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(out.as_bytes());
        let _ = stdout.flush();
    }
}

/// The title a tool call's update gives it, if it gives one.
fn tool_title(update: &agent_client_protocol_schema::v1::SessionUpdate) -> Option<String> {
    use agent_client_protocol_schema::v1::SessionUpdate;
    match update {
        SessionUpdate::ToolCall(call) => Some(call.title.clone()),
        SessionUpdate::ToolCallUpdate(u) => u.fields.title.clone(),
        _ => None,
    }
}

pub fn print_event(e: &Event, format: EventFormat) {
    let mut out = std::io::stdout().lock();
    match format {
        EventFormat::Json => {
            let _ = writeln!(out, "{}", e.to_wire());
        }
        EventFormat::Text => {
            if let Some(line) = event_text(e, e.entry()) {
                let _ = writeln!(out, "{line}");
            }
        }
    }
}

/// `pier events`.
pub async fn events(args: EventsArgs) -> anyhow::Result<()> {
    let only = filter_of(&args)?;
    if args.server.is_some() || std::env::var("PIER_SERVER").is_ok_and(|s| !s.is_empty()) {
        // The server filters and merges: only what is asked for crosses the network.
        let mut query = Vec::new();
        if let Some(t) = &args.task {
            query.push(format!("task={}", crate::serve_cmd::segment(t)));
        }
        if !args.types.is_empty() {
            query.push(format!("type={}", crate::serve_cmd::segment(&args.types.join(","))));
        }
        if let Some(s) = &args.since {
            query.push(format!("since={}", crate::serve_cmd::segment(s)));
        }
        if args.merge_deltas {
            query.push("merge=deltas".into());
        }
        let (server, run) = (args.server.clone(), args.run.clone());
        return crate::serve_cmd::events(server, run, args.after, args.follow, &query.join("&"), |e| {
            print_event(e, args.format)
        })
        .await;
    }
    let tasks = open_tasks(&args.store)?;
    if let Some(run) = &args.run {
        anyhow::ensure!(tasks.run_exists(run).await?, "there is no run `{run}` in the store; `pier runs` lists them");
    }
    // The store's watch carries the commits of the process that runs the tasks.
    let follow = Follow { run: args.run.clone(), after: args.after, live: args.follow, only, merge: args.merge_deltas };
    let mut follower = tasks.follow(follow);
    while let Some(batch) = follower.next_batch().await {
        for e in &batch? {
            print_event(e, args.format);
        }
    }
    Ok(())
}
