//! The embedded model (feature `local`): the tokenizer built from the GGUF, and
//! generation with cancellation. The model is installed by `scripts/test`.
#![cfg(feature = "local")]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use pier_model::local::{LocalConfig, LocalProvider, chatml};
use pier_model::{ChatMessage, FinishReason, ModelEvent, ModelProvider, ModelRequest, Role};

fn model() -> PathBuf {
    let path = std::env::var("PIER_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-peers/models/smollm2.q8_0.gguf")
    });
    assert!(path.is_file(), "the embedded model is missing at {}; run scripts/test, which installs it", path.display());
    path
}

fn tokenizer() -> tokenizers::Tokenizer {
    let mut f = std::fs::File::open(model()).unwrap_or_else(|e| panic!("{e}"));
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap_or_else(|e| panic!("{e}"));
    pier_model::local::tokenizer::from_gguf(&content).unwrap_or_else(|e| panic!("{e}")).0
}

#[test]
fn the_tokenizer_round_trips_text_digits_unicode_and_special_tokens() {
    let tok = tokenizer();
    for text in [
        "Hello, world! The quick brown fox.",
        "  leading spaces and\ttabs\nnewlines",
        "1234567890 and 3.14159",
        "naïve café — 東京 🚀",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ] {
        let ids = tok.encode(text, false).unwrap_or_else(|e| panic!("{e}")).get_ids().to_vec();
        let back = tok.decode(&ids, false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, text);
    }
    // Digits are split one by one, and the special tokens are single tokens.
    let digits = tok.encode("2024", false).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(digits.get_ids().len(), 4);
    let special = tok.encode("<|im_start|><|im_end|>", false).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(special.get_ids().len(), 2);
    assert_eq!(tok.token_to_id("<|im_end|>"), special.get_ids().get(1).copied());
}

#[test]
fn the_chat_template_is_chatml() {
    let prompt = chatml(&[ChatMessage::new(Role::System, "be brief"), ChatMessage::new(Role::User, "hi")]);
    assert_eq!(
        prompt,
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

fn ask(text: &str) -> ModelRequest {
    ModelRequest {
        messages: vec![
            ChatMessage::new(Role::System, "You are a helpful assistant. Answer briefly and accurately."),
            ChatMessage::new(Role::User, text),
        ],
        tools: vec![],
    }
}

#[tokio::test]
async fn it_answers_and_stops_on_its_own() {
    let p = LocalProvider::new(LocalConfig::new(model()));
    let events: Vec<_> =
        tokio::time::timeout(Duration::from_secs(120), p.stream(ask("What is the capital of France?")).collect())
            .await
            .unwrap_or_else(|_| panic!("no answer in time"));
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            Ok(ModelEvent::TextDelta(t)) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert!(text.contains("Paris"), "{text}");
    assert!(events.iter().any(|e| matches!(e, Ok(ModelEvent::Usage(u)) if u.completion_tokens > 0)));
    assert!(
        matches!(events.last(), Some(Ok(ModelEvent::Finish { reason: FinishReason::Stop, .. }))),
        "{:?}",
        events.last()
    );
}

#[tokio::test]
async fn by_default_an_answer_may_use_the_context_the_prompt_leaves() {
    // Under the old fixed limit of 256 tokens this story ended `length`.
    let p = LocalProvider::new(LocalConfig::new(model()));
    let events: Vec<_> = p.stream(ask("Write a 250-word story about a lighthouse keeper.")).collect().await;
    let usage = events.iter().find_map(|e| match e {
        Ok(ModelEvent::Usage(u)) => Some(u.completion_tokens),
        _ => None,
    });
    assert!(
        matches!(events.last(), Some(Ok(ModelEvent::Finish { reason: FinishReason::Stop, .. }))),
        "{:?} after {usage:?} tokens",
        events.last()
    );
    assert!(usage.is_some_and(|n| n > 256), "{usage:?} tokens");
}

#[tokio::test]
async fn the_token_limit_is_max_tokens() {
    let mut config = LocalConfig::new(model());
    config.max_tokens = Some(5);
    let p = LocalProvider::new(config);
    let events: Vec<_> = p.stream(ask("Write a long essay about the sea.")).collect().await;
    assert!(
        matches!(events.last(), Some(Ok(ModelEvent::Finish { reason: FinishReason::Length, .. }))),
        "{:?}",
        events.last()
    );
}

#[tokio::test]
async fn dropping_the_stream_stops_generation_within_a_token_or_two() {
    let mut config = LocalConfig::new(model());
    config.max_tokens = Some(2000);
    let p = LocalProvider::new(config);
    let mut stream = p.stream(ask("Write a very long essay about the history of the sea, in many paragraphs."));
    let first =
        tokio::time::timeout(Duration::from_secs(120), stream.next()).await.unwrap_or_else(|_| panic!("no token"));
    assert!(matches!(first, Some(Ok(ModelEvent::TextDelta(_)))), "{first:?}");
    let cancelled_at = Instant::now();
    drop(stream);
    // The generating thread lets go of the model when it notices, before the next token.
    tokio::time::timeout(Duration::from_secs(120), p.idle()).await.unwrap_or_else(|_| panic!("never idle"));
    let waited = cancelled_at.elapsed();
    assert!(waited < Duration::from_millis(500), "the cancelled generation went on for {waited:?}");
    // And the model serves the next request.
    let mut next = p.stream(ask("Say hi."));
    let first =
        tokio::time::timeout(Duration::from_secs(120), next.next()).await.unwrap_or_else(|_| panic!("no answer"));
    assert!(matches!(first, Some(Ok(ModelEvent::TextDelta(_)))), "{first:?}");
}
