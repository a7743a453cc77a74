//! Whether a `pier serve` node drives a run submitted to it: it does when it has room under
//! its fair share, by taking the run's lease in the commit that creates the run
//! ([`pier_store::TaskStore::create_run_driven`]). Otherwise the run is left free for the
//! nodes to take (`take_runs`), which costs a second commit and a pass of every node.
//!
//! The host's pass publishes what it saw ([`Share::saw`]); submissions between two passes
//! count the runs they took against it. A run this node's view has not counted yet may make
//! it take one more than its share until the next pass: the lease renewal hands back what a
//! node holds beyond its share, as it does for runs taken any other way.

use std::sync::Mutex;

/// What the host's last pass saw, and the runs taken at creation since.
#[derive(Default)]
pub(crate) struct Share(Mutex<Option<Seen>>);

#[derive(Clone, Copy)]
struct Seen {
    /// The unfinished runs in view (this node's and others').
    runs: usize,
    /// Those whose lease this node holds.
    driving: usize,
    /// The live nodes at the last lease renewal (at least 1).
    live: usize,
    /// Runs submitted here since this was seen, and those of them it took at creation.
    submitted: usize,
    taken: usize,
}

impl Share {
    /// The host that drives every run (`pier serve`) has looked: `runs` unfinished runs in its
    /// view, `driving` of them its own, `live` nodes alive.
    pub(crate) fn saw(&self, runs: usize, driving: usize, live: usize) {
        *self.lock() = Some(Seen { runs, driving, live: live.max(1), submitted: 0, taken: 0 });
    }

    /// The host stopped driving runs (or never did): runs submitted here are left free.
    pub(crate) fn stopped(&self) {
        *self.lock() = None;
    }

    /// Whether this node takes the lease of a run submitted to it now: while what it drives,
    /// with the run, fits its share of the runs (those seen and those submitted since) over
    /// the live nodes, rounded up.
    pub(crate) fn take_one(&self) -> bool {
        let mut seen = self.lock();
        let Some(s) = seen.as_mut() else { return false };
        s.submitted += 1;
        let fits = s.driving + s.taken < (s.runs + s.submitted).div_ceil(s.live);
        s.taken += usize::from(fits);
        fits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Seen>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::Share;

    fn takes(share: &Share, n: usize) -> usize {
        (0..n).filter(|_| share.take_one()).count()
    }

    #[test]
    fn a_host_that_does_not_drive_takes_nothing() {
        let share = Share::default();
        assert_eq!(takes(&share, 3), 0);
        share.saw(0, 0, 1);
        share.stopped();
        assert_eq!(takes(&share, 3), 0);
    }

    #[test]
    fn a_lone_node_takes_every_run_submitted_to_it() {
        let share = Share::default();
        share.saw(10, 10, 1);
        assert_eq!(takes(&share, 100), 100);
    }

    #[test]
    fn one_of_three_nodes_takes_up_to_its_share() {
        let share = Share::default();
        // 9 runs, 3 of them its own: with 3 more, 4 each; it takes 1 of them.
        share.saw(9, 3, 3);
        assert_eq!(takes(&share, 3), 1);
        // Submissions go on: of 9 + 9 runs, 6 each, so 3 of the 9.
        assert_eq!(takes(&share, 6), 2);
        // A node that already drives more than its share takes none until it hands some back.
        share.saw(9, 5, 3);
        assert_eq!(takes(&share, 3), 0);
    }
}
