//! Whether a `pier serve` node drives a run submitted to it: it does when it has room under
//! its fair share, by taking the run's lease in the commit that creates it
//! ([`pier_store::TaskStore::create_run_driven`]). Otherwise the run is left free for the
//! nodes to take (`take_runs`), which costs a second commit and a pass of every node.
//!
//! The host's pass publishes what its view holds ([`Share::saw`]); a run taken at creation is
//! counted as this node's until the view has it ([`Share::arrived`]), so submissions between
//! two passes, and creations still being committed, count against the share too. A node that
//! stops first lets the creations in flight end ([`Share::stop`]), so none leaves a lease
//! behind the runs it hands back.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// A run taken at creation that the view has not shown for this long is no longer counted
/// (its creation failed without saying, or the run ended before a pass saw it).
const UNSEEN_FOR: Duration = Duration::from_secs(60);

#[derive(Default)]
pub(crate) struct Share {
    state: Mutex<State>,
    /// Rung when a creation in flight ends.
    settled: Notify,
}

#[derive(Default)]
struct State {
    /// What the host's last pass saw; `None` while it does not drive every run.
    seen: Option<Seen>,
    /// Runs taken at creation that the last pass did not count, since when, and whether the
    /// view has them now (the next pass counts them).
    unseen: HashMap<String, (Instant, bool)>,
    /// Creations that took (or are taking) their run's lease and have not returned.
    in_flight: usize,
}

#[derive(Clone, Copy)]
struct Seen {
    /// The unfinished runs in view (this node's and others').
    runs: usize,
    /// Those whose lease this node holds.
    driving: usize,
    /// The live nodes at the last lease renewal (at least 1).
    live: usize,
    /// Runs taken at creation that it did not count (in none of the above).
    carried: usize,
    /// Runs submitted here since, taken or not.
    submitted: usize,
}

/// A creation that takes its run's lease, counted until it returns ([`Taking::done`]).
pub(crate) struct Taking<'a> {
    share: &'a Share,
    run: String,
}

impl Taking<'_> {
    /// The creation returned: whether the run was created with its lease taken.
    pub(crate) fn done(self, taken: bool) {
        if !taken {
            self.share.lock().unseen.remove(&self.run);
        }
    }
}

impl Drop for Taking<'_> {
    fn drop(&mut self) {
        self.share.lock().in_flight -= 1;
        self.share.settled.notify_waiters();
    }
}

impl Share {
    /// The host that drives every run (`pier serve`) has looked: `runs` unfinished runs in its
    /// view, `driving` of them its own, `live` nodes alive.
    pub(crate) fn saw(&self, runs: usize, driving: usize, live: usize) {
        let mut state = self.lock();
        state.unseen.retain(|_, (since, arrived)| !*arrived && since.elapsed() < UNSEEN_FOR);
        let carried = state.unseen.len();
        state.seen = Some(Seen { runs, driving, live: live.max(1), carried, submitted: 0 });
    }

    /// The view has these runs now: the next pass counts them.
    pub(crate) fn arrived<'r>(&self, runs: impl IntoIterator<Item = &'r String>) {
        let mut state = self.lock();
        if state.unseen.is_empty() {
            return;
        }
        for run in runs {
            if let Some((_, arrived)) = state.unseen.get_mut(run) {
                *arrived = true;
            }
        }
    }

    /// Whether this node takes the lease of run `run`, submitted to it now: while what it
    /// drives (with the runs it took that its view does not have yet, and this one) fits its
    /// share of the runs over the live nodes, rounded up. A yes is counted until it is done.
    pub(crate) fn take_one(&self, run: &str) -> Option<Taking<'_>> {
        let mut state = self.lock();
        let own = state.unseen.len();
        let s = state.seen.as_mut()?;
        s.submitted += 1;
        let fits = s.driving + own < (s.runs + s.carried + s.submitted).div_ceil(s.live);
        if !fits || state.unseen.contains_key(run) {
            return None;
        }
        state.unseen.insert(run.to_owned(), (Instant::now(), false));
        state.in_flight += 1;
        Some(Taking { share: self, run: run.to_owned() })
    }

    /// The host stops driving runs: runs submitted from now on are left free, and this waits
    /// for the creations in flight, so that the leases they take are among those handed back.
    pub(crate) async fn stop(&self) {
        self.lock().seen = None;
        loop {
            let settled = self.settled.notified();
            if self.lock().in_flight == 0 {
                return;
            }
            settled.await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::Share;

    /// Submits `n` runs named `{prefix}{i}`, each created as it was taken; how many it took.
    fn takes(share: &Share, prefix: &str, n: usize) -> usize {
        (0..n)
            .filter(|i| match share.take_one(&format!("{prefix}{i}")) {
                Some(taking) => {
                    taking.done(true);
                    true
                }
                None => false,
            })
            .count()
    }

    fn names(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}{i}")).collect()
    }

    #[test]
    fn a_host_that_does_not_drive_takes_nothing() {
        let share = Share::default();
        assert_eq!(takes(&share, "r", 3), 0);
    }

    #[test]
    fn a_lone_node_takes_every_run_submitted_to_it() {
        let share = Share::default();
        share.saw(10, 10, 1);
        assert_eq!(takes(&share, "r", 100), 100);
        share.saw(10, 10, 1);
        assert_eq!(takes(&share, "s", 100), 100, "those its view does not have yet count on both sides");
    }

    #[test]
    fn one_of_three_nodes_takes_up_to_its_share() {
        let share = Share::default();
        // 9 runs, 3 of them its own: with 3 more, 4 each; it takes 1 of them.
        share.saw(9, 3, 3);
        assert_eq!(takes(&share, "a", 3), 1);
        // Submissions go on: of 9 + 9 runs, 6 each, so 3 of the 9.
        assert_eq!(takes(&share, "b", 6), 2);
        // A pass whose view does not have those 3 yet: 18 runs, 3 of them its own, and the 3
        // it took besides. With 3 more, 24: 8 each, so 2 more.
        share.saw(18, 3, 3);
        assert_eq!(takes(&share, "c", 3), 2);
        // The view has them all now: 24 runs, 8 its own; with 3 more, 9 each.
        share.arrived(&names("a", 3));
        share.arrived(&names("b", 6));
        share.arrived(&names("c", 3));
        share.saw(24, 8, 3);
        assert_eq!(takes(&share, "d", 3), 1);
        // A node that already drives more than its share takes none until it hands some back.
        share.arrived(&names("d", 3));
        share.saw(9, 5, 3);
        assert_eq!(takes(&share, "e", 3), 0);
    }

    #[test]
    fn a_creation_that_took_nothing_is_not_counted() {
        let share = Share::default();
        share.saw(3, 1, 3);
        // With one more, 4 runs: 2 each; it may take one.
        let taking = share.take_one("x").unwrap_or_else(|| panic!("room for one"));
        taking.done(false);
        assert!(share.take_one("y").is_some(), "the failed one holds no place");
    }

    #[tokio::test]
    async fn stopping_waits_for_the_creations_in_flight() {
        let share = std::sync::Arc::new(Share::default());
        share.saw(0, 0, 1);
        let (go, ended) = tokio::sync::oneshot::channel::<()>();
        let taking = share.take_one("y").map(|t| t.run.clone());
        assert_eq!(taking.as_deref(), Some("y"), "(its guard dropped at once: nothing in flight)");
        share.stop().await;
        share.saw(0, 0, 1);
        let held = share.clone();
        let (taken, took) = tokio::sync::oneshot::channel::<bool>();
        let creation = tokio::spawn(async move {
            let taking = held.take_one("z");
            let _ = taken.send(taking.is_some());
            let _ = ended.await;
            drop(taking);
        });
        assert_eq!(took.await.ok(), Some(true));
        let mut stopping = Box::pin(share.stop());
        assert!(futures::poll!(stopping.as_mut()).is_pending(), "stopped with a creation in flight");
        assert!(share.take_one("w").is_none(), "stopping: runs are left free");
        let _ = go.send(());
        let _ = creation.await;
        let stopped = tokio::time::timeout(std::time::Duration::from_secs(10), stopping).await;
        assert!(stopped.is_ok(), "the stop did not follow the creation's end");
    }
}
