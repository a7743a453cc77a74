//! Rate limits per provider, held at the gateway for every agent of a node: requests per minute
//! spaced evenly (a cell-rate schedule: each request takes the next free slot, a burst of at
//! most one second's worth), tokens per minute as a level the answers' usage drains and time
//! refills, and a provider's own "too many requests" (429, 529) closing it for everyone here
//! until the reset it named. A request waits for its slot while the wait is within the
//! provider's `hold`; past it the agent gets the provider's own 429 and the host parks the task
//! until the reset (see [`super::Meter::rate_limited`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::header::HeaderMap;
use serde::Deserialize;
use serde_json::Value;
use tokio::time::Instant;

/// How long a request may be held by default, for the node's limits or an upstream's 429.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(30);
/// The longest `hold` pier.toml may set: beyond it agents' own HTTP clients give up first.
pub const MAX_HOLD_SECS: f64 = 600.0;
/// When an upstream says "too many" without saying until when: waits of 1, 2, 4… s, at most this.
const BACKOFF_CAP: Duration = Duration::from_secs(60);

/// One provider's limits (`[rate_limits."PROVIDER"]` in pier.toml), for the whole store: with
/// several nodes, each holds its share (the limit over the live nodes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Tokens (input and output, as the provider reports them) per minute.
    pub tpm: Option<u64>,
    /// Seconds a request may be held for a free slot or an upstream's reset [default 30].
    pub hold: Option<f64>,
}

impl RateLimit {
    /// Why this limit cannot be held, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.rpm == Some(0) {
            return Err("rpm = 0 would stop every request; leave it out for no limit".into());
        }
        if self.tpm == Some(0) {
            return Err("tpm = 0 would stop every request; leave it out for no limit".into());
        }
        match self.hold {
            Some(h) if !(0.0..=MAX_HOLD_SECS).contains(&h) => {
                Err(format!("hold = {h}: give seconds from 0 to {MAX_HOLD_SECS}"))
            }
            _ => Ok(()),
        }
    }

    fn hold(&self) -> Duration {
        self.hold.and_then(|h| Duration::try_from_secs_f64(h).ok()).unwrap_or(DEFAULT_HOLD)
    }
}

/// Every provider's limiter on this node.
#[derive(Default)]
pub(crate) struct Limiters {
    limits: Mutex<HashMap<String, RateLimit>>,
    live: Mutex<HashMap<String, Arc<Limiter>>>,
    /// The live nodes sharing the limits (at least 1).
    nodes: Mutex<u32>,
}

impl Limiters {
    pub(crate) fn set(&self, limits: HashMap<String, RateLimit>) {
        *self.limits.lock().unwrap_or_else(PoisonError::into_inner) = limits;
        let nodes = self.nodes();
        for (provider, l) in self.live.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            l.configure(self.limit(provider), nodes);
        }
    }

    pub(crate) fn set_nodes(&self, nodes: u32) {
        let nodes = nodes.max(1);
        let changed =
            std::mem::replace(&mut *self.nodes.lock().unwrap_or_else(PoisonError::into_inner), nodes) != nodes;
        if changed {
            for (provider, l) in self.live.lock().unwrap_or_else(PoisonError::into_inner).iter() {
                l.configure(self.limit(provider), nodes);
            }
        }
    }

    fn nodes(&self) -> u32 {
        (*self.nodes.lock().unwrap_or_else(PoisonError::into_inner)).max(1)
    }

    fn limit(&self, provider: &str) -> RateLimit {
        self.limits.lock().unwrap_or_else(PoisonError::into_inner).get(provider).copied().unwrap_or_default()
    }

    /// The provider's limiter, made on first use.
    pub(crate) fn of(&self, provider: &str) -> Arc<Limiter> {
        let (limit, nodes) = (self.limit(provider), self.nodes());
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        live.entry(provider.to_owned())
            .or_insert_with(|| {
                let l = Arc::new(Limiter::default());
                l.configure(limit, nodes);
                l
            })
            .clone()
    }
}

#[derive(Default)]
pub(crate) struct Limiter {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Between two requests, and how far ahead of schedule one may go (rpm).
    interval: Option<Duration>,
    burst: Duration,
    /// When the next request is due on the schedule.
    next: Option<Instant>,
    /// Tokens per second refilled, the level's ceiling, the level now and when it was read.
    tps: f64,
    ceiling: f64,
    level: f64,
    read: Option<Instant>,
    /// Closed by the provider until then.
    closed_until: Option<Instant>,
    hold: Duration,
}

impl State {
    fn refill(&mut self, now: Instant) {
        if let Some(read) = self.read {
            self.level = (self.level + now.duration_since(read).as_secs_f64() * self.tps).min(self.ceiling);
        }
        self.read = Some(now);
    }
}

impl Limiter {
    fn configure(&self, limit: RateLimit, nodes: u32) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.hold = limit.hold();
        s.interval = limit.rpm.map(|rpm| Duration::from_secs_f64(60.0 * f64::from(nodes) / f64::from(rpm)));
        // One second's worth may go at once (at least one request): spacing, not minute-long bursts.
        s.burst = s.interval.map_or(Duration::ZERO, |i| Duration::from_secs(1).saturating_sub(i));
        let now = Instant::now();
        s.refill(now);
        match limit.tpm {
            Some(tpm) => {
                let share = tpm as f64 / f64::from(nodes);
                let was_unlimited = s.ceiling == 0.0;
                s.tps = share / 60.0;
                s.ceiling = share;
                if was_unlimited {
                    s.level = share;
                }
                s.level = s.level.min(share);
            }
            None => (s.tps, s.ceiling, s.level) = (0.0, 0.0, 0.0),
        }
    }

    /// How long the provider may hold a request.
    pub(crate) fn hold(&self) -> Duration {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).hold
    }

    /// Takes the request's slot: `Ok(wait)` to wait before sending (the slot is taken), or
    /// `Err(wait)` when the wait is past `within` (nothing is taken).
    pub(crate) fn reserve(&self, within: Duration) -> Result<Duration, Duration> {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.refill(now);
        let mut at = now;
        if let Some(until) = s.closed_until {
            at = at.max(until);
        }
        if s.ceiling > 0.0 && s.level < 0.0 {
            at = at.max(now + Duration::from_secs_f64(-s.level / s.tps));
        }
        let slot = match (s.interval, s.next) {
            (Some(_), Some(next)) => Some(next.max(at)),
            (Some(_), None) => Some(at),
            _ => None,
        };
        // The slot may be taken up to `burst` before its time.
        let go = slot.map_or(at, |slot| slot.checked_sub(s.burst).unwrap_or(slot).max(at));
        let wait = go.saturating_duration_since(now);
        if wait > within {
            return Err(wait);
        }
        if let (Some(interval), Some(slot)) = (s.interval, slot) {
            s.next = Some(slot + interval);
        }
        Ok(wait)
    }

    /// An answer's tokens, drained from the per-minute level.
    pub(crate) fn spent(&self, tokens: u64) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if s.ceiling > 0.0 {
            s.refill(Instant::now());
            s.level -= tokens as f64;
        }
    }

    /// The provider said "too many" until `wait` from now: nobody here sends before then.
    pub(crate) fn close_for(&self, wait: Duration) {
        let until = Instant::now() + wait;
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.closed_until = Some(s.closed_until.map_or(until, |u| u.max(until)));
    }
}

/// Whether an upstream's status says "too many requests" (429, Anthropic's 529 overloaded).
pub(crate) fn too_many(status: u16) -> bool {
    status == 429 || status == 529
}

/// How long an upstream's 429 asks to wait: `retry-after-ms`, `Retry-After` (seconds or a
/// date), Gemini's `RetryInfo.retryDelay` in the body; else a backoff by `tries` so far.
pub(crate) fn retry_delay(headers: &HeaderMap, body: &[u8], tries: u32) -> Duration {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = header("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && let Ok(d) = Duration::try_from_secs_f64(ms / 1000.0)
    {
        return d;
    }
    if let Some(v) = header("retry-after") {
        if let Ok(d) = v.parse::<f64>().map_err(drop).and_then(|s| Duration::try_from_secs_f64(s).map_err(drop)) {
            return d;
        }
        if let Ok(at) = httpdate::parse_http_date(v) {
            return at.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO);
        }
    }
    let gemini = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
        v.pointer("/error/details")?.as_array()?.iter().find_map(|d| {
            let s = d.get("retryDelay")?.as_str()?.strip_suffix('s')?;
            Duration::try_from_secs_f64(s.parse().ok()?).ok()
        })
    });
    gemini.unwrap_or_else(|| Duration::from_secs(1u64 << tries.min(6)).min(BACKOFF_CAP))
}

/// Milliseconds since the epoch, `wait` from now.
pub(crate) fn wall_ms_after(wait: Duration) -> i64 {
    (SystemTime::now() + wait).duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole seconds (the calls are microseconds apart).
    fn secs(r: Result<Duration, Duration>) -> Result<u64, u64> {
        r.map(|d| d.as_secs_f64().round() as u64).map_err(|d| d.as_secs_f64().round() as u64)
    }

    fn limiter(limit: RateLimit, nodes: u32) -> Limiter {
        let l = Limiter::default();
        l.configure(limit, nodes);
        l
    }

    #[test]
    fn requests_are_spaced_evenly_and_a_node_holds_its_share() {
        let l = limiter(RateLimit { rpm: Some(60), ..Default::default() }, 1);
        let waits: Vec<_> = (0..4).map(|_| secs(l.reserve(Duration::from_secs(30)))).collect();
        assert_eq!(waits, vec![Ok(0), Ok(1), Ok(2), Ok(3)]);
        let l = limiter(RateLimit { rpm: Some(60), ..Default::default() }, 2);
        let _ = l.reserve(Duration::from_secs(30));
        assert_eq!(secs(l.reserve(Duration::from_secs(30))), Ok(2), "half the rate on two nodes");
        assert_eq!(secs(l.reserve(Duration::from_secs(1))), Err(4), "past the hold: nothing taken");
        assert_eq!(secs(l.reserve(Duration::from_secs(30))), Ok(4));
    }

    #[test]
    fn tokens_spent_past_the_minute_s_share_hold_the_next_request() {
        let l = limiter(RateLimit { tpm: Some(6000), ..Default::default() }, 1);
        assert_eq!(l.reserve(Duration::ZERO), Ok(Duration::ZERO));
        l.spent(7000);
        // 1000 tokens over at 100 per second.
        assert_eq!(secs(l.reserve(Duration::from_secs(30))), Ok(10));
    }

    #[test]
    fn the_wait_is_read_where_each_provider_says_it() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", "2".parse().unwrap_or_else(|_| unreachable!()));
        assert_eq!(retry_delay(&h, b"", 0), Duration::from_secs(2));
        h.insert("retry-after-ms", "1500".parse().unwrap_or_else(|_| unreachable!()));
        assert_eq!(retry_delay(&h, b"", 0), Duration::from_millis(1500));
        let body = br#"{"error":{"code":429,"details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"3s"}]}}"#;
        assert_eq!(retry_delay(&HeaderMap::new(), body, 0), Duration::from_secs(3));
        assert_eq!(retry_delay(&HeaderMap::new(), b"{}", 2), Duration::from_secs(4));
        assert!(RateLimit { rpm: Some(0), ..Default::default() }.check().is_err());
        assert!(RateLimit { hold: Some(-1.0), ..Default::default() }.check().is_err());
    }
}
