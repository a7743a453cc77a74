//! The turn loop at the engine boundary, against the fake model server.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use pier_engine::log::SessionLog;
use pier_engine::{Engine, EngineConfig, EngineError, EventMsg, NoApprover, PermissionPolicy, StopReason, TurnContext};
use pier_fake_model::{FakeModel, Reply, Step};
use pier_model::{ModelConfig, OpenAiProvider};
use tokio::io::AsyncWrite;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A disk that is always full.
struct FullDisk;

impl AsyncWrite for FullDisk {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, _: &[u8]) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Err(std::io::Error::other("no space left on device")))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Err(std::io::Error::other("no space left on device")))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// A disk that fills up after `budget` bytes.
struct FillsUp {
    budget: usize,
}

impl AsyncWrite for FillsUp {
    fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if buf.len() > self.budget {
            return Poll::Ready(Err(std::io::Error::other("no space left on device")));
        }
        self.budget -= buf.len();
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

fn engine(fake: &FakeModel, home: &std::path::Path) -> std::io::Result<Engine> {
    let provider =
        OpenAiProvider::new(ModelConfig::new(fake.base_url(), "fake-model")).map_err(std::io::Error::other)?;
    let toolbox = Arc::new(pier_tools::Toolbox::builtin(pier_tools::Limits::default()));
    Ok(Engine::new(EngineConfig::new(home.to_owned()), Arc::new(provider), toolbox, PermissionPolicy::default()))
}

async fn run(session: &pier_engine::Session, prompt: &str) -> (Result<StopReason, EngineError>, Vec<EventMsg>) {
    let (tx, mut rx) = mpsc::channel(64);
    let permit = match session.begin_turn() {
        Ok(p) => p,
        Err(e) => return (Err(e), Vec::new()),
    };
    let cx = TurnContext { cancel: CancellationToken::new(), events: tx, approver: Arc::new(NoApprover) };
    let result = permit.run(prompt.to_owned(), cx).await;
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e);
    }
    (result, events)
}

#[tokio::test]
async fn events_are_deltas_then_the_committed_message() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::Stream(vec![
        Step::Reasoning("hmm".into()),
        Step::Text("a".into()),
        Step::Text("b".into()),
        Step::Finish("stop".into()),
        Step::Usage { prompt: 1, completion: 2 },
        Step::Done,
    ]));
    let home = tempfile::tempdir()?;
    let e = engine(&fake, home.path())?;
    let session = e.create_session(home.path().to_owned()).await.map_err(std::io::Error::other)?;
    let (result, events) = run(&session, "q").await;
    assert_eq!(result.ok(), Some(StopReason::EndTurn));
    assert_eq!(
        events,
        vec![
            EventMsg::Title("q".into()),
            EventMsg::ReasoningDelta("hmm".into()),
            EventMsg::TextDelta("a".into()),
            EventMsg::TextDelta("b".into()),
            EventMsg::Usage(pier_model::Usage { prompt_tokens: 1, completion_tokens: 2, total_tokens: 3 }),
            EventMsg::MessageCommitted("ab".into()),
        ]
    );
    Ok(())
}

#[tokio::test]
async fn a_failed_log_write_ends_the_turn_with_an_error() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::text("fine"));
    let home = tempfile::tempdir()?;
    let e = engine(&fake, home.path())?;
    let log = SessionLog::from_writer(Box::new(FullDisk), home.path().join("full.jsonl"));
    // Even creating the session flushes, so a broken disk is noticed at once.
    let created = e.create_session_with_log(home.path().to_owned(), log).await;
    assert!(matches!(created, Err(EngineError::Log(ref m)) if m.contains("no space left")), "{:?}", created.err());

    // A disk that fills up during a turn fails that turn, and the history stays as it was.
    let log = SessionLog::from_writer(Box::new(FillsUp { budget: 400 }), home.path().join("fills.jsonl"));
    let session = e.create_session_with_log(home.path().to_owned(), log).await.map_err(std::io::Error::other)?;
    let (result, _) = run(&session, "a prompt long enough to overflow the small disk budget").await;
    assert!(matches!(result, Err(EngineError::Log(ref m)) if m.contains("no space left")), "{result:?}");
    Ok(())
}

#[tokio::test]
async fn a_turn_whose_record_is_lost_leaves_no_trace_in_the_conversation() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.set_fallback(|_| Reply::text("fine"));
    let home = tempfile::tempdir()?;
    let e = engine(&fake, home.path())?;
    // Room for the session's start and part of a turn; the end-of-turn flush then fails.
    let log = SessionLog::from_writer(Box::new(FillsUp { budget: 700 }), home.path().join("fills.jsonl"));
    let session = e.create_session_with_log(home.path().to_owned(), log).await.map_err(std::io::Error::other)?;
    let (first, _) = run(&session, "the lost prompt").await;
    assert!(matches!(first, Err(EngineError::Log(_))), "{first:?}");
    let _ = run(&session, "the next prompt").await;
    let second = fake.requests().last().map(|r| r.body.to_string()).unwrap_or_default();
    assert!(second.contains("the next prompt"), "{second}");
    assert!(
        !second.contains("the lost prompt") && !second.contains("fine"),
        "a lost turn stayed in the history: {second}"
    );
    Ok(())
}

/// Grants every request, but only after cancelling the turn: the cancel lands between
/// the grant and the tool's start.
struct CancelThenAllow(CancellationToken);

impl pier_engine::Approver for CancelThenAllow {
    fn ask(
        &self,
        _: &pier_engine::ToolCallRecord,
    ) -> futures::future::BoxFuture<'static, pier_engine::PermissionAnswer> {
        self.0.cancel();
        Box::pin(async { pier_engine::PermissionAnswer::AllowOnce })
    }
}

#[tokio::test]
async fn a_cancel_that_lands_with_the_grant_stops_the_tool() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    fake.push(Reply::tool_call("c1", "write_file", r#"{"path": "never.txt", "content": "x"}"#));
    let home = tempfile::tempdir()?;
    let e = engine(&fake, home.path())?;
    let session = e.create_session(home.path().to_owned()).await.map_err(std::io::Error::other)?;
    let (tx, mut rx) = mpsc::channel(64);
    let permit = session.begin_turn().map_err(std::io::Error::other)?;
    let token = CancellationToken::new();
    let cx = TurnContext { cancel: token.clone(), events: tx, approver: Arc::new(CancelThenAllow(token)) };
    let stop = permit.run("write".to_owned(), cx).await.map_err(std::io::Error::other)?;
    assert_eq!(stop, StopReason::Cancelled);
    assert!(!home.path().join("never.txt").exists(), "the tool ran after the cancel");
    let mut last = None;
    while let Ok(event) = rx.try_recv() {
        if let EventMsg::ToolCallUpdate(r) | EventMsg::ToolCall(r) = event {
            last = Some(r.status);
        }
    }
    assert_eq!(last, Some(pier_engine::ToolCallStatus::Failed));
    Ok(())
}

#[tokio::test]
async fn a_busy_session_refuses_a_second_turn() -> std::io::Result<()> {
    let fake = FakeModel::start().await?;
    let home = tempfile::tempdir()?;
    let e = engine(&fake, home.path())?;
    let session = e.create_session(home.path().to_owned()).await.map_err(std::io::Error::other)?;
    let first = session.begin_turn();
    assert!(first.is_ok());
    assert!(matches!(session.begin_turn(), Err(EngineError::Busy)));
    drop(first);
    assert!(session.begin_turn().is_ok());
    Ok(())
}
