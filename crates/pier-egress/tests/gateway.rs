//! The model gateway against the fake model in each API: answers byte for byte as the upstream
//! sent them, the real key swapped in for the placeholder, tokens recorded exactly as the
//! upstream reported them, and every ending (an unknown key, an agent that hangs up) recorded
//! with what was seen.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pier_egress::gateway::{Account, Gateway, Meter, ModelCall, Route, Upstream, Usage};
use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);

#[derive(Default)]
struct Calls {
    calls: Mutex<Vec<ModelCall>>,
    changed: tokio::sync::Notify,
    /// What [`Meter::rate_limited`] was told: until when, and why.
    limited: Mutex<Vec<(i64, String)>>,
}

impl Meter for Calls {
    fn rate_limited(&self, until_ms: i64, why: String) {
        self.limited.lock().unwrap_or_else(|e| e.into_inner()).push((until_ms, why));
    }

    fn record(&self, call: ModelCall) {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).push(call);
        self.changed.notify_waiters();
    }
}

impl Calls {
    async fn wait(&self, n: usize) -> Vec<ModelCall> {
        let waited = tokio::time::timeout(LIMIT, async {
            loop {
                let changed = self.changed.notified();
                {
                    let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
                    if calls.len() >= n {
                        return calls.clone();
                    }
                }
                changed.await;
            }
        })
        .await;
        waited.unwrap_or_else(|_| panic!("{n} calls were not recorded in time"))
    }
}

struct Setup {
    fake: FakeModel,
    gateway: Gateway,
    calls: Arc<Calls>,
    ticket: pier_egress::gateway::Ticket,
    http: reqwest::Client,
}

const KEYS: [(Route, &str); 4] = [
    (Route::OpenAi, "sk-real-openai"),
    (Route::Anthropic, "sk-ant-real"),
    (Route::Gemini, "g-real"),
    (Route::Pier, "sk-pier"),
];

async fn setup() -> Setup {
    let fake = FakeModel::start().await.unwrap_or_else(|e| panic!("fake: {e}"));
    let gateway = Gateway::start().unwrap_or_else(|e| panic!("gateway: {e}"));
    let calls = Arc::new(Calls::default());
    let root = fake.base_url().trim_end_matches("/v1").to_owned();
    let upstreams = KEYS
        .iter()
        .map(|(route, key)| Upstream {
            route: *route,
            base_url: match route {
                Route::OpenAi | Route::Pier => fake.base_url(),
                _ => root.clone(),
            },
            key: Some((*key).to_owned()),
            provider: route.name().to_owned(),
        })
        .collect();
    let ticket = gateway.open(Account { label: "test".into(), upstreams, meter: calls.clone() });
    Setup { fake, gateway, calls, ticket, http: reqwest::Client::new() }
}

fn scripted(prompt: u64, completion: u64) -> Reply {
    Reply::Stream(vec![
        Step::Text("Hello".into()),
        Step::Text(" there".into()),
        Step::Finish("stop".into()),
        Step::Usage { prompt, completion },
        Step::Done,
    ])
}

/// Posts `body` to `url` with `headers` and reads the whole answer.
async fn post(http: &reqwest::Client, url: &str, headers: &[(&str, String)], body: &Value) -> (u16, Vec<u8>) {
    let mut req = http.post(url).header("content-type", "application/json").body(body.to_string());
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let sent = tokio::time::timeout(LIMIT, async {
        let resp = req.send().await.unwrap_or_else(|e| panic!("send: {e}"));
        let status = resp.status().as_u16();
        (status, resp.bytes().await.unwrap_or_else(|e| panic!("body: {e}")).to_vec())
    });
    sent.await.unwrap_or_else(|_| panic!("no answer from {url} in time"))
}

#[tokio::test]
async fn each_api_passes_through_byte_for_byte_with_the_real_key_and_its_usage_counted() {
    let s = setup().await;
    let gw = format!("http://{}", s.gateway.addr());
    let direct_root = s.fake.base_url().trim_end_matches("/v1").to_owned();
    let key = s.ticket.key().to_owned();
    let tools = json!([{"name": "t", "description": "d", "input_schema": {"type": "object"}}]);
    // (route, path under the route, how the SDK sends its key, body, expected usage)
    type Case<'a> = (Route, &'a str, (&'a str, String), Value, Usage);
    let cases: Vec<Case> = vec![
        (
            Route::OpenAi,
            "/chat/completions",
            ("authorization", format!("Bearer {key}")),
            json!({"model": "gpt-x", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
            Usage { input: 123, cached_input: 0, output: 45, reasoning: 0 },
        ),
        (
            Route::OpenAi,
            "/responses",
            ("authorization", format!("Bearer {key}")),
            json!({"model": "o-x", "stream": true, "input": "hi"}),
            Usage { input: 321, cached_input: 0, output: 54, reasoning: 0 },
        ),
        (
            Route::Anthropic,
            "/v1/messages",
            ("x-api-key", key.clone()),
            json!({"model": "claude-x", "stream": true, "max_tokens": 100, "tools": tools, "messages": [{"role": "user", "content": "hi"}]}),
            Usage { input: 77, cached_input: 0, output: 11, reasoning: 0 },
        ),
        (
            Route::Gemini,
            "/v1beta/models/gemini-x:streamGenerateContent?alt=sse",
            ("x-goog-api-key", key.clone()),
            json!({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}),
            Usage { input: 99, cached_input: 0, output: 9, reasoning: 0 },
        ),
        (
            Route::Pier,
            "/chat/completions",
            ("authorization", format!("Bearer {key}")),
            json!({"model": "fake-model", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
            Usage { input: 5, cached_input: 0, output: 6, reasoning: 0 },
        ),
    ];
    for (i, (route, path, (header, value), body, usage)) in cases.into_iter().enumerate() {
        s.fake.push(scripted(usage.input, usage.output));
        s.fake.push(scripted(usage.input, usage.output));
        let direct_base = match route {
            Route::OpenAi | Route::Pier => s.fake.base_url(),
            _ => direct_root.clone(),
        };
        let (direct_status, direct) = post(&s.http, &format!("{direct_base}{path}"), &[], &body).await;
        let url = format!("{gw}{}{path}", route.prefix());
        let (status, through) = post(&s.http, &url, &[(header, value)], &body).await;
        assert_eq!((status, direct_status), (200, 200), "{route:?} {path}");
        assert_eq!(String::from_utf8_lossy(&through), String::from_utf8_lossy(&direct), "{route:?} {path}");
        let requests = s.fake.requests();
        let upstream = &requests[requests.len() - 1];
        let real = KEYS.iter().find(|(r, _)| *r == route).map(|(_, k)| *k);
        assert_eq!(upstream.api_key.as_deref(), real, "{route:?}: the real key went upstream");
        assert_eq!(upstream.body, body, "{route:?}: the body went upstream unchanged");
        assert!(!upstream.path.contains("key="), "{}", upstream.path);
        let call = &s.calls.wait(i + 1).await[i];
        assert_eq!(call.usage, Some(usage), "{route:?} {path}");
        assert_eq!((call.status, call.complete, call.streamed), (200, true, true), "{call:?}");
        assert_eq!(call.route, route);
        assert!(call.model.is_some(), "{call:?}");
    }
    // Gemini's SDK may put the key in the query instead; it never goes upstream there.
    s.fake.push(scripted(3, 4));
    let url = format!("{gw}/gemini/v1beta/models/gemini-x:streamGenerateContent?alt=sse&key={key}");
    let (status, _) = post(&s.http, &url, &[], &json!({"contents": []})).await;
    assert_eq!(status, 200);
    let requests = s.fake.requests();
    let last = &requests[requests.len() - 1];
    assert_eq!(last.api_key.as_deref(), Some("g-real"));
    assert_eq!(last.path, "/v1beta/models/gemini-x:streamGenerateContent?alt=sse");
}

#[tokio::test]
async fn a_key_that_names_no_attempt_is_refused_in_the_api_s_own_shape_and_nothing_goes_upstream() {
    let s = setup().await;
    let gw = format!("http://{}", s.gateway.addr());
    let body = json!({"model": "m", "messages": []});
    let (status, answer) = post(
        &s.http,
        &format!("{gw}/openai/v1/chat/completions"),
        &[("authorization", "Bearer sk-real".into())],
        &body,
    )
    .await;
    assert_eq!(status, 401);
    let v: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("does not name a running attempt")), "{v}");
    let (status, answer) =
        post(&s.http, &format!("{gw}/anthropic/v1/messages"), &[("x-api-key", "nope".into())], &body).await;
    assert_eq!(status, 401);
    let v: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "authentication_error");
    // A closed account's placeholder stops working.
    let key = s.ticket.key().to_owned();
    drop(s.ticket);
    let (status, _) = post(
        &s.http,
        &format!("{gw}/openai/v1/chat/completions"),
        &[("authorization", format!("Bearer {key}"))],
        &body,
    )
    .await;
    assert_eq!(status, 401);
    assert!(s.fake.requests().is_empty(), "nothing reached the upstream");
    assert!(s.calls.calls.lock().unwrap_or_else(|e| e.into_inner()).is_empty());
}

#[tokio::test]
async fn an_agent_that_hangs_up_mid_stream_is_recorded_incomplete_with_the_usage_already_streamed() {
    let s = setup().await;
    s.fake.push(Reply::Stream(vec![
        Step::Text("partial".into()),
        Step::Usage { prompt: 40, completion: 2 },
        Step::Hang,
    ]));
    let url = format!("http://{}/openai/v1/chat/completions", s.gateway.addr());
    let body = json!({"model": "gpt-x", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let mut resp = tokio::time::timeout(
        LIMIT,
        s.http.post(&url).header("authorization", format!("Bearer {}", s.ticket.key())).body(body.to_string()).send(),
    )
    .await
    .unwrap_or_else(|_| panic!("no head in time"))
    .unwrap_or_else(|e| panic!("send: {e}"));
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("prompt_tokens") {
        match tokio::time::timeout(LIMIT, resp.chunk()).await {
            Ok(Ok(Some(c))) => seen.extend_from_slice(c.as_ref()),
            _ => panic!("the stream ended early"),
        }
    }
    drop(resp);
    let call = &s.calls.wait(1).await[0];
    assert!(!call.complete, "{call:?}");
    assert!(call.error.as_deref().is_some_and(|e| e.contains("hung up")), "{call:?}");
    assert_eq!(call.usage, Some(Usage { input: 40, cached_input: 0, output: 2, reasoning: 0 }));
}

#[tokio::test]
async fn an_upstream_error_passes_through_and_is_recorded_with_its_status() {
    let s = setup().await;
    s.fake.push(Reply::status(500, "it broke"));
    let url = format!("http://{}/openai/v1/chat/completions", s.gateway.addr());
    let body = json!({"model": "gpt-x", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let (status, answer) = post(&s.http, &url, &[("authorization", format!("Bearer {}", s.ticket.key()))], &body).await;
    assert_eq!(status, 500);
    assert!(String::from_utf8_lossy(&answer).contains("it broke"));
    let call = &s.calls.wait(1).await[0];
    assert_eq!((call.status, call.usage), (500, None));
}

fn chat(key: &str) -> (Vec<(&'static str, String)>, Value) {
    let body = json!({"model": "gpt-x", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    (vec![("authorization", format!("Bearer {key}"))], body)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// An upstream's 429 with `Retry-After: 2` closes that provider on the node until the reset and
/// the request goes again then, within a second of it; the agent never sees the 429, and
/// another provider's requests go on meanwhile.
#[tokio::test]
async fn an_upstream_429_is_held_and_sent_again_at_its_reset_while_other_providers_go_on() {
    let s = setup().await;
    s.fake.push(Reply::Status { code: 429, message: "slow down".into(), retry_after_secs: Some(2) });
    let anthropic =
        Reply::Stream(vec![Step::Text("other".into()), Step::Usage { prompt: 7, completion: 1 }, Step::Done]);
    s.fake.push(anthropic);
    s.fake.push(scripted(10, 2));
    let gw = format!("http://{}", s.gateway.addr());
    let (headers, body) = chat(s.ticket.key());
    let openai = {
        let (http, url) = (s.http.clone(), format!("{gw}/openai/v1/chat/completions"));
        tokio::spawn(async move { post(&http, &url, &headers, &body).await })
    };
    // The 429 is in: the other provider's request goes through at once.
    tokio::time::timeout(LIMIT, s.fake.wait_for_requests(1)).await.unwrap_or_else(|_| panic!("no first request"));
    let url = format!("{gw}/anthropic/v1/messages");
    let body = json!({"model": "claude-x", "max_tokens": 10, "stream": true, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "t", "description": "d", "input_schema": {"type": "object"}}]});
    let (status, _) = post(&s.http, &url, &[("x-api-key", s.ticket.key().to_owned())], &body).await;
    assert_eq!(status, 200);
    let (status, answer) = openai.await.unwrap_or_else(|e| panic!("join: {e}"));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert!(String::from_utf8_lossy(&answer).contains("Hello"));
    let seen = s.fake.requests();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let (first, other, again) = (&seen[0], &seen[1], &seen[2]);
    assert!(first.path.contains("chat/completions") && again.path.contains("chat/completions"), "{seen:?}");
    assert!(other.path.contains("messages") && other.at < first.at + Duration::from_secs(1), "not held: {seen:?}");
    let waited = again.at - first.at;
    assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(3), "sent again {waited:?} after the 429");
    let calls = s.calls.wait(2).await;
    let call = calls.iter().find(|c| c.route == Route::OpenAi).unwrap_or_else(|| panic!("{calls:?}"));
    assert_eq!((call.status, call.complete), (200, true), "one call, recorded once: {calls:?}");
    assert!(call.held_ms >= 2000, "{call:?}");
    assert_eq!(call.usage, Some(Usage { input: 10, cached_input: 0, output: 2, reasoning: 0 }));
    assert!(s.calls.limited.lock().unwrap_or_else(|e| e.into_inner()).is_empty(), "nothing to park");
}

/// Past the provider's `hold` the agent gets the upstream's own 429 and the account is told the
/// reset; until then the node sends nothing more to that provider (it answers 429 itself).
#[tokio::test]
async fn past_the_hold_the_agent_gets_the_429_and_its_account_is_told_the_reset() {
    let s = setup().await;
    let limit = pier_egress::gateway::RateLimit { hold: Some(1.0), ..Default::default() };
    s.gateway.set_rate_limits([("openai".to_owned(), limit)].into_iter().collect());
    s.fake.push(Reply::Status { code: 429, message: "quota for the minute".into(), retry_after_secs: Some(5) });
    let url = format!("http://{}/openai/v1/chat/completions", s.gateway.addr());
    let (headers, body) = chat(s.ticket.key());
    let before = now_ms();
    let (status, answer) = post(&s.http, &url, &headers, &body).await;
    assert_eq!(status, 429);
    assert!(String::from_utf8_lossy(&answer).contains("quota for the minute"), "the upstream's own answer");
    let limited = s.calls.limited.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(limited.len(), 1, "{limited:?}");
    let (until, why) = &limited[0];
    assert!((before + 4_000..=now_ms() + 5_000).contains(until), "until {until}, asked at {before}");
    assert!(why.contains("rate limited") && why.contains("openai"), "{why}");
    let call = &s.calls.wait(1).await[0];
    assert_eq!(call.status, 429);
    // The provider is closed on this node: the next request is not sent.
    let (status, answer) = post(&s.http, &url, &headers, &body).await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&answer));
    assert!(String::from_utf8_lossy(&answer).contains("pier gateway"), "{}", String::from_utf8_lossy(&answer));
    assert_eq!(s.fake.requests().len(), 1, "nothing more went upstream before the reset");
}

/// `rpm = 60` for two minutes with eight agents asking as fast as they can: the upstream sees
/// one request a second, within 5 %.
#[tokio::test]
async fn rpm_60_holds_over_two_minutes_within_five_percent() {
    let s = setup().await;
    let limit = pier_egress::gateway::RateLimit { rpm: Some(60), ..Default::default() };
    s.gateway.set_rate_limits([("openai".to_owned(), limit)].into_iter().collect());
    s.fake.set_fallback(|_| scripted(1, 1));
    let url = format!("http://{}/openai/v1/chat/completions", s.gateway.addr());
    let window = Duration::from_secs(120);
    let end = tokio::time::Instant::now() + window;
    let mut agents = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (http, url, key) = (s.http.clone(), url.clone(), s.ticket.key().to_owned());
        agents.spawn(async move {
            let (headers, body) = chat(&key);
            while tokio::time::Instant::now() < end {
                let (status, _) = post(&http, &url, &headers, &body).await;
                assert_eq!(status, 200);
            }
        });
    }
    while let Some(done) = agents.join_next().await {
        done.unwrap_or_else(|e| panic!("agent: {e}"));
    }
    let seen = s.fake.requests();
    let first = seen[0].at;
    let within = seen.iter().filter(|r| r.at - first < window).count();
    assert!((114..=126).contains(&within), "{within} requests in 120 s at rpm = 60");
}
