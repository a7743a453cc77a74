//! The event log as its readers see it: one entry per event, this process's own commits as
//! they are made, and where a follower of the log stands.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{broadcast, watch};

use crate::rows::{ErrorClass, QuestionRequest, TaskRow};
use crate::state::TaskState;

/// What one of this process's group commits changed: every task with an event in
/// `(after, upto]`, as the commit left it (read in the commit's own transaction). A follower
/// current to `after` applies it and is current to `upto` without reading the store; one at
/// another point (another process committed in between) reads instead.
#[derive(Debug)]
pub struct OwnCommit {
    pub after: i64,
    pub upto: i64,
    pub tasks: Vec<TaskRow>,
    /// Every event of `(after, upto]`, in order: what a follower of the log would read.
    pub events: Vec<RawEvent>,
}

/// An event as its commit wrote it, its data still text: whoever takes it parses it, not the
/// committer.
#[derive(Debug, Clone)]
pub struct RawEvent {
    pub seq: i64,
    pub run: String,
    pub task: Option<String>,
    pub kind: String,
    pub at_ms: i64,
    pub data: String,
}

impl RawEvent {
    /// The event as a read of the log gives it: both stores' reads come through here.
    pub fn into_event(self) -> Event {
        let data = serde_json::from_str(&self.data).unwrap_or(Value::Null);
        Event { seq: self.seq, run: self.run, task: self.task, kind: self.kind, at_ms: self.at_ms, data }
    }
}

/// How many of its own commits a store keeps for a follower that has not taken them yet (a
/// commit's value is dropped once every follower has taken it, so this bounds only what a
/// stalled follower, such as a slow `/events` client, holds); one further behind reads the
/// store instead.
const OWN_COMMITS: usize = 256;

pub(crate) fn own_commits() -> broadcast::Sender<Arc<OwnCommit>> {
    broadcast::Sender::new(OWN_COMMITS)
}

/// This process's commits waiting in `own` that follow on from `at` (each starts where the one
/// before ended), in order, with `at` moved to the last one's end. The others are passed over:
/// what a commit holds that another process's commit came before (or that a follower fell too
/// far behind for) is read from the store, which the commit watch calls for.
pub fn own_following(own: &mut broadcast::Receiver<Arc<OwnCommit>>, at: &mut i64) -> Vec<Arc<OwnCommit>> {
    let mut taken = Vec::new();
    loop {
        match own.try_recv() {
            Ok(commit) if commit.after == *at => {
                *at = commit.upto;
                taken.push(commit);
            }
            Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
            Err(_) => return taken,
        }
    }
}

/// Makes a commit of this process up to `last` known: its [`OwnCommit`] first (if its rows
/// were read), then the watch, so a follower woken by the watch finds the commit waiting.
pub(crate) fn announce(
    own: &broadcast::Sender<Arc<OwnCommit>>,
    seq_tx: &watch::Sender<i64>,
    commit: Option<OwnCommit>,
    last: i64,
) {
    if let Some(commit) = commit {
        // No follower is not an error: the rows were read for one that has just gone.
        let _ = own.send(Arc::new(commit));
    }
    publish(seq_tx, last);
}

/// Publishes `seq` on a store's commit watch if it is newer than what was published.
pub(crate) fn publish(seq_tx: &watch::Sender<i64>, seq: i64) {
    seq_tx.send_if_modified(|s| {
        if seq > *s {
            *s = seq;
            true
        } else {
            false
        }
    });
}

/// Where a follower of the log stands: the last event it read, and how far the log is read
/// through. Every event up to the sequence the commit watch shows is committed (both stores
/// number events in commit order), so a read that comes back short has seen all of them,
/// other runs' too: the follower reads again only when the watch moves past that, not once
/// more after every batch to find nothing.
#[derive(Debug, Clone, Copy)]
pub struct LogCursor {
    after: i64,
    read_to: i64,
    full: bool,
}

impl LogCursor {
    /// A follower that has read the events up to `after`.
    pub fn new(after: i64) -> LogCursor {
        LogCursor { after, read_to: after, full: true }
    }

    /// The last event read: the next read is of the events after it.
    pub fn after(&self) -> i64 {
        self.after
    }

    /// Whether a read can find anything, when the watch shows `seen`.
    pub fn due(&self, seen: i64) -> bool {
        self.full || seen > self.read_to
    }

    /// Takes this process's commits waiting in `own` that follow on from what has been read
    /// ([`own_following`]); none while a full batch is pending (the reads it calls for get
    /// them). The follower is then current to the last one's end.
    pub fn take_own(&mut self, own: &mut broadcast::Receiver<Arc<OwnCommit>>) -> Vec<Arc<OwnCommit>> {
        if self.full {
            // Taken out of the channel all the same, not held there for nothing.
            while !matches!(
                own.try_recv(),
                Err(broadcast::error::TryRecvError::Empty | broadcast::error::TryRecvError::Closed)
            ) {}
            return Vec::new();
        }
        let taken = own_following(own, &mut self.read_to);
        if !taken.is_empty() {
            self.after = self.read_to;
        }
        taken
    }

    /// Takes in a read of at most `limit` events, begun when the watch showed `seen`.
    pub fn read(&mut self, events: &[Event], limit: usize, seen: i64) {
        if let Some(last) = events.last() {
            self.after = last.seq;
            self.read_to = self.read_to.max(last.seq);
        }
        self.full = events.len() >= limit;
        if !self.full {
            self.read_to = self.read_to.max(seen);
        }
    }
}
/// One event of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub seq: i64,
    pub run: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub at_ms: i64,
    pub data: Value,
}

impl Event {
    /// The event as one flat JSON object, its own fields (`seq`, `run`, `task`, `type`,
    /// `at_ms`) first and its data's after: the SSE `data` of `/events` and each line of
    /// `pier events --format json`. [`Event::from_wire`] reads it back.
    pub fn to_wire(&self) -> Value {
        self.clone().into_wire()
    }

    /// [`Event::to_wire`], taking the event (nothing is copied: a replay of a million events
    /// encodes each once).
    pub fn into_wire(self) -> Value {
        let mut out = serde_json::Map::new();
        out.insert("seq".into(), self.seq.into());
        out.insert("run".into(), self.run.into());
        out.insert("type".into(), self.kind.into());
        out.insert("at_ms".into(), self.at_ms.into());
        if let Some(t) = self.task {
            out.insert("task".into(), t.into());
        }
        if let Value::Object(data) = self.data {
            for (k, v) in data {
                out.entry(k).or_insert(v);
            }
        }
        Value::Object(out)
    }

    /// An event from its flat JSON object ([`Event::to_wire`]); `None` if it is not one.
    pub fn from_wire(v: Value) -> Option<Event> {
        let Value::Object(mut data) = v else { return None };
        let seq = data.remove("seq")?.as_i64()?;
        let run = data.remove("run")?.as_str()?.to_owned();
        let kind = data.remove("type")?.as_str()?.to_owned();
        let at_ms = data.remove("at_ms").and_then(|v| v.as_i64()).unwrap_or(0);
        let task = data.remove("task").and_then(|v| v.as_str().map(str::to_owned));
        Some(Event { seq, run, task, kind, at_ms, data: Value::Object(data) })
    }
}

/// The type of the events that move a task from one state to another (`LogEvent::Transition`).
pub const TRANSITION: &str = "transition";

/// What the host itself writes to the event log (the agents' events are `ClientEvent`s,
/// recorded as they serialize). One type, so the log's shape is checked by the compiler:
/// `type` is the event's name, the other fields its data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LogEvent {
    RunCreated {
        tasks: usize,
        source: String,
        /// The node that created the run and took its lease in the same commit (it drives
        /// the run); absent when the run was left for the nodes to take.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        driven_by: Option<String>,
    },
    TaskCreated {
        depends_on: Vec<String>,
        agent: String,
        metadata: std::collections::BTreeMap<String, Value>,
        to: TaskState,
        /// The task whose agent added this one to the run as it ran; absent for the plan's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        added_by: Option<String>,
    },
    Transition {
        from: TaskState,
        to: TaskState,
        attempt: i64,
        reason: String,
        /// The task's version after the move.
        version: i64,
        /// Who claimed the attempt (on `pending → running`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        class: Option<ErrorClass>,
        /// The side effects behind a decision that a person re-runs the task.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        evidence: Option<Vec<Value>>,
    },
    Question {
        attempt: i64,
        question: i64,
        request: QuestionRequest,
    },
    Answer {
        attempt: i64,
        question: i64,
        option: String,
        by: String,
    },
    /// A person's message to a running task (`pier say`): queued for the next prompt, or
    /// (`interrupt`) sent at once after the current turn is cancelled.
    Message {
        n: i64,
        text: String,
        interrupt: bool,
        by: String,
    },
    /// A message went to the agent as a prompt of this attempt.
    MessageSent {
        n: i64,
        attempt: i64,
    },
    /// A person cancelled a task a live attempt holds: the attempt ends it, with its output.
    CancelRequested {
        attempt: i64,
        reason: String,
    },
    /// A person set a task's budget or the run's (on the run's first task event, `task` none).
    Budget {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget: Option<crate::plan::Budget>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        run_budget: Option<crate::plan::Budget>,
        by: String,
    },
}

impl LogEvent {
    /// The event's name and its data, as stored.
    pub fn split(&self) -> (String, Value) {
        let mut data = serde_json::to_value(self).unwrap_or(Value::Null);
        let kind = data.as_object_mut().and_then(|o| o.remove("type")).and_then(|t| t.as_str().map(str::to_owned));
        (kind.unwrap_or_default(), data)
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_again_only_past_what_a_short_read_saw() {
        let event = |seq| Event { seq, run: "r".into(), task: None, kind: "note".into(), at_ms: 0, data: Value::Null };
        let mut c = LogCursor::new(0);
        assert!(c.due(0), "a new follower reads once");
        c.read(&[event(1), event(2)], 2, 5);
        assert_eq!((c.after(), c.due(5)), (2, true), "a full batch reads on");
        c.read(&[event(3)], 2, 5);
        assert_eq!((c.after(), c.due(5), c.due(6)), (3, false, true), "a short read saw up to 5");
        c.read(&[], 2, 9);
        assert_eq!((c.after(), c.due(9), c.due(10)), (3, false, true), "other runs' events passed over");
        // This process's commits are taken while each starts where the cursor has read to.
        let tx = broadcast::Sender::new(8);
        let mut rx = tx.subscribe();
        let own = |after, upto| {
            let _ = tx.send(Arc::new(OwnCommit { after, upto, tasks: Vec::new(), events: Vec::new() }));
        };
        let follows = |c: &mut LogCursor, rx: &mut broadcast::Receiver<Arc<OwnCommit>>| !c.take_own(rx).is_empty();
        own(10, 12);
        assert!(!follows(&mut c, &mut rx), "another's commit came in between");
        own(9, 12);
        assert!(follows(&mut c, &mut rx));
        assert_eq!((c.after(), c.due(12), c.due(13)), (12, false, true));
        c.read(&[event(13), event(14)], 2, 20);
        own(12, 15);
        own(14, 15);
        assert!(!follows(&mut c, &mut rx), "not while a full batch is pending");
    }
}
