//! `pier serve`, and the commands that talk to it: `pier submit`, `pier status`, `pier cancel`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pier_host::HostConfig;
use pier_server::App;
use serde_json::{Value, json};

use crate::config::{self, ProcessEnv};
use crate::run_cmd::EventFormat;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on; loopback unless you say otherwise
    #[arg(long, default_value = "127.0.0.1:8477")]
    listen: SocketAddr,
    /// The bearer token [env: PIER_TOKEN; default: created once in $PIER_HOME/serve.token]
    #[arg(long)]
    token: Option<String>,
    /// People with tokens of their own, each with a role (viewer, operator, admin): a TOML
    /// file of `[[user]] name, role, token_sha256`. The server's token stays an admin's
    #[arg(long, value_name = "FILE")]
    users: Option<PathBuf>,
    /// Tasks run at once by this node, across every run it drives
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// The store: `postgres://USER@HOST/DB` to share one database among several nodes,
    /// `sqlite://PATH` or a path [env: PIER_STORE; default: $PIER_HOME/pier.db]
    #[arg(long)]
    store: Option<String>,
    /// This node's name among the nodes sharing the store (`GET /nodes`) [default: HOST-PID]
    #[arg(long)]
    node_id: Option<String>,
    /// Lease time-to-live in milliseconds; renewed every third of it. Another node takes
    /// an attempt back this long after its host died
    #[arg(long, default_value_t = 15_000, hide = true)]
    lease_ttl_ms: u64,
    /// Also serve `GET /metrics` here, without the token (an address only the scraper reaches)
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// Events queued at most for one /events client
    #[arg(long, default_value_t = 256, hide = true)]
    sse_buffer: usize,
    /// How long a client whose queue is full may take nothing before it is cut (it can resume)
    #[arg(long, default_value_t = 30_000, hide = true)]
    sse_patience_ms: u64,
}

/// Roughly how many guesses a token takes, in bits: its length times the bits of the
/// character classes it draws from (a generous estimate for a word, exact for random hex).
fn token_bits(token: &str) -> f64 {
    let has = |class: fn(&char) -> bool| token.chars().any(|c| class(&c));
    let mut alphabet: f64 = 0.0;
    for (class, size) in [
        (char::is_ascii_lowercase as fn(&char) -> bool, 26.0),
        (char::is_ascii_uppercase, 26.0),
        (char::is_ascii_digit, 10.0),
        (|c: &char| !c.is_ascii_alphanumeric(), 33.0),
    ] {
        if has(class) {
            alphabet += size;
        }
    }
    // Hex (digits and a-f only) is 16 symbols, not 36.
    let hex = token.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        && token.chars().any(|c| c.is_ascii_lowercase());
    let alphabet = if hex { 16.0 } else { alphabet };
    token.chars().count() as f64 * alphabet.max(1.0).log2()
}

/// The token: `--token`, `PIER_TOKEN`, or the token file (made on first use).
fn token(args: &ServeArgs, home: &std::path::Path) -> anyhow::Result<String> {
    Ok(match args.token.clone().or_else(|| std::env::var("PIER_TOKEN").ok().filter(|t| !t.is_empty())) {
        Some(t) => t,
        None => {
            let path = pier_server::token_path(home);
            let (token, created) =
                pier_server::load_or_create_token(&path).with_context(|| format!("token file {}", path.display()))?;
            if created {
                eprintln!("pier serve: created a token (saved to {}, mode 0600): {token}", path.display());
            }
            token
        }
    })
}

/// Resolves once SIGTERM or SIGINT comes, or the service fails (with its error).
async fn stopped(app: &std::sync::Arc<pier_server::App>) -> Option<pier_host::StoreError> {
    use tokio::signal::unix::{SignalKind, signal};
    let signals = async {
        if let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        _ = signals => None,
        e = app.failed() => Some(e),
    }
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let env = ProcessEnv;
    let home = config::pier_home(&env)?;
    let here = std::env::current_dir()?;
    let files = config::load_files(&env, &here)?;
    if args.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
        anyhow::bail!("--token is empty: give a token, or leave --token out to use the token file");
    }
    let token = token(&args, &home)?;
    let bits = token_bits(&token);
    if bits < 128.0 {
        let why = format!(
            "the token has about {bits:.0} bits of entropy, under 128: someone who can reach {} could guess it",
            args.listen
        );
        let fix = "leave --token and PIER_TOKEN out to use the generated one, or give 32 random hex characters \
                   (`openssl rand -hex 16`)";
        if !args.listen.ip().is_loopback() {
            anyhow::bail!("{why}; {fix}");
        }
        eprintln!("pier serve: warning: {why} (loopback only, so it starts); {fix}");
    }
    let users = args.users.as_deref().map(pier_server::access::Users::load).transpose()?;
    let schedules = config::schedules(&files.schedules, &here)?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let config = HostConfig {
        concurrency: args.concurrency.max(1),
        node: match &args.node_id {
            Some(n) if n.trim().is_empty() => {
                anyhow::bail!("--node-id is empty: give this node a name, or leave it out")
            }
            Some(n) => n.clone(),
            None => HostConfig::node_id(),
        },
        lease_ttl: Duration::from_millis(args.lease_ttl_ms.max(300)),
        gateway: config::gateway(&files, &env)?,
        types: config::types(&files)?,
        mcp: Some(pier_host::host_mcp::HostMcp::new(&mcp_url(addr)).map_err(anyhow::Error::msg)?),
        ..HostConfig::new(std::env::current_exe()?, files.agents.clone(), here)
    };
    let tasks = crate::run_cmd::open_tasks_with(&args.store, &files, config)?;
    tasks.install_schedules(schedules).await.context("`[[schedules]]` in pier.toml")?;
    let sse = pier_server::SseLimits {
        buffer: args.sse_buffer.max(1),
        patience: Duration::from_millis(args.sse_patience_ms),
    };
    let app = App::configured(tasks, token, sse, users);
    // Runs left unfinished by an earlier host go on, with every run submitted later.
    let host = app.start();
    // Without it an SSE event or an answer written right after another waits for the
    // client's delayed ACK (Nagle's algorithm): up to 40 ms.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY on a connection");
        }
    });
    eprintln!("pier serve: listening on http://{addr}");
    if let Some(at) = args.metrics_listen {
        let metrics = tokio::net::TcpListener::bind(at).await.with_context(|| format!("cannot listen on {at}"))?;
        eprintln!("pier serve: metrics on http://{}/metrics", metrics.local_addr()?);
        let router = pier_server::metrics_router(app.clone());
        // It ends with the process; it holds no work to finish.
        tokio::spawn(async move {
            if let Err(e) = axum::serve(metrics, router).await {
                tracing::error!(error = %e, "the metrics listener stopped");
            }
        });
    }
    let shutdown_app = app.clone();
    let fatal = Arc::new(std::sync::Mutex::new(None));
    let fatal_seen = fatal.clone();
    let service = pier_server::router(app).into_make_service_with_connect_info::<std::net::SocketAddr>();
    axum::serve(listener, service)
        .with_graceful_shutdown(async move {
            *fatal_seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = stopped(&shutdown_app).await;
            shutdown_app.shutdown();
        })
        .await?;
    // Running attempts are cancelled through the handshake before the process ends.
    let _ = host.await;
    if let Some(e) = fatal.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
        return Err(anyhow::Error::new(e).context("pier serve stopped"));
    }
    Ok(())
}

/// The URL of the host's MCP endpoint as its agents, on this machine, reach it: a server
/// listening on every address is reached on loopback.
fn mcp_url(addr: std::net::SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/mcp", std::net::SocketAddr::new(ip, addr.port()))
}

/// Where a running `pier serve` is, and its token.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// The server's base URL [env: PIER_SERVER]
    #[arg(long)]
    server: Option<String>,
}

impl ServerArgs {
    /// The server's URL: `--server`, else `PIER_SERVER`.
    pub fn url(&self) -> anyhow::Result<String> {
        server_url(self)
    }
}

fn server_url(args: &ServerArgs) -> anyhow::Result<String> {
    args.server
        .clone()
        .or_else(|| std::env::var("PIER_SERVER").ok().filter(|s| !s.is_empty()))
        .context("name the server with --server URL or PIER_SERVER")
}

fn client(args: &ServerArgs) -> anyhow::Result<(reqwest::Client, String, String)> {
    let server = server_url(args)?;
    let token = match std::env::var("PIER_TOKEN").ok().filter(|t| !t.is_empty()) {
        Some(t) => t,
        None => {
            let path = pier_server::token_path(&config::pier_home(&ProcessEnv)?);
            std::fs::read_to_string(&path)
                .with_context(|| format!("set PIER_TOKEN or keep the token in {}", path.display()))?
                .trim()
                .to_owned()
        }
    };
    Ok((reqwest::Client::new(), server.trim_end_matches('/').to_owned(), token))
}

async fn call(args: &ServerArgs, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
    let (http, base, token) = client(args)?;
    let mut req = http.request(method, format!("{base}{path}")).bearer_auth(token);
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b.to_string());
    }
    let resp = req.send().await.with_context(|| format!("cannot reach {base}"))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    let value: Value = serde_json::from_str(&text).unwrap_or(json!({"raw": text}));
    if !status.is_success() {
        let msg = value["error"]["message"].as_str().unwrap_or(&text).to_owned();
        let code = value["error"]["code"].as_str().unwrap_or("http");
        anyhow::bail!("the server answered {status} ({code}): {msg}");
    }
    Ok(value)
}

#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    /// The plan file (or give --type)
    #[arg(required_unless_present = "task_type", conflicts_with = "task_type")]
    plan: Option<PathBuf>,
    #[arg(long)]
    run_id: Option<String>,
    /// One task of this type (pier.toml's `[types.NAME]` on the server)
    #[arg(long = "type", value_name = "NAME")]
    task_type: Option<String>,
    /// A field of the task's input: `KEY=VALUE` (VALUE read as JSON when it is, else as text)
    #[arg(long, value_name = "KEY=VALUE", requires = "task_type")]
    input: Vec<String>,
    /// 0..=9, for every task of the plan (or the --type task); among ready tasks the higher goes first
    #[arg(long)]
    priority: Option<u8>,
    /// The task's id [default: the type's name]
    #[arg(long, requires = "task_type")]
    task_id: Option<String>,
    #[command(flatten)]
    server: ServerArgs,
}

/// `KEY=VALUE` pairs as a JSON object: a VALUE that is JSON (`3`, `true`, `["a"]`) as that, else as text.
fn input_object(pairs: &[String]) -> anyhow::Result<serde_json::Value> {
    let mut input = serde_json::Map::new();
    for pair in pairs {
        let Some((key, value)) = pair.split_once('=') else {
            anyhow::bail!("--input {pair:?}: give KEY=VALUE");
        };
        let value = serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::String(value.to_owned()));
        input.insert(key.to_owned(), value);
    }
    Ok(serde_json::Value::Object(input))
}

#[allow(clippy::print_stdout)]
pub async fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    let body = match (&args.plan, &args.task_type) {
        (Some(path), _) => {
            let plan = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            let types = config::types_beside(path)?;
            json!({"plan": plan, "run_id": args.run_id, "priority": args.priority, "types": types})
        }
        (None, Some(ty)) => json!({"type": ty, "input": input_object(&args.input)?, "priority": args.priority,
                                   "task_id": args.task_id, "run_id": args.run_id}),
        (None, None) => anyhow::bail!("give a plan file or --type NAME"),
    };
    let v = call(&args.server, reqwest::Method::POST, "/runs", Some(body)).await?;
    let run = v["run"].as_str().unwrap_or("");
    if v["created"] == false {
        eprintln!("pier submit: run {run} was submitted with this plan already; nothing runs again");
    }
    println!("{run}");
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// One run's tasks [default: every run, newest first]
    run: Option<String>,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
    #[command(flatten)]
    server: ServerArgs,
}

/// `pier status [RUN]`: `pier runs` or `pier show RUN` against a server.
pub async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let server = Some(server_url(&args.server)?);
    let source = crate::show_cmd::Source::remote(server);
    match args.run {
        Some(run) => crate::show_cmd::show(crate::show_cmd::ShowArgs::new(run, args.format, source)).await,
        None => crate::show_cmd::runs(crate::show_cmd::RunsArgs::new(args.format, source)).await,
    }
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    run: String,
    /// Only this task
    task: Option<String>,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
    #[command(flatten)]
    server: ServerArgs,
}

#[allow(clippy::print_stdout)]
pub async fn cancel(args: CancelArgs) -> anyhow::Result<()> {
    let path = match &args.task {
        Some(t) => format!("/runs/{}/tasks/{}/cancel", segment(&args.run), segment(t)),
        None => format!("/runs/{}/cancel", segment(&args.run)),
    };
    let v = call(&args.server, reqwest::Method::POST, &path, Some(json!({}))).await?;
    match (args.format, &args.task) {
        (EventFormat::Json, _) => println!("{v}"),
        (EventFormat::Text, Some(task)) => {
            let state = v["task"]["state"].as_str().unwrap_or("?");
            if state == "cancelled" {
                println!("task {task} of run {}: cancelled", args.run);
            } else if v["task"]["cancel_requested"].is_string() {
                println!(
                    "task {task} of run {}: stopping; its agent was asked to end and the task ends cancelled \
                     (`pier show {} {task}` to see it end)",
                    args.run, args.run
                );
            } else {
                println!("task {task} of run {} is {state}; there was nothing to cancel", args.run);
            }
        }
        (EventFormat::Text, None) => match v["stopping"].as_u64() {
            Some(n) if n > 0 => println!(
                "run {}: {} unfinished task(s) cancelled; {n} still stopping (their agents were asked to end)",
                args.run, v["cancelled"]
            ),
            _ => println!("run {}: {} unfinished task(s) cancelled", args.run, v["cancelled"]),
        },
    }
    Ok(())
}

/// A GET of `path` on the server (`--server` or `PIER_SERVER`), its JSON answer.
pub async fn get(server: Option<String>, path: &str) -> anyhow::Result<Value> {
    call(&ServerArgs { server }, reqwest::Method::GET, path, None).await
}

/// A `method` request of `path` on the server, with `body`, its JSON answer.
pub async fn request(
    server: Option<String>,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    call(&ServerArgs { server }, method, path, body).await
}

/// A POST of `body` to `path` on the server, its JSON answer.
pub async fn post(server: Option<String>, path: &str, body: Value) -> anyhow::Result<Value> {
    call(&ServerArgs { server }, reqwest::Method::POST, path, Some(body)).await
}

pub use pier_server::segment;

/// Streams events from a running server (SSE), resuming after the last one seen
/// if the connection drops.
pub async fn events(
    server: Option<String>,
    run: Option<String>,
    mut after: i64,
    follow: bool,
    query: &str,
    mut print: impl FnMut(&pier_host::Event),
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let (http, base, token) = client(&ServerArgs { server })?;
    loop {
        let mut url = format!("{base}/events?after={after}&follow={follow}");
        if let Some(r) = &run {
            url.push_str(&format!("&run={}", segment(r)));
        }
        if !query.is_empty() {
            url.push('&');
            url.push_str(query);
        }
        let resp = http.get(&url).bearer_auth(&token).send().await.with_context(|| format!("cannot reach {base}"))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body: serde_json::Value =
                serde_json::from_str(&resp.text().await.unwrap_or_default()).unwrap_or_default();
            let why = body["error"]["message"].as_str().map(|m| format!(": {m}")).unwrap_or_default();
            anyhow::bail!("the server answered {status}{why}");
        }
        let mut stream = resp.bytes_stream();
        let mut sse = pier_model::sse::SseDecoder::new(16 << 20);
        while let Some(chunk) = stream.next().await {
            let Ok(chunk) = chunk else { break };
            for data in sse.push(&chunk).map_err(|e| anyhow::anyhow!("an event line of {} bytes is too long", e.0))? {
                let event = pier_host::Event::from_wire(serde_json::from_str(&data)?)
                    .ok_or_else(|| anyhow::anyhow!("the server sent an event that is not one: {data}"))?;
                after = event.seq;
                print(&event);
            }
        }
        if !follow {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod token_tests {
    #[test]
    fn short_tokens_are_weak_and_the_generated_one_is_not() {
        assert!(super::token_bits("tok123") < 40.0);
        assert!(super::token_bits("bench") < 128.0);
        assert!(super::token_bits(&"7".repeat(32)) < 128.0, "digits only are 10 symbols, not 16");
        assert!(super::token_bits(&"0123456789abcdef".repeat(2)) >= 128.0, "32 hex characters");
        assert!(super::token_bits(&"0123456789abcdef".repeat(4)) >= 128.0, "the generated token");
    }
}
