//! The OpenAI-compatible provider against a real local HTTP server speaking the
//! streaming format.

use std::time::Duration;

use futures::StreamExt;
use pier_fake_model::{FakeModel, Reply, Step};
use pier_model::{
    ChatMessage, FinishReason, ModelConfig, ModelError, ModelEvent, ModelProvider, ModelRequest, OpenAiProvider, Role,
    Secret, ToolCall, Usage,
};

const LIMIT: Duration = Duration::from_secs(20);

fn provider(fake: &FakeModel) -> OpenAiProvider {
    let mut config = ModelConfig::new(fake.base_url(), "fake-model");
    config.api_key = Some(Secret::new("sk-test"));
    config.retry_base_delay = Duration::from_millis(5);
    config.max_retries = 2;
    config.idle_timeout = Duration::from_secs(5);
    match OpenAiProvider::new(config) {
        Ok(p) => p,
        Err(e) => panic!("provider: {e}"),
    }
}

fn request(text: &str) -> ModelRequest {
    ModelRequest { messages: vec![ChatMessage::new(Role::User, text)], tools: vec![] }
}

async fn collect(p: &OpenAiProvider, text: &str) -> Vec<Result<ModelEvent, ModelError>> {
    let fut = p.stream(request(text)).collect::<Vec<_>>();
    match tokio::time::timeout(LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("the stream did not end within {LIMIT:?}"),
    }
}

fn finish(events: &[Result<ModelEvent, ModelError>]) -> (FinishReason, Vec<ToolCall>) {
    match events.last() {
        Some(Ok(ModelEvent::Finish { reason, tool_calls })) => (reason.clone(), tool_calls.clone()),
        other => panic!("expected a finish event last, got {other:?}"),
    }
}

fn text(events: &[Result<ModelEvent, ModelError>]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            Ok(ModelEvent::TextDelta(t)) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn streams_text_usage_and_sends_the_request_right() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![
        Step::Comment("keep-alive".into()),
        Step::Text("Hello, ".into()),
        Step::Comment("".into()),
        Step::Text("world".into()),
        Step::Finish("stop".into()),
        Step::Usage { prompt: 7, completion: 3 },
        Step::Done,
    ]));
    let p = provider(&fake);
    let events = collect(&p, "hi").await;
    assert_eq!(text(&events), "Hello, world");
    assert!(events.iter().any(|e| matches!(
        e,
        Ok(ModelEvent::Usage(Usage { prompt_tokens: 7, completion_tokens: 3, total_tokens: 10 }))
    )));
    assert_eq!(finish(&events).0, FinishReason::Stop);
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].path, "/v1/chat/completions");
    assert_eq!(reqs[0].authorization.as_deref(), Some("Bearer sk-test"));
    assert_eq!(reqs[0].body["model"], "fake-model");
    assert_eq!(reqs[0].body["stream"], true);
    assert_eq!(reqs[0].body["messages"][0]["content"], "hi");
    Ok(())
}

#[tokio::test]
async fn assembles_tool_call_arguments_split_across_chunks() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![
        Step::ToolCallStart { index: 0, id: "call_a".into(), name: "read_file".into() },
        Step::ToolCallStart { index: 1, id: "call_b".into(), name: "grep".into() },
        Step::ToolCallArgs { index: 0, fragment: "{\"pa".into() },
        Step::ToolCallArgs { index: 1, fragment: "{\"pattern\":".into() },
        Step::ToolCallArgs { index: 0, fragment: "th\":\"a.txt\"}".into() },
        Step::ToolCallArgs { index: 1, fragment: "\"x\"}".into() },
        Step::Finish("tool_calls".into()),
        Step::Done,
    ]));
    let events = collect(&provider(&fake), "go").await;
    let (reason, calls) = finish(&events);
    assert_eq!(reason, FinishReason::ToolCalls);
    assert_eq!(
        calls,
        vec![
            ToolCall { id: "call_a".into(), name: "read_file".into(), arguments: "{\"path\":\"a.txt\"}".into() },
            ToolCall { id: "call_b".into(), name: "grep".into(), arguments: "{\"pattern\":\"x\"}".into() },
        ]
    );
    Ok(())
}

#[tokio::test]
async fn reasoning_content_streams_apart_from_text() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![
        Step::Reasoning("thinking".into()),
        Step::Text("answer".into()),
        Step::Finish("stop".into()),
        Step::Done,
    ]));
    let events = collect(&provider(&fake), "q").await;
    assert!(matches!(&events[0], Ok(ModelEvent::ReasoningDelta(r)) if r == "thinking"));
    assert_eq!(text(&events), "answer");
    Ok(())
}

#[tokio::test]
async fn finish_reasons_map_to_length_and_refusal() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![Step::Text("trunc".into()), Step::Finish("length".into()), Step::Done]));
    fake.push(Reply::Stream(vec![Step::Finish("content_filter".into()), Step::Done]));
    fake.push(Reply::Stream(vec![
        Step::Refusal("I can't help with that".into()),
        Step::Finish("stop".into()),
        Step::Done,
    ]));
    let p = provider(&fake);
    assert_eq!(finish(&collect(&p, "a").await).0, FinishReason::Length);
    assert_eq!(finish(&collect(&p, "b").await).0, FinishReason::Refusal);
    let events = collect(&p, "c").await;
    assert!(events.iter().any(|e| matches!(e, Ok(ModelEvent::RefusalDelta(_)))));
    assert_eq!(finish(&events).0, FinishReason::Refusal);
    Ok(())
}

#[tokio::test]
async fn a_stream_dropped_midway_is_an_error_not_a_retry() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![Step::Text("partial".into()), Step::Cut]));
    fake.push(Reply::text("should never be asked for"));
    let events = collect(&provider(&fake), "q").await;
    assert_eq!(text(&events), "partial");
    assert!(matches!(events.last(), Some(Err(ModelError::StreamCut(_)))), "{events:?}");
    assert_eq!(fake.requests().len(), 1, "output had started: no retry");
    Ok(())
}

#[tokio::test]
async fn a_cut_before_any_output_is_retried() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![Step::Cut]));
    fake.push(Reply::text("second time lucky"));
    let events = collect(&provider(&fake), "q").await;
    assert_eq!(text(&events), "second time lucky");
    assert_eq!(fake.requests().len(), 2);
    Ok(())
}

#[tokio::test]
async fn a_429_then_success_is_retried() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::status(429, "slow down"));
    fake.push(Reply::status(503, "overloaded"));
    fake.push(Reply::text("ok"));
    let events = collect(&provider(&fake), "q").await;
    assert_eq!(text(&events), "ok");
    assert_eq!(fake.requests().len(), 3);
    Ok(())
}

#[tokio::test]
async fn retries_give_up_with_the_last_provider_message() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    for _ in 0..3 {
        fake.push(Reply::status(500, "boom"));
    }
    let events = collect(&provider(&fake), "q").await;
    // A retry marker before each retry (tries 2 and 3), then the last provider message.
    match events.as_slice() {
        [
            Ok(ModelEvent::Retrying { attempt: 2, error: first, .. }),
            Ok(ModelEvent::Retrying { attempt: 3, .. }),
            Err(ModelError::Http { status: 500, message }),
        ] => {
            assert_eq!(message, "boom");
            assert!(first.contains("boom"), "{first}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.requests().len(), 3, "one attempt and two retries");
    Ok(())
}

#[tokio::test]
async fn a_401_fails_at_once_with_its_message() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::status(401, "Incorrect API key provided"));
    let events = collect(&provider(&fake), "q").await;
    match events.as_slice() {
        [Err(e @ ModelError::Http { status: 401, .. })] => {
            assert!(e.to_string().contains("Incorrect API key provided"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.requests().len(), 1);
    Ok(())
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Hang);
    fake.push(Reply::Hang);
    let mut config = ModelConfig::new(fake.base_url(), "fake-model");
    config.idle_timeout = Duration::from_millis(300);
    config.max_retries = 1;
    config.retry_base_delay = Duration::from_millis(5);
    let p = OpenAiProvider::new(config).map_err(std::io::Error::other)?;
    let events = collect(&p, "q").await;
    assert!(
        matches!(events.as_slice(), [Ok(ModelEvent::Retrying { attempt: 2, .. }), Err(ModelError::IdleTimeout(_))]),
        "{events:?}"
    );
    assert_eq!(fake.requests().len(), 2);
    Ok(())
}

#[tokio::test]
async fn an_unreachable_endpoint_is_a_connect_error() -> std::io::Result<()> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    drop(listener);
    let mut config = ModelConfig::new(format!("http://127.0.0.1:{port}/v1"), "m");
    config.max_retries = 0;
    let p = OpenAiProvider::new(config).map_err(std::io::Error::other)?;
    let events = p.stream(request("q")).collect::<Vec<_>>().await;
    assert!(matches!(events.as_slice(), [Err(ModelError::Connect { .. })]), "{events:?}");
    Ok(())
}

#[tokio::test]
async fn dropping_the_stream_closes_the_connection() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![Step::Text("first".into()), Step::Hang]));
    let p = provider(&fake);
    let mut stream = p.stream(request("q"));
    let first = tokio::time::timeout(LIMIT, stream.next()).await?;
    assert!(matches!(first, Some(Ok(ModelEvent::TextDelta(_)))));
    drop(stream);
    tokio::time::timeout(LIMIT, fake.wait_for_disconnects(1)).await?;
    Ok(())
}

#[tokio::test]
async fn an_error_inside_the_stream_carries_the_provider_message() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![Step::Data(serde_json::json!({"error": {"message": "context too long"}}))]));
    let events = collect(&provider(&fake), "q").await;
    assert!(matches!(events.as_slice(), [Err(ModelError::Provider(m))] if m == "context too long"), "{events:?}");
    Ok(())
}
