//! How to reach a model: endpoint, model name, key, timeouts and retries.

use std::fmt;
use std::time::Duration;

/// A secret that never prints: `Debug` and `Display` show `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    /// The secret itself; call only where it goes on the wire.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Settings of an OpenAI-compatible Chat Completions endpoint.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Base URL up to and including the version segment, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    pub model: String,
    pub api_key: Option<Secret>,
    /// Time allowed to open the TCP/TLS connection.
    pub connect_timeout: Duration,
    /// Longest silence allowed while waiting for the response head or the next chunk.
    pub idle_timeout: Duration,
    /// Retries after the first attempt, for retryable failures before any output.
    pub max_retries: u32,
    /// First backoff delay; doubled per attempt, jittered, capped at 30 s.
    pub retry_base_delay: Duration,
    /// `max_tokens` sent with each request, if any.
    pub max_tokens: Option<u32>,
    /// Whether to ask for usage in the stream (`stream_options.include_usage`).
    pub stream_usage: bool,
    /// The model's context window in tokens, for clients' usage meters.
    pub context_window: Option<u64>,
    /// The model takes images (pier.toml's `vision`): prompts' and tools' images are sent.
    pub vision: bool,
}

impl ModelConfig {
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_retries: 4,
            retry_base_delay: Duration::from_millis(500),
            max_tokens: None,
            stream_usage: true,
            context_window: None,
            vision: false,
        }
    }

    /// The chat completions URL for this endpoint.
    pub fn completions_url(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}

/// The delay before retry number `attempt` (1-based): exponential with jitter,
/// or the server's `Retry-After` when it asks for a longer wait (capped at 60 s).
pub fn backoff(base: Duration, attempt: u32, retry_after: Option<Duration>) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    let capped = exp.min(Duration::from_secs(30));
    // Full jitter over the upper half keeps retries of many sessions apart.
    let jittered = capped.mul_f64(0.5 + fastrand::f64() * 0.5);
    match retry_after {
        Some(ra) => jittered.max(ra.min(Duration::from_secs(60))),
        None => jittered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("sk-live-123");
        assert_eq!(format!("{s:?} {s}"), "*** ***");
        let mut c = ModelConfig::new("http://x/v1", "m");
        c.api_key = Some(s);
        assert!(!format!("{c:?}").contains("sk-live"));
    }

    #[test]
    fn backoff_grows_and_honours_retry_after() {
        let base = Duration::from_millis(100);
        for attempt in 1..6 {
            let d = backoff(base, attempt, None);
            let full = base * (1 << (attempt - 1));
            assert!(d >= full / 2 && d <= full, "attempt {attempt}: {d:?}");
        }
        assert!(backoff(base, 1, Some(Duration::from_secs(2))) >= Duration::from_secs(2));
        assert!(backoff(base, 1, Some(Duration::from_secs(900))) <= Duration::from_secs(60));
    }
}
