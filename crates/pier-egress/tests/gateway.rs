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
}

impl Meter for Calls {
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
    s.fake.push(Reply::status(429, "slow down"));
    let url = format!("http://{}/openai/v1/chat/completions", s.gateway.addr());
    let body = json!({"model": "gpt-x", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let (status, answer) = post(&s.http, &url, &[("authorization", format!("Bearer {}", s.ticket.key()))], &body).await;
    assert_eq!(status, 429);
    assert!(String::from_utf8_lossy(&answer).contains("slow down"));
    let call = &s.calls.wait(1).await[0];
    assert_eq!((call.status, call.usage), (429, None));
}
