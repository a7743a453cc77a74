//! The model gateway: the model APIs agents speak, passed through to their providers with the
//! real key swapped in and every request's tokens counted from the provider's own answer.
//!
//! One gateway serves a whole host on a loopback port. Each attempt opens an [`Account`]: its
//! upstreams (base URL and real key per route) and the [`Meter`] its requests are recorded to.
//! The attempt's agent is given base-URL variables that point at the gateway and, in place of
//! every key, the account's placeholder ([`Ticket::env`]); the placeholder names the account, so
//! a request is billed to the attempt that made it and an agent never holds a real key. Routes:
//!
//! | agent variable | path prefix | speaks |
//! |---|---|---|
//! | `OPENAI_BASE_URL` | `/openai/v1` | Chat Completions, Responses |
//! | `ANTHROPIC_BASE_URL` | `/anthropic` | Messages |
//! | `GOOGLE_GEMINI_BASE_URL` | `/gemini` | `generateContent`, `streamGenerateContent` |
//! | `PIER_BASE_URL` | `/pier/v1` | Chat Completions (pier's own agent) |
//!
//! Answers reach the agent byte for byte as the upstream sent them (only `Accept-Encoding` is
//! dropped on the way up, so the gateway can read the usage it carries).

mod forward;
pub mod limit;
pub mod usage;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub use limit::RateLimit;
pub use usage::{Api, Usage};

/// Largest request body the gateway takes (a prompt with images); larger ones get 413.
pub const MAX_REQUEST_BYTES: usize = 64 << 20;
/// Longest silence allowed from an upstream, for the head and between chunks of an answer.
pub const UPSTREAM_IDLE: Duration = Duration::from_secs(300);

/// Key variables an agent might read instead of a route's own, withheld from every agent the
/// gateway serves (a bearer token in place of an Anthropic key, a Vertex key for Gemini).
pub const OTHER_KEYS: &[&str] = &["ANTHROPIC_AUTH_TOKEN", "GOOGLE_API_KEY", "CODEX_API_KEY", "AZURE_OPENAI_API_KEY"];

/// A model API as the gateway routes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    OpenAi,
    Anthropic,
    Gemini,
    /// pier's own agent's provider (an OpenAI-compatible endpoint).
    Pier,
}

impl Route {
    pub const ALL: [Route; 4] = [Route::OpenAi, Route::Anthropic, Route::Gemini, Route::Pier];

    /// The path the route's base URL ends in at the gateway.
    pub fn prefix(self) -> &'static str {
        match self {
            Route::OpenAi => "/openai/v1",
            Route::Anthropic => "/anthropic",
            Route::Gemini => "/gemini",
            Route::Pier => "/pier/v1",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Route::OpenAi => "openai",
            Route::Anthropic => "anthropic",
            Route::Gemini => "gemini",
            Route::Pier => "pier",
        }
    }

    pub fn api(self) -> Api {
        match self {
            Route::OpenAi | Route::Pier => Api::OpenAi,
            Route::Anthropic => Api::Anthropic,
            Route::Gemini => Api::Gemini,
        }
    }

    /// The variable an agent reads its base URL from, and the one it reads its key from.
    pub fn variables(self) -> (&'static str, &'static str) {
        match self {
            Route::OpenAi => ("OPENAI_BASE_URL", "OPENAI_API_KEY"),
            Route::Anthropic => ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"),
            Route::Gemini => ("GOOGLE_GEMINI_BASE_URL", "GEMINI_API_KEY"),
            Route::Pier => ("PIER_BASE_URL", "PIER_API_KEY"),
        }
    }

    /// The provider's own base URL, in the form its variable takes.
    pub fn default_base(self) -> Option<&'static str> {
        match self {
            Route::OpenAi => Some("https://api.openai.com/v1"),
            Route::Anthropic => Some("https://api.anthropic.com"),
            Route::Gemini => Some("https://generativelanguage.googleapis.com"),
            Route::Pier => None,
        }
    }
}

/// Where one route of an account goes.
#[derive(Clone)]
pub struct Upstream {
    pub route: Route,
    /// The provider's base URL, as the route's variable would hold it.
    pub base_url: String,
    /// The real key, sent in the header the agent used for the placeholder.
    pub key: Option<String>,
    /// The provider's name in accounting (`openai`, `deepseek`…).
    pub provider: String,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("route", &self.route)
            .field("base_url", &self.base_url)
            .field("key", &self.key.as_ref().map(|_| "***"))
            .field("provider", &self.provider)
            .finish()
    }
}

/// One model request as the gateway saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCall {
    pub provider: String,
    pub route: Route,
    /// As the upstream's answer names it, else as the request did.
    pub model: Option<String>,
    /// The upstream's status; 0 when no answer came.
    pub status: u16,
    /// From the request's arrival to the answer's last byte (or its failure).
    pub latency_ms: u64,
    /// Of the latency, how long the request was held for a rate limit (the node's or the provider's).
    pub held_ms: u64,
    pub streamed: bool,
    /// Tokens as the upstream reported them; `None` when it reported none.
    pub usage: Option<Usage>,
    /// The answer reached the agent whole.
    pub complete: bool,
    /// The agent hung up before the answer ended, and [`Meter::hung_up`] was told then.
    #[serde(skip)]
    pub hung_up: bool,
    /// Why it did not, or why it was not sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Where an account's requests are recorded: [`Meter::admit`] before anything is sent, [`Meter::begin`] when a request is taken on,
/// then exactly one [`Meter::record`] however it ends.
pub trait Meter: Send + Sync {
    /// Whether a request may go at all (`Err`: why not, for the agent to read); asked first.
    fn admit(&self) -> Result<(), String> {
        Ok(())
    }
    fn begin(&self) {}
    /// The agent went away mid-answer; the rest is still read for its usage, and recorded
    /// later ([`ModelCall::hung_up`] then set). Nobody waits on the agent's side any more.
    fn hung_up(&self) {}
    /// The provider is rate limited past what the gateway may hold a request for: the agent
    /// was given the provider's 429, and nothing of this account should be sent before
    /// `until_ms` (milliseconds since the epoch). Told before the refused request is recorded.
    fn rate_limited(&self, until_ms: i64, why: String) {
        let _ = (until_ms, why);
    }
    fn record(&self, call: ModelCall);
}

/// What one attempt may reach through the gateway, and where its spend is recorded.
pub struct Account {
    /// Names the attempt in logs.
    pub label: String,
    pub upstreams: Vec<Upstream>,
    pub meter: Arc<dyn Meter>,
}

/// The gateway, shared by every attempt of a host; cheap to clone.
#[derive(Clone)]
pub struct Gateway {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    accounts: Mutex<HashMap<String, Arc<Account>>>,
    pub(crate) client: reqwest::Client,
    addr: SocketAddr,
    cancel: CancellationToken,
    pub(crate) limiters: limit::Limiters,
}

impl Shared {
    pub(crate) fn account(&self, key: &str) -> Option<Arc<Account>> {
        self.accounts.lock().unwrap_or_else(PoisonError::into_inner).get(key).cloned()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("addr", &self.shared.addr).finish_non_exhaustive()
    }
}

impl Gateway {
    /// Binds a loopback port and serves it until the last clone is dropped. Call within a
    /// tokio runtime.
    pub fn start() -> std::io::Result<Gateway> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let client = reqwest::Client::builder()
            .connect_timeout(crate::CONNECT_TIMEOUT)
            .read_timeout(UPSTREAM_IDLE)
            .tcp_nodelay(true)
            // Answers are read as they come; a decompressing client would hide their usage.
            .no_gzip()
            .build()
            .map_err(std::io::Error::other)?;
        let cancel = CancellationToken::new();
        let shared = Arc::new(Shared {
            accounts: Mutex::new(HashMap::new()),
            client,
            addr,
            cancel: cancel.clone(),
            limiters: Default::default(),
        });
        let limit = Arc::new(Semaphore::new(crate::MAX_CONNECTIONS * 4));
        tokio::spawn(cancel.run_until_cancelled_owned(forward::accept_loop(listener, Arc::downgrade(&shared), limit)));
        tracing::info!(%addr, "model gateway serving");
        Ok(Gateway { shared })
    }

    /// Each provider's rate limits (by [`Upstream::provider`]), for the whole store.
    pub fn set_rate_limits(&self, limits: HashMap<String, RateLimit>) {
        self.shared.limiters.set(limits);
    }

    /// How many live nodes share the rate limits: this node holds its share of each.
    pub fn set_nodes(&self, nodes: u32) {
        self.shared.limiters.set_nodes(nodes);
    }

    /// The gateway's address (loopback).
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Opens `account` until the returned ticket is dropped.
    pub fn open(&self, account: Account) -> Ticket {
        let key = format!("pier-gw-{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
        let routes = account.upstreams.iter().map(|u| u.route).collect();
        self.shared.accounts.lock().unwrap_or_else(PoisonError::into_inner).insert(key.clone(), Arc::new(account));
        Ticket { key, routes, shared: self.shared.clone() }
    }
}

/// An open account; dropping it closes the account (its placeholder stops working).
pub struct Ticket {
    key: String,
    routes: Vec<Route>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("addr", &self.shared.addr).finish_non_exhaustive()
    }
}

impl Ticket {
    /// The placeholder key that names the account.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The agent's variables: each of the account's routes' base URL at the gateway and the
    /// placeholder as its key. (The host also withholds every other key variable: [`OTHER_KEYS`].)
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        for &route in &self.routes {
            let (base, key) = route.variables();
            env.push((base.to_owned(), format!("http://{}{}", self.shared.addr, route.prefix())));
            env.push((key.to_owned(), self.key.clone()));
        }
        env
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.shared.accounts.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.key);
    }
}
