//! The connection over an in-memory duplex pipe, with the peer played by raw lines.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use pier_acp::schema::Error;
use pier_acp::{CloseReason, Connection, ConnectionConfig, Handler, RequestCx, RequestError};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, DuplexStream, Lines, ReadHalf, WriteHalf};
use tokio::sync::Notify;

const LIMIT: Duration = Duration::from_secs(10);

/// A handler whose behaviour tests steer: `slow` waits for `release` or its cancel.
#[derive(Default)]
struct TestHandler {
    release: Arc<Notify>,
    notes: Mutex<Vec<String>>,
    returned_after_cancel: Arc<Mutex<u32>>,
}

impl Handler for TestHandler {
    fn request(&self, cx: RequestCx, method: String, params: Value) -> BoxFuture<'static, Result<Value, Error>> {
        let release = self.release.clone();
        let returned = self.returned_after_cancel.clone();
        Box::pin(async move {
            match method.as_str() {
                "echo" => Ok(params),
                "fail" => Err(Error::new(-32099, "failed on purpose")),
                "slow" => {
                    tokio::select! {
                        _ = release.notified() => Ok(json!("released")),
                        _ = cx.cancel.cancelled() => {
                            *returned.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                            Ok(json!("wound down"))
                        }
                    }
                }
                "ask_back" => {
                    let answer: Value = cx
                        .conn
                        .request("peer/method", &json!({"q": 1}))
                        .await
                        .map_err(|e| Error::new(-32603, e.to_string()))?;
                    Ok(answer)
                }
                _ => Err(Error::method_not_found()),
            }
        })
    }

    fn notification(&self, _conn: &Connection, method: &str, params: Value) {
        self.notes.lock().unwrap_or_else(|e| e.into_inner()).push(format!("{method}:{params}"));
    }
}

struct Peer {
    lines: Lines<BufReader<ReadHalf<DuplexStream>>>,
    writer: Option<WriteHalf<DuplexStream>>,
}

impl Peer {
    async fn send(&mut self, line: &str) {
        let w = self.writer.as_mut().unwrap_or_else(|| panic!("peer writer closed"));
        w.write_all(line.as_bytes()).await.unwrap_or_else(|e| panic!("{e}"));
        w.write_all(b"\n").await.unwrap_or_else(|e| panic!("{e}"));
    }

    async fn recv(&mut self) -> Value {
        match tokio::time::timeout(LIMIT, self.lines.next_line()).await {
            Ok(Ok(Some(line))) => serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}")),
            other => panic!("no line from the connection: {other:?}"),
        }
    }

    async fn eof(&mut self) -> bool {
        matches!(tokio::time::timeout(LIMIT, self.lines.next_line()).await, Ok(Ok(None)))
    }
}

fn setup(handler: Arc<TestHandler>, config: ConnectionConfig) -> (Connection, Peer) {
    let (ours, theirs) = tokio::io::duplex(1 << 20);
    let (r, w) = tokio::io::split(ours);
    let conn = Connection::spawn(r, w, handler, config);
    let (pr, pw) = tokio::io::split(theirs);
    (conn, Peer { lines: BufReader::new(pr).lines(), writer: Some(pw) })
}

fn quick() -> ConnectionConfig {
    ConnectionConfig { settle_timeout: Duration::from_secs(2), ..ConnectionConfig::default() }
}

#[tokio::test]
async fn a_slow_request_blocks_neither_requests_nor_notifications() {
    let handler = Arc::new(TestHandler::default());
    let (_conn, mut peer) = setup(handler.clone(), quick());
    peer.send(r#"{"jsonrpc":"2.0","id":1,"method":"slow"}"#).await;
    peer.send(r#"{"jsonrpc":"2.0","method":"note","params":{"n":1}}"#).await;
    peer.send(r#"{"jsonrpc":"2.0","id":2,"method":"echo","params":{"x":2}}"#).await;
    assert_eq!(peer.recv().await, json!({"jsonrpc":"2.0","id":2,"result":{"x":2}}));
    assert_eq!(handler.notes.lock().map(|n| n.clone()).unwrap_or_default(), vec!["note:{\"n\":1}"]);
    handler.release.notify_one();
    assert_eq!(peer.recv().await, json!({"jsonrpc":"2.0","id":1,"result":"released"}));
}

#[tokio::test]
async fn notifications_arrive_in_wire_order() {
    let handler = Arc::new(TestHandler::default());
    let (_conn, mut peer) = setup(handler.clone(), quick());
    for i in 0..200 {
        peer.send(&format!(r#"{{"jsonrpc":"2.0","method":"n","params":[{i}]}}"#)).await;
    }
    peer.send(r#"{"jsonrpc":"2.0","id":"sync","method":"echo","params":{}}"#).await;
    assert_eq!(peer.recv().await["id"], "sync");
    let notes = handler.notes.lock().map(|n| n.clone()).unwrap_or_default();
    let expected: Vec<String> = (0..200).map(|i| format!("n:[{i}]")).collect();
    assert_eq!(notes, expected);
}

#[tokio::test]
async fn outgoing_requests_correlate_out_of_order_answers() {
    let (conn, mut peer) = setup(Arc::new(TestHandler::default()), quick());
    let c1 = conn.clone();
    let a = tokio::spawn(async move { c1.request::<_, Value>("m/a", &json!({})).await });
    let first = peer.recv().await;
    let c2 = conn.clone();
    let b = tokio::spawn(async move { c2.request::<_, Value>("m/b", &json!({})).await });
    let second = peer.recv().await;
    assert_eq!((first["method"].clone(), second["method"].clone()), (json!("m/a"), json!("m/b")));
    peer.send(&json!({"jsonrpc":"2.0","id":second["id"],"error":{"code":-32001,"message":"nope"}}).to_string()).await;
    peer.send(&json!({"jsonrpc":"2.0","id":first["id"],"result":"A"}).to_string()).await;
    let a = a.await.unwrap_or_else(|e| panic!("{e}"));
    let b = b.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.ok(), Some(json!("A")));
    assert!(matches!(b, Err(RequestError::Remote(e)) if e.message == "nope"));
}

#[tokio::test]
async fn a_handler_can_call_back_into_the_peer() {
    let (_conn, mut peer) = setup(Arc::new(TestHandler::default()), quick());
    peer.send(r#"{"jsonrpc":"2.0","id":7,"method":"ask_back"}"#).await;
    let back = peer.recv().await;
    assert_eq!(back["method"], "peer/method");
    peer.send(&json!({"jsonrpc":"2.0","id":back["id"],"result":{"answer":42}}).to_string()).await;
    assert_eq!(peer.recv().await, json!({"jsonrpc":"2.0","id":7,"result":{"answer":42}}));
}

#[tokio::test]
async fn cancel_request_answers_minus_32800_after_the_handler_settles() {
    let handler = Arc::new(TestHandler::default());
    let (_conn, mut peer) = setup(handler.clone(), quick());
    peer.send(r#"{"jsonrpc":"2.0","id":"s","method":"slow"}"#).await;
    peer.send(r#"{"jsonrpc":"2.0","method":"$/cancel_request","params":{"requestId":"s"}}"#).await;
    let r = peer.recv().await;
    assert_eq!((r["id"].clone(), r["error"]["code"].clone()), (json!("s"), json!(-32800)));
    assert_eq!(*handler.returned_after_cancel.lock().unwrap_or_else(|e| e.into_inner()), 1);
    // Cancelling a finished or unknown request is ignored.
    peer.send(r#"{"jsonrpc":"2.0","method":"$/cancel_request","params":{"requestId":"zzz"}}"#).await;
    peer.send(r#"{"jsonrpc":"2.0","id":3,"method":"echo","params":[]}"#).await;
    assert_eq!(peer.recv().await["id"], 3);
}

#[tokio::test]
async fn a_duplicate_in_flight_id_is_refused() {
    let handler = Arc::new(TestHandler::default());
    let (_conn, mut peer) = setup(handler.clone(), quick());
    peer.send(r#"{"jsonrpc":"2.0","id":1,"method":"slow"}"#).await;
    peer.send(r#"{"jsonrpc":"2.0","id":1,"method":"echo","params":{}}"#).await;
    let r = peer.recv().await;
    assert_eq!((r["id"].clone(), r["error"]["code"].clone()), (json!(1), json!(-32600)));
    handler.release.notify_one();
    assert_eq!(peer.recv().await["result"], "released");
}

#[tokio::test]
async fn errors_and_stray_responses_keep_the_connection_up() {
    let (_conn, mut peer) = setup(Arc::new(TestHandler::default()), quick());
    peer.send(r#"{"jsonrpc":"2.0","id":1,"method":"fail"}"#).await;
    assert_eq!(peer.recv().await["error"]["code"], -32099);
    peer.send(r#"{"jsonrpc":"2.0","id":99,"result":"nobody asked"}"#).await;
    peer.send(r#"{"jsonrpc":"2.0","id":"x","error":{"code":1,"message":"nobody asked"}}"#).await;
    peer.send("\u{0}\u{1}garbage").await;
    assert_eq!(peer.recv().await["error"]["code"], -32700);
    peer.send(r#"{"jsonrpc":"2.0","id":2,"method":"echo","params":{"still":"up"}}"#).await;
    assert_eq!(peer.recv().await["result"]["still"], "up");
}

#[tokio::test]
async fn an_oversized_frame_is_skipped_with_minus_32700() {
    let config = ConnectionConfig { max_frame_bytes: 256, ..quick() };
    let (_conn, mut peer) = setup(Arc::new(TestHandler::default()), config);
    let big = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"echo","params":"{}"}}"#, "y".repeat(10_000));
    peer.send(&big).await;
    let r = peer.recv().await;
    assert_eq!((r["id"].clone(), r["error"]["code"].clone()), (Value::Null, json!(-32700)));
    peer.send(r#"{"jsonrpc":"2.0","id":2,"method":"echo","params":[1]}"#).await;
    assert_eq!(peer.recv().await["result"], json!([1]));
}

#[tokio::test]
async fn eof_settles_everything_before_closed_resolves() {
    let handler = Arc::new(TestHandler::default());
    let (conn, mut peer) = setup(handler.clone(), quick());
    peer.send(r#"{"jsonrpc":"2.0","id":1,"method":"slow"}"#).await;
    let c = conn.clone();
    let outgoing = tokio::spawn(async move { c.request::<_, Value>("peer/never", &json!({})).await });
    assert_eq!(peer.recv().await["method"], "peer/never");
    if let Some(mut w) = peer.writer.take() {
        w.shutdown().await.unwrap_or_else(|e| panic!("{e}")); // EOF
    }
    let reason = tokio::time::timeout(LIMIT, conn.closed()).await.unwrap_or_else(|_| panic!("close did not settle"));
    assert_eq!(reason, CloseReason::Eof);
    // The handler was cancelled and had returned before closed() resolved.
    assert_eq!(*handler.returned_after_cancel.lock().unwrap_or_else(|e| e.into_inner()), 1);
    // Its answer was flushed before the writer shut down.
    assert_eq!(peer.recv().await, json!({"jsonrpc":"2.0","id":1,"result":"wound down"}));
    assert!(peer.eof().await);
    let outgoing = outgoing.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(outgoing, Err(RequestError::Closed)));
    // Close is memoized, and nothing more can be sent.
    assert_eq!(conn.close().await, CloseReason::Eof);
    assert!(matches!(conn.notify("x", &json!({})).await, Err(RequestError::Closed)));
    assert!(matches!(conn.request::<_, Value>("x", &json!({})).await, Err(RequestError::Closed)));
}

#[tokio::test]
async fn an_explicit_close_is_a_settled_boundary() {
    let handler = Arc::new(TestHandler::default());
    let (conn, mut peer) = setup(handler.clone(), quick());
    peer.send(r#"{"jsonrpc":"2.0","id":1,"method":"slow"}"#).await;
    peer.send(r#"{"jsonrpc":"2.0","id":2,"method":"echo","params":{}}"#).await;
    assert_eq!(peer.recv().await["id"], 2);
    let reason = tokio::time::timeout(LIMIT, conn.close()).await.unwrap_or_else(|_| panic!("close did not settle"));
    assert_eq!(reason, CloseReason::Requested);
    assert!(conn.is_closing());
    assert_eq!(peer.recv().await["result"], "wound down");
    assert!(peer.eof().await);
}

#[tokio::test]
async fn dropping_an_outgoing_request_tells_the_peer() {
    let (conn, mut peer) = setup(Arc::new(TestHandler::default()), quick());
    let c = conn.clone();
    let task = tokio::spawn(async move { c.request::<_, Value>("peer/slow", &json!({})).await });
    let sent = peer.recv().await;
    task.abort();
    let cancel = peer.recv().await;
    assert_eq!(cancel["method"], "$/cancel_request");
    assert_eq!(cancel["params"]["requestId"], sent["id"]);
    // A late answer to the forgotten request is ignored.
    peer.send(&json!({"jsonrpc":"2.0","id":sent["id"],"result":1}).to_string()).await;
    peer.send(r#"{"jsonrpc":"2.0","id":5,"method":"echo","params":{}}"#).await;
    assert_eq!(peer.recv().await["id"], 5);
}

#[tokio::test]
async fn a_handler_that_ignores_cancellation_is_abandoned_after_the_settle_timeout() {
    struct Stubborn;
    impl Handler for Stubborn {
        fn request(&self, _cx: RequestCx, _m: String, _p: Value) -> BoxFuture<'static, Result<Value, Error>> {
            Box::pin(std::future::pending())
        }
        fn notification(&self, _conn: &Connection, _m: &str, _p: Value) {}
    }
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    let (r, w) = tokio::io::split(ours);
    let config = ConnectionConfig { settle_timeout: Duration::from_millis(200), ..ConnectionConfig::default() };
    let conn = Connection::spawn(r, w, Arc::new(Stubborn), config);
    let (pr, mut pw) = tokio::io::split(theirs);
    pw.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"m\"}\n").await.unwrap_or_else(|e| panic!("{e}"));
    let mut lines = BufReader::new(pr).lines();
    pw.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"m\"}\n").await.unwrap_or_else(|e| panic!("{e}"));
    let dup = tokio::time::timeout(LIMIT, lines.next_line()).await;
    assert!(matches!(dup, Ok(Ok(Some(ref l))) if l.contains("-32600")), "{dup:?}");
    let closed = tokio::time::timeout(LIMIT, conn.close()).await;
    assert_eq!(closed.ok(), Some(CloseReason::Requested));
}
