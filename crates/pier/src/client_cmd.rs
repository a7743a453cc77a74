//! `pier exec` and `pier prompt`: the headless client.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agent_client_protocol_schema::v1::{
    ContentBlock, EmbeddedResource, EmbeddedResourceResource, TextContent, TextResourceContents,
};
use anyhow::Context;
use pier_client::store::{SessionRecord, SessionStore};
use pier_client::{ClientError, ClientPolicy, NonInteractive, RunOptions, RunOutcome, SessionTarget, registry};
use pier_tools::ToolKind;
use tokio::sync::mpsc;

use crate::config::{self, FileConfig, ProcessEnv};
use crate::render::{self, Format, Renderer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NonInteractiveArg {
    Deny,
    Fail,
}

/// Options shared by `pier exec` and `pier prompt`.
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    /// The agent: pier, codex, claude, gemini, a name from [agents.NAME], or a command line
    #[arg(long, default_value = "pier")]
    agent: String,
    /// The session's working directory [default: the current directory]
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Add this file to the prompt, after the arguments (as an embedded resource where the agent takes one)
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
    /// Do not add stdin to the prompt even when it is not a terminal
    #[arg(long)]
    no_stdin: bool,
    /// Output: text, json (NDJSON events, then a result line) or quiet (the final text) [default: text]
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Allow every tool kind
    #[arg(long, conflicts_with_all = ["deny_all", "approve_reads"])]
    approve_all: bool,
    /// Allow read, search, think and fetch; ask for the rest (the default)
    #[arg(long)]
    approve_reads: bool,
    /// Deny every tool kind
    #[arg(long)]
    deny_all: bool,
    /// What an `ask` does when no one can be asked: deny it, or fail the run (exit 6)
    #[arg(long, value_enum, default_value = "deny")]
    non_interactive: NonInteractiveArg,
    /// Another directory the agent's fs/terminal calls may use (repeatable)
    #[arg(long = "allow-dir", value_name = "DIR")]
    allow_dirs: Vec<PathBuf>,
    /// Do not serve fs/read_text_file and fs/write_text_file
    #[arg(long)]
    no_fs: bool,
    /// Do not serve terminal/*
    #[arg(long)]
    no_terminal: bool,
    /// Cancel the turn after this many seconds without any update from the agent, and
    /// give up on an agent that takes longer to start or open the session [default: 600; start: 60]
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Cancel the turn after this many seconds in all
    #[arg(long, value_name = "SECS")]
    max_time: Option<f64>,
    /// How long a cancel may take to be confirmed before the agent is killed
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    cancel_grace: f64,
    /// `on`: terminal/* commands write only beneath the roots and the temp dir (Landlock), the agent
    /// runs open; `strict`: the agent and its commands run in a jail (files, network through pier's
    /// proxy, processes, `[limits]`); `workspace`: a jail for files only; `off`: nothing
    /// [default: on, or `sandbox = "off"` in pier.toml]
    #[arg(long, value_enum)]
    sandbox: Option<config::SandboxArg>,
    /// Show the agent's stderr and every client call
    #[arg(long, short)]
    verbose: bool,
    /// The prompt. Then come the -f file and stdin (when it is not a terminal), each as a block of its own
    prompt: Vec<String>,
}

/// `pier prompt`'s own options.
#[derive(Debug, clap::Args)]
pub struct PromptArgs {
    /// The session's name; the first call creates it, later ones continue it
    #[arg(short = 's', long = "session")]
    session: String,
    #[command(flatten)]
    client: ClientArgs,
}

fn secs(s: f64) -> Result<Duration, ClientError> {
    Duration::try_from_secs_f64(s).map_err(|_| ClientError::usage(format!("{s} is not a number of seconds")))
}

/// The prompt's blocks, as `llm` and `aichat` combine them: the arguments, then the
/// `-f` file, then stdin when it is not a terminal (unless `--no-stdin`), each a block
/// of its own. A lone `-` argument only says "stdin".
fn read_prompt(args: &ClientArgs) -> Result<Vec<ContentBlock>, ClientError> {
    let mut blocks = Vec::new();
    let words: Vec<&String> = args.prompt.iter().filter(|w| w.as_str() != "-").collect();
    if !words.is_empty() {
        blocks.push(ContentBlock::Text(TextContent::new(args.prompt.join(" "))));
    }
    if let Some(file) = &args.file {
        let text = std::fs::read_to_string(file)
            .map_err(|e| ClientError::usage(format!("cannot read -f {}: {e}", file.display())))?;
        let path = std::path::absolute(file).unwrap_or_else(|_| file.clone());
        let uri = format!("file://{}", path.display());
        blocks.push(ContentBlock::Resource(EmbeddedResource::new(EmbeddedResourceResource::TextResourceContents(
            TextResourceContents::new(text, uri),
        ))));
    }
    if !args.no_stdin && !std::io::stdin().is_terminal() {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| ClientError::usage(format!("cannot read stdin: {e} (--no-stdin leaves it out)")))?;
        if !text.trim().is_empty() {
            blocks.push(ContentBlock::Text(TextContent::new(text)));
        }
    }
    if blocks.is_empty() {
        return Err(ClientError::usage("no prompt: give it as arguments, with -f FILE, or on stdin"));
    }
    Ok(blocks)
}

fn policy(args: &ClientArgs, files: &FileConfig) -> Result<ClientPolicy, ClientError> {
    let mut p = ClientPolicy::default();
    for (kind, rule) in &files.client.permissions {
        let kind: ToolKind =
            kind.parse().map_err(|e: String| ClientError::usage(format!("[client.permissions]: {e}")))?;
        p.set(
            kind,
            rule.parse()
                .map_err(|e: String| ClientError::usage(format!("[client.permissions] {}: {e}", kind.as_str())))?,
        );
    }
    if args.approve_reads {
        p.approve_reads();
    }
    if args.approve_all {
        p.approve_all();
    }
    if args.deny_all {
        p.deny_all();
    }
    p.non_interactive = match args.non_interactive {
        NonInteractiveArg::Deny => NonInteractive::Deny,
        NonInteractiveArg::Fail => NonInteractive::Fail,
    };
    Ok(p)
}

/// The jail of `pier exec`/`pier prompt --sandbox strict|workspace`: the session's directories,
/// pier.toml's hosts and limits, pier's home hidden. Refused, never run open, where the
/// machine cannot give it.
fn client_jail(
    level: pier_jail::Level,
    exe: &std::path::Path,
    files: &config::FileConfig,
    cwd: &std::path::Path,
    allow_dirs: &[PathBuf],
) -> Result<pier_client::process::JailSetup, ClientError> {
    let jailer = pier_jail::Jailer::new(exe);
    if let Some(why) = jailer.kernel().refuses(level, &files.limits) {
        return Err(ClientError::usage(format!("--sandbox {level}: {why}")));
    }
    let hide = config::pier_home(&ProcessEnv).map(|h| vec![h]).unwrap_or_default();
    let request = pier_jail::Request {
        level,
        cwd: cwd.to_owned(),
        roots: allow_dirs.to_vec(),
        writable: None,
        network: files.network.clone(),
        limits: files.limits,
        hide,
        through_gateway: false,
    };
    Ok(pier_client::process::JailSetup { jailer, request })
}

fn options(args: &ClientArgs) -> Result<(RunOptions, Vec<ContentBlock>), ClientError> {
    let env = ProcessEnv;
    let here =
        std::env::current_dir().map_err(|e| ClientError::usage(format!("cannot read the current directory: {e}")))?;
    let cwd = args.cwd.clone().unwrap_or_else(|| here.clone());
    let cwd = cwd.canonicalize().map_err(|e| ClientError::usage(format!("--cwd {}: {e}", cwd.display())))?;
    let files = config::load_files(&env, &here).map_err(|e| ClientError::usage(format!("{e:#}")))?;
    let exe = std::env::current_exe().map_err(|e| ClientError::usage(format!("cannot find pier itself: {e}")))?;
    let path = std::env::var("PATH").ok();
    let agent = registry::resolve(&args.agent, &files.agents, &exe, path.as_deref())?;
    let prompt = read_prompt(args)?;
    let interactive = std::io::stdin().is_terminal() && std::io::stderr().is_terminal();
    let jail = match args.sandbox.and_then(config::SandboxArg::jail) {
        Some(level) => Some(client_jail(level, &exe, &files, &cwd, &args.allow_dirs)?),
        None => None,
    };
    let opts = RunOptions {
        agent,
        cwd,
        allow_dirs: args.allow_dirs.clone(),
        fs: !args.no_fs,
        terminal: !args.no_terminal,
        policy: policy(args, &files)?,
        interactive,
        echo_stderr: args.verbose,
        idle_timeout: Some(secs(args.timeout.unwrap_or(600.0))?),
        max_time: args.max_time.map(secs).transpose()?,
        cancel_grace: secs(args.cancel_grace)?,
        setup_timeout: args.timeout.map_or(Ok(Duration::from_secs(60)), secs)?,
        asker: None,
        writable: None,
        confinement: config::resolve_confinement(&files, args.sandbox)
            .map_err(|e| ClientError::usage(format!("{e:#}")))?,
        jail,
        session_ids: None,
        meta: None,
        mcp_servers: Vec::new(),
        host_mcp_servers: Vec::new(),
    };
    // Which confinement terminals get, where it can be seen without flooding the output.
    tracing::info!(confinement = %pier_tools::contain::describe(&opts.confinement), "terminals");
    if args.verbose {
        eprintln!("pier: terminals: {}", pier_tools::contain::describe(&opts.confinement));
    }
    Ok((opts, prompt))
}

/// Which signal interrupted a run first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signalled {
    Interrupt,
    Terminate,
}

/// Runs one prompt with Ctrl-C and SIGTERM wired to the run: each is one interrupt
/// (the cancel handshake during a turn, a kill before it). Also says which signal came first.
async fn run_with_signals(
    opts: RunOptions,
    target: SessionTarget,
    prompt: Vec<ContentBlock>,
    renderer: &mut Renderer,
) -> (RunOutcome, Option<Signalled>) {
    let (events_tx, mut events_rx) = mpsc::channel(pier_client::run::EVENT_QUEUE);
    let (int_tx, int_rx) = mpsc::unbounded_channel();
    let first = std::sync::Arc::new(std::sync::OnceLock::new());
    let seen = first.clone();
    // Installed before the agent starts, so no signal finds the default action.
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()));
    let signals = tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            return;
        };
        loop {
            let which = tokio::select! {
                _ = term.recv() => Signalled::Terminate,
                _ = int.recv() => Signalled::Interrupt,
            };
            let _ = seen.set(which);
            if int_tx.send(()).is_err() {
                return;
            }
        }
    });
    let run = pier_client::run::run(opts, target, prompt, events_tx, int_rx);
    tokio::pin!(run);
    let outcome = loop {
        tokio::select! {
            outcome = &mut run => break outcome,
            Some(event) = events_rx.recv() => renderer.event(&event),
        }
    };
    while let Ok(event) = events_rx.try_recv() {
        renderer.event(&event);
    }
    signals.abort();
    (outcome, first.get().copied())
}

/// The exit code: 143 for a run that SIGTERM ended, as for any process it ends.
fn exit_code(outcome: &RunOutcome, signalled: Option<Signalled>) -> i32 {
    let code = render::exit_code(outcome);
    if code == render::exit::CANCELLED && signalled == Some(Signalled::Terminate) {
        render::exit::TERMINATED
    } else {
        code
    }
}

fn format_of(args: &ClientArgs) -> Format {
    args.format.unwrap_or(Format::Text)
}

/// `pier exec`: returns the exit code.
pub async fn exec(args: ClientArgs) -> i32 {
    let mut renderer = Renderer::new(format_of(&args), args.verbose);
    let (outcome, signalled) = match options(&args) {
        Ok((opts, prompt)) => run_with_signals(opts, SessionTarget::New, prompt, &mut renderer).await,
        Err(e) => (RunOutcome::failed(Some(e)), None),
    };
    let code = exit_code(&outcome, signalled);
    renderer.finish(&outcome, code);
    code
}

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// `pier prompt -s NAME`: returns the exit code.
pub async fn prompt(args: PromptArgs) -> i32 {
    let mut renderer = Renderer::new(format_of(&args.client), args.client.verbose);
    let (outcome, signalled) = match prompt_inner(&args, &mut renderer).await {
        Ok(o) => o,
        Err(e) => (RunOutcome::failed(Some(e)), None),
    };
    let code = exit_code(&outcome, signalled);
    renderer.finish(&outcome, code);
    code
}

async fn prompt_inner(
    args: &PromptArgs,
    renderer: &mut Renderer,
) -> Result<(RunOutcome, Option<Signalled>), ClientError> {
    let (opts, prompt) = options(&args.client)?;
    let home = config::pier_home(&ProcessEnv).map_err(|e| ClientError::usage(format!("{e:#}")))?;
    let store = SessionStore::new(&home);
    let agent = args.client.agent.clone();
    let cwd = opts.cwd.clone();
    let existing = store
        .get(&agent, &cwd, &args.session)
        .map_err(|e| ClientError::usage(format!("cannot read the session record: {e}")))?;
    let target = match &existing {
        Some(r) => SessionTarget::Continue { session_id: r.session_id.clone() },
        None => SessionTarget::NewContinuable,
    };
    let (outcome, signalled) = run_with_signals(opts, target, prompt, renderer).await;
    if let Some(session_id) = &outcome.session_id {
        let now = now_ms();
        let record = SessionRecord {
            name: args.session.clone(),
            agent,
            cwd,
            session_id: session_id.clone(),
            created_at_ms: existing.as_ref().map_or(now, |r| r.created_at_ms),
            updated_at_ms: now,
            turns: existing.as_ref().map_or(0, |r| r.turns) + u64::from(outcome.stop_reason.is_some()),
            last_stop_reason: outcome
                .stop_reason
                .and_then(|s| serde_json::to_value(s).ok())
                .and_then(|v| v.as_str().map(str::to_owned)),
        };
        if let Err(e) = store.put(&record) {
            tracing::error!(error = %e, "could not save the session record");
            return Err(ClientError::usage(format!("the turn ran, but its session record could not be saved: {e}")));
        }
    }
    Ok((outcome, signalled))
}

/// `pier sessions`.
#[derive(Debug, clap::Subcommand)]
pub enum SessionsCmd {
    /// List named sessions
    List {
        /// One JSON object per line
        #[arg(long)]
        json: bool,
    },
    /// Show one named session
    Show(SessionKey),
    /// Forget a named session (the agent keeps its own copy)
    Rm(SessionKey),
}

#[derive(Debug, clap::Args)]
pub struct SessionKey {
    name: String,
    #[arg(long, default_value = "pier")]
    agent: String,
    /// [default: the current directory]
    #[arg(long)]
    cwd: Option<PathBuf>,
}

#[allow(clippy::print_stdout)]
pub fn sessions(cmd: SessionsCmd) -> anyhow::Result<()> {
    let store = SessionStore::new(&config::pier_home(&ProcessEnv)?);
    let key_cwd = |k: &SessionKey| -> anyhow::Result<PathBuf> {
        let cwd = match &k.cwd {
            Some(c) => c.clone(),
            None => std::env::current_dir()?,
        };
        cwd.canonicalize().with_context(|| format!("--cwd {}", cwd.display()))
    };
    match cmd {
        SessionsCmd::List { json } => {
            for r in store.list()? {
                if json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!(
                        "{}\t{}\t{}\t{} turns\t{}",
                        r.name,
                        r.agent,
                        r.cwd.display(),
                        r.turns,
                        r.last_stop_reason.as_deref().unwrap_or("-")
                    );
                }
            }
        }
        SessionsCmd::Show(k) => {
            let cwd = key_cwd(&k)?;
            match store.get(&k.agent, &cwd, &k.name)? {
                Some(r) => println!("{}", serde_json::to_string_pretty(&r)?),
                None => anyhow::bail!("no session `{}` for agent `{}` in {}", k.name, k.agent, cwd.display()),
            }
        }
        SessionsCmd::Rm(k) => {
            let cwd = key_cwd(&k)?;
            if !store.remove(&k.agent, &cwd, &k.name)? {
                anyhow::bail!("no session `{}` for agent `{}` in {}", k.name, k.agent, cwd.display());
            }
        }
    }
    Ok(())
}
