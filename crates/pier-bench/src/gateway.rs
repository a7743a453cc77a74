//! B9, the model gateway against LiteLLM's proxy: streamed chat completions from one fake
//! upstream (in this process), direct and through each proxy (each its own process), at 1 and
//! at 64 concurrent streams: requests/s, latency p50/p99 and what each adds over direct, the
//! proxy's peak RSS, and the tokens each recorded against what the upstream reported.
//!
//! `gateway-serve --upstream URL` is pier's side as a process of its own: it prints
//! `{"addr", "key"}`, serves until its stdin closes, then prints the tokens it recorded.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pier_egress::gateway::{Account, Gateway, Meter, ModelCall, Route, Upstream};
use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

use crate::{arg, status_kb};

/// LiteLLM's own key (it refuses to start without one); no database, so no key store behind it.
const MASTER: &str = "sk-pier-bench-0123456789abcdef0123456789abcdef";

/// The usage each answer of the fake reports.
const PROMPT: u64 = 1234;
const COMPLETION: u64 = 56;

#[derive(Default)]
struct Counted {
    requests: AtomicU64,
    input: AtomicU64,
    output: AtomicU64,
}

impl Meter for Counted {
    fn record(&self, call: ModelCall) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if let Some(u) = call.usage {
            self.input.fetch_add(u.input, Ordering::Relaxed);
            self.output.fetch_add(u.output, Ordering::Relaxed);
        }
    }
}

/// pier's gateway as a process: one account whose OpenAI route goes to `--upstream`.
pub async fn serve(args: &[String]) {
    let upstream = args.iter().skip_while(|a| *a != "--upstream").nth(1).cloned().unwrap_or_default();
    let gateway = Gateway::start().unwrap_or_else(|e| panic!("gateway: {e}"));
    let counted = Arc::new(Counted::default());
    let ticket = gateway.open(Account {
        label: "bench".into(),
        upstreams: vec![Upstream {
            route: Route::OpenAi,
            base_url: upstream,
            key: Some("sk-upstream".into()),
            provider: "fake".into(),
        }],
        meter: counted.clone(),
    });
    println!("{}", json!({"addr": gateway.addr().to_string(), "key": ticket.key()}));
    let mut rest = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut rest).await;
    println!(
        "{}",
        json!({"requests": counted.requests.load(Ordering::Relaxed), "input": counted.input.load(Ordering::Relaxed),
               "output": counted.output.load(Ordering::Relaxed)})
    );
}

/// One proxy under test: where to send, with which key, and its process.
struct Target {
    url: String,
    key: String,
    pid: Option<u32>,
}

/// `n` streamed requests, `concurrency` at a time; each one's time from send to last byte.
async fn load(http: &reqwest::Client, t: &Target, n: usize, concurrency: usize) -> (Duration, Vec<Duration>) {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (http, url, key, next) = (http.clone(), t.url.clone(), t.key.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut times = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < n as u64 {
                let body = json!({"model": "fake-model", "stream": true, "stream_options": {"include_usage": true},
                                  "messages": [{"role": "user", "content": "hi"}]});
                let t0 = Instant::now();
                let sent = http
                    .post(&url)
                    .header("authorization", format!("Bearer {key}"))
                    .header("content-type", "application/json")
                    .body(body.to_string())
                    .send()
                    .await;
                let ok = match sent {
                    Ok(resp) if resp.status().is_success() => {
                        resp.bytes().await.is_ok_and(|b| b.windows(6).any(|w| w == b"[DONE]"))
                    }
                    Ok(resp) => {
                        eprintln!("B9: {url} answered {}", resp.status());
                        false
                    }
                    Err(e) => {
                        eprintln!("B9: {url}: {e}");
                        false
                    }
                };
                if ok {
                    times.push(t0.elapsed());
                }
            }
            times
        }));
    }
    let mut times = Vec::new();
    for w in workers {
        times.extend(w.await.unwrap_or_default());
    }
    (started.elapsed(), times)
}

fn quantile_ms(v: &mut [Duration], q: usize) -> f64 {
    v.sort();
    v.get((v.len() * q / 100).min(v.len().saturating_sub(1))).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// Starts LiteLLM's proxy (`--litellm PATH`, its `litellm` executable) on the fake, with a
/// callback that writes the usage of each logged request to a file.
async fn litellm(exe: &str, upstream: &str, dir: &std::path::Path) -> (tokio::process::Child, Target) {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("port: {e}"));
        l.local_addr().map(|a| a.port()).unwrap_or(0)
    };
    let usage = dir.join("usage.jsonl");
    std::fs::write(
        dir.join("pier_usage.py"),
        format!(
            "import json\nfrom litellm.integrations.custom_logger import CustomLogger\n\n\
             class Usage(CustomLogger):\n    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):\n        \
             slo = kwargs.get('standard_logging_object') or {{}}\n        \
             with open({usage:?}, 'a') as f:\n            \
             f.write(json.dumps({{'prompt': slo.get('prompt_tokens'), 'completion': slo.get('completion_tokens')}}) + '\\n')\n\n\
             handler = Usage()\n",
            usage = usage.display().to_string()
        ),
    )
    .unwrap_or_else(|e| panic!("callback: {e}"));
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: fake-model\n    litellm_params:\n      model: openai/fake-model\n      api_base: {upstream}\n      api_key: sk-upstream\n\
             litellm_settings:\n  callbacks: pier_usage.handler\n  telemetry: false\n\
             general_settings:\n  master_key: {MASTER}\n"
        ),
    )
    .unwrap_or_else(|e| panic!("config: {e}"));
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(["--config", &config.display().to_string(), "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--num_workers", "1"])
        .current_dir(dir)
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_TELEMETRY", "False")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    let child = cmd.spawn().unwrap_or_else(|e| panic!("litellm {exe}: {e}"));
    let health = format!("http://127.0.0.1:{port}/health/liveliness");
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !http.get(&health).send().await.is_ok_and(|r| r.status().is_success()) {
        assert!(Instant::now() < deadline, "LiteLLM did not come up on port {port} in 120 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pid = child.id();
    (child, Target { url: format!("http://127.0.0.1:{port}/v1/chat/completions"), key: MASTER.into(), pid })
}

/// The usage LiteLLM logged, once `n` requests are in its log (it logs after answering).
async fn litellm_usage(dir: &std::path::Path, n: u64) -> (u64, u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(dir.join("usage.jsonl")).unwrap_or_default();
        let rows: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        if rows.len() as u64 >= n || Instant::now() > deadline {
            let sum = |k: &str| rows.iter().filter_map(|r| r[k].as_u64()).sum::<u64>();
            return (rows.len() as u64, sum("prompt"), sum("completion"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `gateway [--n N] [--n64 N] --litellm PATH`: prints one JSON line of figures.
pub async fn run(args: &[String]) {
    let (n1, n64) = (arg(args, "--n", 300) as usize, arg(args, "--n64", 3000) as usize);
    let litellm_exe = args.iter().skip_while(|a| *a != "--litellm").nth(1).cloned();
    let fake = FakeModel::start().await.unwrap_or_else(|e| panic!("fake: {e}"));
    fake.set_fallback(|_| {
        let mut steps: Vec<Step> = (0..20).map(|i| Step::Text(format!("token{i} "))).collect();
        steps.push(Step::Finish("stop".into()));
        steps.push(Step::Usage { prompt: PROMPT, completion: COMPLETION });
        steps.push(Step::Done);
        Reply::Stream(steps)
    });
    let upstream = fake.base_url();
    let http = reqwest::Client::builder().pool_max_idle_per_host(128).build().unwrap_or_else(|e| panic!("{e}"));
    let mut out = serde_json::Map::new();

    let direct = Target { url: format!("{upstream}/chat/completions"), key: "sk-upstream".into(), pid: None };
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let mut pier = tokio::process::Command::new(exe)
        .args(["gateway-serve", "--upstream", &upstream])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("gateway-serve: {e}"));
    let mut lines = BufReader::new(pier.stdout.take().unwrap_or_else(|| panic!("no stdout"))).lines();
    let hello: Value =
        serde_json::from_str(&lines.next_line().await.ok().flatten().unwrap_or_default()).unwrap_or_default();
    let pier_target = Target {
        url: format!("http://{}/openai/v1/chat/completions", hello["addr"].as_str().unwrap_or_default()),
        key: hello["key"].as_str().unwrap_or_default().to_owned(),
        pid: pier.id(),
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let lite = match &litellm_exe {
        Some(exe) => Some(litellm(exe, &upstream, dir.path()).await),
        None => None,
    };
    let mut targets: Vec<(&str, &Target)> = vec![("direct", &direct), ("pier", &pier_target)];
    if let Some((_, t)) = &lite {
        targets.push(("litellm", t));
    }
    // Warm-up: connections, caches, LiteLLM's first-request work.
    for (_, t) in &targets {
        load(&http, t, 20, 4).await;
    }
    let before = fake.requests().len();
    let mut sent = std::collections::HashMap::new();
    for (concurrency, n) in [(1usize, n1), (64, n64)] {
        let mut p50 = std::collections::HashMap::new();
        for (name, t) in &targets {
            let (took, mut times) = load(&http, t, n, concurrency).await;
            *sent.entry(*name).or_insert(0u64) += times.len() as u64;
            let rps = times.len() as f64 / took.as_secs_f64();
            let (q50, q99) = (quantile_ms(&mut times, 50), quantile_ms(&mut times, 99));
            p50.insert(*name, (q50, q99));
            out.insert(format!("{name}_c{concurrency}_rps"), json!(rps));
            out.insert(format!("{name}_c{concurrency}_p50_ms"), json!(q50));
            out.insert(format!("{name}_c{concurrency}_p99_ms"), json!(q99));
            out.insert(format!("{name}_c{concurrency}_ok"), json!(times.len()));
        }
        let (d50, d99) = p50["direct"];
        for name in ["pier", "litellm"] {
            if let Some((q50, q99)) = p50.get(name) {
                out.insert(format!("{name}_c{concurrency}_added_p50_ms"), json!(q50 - d50));
                out.insert(format!("{name}_c{concurrency}_added_p99_ms"), json!(q99 - d99));
            }
        }
    }
    for (name, t) in &targets {
        if let Some(pid) = t.pid {
            out.insert(format!("{name}_rss_kb"), json!(status_kb(pid, "VmHWM:")));
        }
    }
    // Tokens: what the upstream reported for each request measured, and what each proxy recorded.
    let reported: Vec<(u64, u64)> = fake.requests()[before..].iter().filter_map(|r| r.reported).collect();
    out.insert("upstream_requests".into(), json!(reported.len()));
    drop(pier.stdin.take());
    let totals: Value =
        serde_json::from_str(&lines.next_line().await.ok().flatten().unwrap_or_default()).unwrap_or_default();
    let _ = pier.wait().await;
    // The warm-up's 20 requests are counted by the proxies too.
    let measured = |name: &str| sent.get(name).copied().unwrap_or(0) + 20;
    out.insert("pier_recorded".into(), json!([totals["requests"], totals["input"], totals["output"]]));
    out.insert(
        "pier_expected".into(),
        json!([measured("pier"), measured("pier") * PROMPT, measured("pier") * COMPLETION]),
    );
    if let Some((child, _)) = lite {
        let n = measured("litellm");
        let (rows, input, output) = litellm_usage(dir.path(), n).await;
        out.insert("litellm_recorded".into(), json!([rows, input, output]));
        out.insert("litellm_expected".into(), json!([n, n * PROMPT, n * COMPLETION]));
        crate::end(child).await;
    }
    println!("{}", Value::Object(out));
}
