//! A queued write of the committer: an operation with its reply, which may run more than
//! once (a group rolled back runs again).

use crate::StoreError;
use crate::ops::Tx;

use super::conn::RETRIES;

/// A queued write. It may run more than once: a job rolled back (with its group, or alone by
/// a deadlock) runs again in the next group.
pub(crate) trait Job: Send {
    /// Runs the operation in the open transaction and keeps its answer.
    fn run(&mut self, tx: &mut dyn Tx) -> Result<(), StoreError>;
    /// Counts a try; false once the job has had its share.
    fn again(&mut self) -> bool;
    /// Hands over the answer with the last sequence the job wrote (0 for none), or the error.
    fn finish(self: Box<Self>, outcome: Result<i64, StoreError>);
    /// The task (run, id) whose rows alone the job touches, if it is one: jobs of different
    /// tasks run side by side (`rounds`).
    fn task(&self) -> Option<&(String, String)>;
}

pub(super) struct Op<T, F> {
    pub(super) work: F,
    pub(super) task: Option<(String, String)>,
    pub(super) answer: Option<T>,
    pub(super) tries: u32,
    pub(super) reply: std::sync::mpsc::SyncSender<Result<(T, i64), StoreError>>,
}

impl<T: Send, F: FnMut(&mut dyn Tx) -> Result<(T, i64), StoreError> + Send> Job for Op<T, F> {
    fn run(&mut self, tx: &mut dyn Tx) -> Result<(), StoreError> {
        self.answer = Some((self.work)(tx)?.0);
        Ok(())
    }

    fn again(&mut self) -> bool {
        self.tries += 1;
        self.tries <= RETRIES
    }

    fn finish(self: Box<Self>, outcome: Result<i64, StoreError>) {
        let this = *self;
        let answer = outcome.and_then(|seq| {
            this.answer.map(|a| (a, seq)).ok_or_else(|| StoreError::Db("a write finished without an answer".into()))
        });
        let _ = this.reply.send(answer);
    }

    fn task(&self) -> Option<&(String, String)> {
        self.task.as_ref()
    }
}
