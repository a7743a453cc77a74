//! What model traffic cost: each request the model gateway passed is recorded as a
//! `model_request` event ([`ModelRequest`]), and a task's or a run's [`Spend`] is summed from
//! those events. No events means no traffic passed the gateway: the spend is unknown, never 0.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::log::Event;

/// The event kind a model request is recorded as.
pub const MODEL_REQUEST: &str = "model_request";

/// Tokens as providers bill them: `input` counts every prompt token (cached ones included),
/// `reasoning` is part of `output`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    pub input: u64,
    pub cached_input: u64,
    pub output: u64,
    pub reasoning: u64,
}

impl Tokens {
    pub fn total(&self) -> u64 {
        self.input + self.output
    }

    pub fn add(&mut self, t: &Tokens) {
        self.input += t.input;
        self.cached_input += t.cached_input;
        self.output += t.output;
        self.reasoning += t.reasoning;
    }
}

/// One model request an attempt's agent made through the gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    pub attempt: i64,
    /// The provider's name (`openai`, `anthropic`, `gemini`, pier's own provider).
    pub provider: String,
    #[serde(default)]
    pub model: Option<String>,
    /// The upstream's status; 0 when none answered.
    pub status: u16,
    pub latency_ms: u64,
    /// Of the latency, how long the gateway held the request for a rate limit (its own or the provider's).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_ms: u64,
    pub streamed: bool,
    /// As the upstream reported them; `None`: it reported none.
    #[serde(default)]
    pub tokens: Option<Tokens>,
    /// In the price table's currency; `None`: the model has no price (or no tokens were reported).
    #[serde(default)]
    pub cost: Option<f64>,
    /// The answer reached the agent whole.
    pub complete: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The host node whose gateway passed it.
    #[serde(default)]
    pub node: String,
    /// The agent (its spec, as the task names it) that made it; empty in logs older than it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agent: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The spend of one model (or of everything) summed.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Subtotal {
    pub requests: u64,
    pub tokens: Tokens,
    /// Of the priced requests; `None` when none was priced.
    pub cost: Option<f64>,
    /// Requests whose tokens or price are unknown (their cost is not in `cost`).
    pub unpriced: u64,
}

impl Subtotal {
    fn add(&mut self, r: &ModelRequest) {
        self.requests += 1;
        if let Some(t) = &r.tokens {
            self.tokens.add(t);
        }
        match r.cost {
            Some(c) => *self.cost.get_or_insert(0.0) += c,
            None => self.unpriced += 1,
        }
    }
}

/// A task's or a run's model spend, with a breakdown by model and by provider.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Spend {
    #[serde(flatten)]
    pub total: Subtotal,
    pub by_model: BTreeMap<String, Subtotal>,
    pub by_provider: BTreeMap<String, Subtotal>,
    /// By the agent (its spec) that made the requests.
    pub by_agent: BTreeMap<String, Subtotal>,
    /// By the host node whose gateway passed them (`worker:NAME` for a worker's report).
    pub by_node: BTreeMap<String, Subtotal>,
    /// By attempt number (of a task's spend; a run's sums its tasks' attempts of each number).
    pub by_attempt: BTreeMap<i64, Subtotal>,
}

impl Spend {
    /// Summed from a log's `model_request` events (others are passed over).
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a Event>) -> Spend {
        let mut spend = Spend::default();
        for e in events {
            spend.add_event(e);
        }
        spend
    }

    /// Adds `e` if it is a `model_request` event.
    pub fn add_event(&mut self, e: &Event) {
        if e.kind == MODEL_REQUEST
            && let Ok(r) = ModelRequest::deserialize(&e.data)
        {
            self.add(&r);
        }
    }

    pub fn add(&mut self, r: &ModelRequest) {
        self.total.add(r);
        self.by_model.entry(r.model.clone().unwrap_or_else(|| "unknown".into())).or_default().add(r);
        self.by_provider.entry(r.provider.clone()).or_default().add(r);
        let agent = if r.agent.is_empty() { "unknown" } else { r.agent.as_str() };
        self.by_agent.entry(agent.to_owned()).or_default().add(r);
        self.by_node.entry(r.node.clone()).or_default().add(r);
        self.by_attempt.entry(r.attempt).or_default().add(r);
    }

    /// As the API and `--format json` show it: `null` when unknown (never zeros), else the
    /// sums with `text`, the one-line description.
    pub fn to_json(&self) -> serde_json::Value {
        if !self.known() {
            return serde_json::Value::Null;
        }
        let mut v = serde_json::to_value(self).unwrap_or_default();
        v["text"] = self.describe().into();
        v
    }

    /// Whether any request passed the gateway; without one the spend is unknown.
    pub fn known(&self) -> bool {
        self.total.requests > 0
    }

    /// One line: `1,234 tokens (in 1,000, cached 200, out 234) over 3 requests, cost 0.0123`.
    pub fn describe(&self) -> String {
        if !self.known() {
            return "spend unknown (no model traffic passed pier's gateway)".into();
        }
        let t = &self.total.tokens;
        let mut out = format!(
            "{} tokens (in {}, cached {}, out {}, reasoning {}) over {} request{}",
            group(t.total()),
            group(t.input),
            group(t.cached_input),
            group(t.output),
            group(t.reasoning),
            self.total.requests,
            if self.total.requests == 1 { "" } else { "s" }
        );
        match (self.total.cost, self.total.unpriced) {
            (Some(c), 0) => out.push_str(&format!(", cost {c:.4}")),
            (Some(c), n) => out.push_str(&format!(", cost {c:.4} + unknown ({n} unpriced)")),
            (None, _) => out.push_str(", cost unknown (no price for the model)"),
        }
        out
    }
}

/// `1234567` as `1,234,567`.
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(model: &str, tokens: Option<Tokens>, cost: Option<f64>) -> Event {
        let r = ModelRequest {
            attempt: 1,
            provider: "openai".into(),
            model: Some(model.into()),
            status: 200,
            latency_ms: 3,
            held_ms: 0,
            streamed: true,
            tokens,
            cost,
            complete: true,
            error: None,
            node: "n".into(),
            agent: "pier".into(),
        };
        Event {
            seq: 1,
            run: "r".into(),
            task: Some("t".into()),
            kind: MODEL_REQUEST.into(),
            at_ms: 0,
            data: serde_json::to_value(r).unwrap_or_default(),
        }
    }

    #[test]
    fn spend_sums_per_model_and_says_what_it_does_not_know() {
        assert!(Spend::from_events(&[]).describe().contains("spend unknown"));
        let t = |i, o| Some(Tokens { input: i, cached_input: 0, output: o, reasoning: 0 });
        let events =
            [request("a", t(1000, 200), Some(0.5)), request("a", t(10, 2), Some(0.25)), request("b", t(5, 5), None)];
        let s = Spend::from_events(&events);
        assert_eq!(s.total.requests, 3);
        assert_eq!(s.total.tokens.total(), 1222);
        assert_eq!(s.total.cost, Some(0.75));
        assert_eq!(s.total.unpriced, 1);
        assert_eq!(s.by_model["a"].requests, 2);
        assert_eq!(s.by_model["b"].cost, None);
        assert!(s.describe().starts_with("1,222 tokens"), "{}", s.describe());
        assert!(s.describe().contains("unknown (1 unpriced)"), "{}", s.describe());
    }
}
