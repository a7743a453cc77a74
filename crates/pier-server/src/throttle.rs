//! Failed authentication, throttled per client address: each address may fail [`BURST`]
//! times at once and then once per [`EVERY`]; past that its requests (right or wrong) are
//! answered 429 with `Retry-After` until it may try again. Guessing the token or the
//! dashboard's login goes at a walk, whoever tries, and the table of addresses is bounded.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures an address may make at once.
const BURST: f64 = 10.0;
/// One more failure is allowed this often.
const EVERY: Duration = Duration::from_secs(1);
/// Addresses remembered at most (memory stays bounded whoever knocks).
const MAX_ADDRESSES: usize = 16_384;

#[derive(Clone, Copy)]
struct Bucket {
    /// Failures still allowed, as of `at`.
    left: f64,
    at: Instant,
}

impl Bucket {
    fn now(self, now: Instant) -> Bucket {
        let grown = now.saturating_duration_since(self.at).as_secs_f64() / EVERY.as_secs_f64();
        Bucket { left: (self.left + grown).min(BURST), at: now }
    }
}

/// Who failed to authenticate lately. Requests with no known address (a server started
/// without connection info, as in-process tests do) share one entry.
#[derive(Default)]
pub struct Throttle {
    map: Mutex<HashMap<Option<IpAddr>, Bucket>>,
}

impl Throttle {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Option<IpAddr>, Bucket>> {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `Err(wait)` while `addr` may not try: it used up its failures.
    pub fn check(&self, addr: Option<IpAddr>) -> Result<(), Duration> {
        let addr = addr.map(holder);
        let now = Instant::now();
        match self.lock().get(&addr).map(|b| b.now(now)) {
            Some(b) if b.left < 1.0 => Err(EVERY.mul_f64(1.0 - b.left)),
            _ => Ok(()),
        }
    }

    /// `addr` failed once more.
    pub fn failed(&self, addr: Option<IpAddr>) {
        let addr = addr.map(holder);
        let now = Instant::now();
        let mut map = self.lock();
        if map.len() >= MAX_ADDRESSES && !map.contains_key(&addr) {
            // Those that could fail a whole burst again are forgotten first; if none can,
            // the one that failed longest ago.
            map.retain(|_, b| b.now(now).left < BURST);
            if map.len() >= MAX_ADDRESSES
                && let Some(oldest) = map.iter().min_by_key(|(_, b)| b.at).map(|(k, _)| *k)
            {
                map.remove(&oldest);
            }
        }
        let b = map.get(&addr).map_or(Bucket { left: BURST, at: now }, |b| b.now(now));
        map.insert(addr, Bucket { left: (b.left - 1.0).max(0.0), at: now });
    }
}

/// Who holds an address: an IPv6 address's /64 (one subscriber's usual share, which it can
/// pick addresses from at will), an IPv4 one (mapped into IPv6 or not) itself.
fn holder(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
        v4 => v4,
    }
}

/// The 429 a throttled address gets, with when to try again.
pub fn refusal(wait: Duration) -> axum::response::Response {
    use axum::response::IntoResponse;
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let mut resp = crate::error::ApiError::new(
        pier_host::ErrorCode::TooManyRequests,
        format!("too many failed attempts to authenticate from this address; try again in {secs} s"),
    )
    .into_response();
    if let Ok(v) = axum::http::HeaderValue::from_str(&secs.to_string()) {
        resp.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
    }
    resp
}

/// The client's address, when the server was started with connection info.
pub fn client(req: &axum::extract::Request) -> Option<IpAddr> {
    of(req.extensions())
}

fn of(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip())
}

/// The client's address as an extractor (a handler that also reads the body).
pub struct Client(pub Option<IpAddr>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Client {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Client(of(&parts.extensions)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_may_fail_a_burst_then_waits() {
        let t = Throttle::default();
        let (a, b) = (Some(IpAddr::from([10, 0, 0, 1])), Some(IpAddr::from([10, 0, 0, 2])));
        for _ in 0..10 {
            assert!(t.check(a).is_ok());
            t.failed(a);
        }
        let wait = t.check(a).err();
        assert!(wait.is_some_and(|w| w > Duration::ZERO && w <= EVERY), "{wait:?}");
        assert!(t.check(b).is_ok(), "another address is not held back");
        let c = IpAddr::from(std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
        let d = IpAddr::from(std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0xffff, 2));
        for _ in 0..10 {
            t.failed(Some(c));
        }
        assert!(t.check(Some(d)).is_err(), "one /64 is one holder");
    }
}
