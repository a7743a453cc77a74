//! Measures the embedded model: load time, generation speed and peak memory.
//!
//! ```sh
//! cargo run --release -p pier-model --features local --example local_bench -- PATH/TO/smollm2.q8_0.gguf
//! ```
#![allow(clippy::print_stdout)]

use std::time::Instant;

use futures::StreamExt;
use pier_model::local::{LocalConfig, LocalProvider};
use pier_model::{ChatMessage, ModelEvent, ModelProvider, ModelRequest, Role};

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

#[tokio::main]
async fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| "target/test-peers/models/smollm2.q8_0.gguf".into());
    let mut config = LocalConfig::new(path.into());
    config.max_tokens = Some(200);
    let provider = LocalProvider::new(config);
    let request = |text: &str| ModelRequest { messages: vec![ChatMessage::new(Role::User, text)], tools: vec![] };
    for round in 0..3 {
        let started = Instant::now();
        let mut first = None;
        let mut tokens = 0u64;
        let mut stream = provider.stream(request("Write a long story about a lighthouse keeper."));
        while let Some(event) = stream.next().await {
            match event {
                Ok(ModelEvent::TextDelta(_)) if first.is_none() => first = Some(started.elapsed()),
                Ok(ModelEvent::Usage(u)) => tokens = u.completion_tokens,
                Err(e) => panic!("{e}"),
                _ => {}
            }
        }
        let total = started.elapsed();
        let first = first.unwrap_or(total);
        let rate = tokens as f64 / (total - first).as_secs_f64().max(1e-9);
        println!(
            "round {round}: first token after {:.0} ms{}, {tokens} tokens at {rate:.1} tokens/s, peak RSS {:.0} MB",
            first.as_secs_f64() * 1000.0,
            if round == 0 { " (includes loading)" } else { "" },
            peak_rss_mb()
        );
    }
}
