//! Which ready tasks a host starts when it has room: in queue order ([`pier_store::queue`]: by
//! priority, 9 first, first come first served within one, a waiting task ageing a level every
//! [`AGE_MS`](pier_store::queue::AGE_MS), so a task of priority `p` waits behind tasks that became ready after it for at
//! most `(9 - p) × AGE_MS`), and never past a concurrency key's limit as the host sees it.
//! Pull workers lease in the same order. Waiting is counted from when the task became ready as
//! the run's log says (`host.rs`' `ready_since`, seeding `since`), so a host that restarts or
//! takes a run over keeps it; from when this host first saw it only where that is unknown.
//!
//! The keys' counts here keep a host from trying claims the store would refuse; the store's
//! claim is what holds the limit (`pier_store`'s `keys`), across every node and worker.

use std::collections::HashMap;

use pier_store::TaskRow;
use pier_store::plan::MAX_PRIORITY;
use pier_store::queue::rank;

/// A ready task, in first-come order: one this host could start (`mine`), or one another
/// node drives, which keeps its place in its concurrency keys from this host's tasks of a
/// lower priority (so a key's next free place goes to the higher priority, whoever drives it).
/// Only the stated priority counts there, not ageing, which each node reckons by itself: two
/// nodes never each hold back for the other.
pub(crate) struct Ready<'a, K> {
    pub key: K,
    pub row: &'a TaskRow,
    pub mine: bool,
}

/// Up to `room` of `ready` (in first-come order) to start now: by rank, then by how long each
/// has waited, then in order; skipping any whose concurrency key is full, counting
/// `held` (live attempts by key, anyone's) and those picked before it. `since` keeps when each
/// task was first seen ready; it is rebuilt from `ready`, so tasks that left are forgotten.
pub(crate) fn pick<K: Clone + Eq + std::hash::Hash>(
    ready: Vec<Ready<'_, K>>,
    room: usize,
    mut held: HashMap<String, u32>,
    since: &mut HashMap<K, i64>,
    now: i64,
) -> Vec<K> {
    let mut seen = HashMap::with_capacity(ready.len());
    let mut ranked: Vec<(i64, i64, usize, &Ready<'_, K>)> = Vec::with_capacity(ready.len());
    // Other nodes' ready tasks by key: how many of each stated priority.
    let mut theirs: HashMap<&str, [u32; MAX_PRIORITY as usize + 1]> = HashMap::new();
    for (i, r) in ready.iter().enumerate() {
        if !r.mine {
            for k in &r.row.spec.concurrency {
                let at = usize::from(r.row.spec.priority.min(MAX_PRIORITY));
                theirs.entry(k.key.as_str()).or_default()[at] += 1;
            }
            continue;
        }
        let first = since.get(&r.key).copied().unwrap_or(now);
        seen.insert(r.key.clone(), first);
        ranked.push((rank(r.row.spec.priority, first), first, i, r));
    }
    *since = seen;
    ranked.sort_by_key(|&(rank, first, i, _)| (rank, first, i));
    let mut out = Vec::new();
    for (_, _, _, r) in ranked {
        if out.len() == room {
            break;
        }
        let (keys, p) = (&r.row.spec.concurrency, r.row.spec.priority);
        let above = usize::from(p.min(MAX_PRIORITY)) + 1;
        let kept = |k: &str| theirs.get(k).map_or(0, |n| n[above..].iter().sum::<u32>());
        if keys.iter().any(|k| held.get(&k.key).copied().unwrap_or(0) + kept(&k.key) >= k.limit) {
            continue;
        }
        for k in keys {
            *held.entry(k.key.clone()).or_default() += 1;
        }
        out.push(r.key.clone());
    }
    out
}

/// The live attempts of `live` by concurrency key.
pub(crate) fn held<'a>(live: impl Iterator<Item = &'a TaskRow>) -> HashMap<String, u32> {
    let mut held = HashMap::new();
    for t in live.filter(|t| t.lease_owner.is_some()) {
        for k in &t.spec.concurrency {
            *held.entry(k.key.clone()).or_default() += 1;
        }
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;
    use pier_store::TaskSpec;
    use pier_store::plan::ConcurrencyKey;
    use pier_store::queue::AGE_MS;

    fn row(id: &str, priority: u8, keys: &[(&str, u32)]) -> TaskRow {
        let concurrency = keys.iter().map(|(k, l)| ConcurrencyKey { key: (*k).into(), limit: *l }).collect();
        let spec = TaskSpec { id: id.into(), priority, concurrency, ..TaskSpec::default() };
        TaskRow {
            run_id: "r".into(),
            id: id.into(),
            state: pier_store::TaskState::Pending,
            version: 1,
            attempt: 0,
            failures: 0,
            lease_owner: None,
            lease_expires_at_ms: None,
            not_before_ms: 0,
            result: None,
            usage: None,
            error: None,
            spec,
            cancel_requested: None,
        }
    }

    fn ids(
        rows: &[TaskRow],
        room: usize,
        held: HashMap<String, u32>,
        since: &mut HashMap<String, i64>,
        now: i64,
    ) -> Vec<String> {
        let ready =
            rows.iter().map(|r| Ready { key: r.id.clone(), row: r, mine: !r.id.starts_with("theirs") }).collect();
        pick(ready, room, held, since, now)
    }

    #[test]
    fn the_higher_priority_goes_first_and_order_holds_within_one() {
        let mut rows: Vec<TaskRow> = (0..100).map(|i| row(&format!("low{i}"), 0, &[])).collect();
        rows.push(row("high", 9, &[]));
        rows.push(row("mid", 4, &[]));
        let got = ids(&rows, 3, HashMap::new(), &mut HashMap::new(), 0);
        assert_eq!(got, vec!["high", "mid", "low0"]);
    }

    #[test]
    fn a_full_key_is_passed_over_and_picks_count_against_it() {
        let rows = vec![row("a", 0, &[("k", 2)]), row("b", 0, &[("k", 2)]), row("c", 0, &[("k", 2)]), row("d", 0, &[])];
        let held = HashMap::from([("k".to_owned(), 1)]);
        assert_eq!(ids(&rows, 4, held, &mut HashMap::new(), 0), vec!["a", "d"]);
    }

    #[test]
    fn another_nodes_higher_task_keeps_its_keys_place_and_takes_no_room() {
        let rows = vec![
            row("theirs-hi", 9, &[("k", 1)]),
            row("theirs-free", 9, &[]),
            row("mine-k", 0, &[("k", 1)]),
            row("mine", 0, &[]),
        ];
        assert_eq!(ids(&rows, 2, HashMap::new(), &mut HashMap::new(), 0), vec!["mine"]);
        // Of the same stated priority, it keeps no place: each node would hold back for the other.
        let rows = vec![row("theirs-same", 0, &[("k", 1)]), row("mine-k", 0, &[("k", 1)])];
        assert_eq!(ids(&rows, 2, HashMap::new(), &mut HashMap::new(), 0), vec!["mine-k"]);
    }

    #[test]
    fn a_waiting_task_ages_past_newer_higher_ones_within_the_bound() {
        let mut since = HashMap::new();
        let old = vec![row("old", 0, &[])];
        assert_eq!(ids(&old, 0, HashMap::new(), &mut since, 0), Vec::<String>::new());
        let mut rows = old.clone();
        rows.push(row("new9", 9, &[]));
        // Just before the bound the newer priority-9 task goes first; at it, the older one does.
        let before = 9 * AGE_MS - 1;
        assert_eq!(ids(&rows, 1, HashMap::new(), &mut since.clone(), before), vec!["new9"]);
        let mut at = since.clone();
        at.insert("new9".into(), 9 * AGE_MS);
        assert_eq!(ids(&rows, 1, HashMap::new(), &mut at, 9 * AGE_MS), vec!["old"]);
    }
}
