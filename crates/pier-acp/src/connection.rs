//! One bidirectional JSON-RPC connection over any `AsyncRead`/`AsyncWrite` pair.
//!
//! The connection owns three pieces of state, each behind its own lock:
//! the table of outgoing requests awaiting an answer ([`Pending`]), the table of
//! incoming requests being handled (for `$/cancel_request`), and the writer queue.
//! A driver task reads frames and dispatches them; a writer task owns the sink.
//!
//! # Dispatch
//! An incoming request's handler is polled once on the read loop, so requests begin
//! in wire order and one that needs no waiting (most of them) is answered without a
//! task; one that waits continues on its own task, so a long `session/prompt` never
//! blocks `session/cancel`, another session, or a response this side awaits.
//! Notifications are handed to the handler synchronously on the read loop, so the
//! handler sees them in wire order.
//!
//! # Close
//! Close is one memoized boundary, reached on EOF, on a transport error, or on
//! [`Connection::close`]. The recipe, in order:
//! 1. stop reading;
//! 2. fail every outgoing request still awaiting an answer with [`RequestError::Closed`],
//!    and refuse new ones;
//! 3. cancel every running handler through its token and wait for all of them to
//!    return, at most `settle_timeout`;
//! 4. let the writer flush what is queued, at most `settle_timeout`, then abandon it;
//! 5. publish the [`CloseReason`]; only now does [`Connection::closed`] resolve.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use agent_client_protocol_schema::v1::{CancelRequestNotification, Error, RequestId};
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{RequestError, decode_params};
use crate::frame::{DEFAULT_MAX_FRAME_BYTES, Frame, FrameReader, write_frame};
use crate::message::{self, Message};

/// The method of the protocol-level request-cancellation notification.
pub const CANCEL_REQUEST: &str = "$/cancel_request";

/// Tunables of a connection.
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// Longest accepted frame in bytes; longer lines are skipped and answered -32700.
    pub max_frame_bytes: usize,
    /// How long close waits for handlers to return and for the writer to flush.
    pub settle_timeout: Duration,
    /// Incoming requests handled at once; beyond it requests are answered -32603.
    pub max_in_flight: usize,
    /// Frames queued for the writer before senders wait.
    pub write_queue: usize,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            settle_timeout: Duration::from_secs(5),
            max_in_flight: 1024,
            write_queue: 1024,
        }
    }
}

/// Why a connection closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// The peer closed its end.
    Eof,
    /// Reading or writing failed.
    Transport(String),
    /// [`Connection::close`] was called.
    Requested,
}

/// What a side of the connection does with incoming messages.
pub trait Handler: Send + Sync + 'static {
    /// Handles one request. The future runs on its own task; it should watch
    /// `cx.cancel` and return promptly once it fires.
    fn request(&self, cx: RequestCx, method: String, params: Value) -> BoxFuture<'static, Result<Value, Error>>;

    /// Handles one notification, synchronously and in wire order. Unknown
    /// notifications should be ignored.
    fn notification(&self, conn: &Connection, method: &str, params: Value);

    /// Told when the peer sent something that is not a valid message (it has
    /// already been answered as the spec says). The default ignores it.
    fn protocol_error(&self, _conn: &Connection, _description: &str) {}

    /// Checked before each frame is read. A handler whose consumer has fallen behind
    /// returns a future that resolves once it has caught up; the connection stops
    /// reading meanwhile (the peer's writes then wait on the pipe) instead of buffering
    /// without bound. The default never waits.
    fn backpressure(&self) -> Option<BoxFuture<'static, ()>> {
        None
    }
}

/// Context of one incoming request.
pub struct RequestCx {
    pub id: RequestId,
    /// Fires on `$/cancel_request` for this id or when the connection closes.
    pub cancel: CancellationToken,
    pub conn: Connection,
}

/// A cheap, clonable handle to a running connection.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<Inner>,
}

struct Inner {
    config: ConnectionConfig,
    writer: mpsc::Sender<WriterCmd>,
    pending: Mutex<Pending>,
    in_flight: Mutex<HashMap<RequestId, InFlight>>,
    /// Cancelled when close begins; every handler token is a child of it.
    root: CancellationToken,
    /// Cancelled to ask the driver to close.
    shutdown: CancellationToken,
    tracker: TaskTracker,
    closed: watch::Sender<Option<CloseReason>>,
}

/// Outgoing requests awaiting an answer. Correlation is a table; a waiter is a
/// oneshot sender, and dropping it is how close fails the waiter.
struct Pending {
    next_id: i64,
    waiters: HashMap<i64, oneshot::Sender<Result<Value, Error>>>,
    closed: bool,
}

struct InFlight {
    cancel: CancellationToken,
    cancelled_by_peer: Arc<AtomicBool>,
}

enum WriterCmd {
    Frame(Vec<u8>),
    Flush(oneshot::Sender<()>),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another task panicked mid-update of a plain
    // table; the table itself stays usable, and refusing to go on would turn one
    // bug into a hung connection.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Connection {
    /// Starts a connection over `reader`/`writer` with `handler` serving incoming messages.
    pub fn spawn<R, W>(reader: R, writer: W, handler: Arc<dyn Handler>, config: ConnectionConfig) -> Connection
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (writer_tx, writer_rx) = mpsc::channel(config.write_queue.max(1));
        let (closed, _) = watch::channel(None);
        let inner = Arc::new(Inner {
            config,
            writer: writer_tx,
            pending: Mutex::new(Pending { next_id: 0, waiters: HashMap::new(), closed: false }),
            in_flight: Mutex::new(HashMap::new()),
            root: CancellationToken::new(),
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
            closed,
        });
        let conn = Connection { inner };
        tokio::spawn(write_loop(writer, writer_rx, conn.inner.shutdown.clone()));
        let reader = FrameReader::new(BufReader::with_capacity(64 * 1024, reader), conn.inner.config.max_frame_bytes);
        tokio::spawn(drive(conn.clone(), reader, handler));
        conn
    }

    /// Sends a request and waits for its answer, decoded as `R`.
    ///
    /// Dropping the returned future forgets the request and tells the peer with
    /// `$/cancel_request`.
    pub async fn request<P: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        params: &P,
    ) -> Result<R, RequestError> {
        let value = self.request_value(method, params).await?;
        serde_json::from_value(value).map_err(|source| RequestError::Malformed { method: method.to_owned(), source })
    }

    /// Like [`Connection::request`], returning the raw result.
    pub async fn request_value<P: Serialize>(&self, method: &str, params: &P) -> Result<Value, RequestError> {
        self.send_request(method, params).await?.value().await
    }

    /// Queues a request's frame and returns at once, before its answer: frames sent
    /// after this call leave after the request. Await [`Outgoing::value`] for the answer;
    /// dropping it withdraws the request (`$/cancel_request`).
    pub async fn send_request<P: Serialize>(&self, method: &str, params: &P) -> Result<Outgoing, RequestError> {
        let (id, rx) = {
            let mut pending = lock(&self.inner.pending);
            if pending.closed {
                return Err(RequestError::Closed);
            }
            let id = pending.next_id;
            pending.next_id += 1;
            let (tx, rx) = oneshot::channel();
            pending.waiters.insert(id, tx);
            (id, rx)
        };
        let outgoing = Outgoing { inner: self.inner.clone(), id, rx: Some(rx) };
        let frame = message::encode_request(&RequestId::Number(id), method, params)?;
        self.send_frame(frame).await?;
        Ok(outgoing)
    }

    /// Sends a notification. Frames leave in the order they were sent.
    pub async fn notify<P: Serialize>(&self, method: &str, params: &P) -> Result<(), RequestError> {
        let frame = message::encode_notification(method, params)?;
        self.send_frame(frame).await
    }

    async fn send_frame(&self, frame: Vec<u8>) -> Result<(), RequestError> {
        if self.inner.closed.borrow().is_some() {
            return Err(RequestError::Closed);
        }
        self.inner.writer.send(WriterCmd::Frame(frame)).await.map_err(|_| RequestError::Closed)
    }

    async fn respond(&self, id: &RequestId, result: Result<Value, Error>) {
        let frame = match message::encode_response(id, &result) {
            Ok(frame) => frame,
            Err(e) => {
                tracing::error!(%id, error = %e, "could not encode a response; answering -32603");
                match message::encode_response(id, &Err(crate::error::internal("the response could not be encoded"))) {
                    Ok(frame) => frame,
                    Err(_) => return,
                }
            }
        };
        if self.send_frame(frame).await.is_err() {
            tracing::debug!(%id, "connection closed before the response could be written");
        }
    }

    /// Asks the connection to close and waits until it has fully settled.
    pub async fn close(&self) -> CloseReason {
        self.inner.shutdown.cancel();
        self.closed().await
    }

    /// Resolves once the connection has closed and settled (see the module doc).
    pub async fn closed(&self) -> CloseReason {
        let mut rx = self.inner.closed.subscribe();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return reason;
            }
            if rx.changed().await.is_err() {
                return CloseReason::Requested;
            }
        }
    }

    /// True once close has begun.
    pub fn is_closing(&self) -> bool {
        self.inner.root.is_cancelled()
    }

    /// A token that fires when close begins; for work tied to the connection's life.
    pub fn closing_token(&self) -> CancellationToken {
        self.inner.root.child_token()
    }
}

/// A request on the wire, waiting for its answer. Dropped before the answer, it
/// removes its waiter and tells the peer (`$/cancel_request`).
pub struct Outgoing {
    inner: Arc<Inner>,
    id: i64,
    /// `None` once answered.
    rx: Option<oneshot::Receiver<Result<Value, Error>>>,
}

impl Outgoing {
    /// The answer: the raw result, the peer's error, or `Closed`.
    pub async fn value(mut self) -> Result<Value, RequestError> {
        let Some(rx) = self.rx.as_mut() else { return Err(RequestError::Closed) };
        let answer = rx.await;
        self.rx = None;
        match answer {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(RequestError::Remote(error)),
            Err(_) => Err(RequestError::Closed),
        }
    }

    /// The answer, decoded.
    pub async fn answer<R: DeserializeOwned>(self, method: &str) -> Result<R, RequestError> {
        let value = self.value().await?;
        serde_json::from_value(value).map_err(|source| RequestError::Malformed { method: method.to_owned(), source })
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        if self.rx.is_none() {
            return;
        }
        let removed = lock(&self.inner.pending).waiters.remove(&self.id).is_some();
        if removed && self.inner.closed.borrow().is_none() {
            let params = CancelRequestNotification::new(RequestId::Number(self.id));
            if let Ok(frame) = message::encode_notification(CANCEL_REQUEST, &params) {
                // Best effort: a full queue means the peer is not reading anyway.
                let _ = self.inner.writer.try_send(WriterCmd::Frame(frame));
            }
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(sink: W, mut rx: mpsc::Receiver<WriterCmd>, shutdown: CancellationToken) {
    // Frames are batched into one buffer and flushed when the queue runs dry: a burst
    // of notifications costs a few large writes, not two small ones per frame.
    let mut sink = tokio::io::BufWriter::with_capacity(64 * 1024, sink);
    let mut broken = false;
    while let Some(cmd) = rx.recv().await {
        match cmd {
            WriterCmd::Frame(frame) if !broken => {
                let mut result = write_frame(&mut sink, &frame).await;
                if result.is_ok() && rx.is_empty() {
                    result = sink.flush().await;
                }
                if let Err(e) = result {
                    tracing::debug!(error = %e, "writing to the peer failed; closing the connection");
                    broken = true;
                    shutdown.cancel();
                }
            }
            WriterCmd::Frame(_) => {}
            WriterCmd::Flush(ack) => {
                if !broken {
                    let _ = sink.flush().await;
                }
                let _ = ack.send(());
                // Flush is only sent by close; nothing more will be written.
                let _ = sink.shutdown().await;
                return;
            }
        }
    }
}

async fn drive<R: tokio::io::AsyncBufRead + Unpin>(
    conn: Connection,
    mut reader: FrameReader<R>,
    handler: Arc<dyn Handler>,
) {
    let inner = conn.inner.clone();
    let reason = loop {
        if let Some(caught_up) = handler.backpressure() {
            tokio::select! {
                biased;
                _ = inner.shutdown.cancelled() => break CloseReason::Requested,
                () = caught_up => {}
            }
        }
        let frame = tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => break CloseReason::Requested,
            frame = reader.next_frame() => frame,
        };
        match frame {
            Ok(None) => break CloseReason::Eof,
            Err(e) => break CloseReason::Transport(e.to_string()),
            Ok(Some(Frame::Oversized { len })) => {
                let limit = inner.config.max_frame_bytes;
                tracing::warn!(len, limit, "skipped a frame longer than the limit");
                handler.protocol_error(&conn, &format!("a frame of {len} bytes exceeds the limit of {limit} bytes"));
                let error = Error::parse_error().data(json!({
                    "reason": format!("frame of {len} bytes exceeds the limit of {limit} bytes; it was skipped"),
                }));
                conn.respond(&RequestId::Null, Err(error)).await;
            }
            Ok(Some(Frame::Line(line))) => match message::parse(&line) {
                Err(rejection) => {
                    tracing::debug!(code = i32::from(rejection.error.code), "rejected an incoming message");
                    let excerpt: String = String::from_utf8_lossy(&line).chars().take(120).collect();
                    handler.protocol_error(&conn, &format!("{} in {excerpt:?}", rejection.error.message));
                    if rejection.reply {
                        conn.respond(&rejection.id, Err(rejection.error)).await;
                    }
                }
                Ok(Message::Request { id, method, params }) => start_request(&conn, &handler, id, method, params).await,
                Ok(Message::Notification { method, params }) => {
                    if method == CANCEL_REQUEST {
                        cancel_in_flight(&inner, &params);
                    } else {
                        handler.notification(&conn, &method, params);
                    }
                }
                Ok(Message::Response { id, result }) => deliver(&inner, id, result),
            },
        }
    };
    tracing::debug!(?reason, "connection closing");
    settle(&inner).await;
    inner.closed.send_replace(Some(reason));
}

async fn start_request(conn: &Connection, handler: &Arc<dyn Handler>, id: RequestId, method: String, params: Value) {
    let inner = &conn.inner;
    let cancel = inner.root.child_token();
    let cancelled_by_peer = Arc::new(AtomicBool::new(false));
    let refusal = {
        let mut in_flight = lock(&inner.in_flight);
        if in_flight.contains_key(&id) {
            Some(Error::invalid_request().data(json!({ "reason": format!("request id {id} is already in flight") })))
        } else if in_flight.len() >= inner.config.max_in_flight {
            Some(crate::error::internal(format!(
                "more than {} requests are in flight; wait for some to finish",
                inner.config.max_in_flight
            )))
        } else {
            in_flight
                .insert(id.clone(), InFlight { cancel: cancel.clone(), cancelled_by_peer: cancelled_by_peer.clone() });
            None
        }
    };
    if let Some(error) = refusal {
        conn.respond(&id, Err(error)).await;
        return;
    }
    let cx = RequestCx { id: id.clone(), cancel: cancel.clone(), conn: conn.clone() };
    let mut fut = handler.request(cx, method, params);
    // Most requests (initialize, session/new, a cancel) finish without waiting: polled
    // once here, they are answered without a task of their own. One that waits goes on
    // to its task, which polls it again with a real waker straight away.
    let first = fut.as_mut().poll(&mut std::task::Context::from_waker(futures::task::noop_waker_ref()));
    if let std::task::Poll::Ready(result) = first {
        lock(&inner.in_flight).remove(&id);
        let result = if cancelled_by_peer.load(Ordering::SeqCst) { Err(Error::request_cancelled()) } else { result };
        conn.respond(&id, result).await;
        return;
    }
    let conn = conn.clone();
    inner.tracker.spawn(async move {
        let settle_timeout = conn.inner.config.settle_timeout;
        tokio::pin!(fut);
        let result = tokio::select! {
            result = &mut fut => result,
            _ = cancel.cancelled() => {
                // Give the handler the chance to wind down and settle its state.
                match tokio::time::timeout(settle_timeout, &mut fut).await {
                    Ok(result) => result,
                    Err(_) => {
                        tracing::warn!(%id, "a handler did not return within the settle timeout after cancellation");
                        Err(Error::request_cancelled())
                    }
                }
            }
        };
        lock(&conn.inner.in_flight).remove(&id);
        let result = if cancelled_by_peer.load(Ordering::SeqCst) { Err(Error::request_cancelled()) } else { result };
        conn.respond(&id, result).await;
    });
}

fn cancel_in_flight(inner: &Inner, params: &Value) {
    let params: CancelRequestNotification = match decode_params(CANCEL_REQUEST, params) {
        Ok(p) => p,
        Err(_) => {
            tracing::debug!("ignored a malformed $/cancel_request");
            return;
        }
    };
    if let Some(entry) = lock(&inner.in_flight).get(&params.request_id) {
        entry.cancelled_by_peer.store(true, Ordering::SeqCst);
        entry.cancel.cancel();
    }
}

fn deliver(inner: &Inner, id: RequestId, result: Result<Value, Error>) {
    let waiter = match id {
        RequestId::Number(n) => lock(&inner.pending).waiters.remove(&n),
        _ => None,
    };
    match waiter {
        Some(tx) => {
            let _ = tx.send(result);
        }
        None => tracing::warn!(%id, "ignored a response to no request of ours"),
    }
}

async fn settle(inner: &Inner) {
    let waiters = {
        let mut pending = lock(&inner.pending);
        pending.closed = true;
        std::mem::take(&mut pending.waiters)
    };
    drop(waiters);
    inner.root.cancel();
    inner.tracker.close();
    let timeout = inner.config.settle_timeout;
    if tokio::time::timeout(timeout, inner.tracker.wait()).await.is_err() {
        tracing::warn!(?timeout, "handlers did not all return within the settle timeout");
    }
    let (ack, acked) = oneshot::channel();
    let flushed = async {
        inner.writer.send(WriterCmd::Flush(ack)).await.ok()?;
        acked.await.ok()
    };
    if tokio::time::timeout(timeout, flushed).await.ok().flatten().is_none() {
        tracing::warn!("the writer did not flush before close; abandoning queued frames");
    }
}
