//! Subagents over ACP (seed 003's cross-process backend): the built-in `delegate`
//! tool hands one prompt to another ACP agent process and returns its answer.
//!
//! Each call starts a fresh child in its own process group, led by a [`guard`] that
//! ends the group when this process dies however it dies, runs `initialize`, `session/new` and one
//! `session/prompt` through `pier_client::run::run` (the same client as `pier exec`,
//! so every teardown guarantee of that path holds), and returns the child's last
//! message. The child's permission requests come back through the call's
//! [`pier_tools::CallLink`] and are judged by the parent's session ([`asker`]).
//! The child is not offered `fs/*` or `terminal/*`: it works with its own tools,
//! inside the roots it is given, which are the parent's.
//!
//! - [`asker`]: the machine channel for the child's permission requests.
//! - [`progress`]: what the delegate call shows while the child works.
//! - [`guard`]: `pier subagent-guard`, the leader of a child's process group.

pub mod asker;
pub mod guard;
pub mod progress;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_client_protocol_schema::v1::{ContentBlock, StopReason, TextContent};
use futures::future::BoxFuture;
use pier_client::registry::{self, AgentCommand, AgentDef};
use pier_client::run::{self as client_run, EVENT_QUEUE};
use pier_client::{ClientPolicy, Ending, Rule, RunOptions, SessionTarget};
use pier_tools::{Confinement, Preview, Scope, Tool, ToolContext, ToolError, ToolKind, ToolOutput, Workspace};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::asker::ParentAsker;
use crate::progress::Progress;

/// The tool's name, as the model calls it.
pub const NAME: &str = "delegate";

/// How often the delegate call's shown progress is refreshed, at most.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// The subagents running now, by their session ids: how an editor's `session/cancel`
/// of a child session (ACP subagents' per-child cancel) reaches that child alone.
/// Two children may report the same session id (ids are the agents' own), so each id
/// holds every child that reported it.
#[derive(Debug, Default)]
pub struct Children {
    running: Mutex<Running>,
}

#[derive(Debug, Default)]
struct Running {
    next: u64,
    by_session: HashMap<String, Vec<(u64, CancellationToken)>>,
}

impl Children {
    /// Cancels the children running in `session_id`; false when none does.
    pub fn cancel(&self, session_id: &str) -> bool {
        let tokens: Vec<CancellationToken> = self
            .lock()
            .by_session
            .get(session_id)
            .map(|v| v.iter().map(|(_, t)| t.clone()).collect())
            .unwrap_or_default();
        tokens.iter().for_each(CancellationToken::cancel);
        !tokens.is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn register(self: &Arc<Self>, session_id: String, stop: CancellationToken) -> Registered {
        let mut running = self.lock();
        running.next += 1;
        let n = running.next;
        running.by_session.entry(session_id.clone()).or_default().push((n, stop));
        Registered { children: self.clone(), session_id, n }
    }
}

/// A child in [`Children`] for as long as it lives.
struct Registered {
    children: Arc<Children>,
    session_id: String,
    n: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut running = self.children.lock();
        if let Some(list) = running.by_session.get_mut(&self.session_id) {
            list.retain(|(n, _)| *n != self.n);
            if list.is_empty() {
                running.by_session.remove(&self.session_id);
            }
        }
    }
}

/// How subagents are started. Built once per `pier agent` by the binary.
#[derive(Debug, Clone)]
pub struct SubagentConfig {
    /// `[agents.NAME]` from configuration, as `pier exec --agent` reads it.
    pub agents: BTreeMap<String, AgentDef>,
    /// The running pier binary.
    pub pier_exe: PathBuf,
    /// `PATH`, to find named agents.
    pub path: Option<String>,
    /// The default child: pier's own agent (automation profile, this agent's model and
    /// permission flags, subagent depth + 1). Also what the name `pier` means here.
    pub own: AgentCommand,
    /// Most delegate calls of one model message that run at once.
    pub max_concurrent: usize,
    /// How long a cancelled child gets to confirm (`--cancel-grace-ms`).
    pub cancel_grace: Duration,
    /// Longest wait for the child's `initialize` and `session/new`.
    pub setup_timeout: Duration,
    /// When set, the only directories the child's edits may land in.
    pub writable: Option<Vec<PathBuf>>,
    pub confinement: Confinement,
    /// The children running now; shared with the agent, which routes a child session's cancel here.
    pub children: Arc<Children>,
}

impl SubagentConfig {
    /// The command for `agent` (a registry name or a command line; the default child
    /// without one), run under `pier subagent-guard`.
    pub fn command(&self, agent: Option<&str>) -> Result<AgentCommand, ToolError> {
        let agent = match agent.map(str::trim) {
            None | Some("") | Some("pier") => self.own.clone(),
            Some(spec) => registry::resolve(spec, &self.agents, &self.pier_exe, self.path.as_deref())
                .map_err(|e| ToolError::new(format!("cannot start the subagent `{spec}`: {e}")))?,
        };
        let mut args = vec!["subagent-guard".to_owned(), "--".to_owned(), agent.program.display().to_string()];
        args.extend(agent.args);
        Ok(AgentCommand {
            name: agent.name,
            program: self.pier_exe.clone(),
            args,
            env: agent.env,
            env_remove: vec![],
            guarded: true,
        })
    }
}

/// The `delegate` tool.
pub struct Delegate {
    config: Arc<SubagentConfig>,
}

impl Delegate {
    pub fn new(config: SubagentConfig) -> Delegate {
        Delegate { config: Arc::new(config) }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    #[serde(default)]
    agent: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    timeout_s: Option<f64>,
}

/// What the model reads of [`Delegate`].
const DELEGATE_DESCRIPTION: &str = "Hand a self-contained piece of work to a subagent: a fresh agent process gets `prompt` in a new \
         session, works with its own tools inside this session's directories, and its final answer comes back \
         as this tool's result. The subagent sees nothing of this conversation, so put everything it needs in \
         the prompt. Several delegate calls in one message run at the same time.";

/// The arguments [`Delegate`] takes (JSON schema).
fn delegate_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "prompt": {"type": "string", "description": "The whole task for the subagent"},
            "agent": {"type": "string", "description": "Which agent: a registry name (pier, codex, claude, gemini or one from [agents]); default pier"},
            "cwd": {"type": "string", "description": "Its working directory, inside this session's roots; default the session directory"},
            "timeout_s": {"type": "number", "description": "Longest time the subagent may take, in seconds"}
        },
        "required": ["prompt"],
        "additionalProperties": false
    })
}

impl Tool for Delegate {
    // `other`, not `think`: a child may act by rules of its own (a third-party agent that
    // runs commands without asking), so starting one is not a read-only step; every action
    // the child does ask about comes back to this session's rules besides.
    pier_tools::tool_spec!(NAME, ToolKind::Other, DELEGATE_DESCRIPTION, delegate_parameters);

    fn preview(&self, args: &Value, _workspace: &Workspace) -> Preview {
        let agent = args.get("agent").and_then(Value::as_str).unwrap_or("pier");
        let prompt = args.get("prompt").and_then(Value::as_str).unwrap_or("");
        let first: String = prompt.lines().next().unwrap_or("").chars().take(60).collect();
        Preview { title: format!("Delegate to {agent}: {first}"), locations: Vec::new(), content: Vec::new() }
    }

    /// An *always* answer covers delegations to the same agent.
    fn scope(&self, args: &Value) -> Scope {
        let agent = args.get("agent").and_then(Value::as_str).map(str::trim).filter(|a| !a.is_empty());
        Scope::Names(vec![agent.unwrap_or("pier").to_owned()])
    }

    fn concurrency(&self) -> usize {
        self.config.max_concurrent.max(1)
    }

    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        let config = self.config.clone();
        Box::pin(async move {
            let args: Args = serde_json::from_value(args)
                .map_err(|e| ToolError::new(format!("invalid arguments for delegate: {e}")))?;
            delegate(&config, args, cx).await
        })
    }
}

async fn delegate(config: &SubagentConfig, args: Args, cx: ToolContext) -> Result<ToolOutput, ToolError> {
    if args.prompt.trim().is_empty() {
        return Err(ToolError::new("the prompt is empty; say what the subagent should do"));
    }
    let agent = config.command(args.agent.as_deref())?;
    let cwd = match args.cwd.as_deref() {
        Some(dir) => {
            let dir = cx.workspace.resolve(dir)?;
            if !dir.is_dir() {
                return Err(ToolError::new(format!("{} is not a directory", dir.display())));
            }
            dir
        }
        None => cx.workspace.root().to_path_buf(),
    };
    // Never wider than the parent: the parent's roots, and no more.
    let allow_dirs: Vec<PathBuf> = cx.workspace.roots().filter(|r| *r != cwd).map(Path::to_path_buf).collect();
    let (session_tx, mut session_ids) = mpsc::unbounded_channel();
    // Fires when the parent's turn is cancelled, or when an editor cancels this child alone.
    let stop = cx.cancel.child_token();
    let mut registered = None;
    let mut policy = ClientPolicy::default();
    for kind in ToolKind::ALL {
        // Every request reaches the parent's rules through the asker.
        policy.set(kind, Rule::Ask);
    }
    let name = agent.name.clone();
    let timeout = match args.timeout_s {
        Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s.min(7.0 * 86_400.0))),
        Some(_) => return Err(ToolError::new("timeout_s must be a positive number of seconds")),
        None => None,
    };
    let opts = RunOptions {
        agent,
        cwd: cwd.clone(),
        allow_dirs,
        fs: false,
        terminal: false,
        policy,
        interactive: false,
        echo_stderr: false,
        idle_timeout: None,
        max_time: timeout,
        cancel_grace: config.cancel_grace,
        setup_timeout: config.setup_timeout,
        asker: Some(Arc::new(ParentAsker { link: cx.link.clone(), agent: name.clone() })),
        writable: config.writable.clone(),
        confinement: config.confinement.clone(),
        jail: None,
        session_ids: Some(session_tx),
        meta: None,
        mcp_servers: Vec::new(),
        host_mcp_servers: Vec::new(),
    };
    let prompt = vec![ContentBlock::Text(TextContent::new(args.prompt))];
    let (events_tx, mut events) = mpsc::channel(EVENT_QUEUE);
    let (interrupt, interrupts) = mpsc::unbounded_channel();
    let run = client_run::run(opts, SessionTarget::New, prompt, events_tx, interrupts);
    tokio::pin!(run);
    let mut progress = Progress::default();
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut interrupted = false;
    let outcome = loop {
        tokio::select! {
            outcome = &mut run => break outcome,
            // The parent's turn is being cancelled: the child gets the cancel handshake
            // (session/cancel, its pending questions answered `cancelled`, a bounded wait),
            // then its group is ended; `run` returns only after all of it.
            _ = stop.cancelled(), if !interrupted => {
                interrupted = true;
                let _ = interrupt.send(());
            }
            Some(session_id) = session_ids.recv() => {
                registered = Some(config.children.register(session_id.clone(), stop.clone()));
                progress.session(session_id);
                if let Some(content) = progress.take() {
                    cx.link.progress(content);
                }
            }
            Some(event) = events.recv() => progress.see(&event),
            _ = tick.tick() => {
                if let Some(content) = progress.take() {
                    cx.link.progress(content);
                }
            }
        }
    };
    drop(registered);
    while let Ok(event) = events.try_recv() {
        progress.see(&event);
    }
    let stop_reason = outcome.stop_reason.map(|r| wire(&r));
    let answered = outcome.error.is_none()
        && outcome.ending == Ending::Answered
        && outcome.stop_reason == Some(StopReason::EndTurn);
    if !answered {
        cx.link.progress(progress.finished(stop_reason.clone(), progress.text()));
    }
    let raw = json!({
        "agent": name,
        "sessionId": outcome.session_id,
        "stopReason": stop_reason,
        "durationMs": outcome.duration.as_millis() as u64,
    });
    if let Some(error) = &outcome.error {
        let last = last_text(&outcome.text);
        return Err(ToolError::new(format!("the subagent `{name}` failed: {error}{last}")));
    }
    match (outcome.ending, outcome.stop_reason) {
        (Ending::Answered, Some(StopReason::EndTurn)) => {
            let mut out = ToolOutput::ok(outcome.text.clone(), raw);
            out.content = progress.finished(Some("end_turn".into()), outcome.text);
            Ok(out)
        }
        (Ending::TimedOut { limit, .. }, _) => {
            Err(ToolError::new(format!("the subagent `{name}` {limit} and was stopped{}", last_text(&outcome.text))))
        }
        (_, Some(reason)) => Err(ToolError::new(format!(
            "the subagent `{name}` stopped with `{}`{}",
            wire(&reason),
            last_text(&outcome.text)
        ))),
        (_, None) => {
            Err(ToolError::new(format!("the subagent `{name}` ended without an answer{}", last_text(&outcome.text))))
        }
    }
}

/// A stop reason's wire name.
fn wire(reason: &StopReason) -> String {
    serde_json::to_value(reason).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// Most bytes of a failed child's last text quoted in the error the model reads.
const LAST_TEXT_BYTES: usize = 4 * 1024;

fn last_text(text: &str) -> String {
    if text.trim().is_empty() {
        String::new()
    } else {
        format!("; its last text: {}", pier_tools::output::cap(text.to_owned(), LAST_TEXT_BYTES))
    }
}
