//! The model gateway as the host uses it: every agent process it starts gets an account
//! at the gateway (a [`Lease`]) whose upstreams hold the real keys the agent would have been
//! given, and whose calls are billed to the attempt the process currently serves (a warm
//! agent serves many, one at a time) as `model_request` events with their cost.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pier_client::AgentCommand;
use pier_egress::gateway::{Account, Gateway, Meter, ModelCall, OTHER_KEYS, Route, Ticket, Upstream};
use pier_store::{Attempt, Budget, MODEL_REQUEST, ModelRequest, TaskSpec, TaskStore, Tokens};

use crate::budget::{Allowance, Ledger};
use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What one model costs, per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input: f64,
    /// Cached prompt tokens [default: `input`].
    #[serde(default)]
    pub cached_input: Option<f64>,
    pub output: f64,
}

impl Price {
    /// The cost of `t` (reasoning is billed as output, which it is part of).
    pub fn cost(&self, t: &Tokens) -> f64 {
        let cached = t.cached_input.min(t.input);
        let fresh = (t.input - cached) as f64 * self.input;
        let cached = cached as f64 * self.cached_input.unwrap_or(self.input);
        (fresh + cached + t.output as f64 * self.output) / 1_000_000.0
    }
}

/// The host's gateway and what it needs to open accounts.
#[derive(Clone)]
pub struct GatewayConfig {
    pub gateway: Gateway,
    /// Where pier's own agent's requests go: the host's own model (base URL, key, provider name).
    pub pier: Option<(String, Option<String>, String)>,
    /// By model name. (Shared: each agent process's lease holds the config.)
    pub prices: Arc<BTreeMap<String, Price>>,
    /// Variables of the host's environment that carry keys: never inherited by an agent.
    pub withhold: Arc<[String]>,
    /// pier.toml's budgets for tasks and runs whose plan gives none.
    pub budget: Option<Budget>,
    pub run_budget: Option<Budget>,
    /// What runs and tasks spent so far, as this process knows it.
    pub ledger: Arc<Ledger>,
}

impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayConfig")
            .field("gateway", &self.gateway)
            .field("prices", &self.prices)
            .field("withhold", &self.withhold)
            .finish_non_exhaustive()
    }
}

impl GatewayConfig {
    /// An account for a process of `agent`: its upstreams are where its own variables (its
    /// definition's, else the host's) would have sent it, with the keys they would have given it.
    pub(crate) fn lease(&self, agent: &AgentCommand, node: &str) -> Lease {
        let var = |name: &str| {
            agent.env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone()).or_else(|| std::env::var(name).ok())
        };
        let mut upstreams = Vec::new();
        for route in Route::ALL {
            let (base_var, key_var) = route.variables();
            let upstream = match route {
                // Named as its agent's PIER_PROVIDER names it, else as the host's is named.
                Route::Pier => var(base_var)
                    .map(|base| {
                        let named = self.pier.as_ref().map(|p| p.2.clone());
                        let provider = var("PIER_PROVIDER").or(named).unwrap_or_else(|| "pier".to_owned());
                        (base, var(key_var).or_else(|| var("OPENAI_API_KEY")), provider)
                    })
                    .or_else(|| self.pier.clone()),
                _ => var(base_var)
                    .or_else(|| route.default_base().map(str::to_owned))
                    .map(|base| (base, var(key_var), route.name().to_owned())),
            };
            if let Some((base_url, key, provider)) = upstream {
                upstreams.push(Upstream { route, base_url, key, provider });
            }
        }
        let bill = Arc::new(Bill {
            to: Mutex::new(None),
            prices: self.prices.clone(),
            node: node.to_owned(),
            in_flight: watch::Sender::new(0),
            exhausted: Mutex::new(None),
            limited: Mutex::new(None),
            collected: Mutex::new(None),
        });
        let ticket = self.gateway.open(Account { label: agent.name.clone(), upstreams, meter: bill.clone() });
        Lease { ticket, bill, config: self.clone() }
    }
}

/// One agent process's account at the gateway; dropped with the process.
pub struct Lease {
    ticket: Ticket,
    bill: Arc<Bill>,
    config: GatewayConfig,
}

impl Lease {
    /// `agent` as it is started: the gateway's base URLs and placeholder in place of its
    /// providers' URLs and keys, every other key of pier's environment withheld.
    pub(crate) fn apply(&self, agent: &mut AgentCommand) {
        let env = self.ticket.env();
        // An agent that reads its base URL from its configuration rather than its environment
        // (codex: `-c openai_base_url=…`) names the gateway's variable in its arguments.
        for arg in &mut agent.args {
            for (k, v) in &env {
                let named = format!("${{{k}}}");
                if arg.contains(&named) {
                    *arg = arg.replace(&named, v);
                }
            }
        }
        agent.env.retain(|(k, _)| !env.iter().any(|(g, _)| g == k) && !OTHER_KEYS.contains(&k.as_str()));
        agent.env.extend(env.iter().cloned());
        agent.env_remove.extend(OTHER_KEYS.iter().map(|k| (*k).to_owned()));
        agent.env_remove.extend(self.config.withhold.iter().filter(|w| !env.iter().any(|(g, _)| g == *w)).cloned());
    }

    /// Bills the process's calls to `attempt` of a task of `spec` from now on, within its
    /// budgets. A budget that cannot be read holds nothing back silently: every request is refused.
    /// `parked` is cancelled when a provider's rate limit stops the attempt's requests.
    pub(crate) async fn bill_to(
        &self,
        store: Arc<dyn TaskStore>,
        attempt: Attempt,
        spec: &TaskSpec,
        parked: CancellationToken,
    ) {
        let (budget, run_budget) = (spec.budget.or(self.config.budget), spec.run_budget.or(self.config.run_budget));
        let (ledger, s, a) = (self.config.ledger.clone(), store.clone(), attempt.clone());
        let opened = tokio::task::spawn_blocking(move || {
            Allowance::open(&ledger, s.as_ref(), &a.run, &a.task, budget, run_budget).map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        let (allowance, exhausted) = match opened {
            Ok(allowance) => (allowance, None),
            Err(e) => (None, Some(format!("{}: the budget could not be read ({e})", crate::budget::OVER_BUDGET))),
        };
        *self.bill.exhausted.lock().unwrap_or_else(PoisonError::into_inner) = exhausted;
        *self.bill.limited.lock().unwrap_or_else(PoisonError::into_inner) = None;
        *self.bill.to.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Billing { store, attempt, agent: spec.agent.clone(), allowance, parked });
    }

    /// What an attempt's ending waits on: the calls still being recorded, and whether a budget stopped it.
    pub(crate) fn settler(&self) -> Settler {
        Settler(self.bill.clone())
    }

    /// Calls from now on are kept here instead of written to a log (a pull worker's attempt,
    /// whose host records them with its ending): [`Lease::collected`] takes them.
    pub(crate) fn collect(&self) {
        *self.bill.collected.lock().unwrap_or_else(PoisonError::into_inner) = Some(Vec::new());
    }

    /// The calls kept since [`Lease::collect`] (still kept), waiting (at most `limit`) for
    /// those in flight.
    pub(crate) async fn collected(&self, limit: Duration) -> Vec<ModelRequest> {
        self.settler().settle(limit).await;
        self.bill.collected.lock().unwrap_or_else(PoisonError::into_inner).clone().unwrap_or_default()
    }

    /// Calls from now on (between tasks) are billed to no one, and said so.
    pub(crate) fn unbill(&self) {
        // What stopped this attempt stays for its ending to read; the next `bill_to` clears it.
        self.bill.to.lock().unwrap_or_else(PoisonError::into_inner).take();
    }
}

/// An attempt's view of its agent process's calls: those still on their way to the log, and
/// the budget that stopped them.
#[derive(Clone)]
pub struct Settler(Arc<Bill>);

impl Settler {
    /// Waits (at most `limit`) until every call in flight is recorded, so the attempt's
    /// ending comes after its spend in the log.
    pub(crate) async fn settle(&self, limit: Duration) {
        let mut rx = self.0.in_flight.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|n| *n == 0)).await;
    }

    /// Why requests were refused, if a budget stopped them.
    pub(crate) fn exhausted(&self) -> Option<String> {
        self.0.exhausted.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Why and until when (ms since the epoch) a provider's rate limit stopped the attempt, if one did.
    pub(crate) fn rate_limited(&self) -> Option<(String, i64)> {
        self.0.limited.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// The attempt an agent process serves now.
struct Billing {
    store: Arc<dyn TaskStore>,
    attempt: Attempt,
    /// The agent spec the task names.
    agent: String,
    allowance: Option<Allowance>,
    /// Cancelled to stop the attempt when a rate limit parks its task.
    parked: CancellationToken,
}

/// Where an agent process's calls go: the attempt it serves now, priced, within its budgets.
struct Bill {
    to: Mutex<Option<Billing>>,
    prices: Arc<BTreeMap<String, Price>>,
    node: String,
    /// Calls begun and not yet written to the log.
    in_flight: watch::Sender<usize>,
    /// Set when a budget is spent: every further request of the attempt is refused with it.
    exhausted: Mutex<Option<String>>,
    /// Set when a rate limit outlasts what the gateway may hold: why, and until when.
    limited: Mutex<Option<(String, i64)>>,
    /// A pull worker's calls, kept for its report instead of written.
    collected: Mutex<Option<Vec<ModelRequest>>>,
}

impl Bill {
    fn exhaust(&self, why: String) {
        tracing::warn!("{why}");
        self.exhausted.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(why);
    }
}

impl Meter for Bill {
    fn admit(&self) -> Result<(), String> {
        if let Some(why) = self.exhausted.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Err(why);
        }
        let checked = match &*self.to.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(Billing { allowance: Some(a), .. }) => a.check(),
            _ => Ok(()),
        };
        if let Err(why) = &checked {
            metrics::counter!("pier_model_requests_refused_total", "why" => "budget").increment(1);
            self.exhaust(why.clone());
        }
        checked
    }

    fn begin(&self) {
        self.in_flight.send_modify(|n| *n += 1);
    }

    /// An attempt's ending does not wait for a call its agent walked away from (a cancelled
    /// turn): its usage is still read and recorded, after the ending.
    fn hung_up(&self) {
        self.in_flight.send_modify(|n| *n = n.saturating_sub(1));
    }

    /// The attempt is stopped, and its task waits for the reset without losing an attempt.
    fn rate_limited(&self, until_ms: i64, why: String) {
        tracing::warn!("{why}");
        *self.limited.lock().unwrap_or_else(PoisonError::into_inner) = Some((why, until_ms));
        if let Some(b) = &*self.to.lock().unwrap_or_else(PoisonError::into_inner) {
            b.parked.cancel();
        }
    }

    fn record(&self, call: ModelCall) {
        let call_hung_up = call.hung_up;
        let tokens = call.usage.map(|u| Tokens {
            input: u.input,
            cached_input: u.cached_input,
            output: u.output,
            reasoning: u.reasoning,
        });
        let price = call.model.as_ref().and_then(|m| self.prices.get(m));
        let cost = match (price, &tokens) {
            (Some(p), Some(t)) => Some(p.cost(t)),
            _ => None,
        };
        if let Some(c) = cost {
            let model = call.model.clone().unwrap_or_default();
            metrics::gauge!("pier_model_cost_total", "provider" => call.provider.clone(), "model" => model)
                .increment(c);
        }
        let to = match &*self.to.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(b) => {
                if let Some(a) = &b.allowance {
                    let total = tokens.map_or(0, |t| t.total());
                    if let Err(why) = a.add(total, cost, call.model.as_deref()) {
                        self.exhaust(why);
                    }
                }
                Some((b.store.clone(), b.attempt.clone(), b.agent.clone()))
            }
            None => None,
        };
        // The request as the log keeps it; whose attempt and agent it was is filled in below.
        let mut request = ModelRequest {
            attempt: 0,
            provider: call.provider,
            model: call.model,
            status: call.status,
            latency_ms: call.latency_ms,
            held_ms: call.held_ms,
            streamed: call.streamed,
            tokens,
            cost,
            complete: call.complete,
            error: call.error,
            node: self.node.clone(),
            agent: String::new(),
        };
        if let Some(kept) = self.collected.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
            kept.push(request);
            if !call_hung_up {
                self.in_flight.send_modify(|n| *n = n.saturating_sub(1));
            }
            return;
        }
        let Some((store, attempt, agent)) = to else {
            tracing::warn!(provider = %request.provider, model = ?request.model, "a model request between tasks: billed to no task");
            metrics::counter!("pier_model_requests_unbilled_total").increment(1);
            if !call_hung_up {
                self.in_flight.send_modify(|n| *n = n.saturating_sub(1));
            }
            return;
        };
        (request.attempt, request.agent) = (attempt.n, agent);
        let data = serde_json::to_value(&request).unwrap_or_default();
        let in_flight = (!call_hung_up).then(|| self.in_flight.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(e) = store.record(&attempt, &[(MODEL_REQUEST.to_owned(), data)], &[]) {
                tracing::error!(task = %attempt.task, error = %e, "a model request could not be recorded");
            }
            if let Some(in_flight) = in_flight {
                in_flight.send_modify(|n| *n = n.saturating_sub(1));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_priced_apart_and_reasoning_as_output() {
        let p = Price { input: 2.0, cached_input: Some(0.5), output: 8.0 };
        let t = Tokens { input: 1_000_000, cached_input: 400_000, output: 250_000, reasoning: 100_000 };
        assert!((p.cost(&t) - (1.2 + 0.2 + 2.0)).abs() < 1e-9);
        let p = Price { input: 1.0, cached_input: None, output: 1.0 };
        assert!((p.cost(&t) - 1.25).abs() < 1e-9);
    }
}
