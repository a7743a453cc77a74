//! The one follower of the event log, which `pier events`, `/events`, the dashboard and
//! `pier run`'s printer all use. It reads only what can have come ([`LogCursor`]: every
//! commit rings the store's watch), takes this process's own commits without reading the
//! store while it is caught up, reads the next batch while one is being sent (a replay uses
//! both cores), and, for a client that may stall, feeds a bounded queue that cuts a client
//! which takes nothing for too long ([`Follower::queued`]).

use std::sync::Arc;
use std::time::Duration;

use pier_store::{Event, LogCursor, OwnCommit, RawEvent, StoreError, TaskStore};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::handle::Tasks;
use super::select::{EventFilter, merge_deltas};

/// Events read from the store at a time. With the batch read ahead, what one follower holds
/// of the log is at most twice this (the memory of 200 `/events` readers of a long log was
/// 2,000 and 2,000 each: about 3 MB a reader).
const BATCH: usize = 256;

/// What to follow.
#[derive(Debug, Clone, Default)]
pub struct Follow {
    /// Only this run's events.
    pub run: Option<String>,
    /// From the event after this sequence.
    pub after: i64,
    /// Keep following once caught up (else end there).
    pub live: bool,
    /// Only the events this keeps (the cursor passes the others all the same).
    pub only: EventFilter,
    /// An agent's text deltas merged per message, within each batch ([`merge_deltas`]).
    pub merge: bool,
}

/// A follower of the log (see the module doc).
pub struct Follower {
    store: Arc<dyn TaskStore>,
    run: Option<String>,
    live: bool,
    only: EventFilter,
    merge: bool,
    cursor: LogCursor,
    /// The commit watch, subscribed before the first read: no commit in between is missed.
    watch: watch::Receiver<i64>,
    /// This process's commits with their events.
    own: broadcast::Receiver<Arc<OwnCommit>>,
    /// The read of the batch after the last one, already under way.
    next: Option<JoinHandle<Result<Vec<Event>, StoreError>>>,
}

/// What a queued follower delivers: each event as its `encode` made it.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivered<T> {
    Event(T),
    /// The client took nothing for too long and was cut: it resumes after this sequence.
    Cut {
        after: i64,
    },
}

impl Tasks {
    /// Follows the log from `f.after`.
    pub fn follow(&self, f: Follow) -> Follower {
        let mut watch = self.store.subscribe();
        watch.borrow_and_update();
        Follower {
            own: self.store.own_commits(),
            store: self.store.clone(),
            run: f.run,
            live: f.live,
            only: f.only,
            merge: f.merge,
            cursor: LogCursor::new(f.after),
            watch,
            next: None,
        }
    }
}

impl Follower {
    /// The last event delivered.
    pub fn after(&self) -> i64 {
        self.cursor.after()
    }

    /// From now on, end once caught up (`pier run`'s printer at the run's end).
    pub fn finish(&mut self) {
        self.live = false;
    }

    /// The next events in order, as the follow asked for them (filtered, deltas merged); never
    /// an empty batch. `None` once a follower that is not live is caught up, or the store is
    /// gone. Cancel-safe: dropped while waiting, nothing is lost (the cursor moves only with a
    /// batch read, and a batch read is returned in the same poll).
    pub async fn next_batch(&mut self) -> Option<Result<Vec<Event>, StoreError>> {
        loop {
            let events = match self.raw_batch().await? {
                Ok(events) => events,
                Err(e) => return Some(Err(e)),
            };
            let mut events: Vec<Event> = if self.only == EventFilter::default() {
                events
            } else {
                events.into_iter().filter(|e| self.only.keeps(e)).collect()
            };
            if self.merge {
                events = merge_deltas(events);
            }
            if !events.is_empty() {
                return Some(Ok(events));
            }
        }
    }

    /// The next events of the log (of the run followed) in order.
    async fn raw_batch(&mut self) -> Option<Result<Vec<Event>, StoreError>> {
        loop {
            if let Some(next) = self.next.take() {
                let events = match next.await {
                    Ok(Ok(events)) => events,
                    Ok(Err(e)) => return Some(Err(e)),
                    Err(e) => return Some(Err(StoreError::Db(format!("a read of the log failed: {e}")))),
                };
                // A read ahead begun before the watch was looked at: it says nothing of it.
                self.cursor.read(&events, BATCH, 0);
                if !events.is_empty() {
                    self.read_ahead(events.len());
                    return Some(Ok(events));
                }
                continue;
            }
            let own = self.take_own();
            if !own.is_empty() {
                return Some(Ok(own));
            }
            let seen = *self.watch.borrow_and_update();
            if !self.cursor.due(seen) {
                if !self.live {
                    return None;
                }
                self.watch.changed().await.ok()?;
                continue;
            }
            let events = match self.fetch().await {
                Ok(events) => events,
                Err(e) => return Some(Err(e)),
            };
            self.cursor.read(&events, BATCH, seen);
            if !events.is_empty() {
                self.read_ahead(events.len());
                return Some(Ok(events));
            }
        }
    }

    /// A full batch: more is waiting, read while this one is handed over.
    fn read_ahead(&mut self, got: usize) {
        if got >= BATCH {
            let (store, run, after) = (self.store.clone(), self.run.clone(), self.cursor.after());
            self.next = Some(tokio::task::spawn_blocking(move || store.events_after(run.as_deref(), after, BATCH)));
        }
    }

    async fn fetch(&self) -> Result<Vec<Event>, StoreError> {
        let (store, run, after) = (self.store.clone(), self.run.clone(), self.cursor.after());
        tokio::task::spawn_blocking(move || store.events_after(run.as_deref(), after, BATCH))
            .await
            .map_err(|e| StoreError::Db(format!("a read of the log failed: {e}")))?
    }

    /// The events of this process's commits that follow on from what was read (of the run
    /// followed). A commit that does not follow (another process committed in between) is
    /// passed over: the read the gap calls for gives its events too.
    fn take_own(&mut self) -> Vec<Event> {
        let commits = self.cursor.take_own(&mut self.own);
        let events = commits.iter().flat_map(|c| &c.events);
        let ours = events.filter(|e| self.run.as_ref().is_none_or(|r| *r == e.run));
        ours.cloned().map(RawEvent::into_event).collect()
    }

    /// The events through a queue of at most `buffer`, for a client that may stall: one that
    /// takes nothing for `patience` while the queue is full is cut (the last thing it gets is
    /// [`Delivered::Cut`]). Ends with the log (a follower that is not live), a store error,
    /// the client leaving, or `end`. Each event is `encode`d on the reading side of the queue,
    /// so a replay encodes one batch while the client's side writes the last (both cores).
    pub fn queued<T: Send + 'static>(
        mut self,
        buffer: usize,
        patience: Duration,
        end: CancellationToken,
        mut encode: impl FnMut(Event) -> T + Send + 'static,
    ) -> impl futures::Stream<Item = Delivered<T>> + Send + 'static {
        let (tx, rx) = tokio::sync::mpsc::channel::<T>(buffer.max(1));
        let (cut_tx, cut_rx) = tokio::sync::oneshot::channel::<i64>();
        let mut sent = self.after();
        tokio::spawn(async move {
            loop {
                let batch = tokio::select! {
                    _ = end.cancelled() => return,
                    // A client that left while nothing happened: stop reading for it.
                    _ = tx.closed() => return,
                    b = self.next_batch() => match b { Some(Ok(b)) => b, Some(Err(e)) => {
                        tracing::warn!(error = %e, "a log follower stopped");
                        return;
                    } None => return },
                };
                for e in batch {
                    let seq = e.seq;
                    match tokio::time::timeout(patience, tx.send(encode(e))).await {
                        Ok(Ok(())) => sent = seq,
                        Ok(Err(_)) => return,
                        Err(_) => {
                            tracing::warn!(
                                after = sent,
                                "cut a slow /events client (it took nothing for its patience)"
                            );
                            let _ = cut_tx.send(sent);
                            return;
                        }
                    }
                }
            }
        });
        futures::stream::unfold((rx, Some(cut_rx)), |(mut rx, cut)| async move {
            if let Some(e) = rx.recv().await {
                return Some((Delivered::Event(e), (rx, cut)));
            }
            let after = cut?.await.ok()?;
            Some((Delivered::Cut { after }, (rx, None)))
        })
    }
}
