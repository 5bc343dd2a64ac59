//! A bounded queue between the daemon loop and one sink's worker thread. Pushing never waits for
//! the worker: when the queue is full an entry is dropped (and counted): the oldest of the lowest
//! rank (severity) queued, or the new one itself when everything queued ranks above it, so a
//! flood of info or warning notices never pushes a critical one out. A sink that hangs costs the
//! loop one short, uncontended lock per notification and nothing more. A sink
//! replaced by a reload is *abandoned*: its queue is emptied and its worker stops retrying, so
//! it ends within one request's timeout instead of lingering behind a hung endpoint.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;

/// What an entry weighs in memory, roughly, in bytes: the queue is bounded by it too.
pub trait Weigh {
    fn weight(&self) -> usize;

    /// What it is worth keeping when the queue is full (higher: kept longer).
    fn rank(&self) -> u8 {
        0
    }
}

/// Bytes of entries one queue holds at most (beside its count): a burst of notices about
/// processes with long command lines cannot grow the daemon without bound.
pub const MAX_QUEUE_BYTES: usize = 4 << 20;

pub struct Queue<T> {
    inner: Mutex<Inner<T>>,
    /// Signalled when an entry arrives or the queue closes.
    arrived: Condvar,
    /// Signalled when the worker has finished an entry.
    finished: Condvar,
    capacity: usize,
    dropped: Counter,
}

struct Inner<T> {
    items: VecDeque<T>,
    /// The weight of `items`.
    bytes: usize,
    /// An entry the worker has taken and not finished.
    in_flight: bool,
    closed: bool,
    /// Closed and emptied: the worker drops what it holds and ends.
    abandoned: bool,
}

impl<T: Weigh> Queue<T> {
    pub fn new(capacity: usize, dropped: Counter) -> Queue<T> {
        Queue {
            inner: Mutex::new(Inner {
                items: VecDeque::new(),
                bytes: 0,
                in_flight: false,
                closed: false,
                abandoned: false,
            }),
            arrived: Condvar::new(),
            finished: Condvar::new(),
            capacity: capacity.max(1),
            dropped,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds an entry; returns true if an entry (a queued one, or this one) was dropped because
    /// the queue was full. What goes is the oldest entry of the lowest rank queued, as long as
    /// that rank is not above the new entry's; otherwise the new entry is dropped: a full queue
    /// never gives up an entry for one of lower rank.
    pub fn push(&self, item: T) -> bool {
        let mut inner = self.lock();
        let weight = item.weight();
        let rank = item.rank();
        let mut dropped = false;
        while !inner.items.is_empty()
            && (inner.items.len() >= self.capacity || inner.bytes + weight > MAX_QUEUE_BYTES)
        {
            // The oldest of the lowest rank, if it does not rank above the new entry.
            let victim = inner
                .items
                .iter()
                .enumerate()
                .min_by_key(|(i, e)| (e.rank(), *i))
                .filter(|(_, e)| e.rank() <= rank)
                .map(|(i, _)| i);
            let Some(at) = victim else {
                self.dropped.inc();
                return true;
            };
            if let Some(old) = inner.items.remove(at) {
                inner.bytes -= old.weight();
            }
            self.dropped.inc();
            dropped = true;
        }
        inner.bytes += weight;
        inner.items.push_back(item);
        drop(inner);
        self.arrived.notify_one();
        dropped
    }

    /// The worker's side: the next entry, or None once the queue is closed and empty. Call
    /// `done` when finished with it.
    pub fn pop(&self) -> Option<T> {
        let mut inner = self.lock();
        loop {
            if let Some(item) = inner.items.pop_front() {
                inner.bytes -= item.weight();
                inner.in_flight = true;
                return Some(item);
            }
            if inner.closed {
                return None;
            }
            inner = self.arrived.wait(inner).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn done(&self) {
        self.lock().in_flight = false;
        self.finished.notify_all();
    }

    /// No more entries: the worker finishes what is queued and stops.
    pub fn close(&self) {
        self.lock().closed = true;
        self.arrived.notify_all();
    }

    /// No more entries, and those waiting are dropped (and counted): the worker ends after the
    /// one it is handling, without retrying it.
    pub fn abandon(&self) {
        let mut inner = self.lock();
        inner.bytes = 0;
        for _ in inner.items.drain(..) {
            self.dropped.inc();
        }
        inner.closed = true;
        inner.abandoned = true;
        drop(inner);
        self.arrived.notify_all();
    }

    /// The worker's pause between retries: waits `pause`, returning early (false) if the queue
    /// is abandoned meanwhile; true if it is still worth retrying.
    pub fn pause(&self, pause: Duration) -> bool {
        let deadline = Instant::now() + pause;
        let mut inner = self.lock();
        while !inner.abandoned {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            inner = self
                .arrived
                .wait_timeout(inner, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        false
    }

    /// Waits until everything queued has been handled, at most until `deadline`.
    pub fn drain(&self, deadline: Instant) -> bool {
        let mut inner = self.lock();
        while !inner.items.is_empty() || inner.in_flight {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            inner = self
                .finished
                .wait_timeout(inner, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Whether nothing is queued (tests wait for a sink to drain).
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.lock().items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    impl Weigh for i32 {
        fn weight(&self) -> usize {
            *self as usize
        }
    }

    /// (rank, tag): weighs nothing, ranks by its first field.
    #[derive(Debug, PartialEq)]
    struct Ranked(u8, &'static str);

    impl Weigh for Ranked {
        fn weight(&self) -> usize {
            0
        }
        fn rank(&self) -> u8 {
            self.0
        }
    }

    fn contents(q: &Queue<Ranked>) -> Vec<&'static str> {
        q.lock().items.iter().map(|r| r.1).collect()
    }

    /// Red-team finding 5: a flood of low-severity notices pushed real critical alerts out of a
    /// full queue. The lowest rank goes first (its oldest entry), and a full queue never gives
    /// up an entry for one of lower rank.
    #[test]
    fn a_full_queue_drops_the_lowest_rank_first_and_never_a_higher_one_for_a_lower() {
        let dropped = Counter::default();
        let q = Queue::new(3, dropped.clone());
        q.push(Ranked(2, "crit1"));
        q.push(Ranked(0, "info1"));
        q.push(Ranked(1, "warn1"));
        // Full: a new warning pushes out the info, not the older critical.
        assert!(q.push(Ranked(1, "warn2")));
        assert_eq!(contents(&q), vec!["crit1", "warn1", "warn2"]);
        // An info finds nothing of its rank or below: it is the one dropped.
        assert!(q.push(Ranked(0, "info2")));
        assert_eq!(contents(&q), vec!["crit1", "warn1", "warn2"]);
        // A critical pushes out the oldest warning.
        assert!(q.push(Ranked(2, "crit2")));
        assert_eq!(contents(&q), vec!["crit1", "warn2", "crit2"]);
        // A flood of warnings keeps the criticals, and the newest warning.
        for _ in 0..100 {
            q.push(Ranked(1, "flood"));
        }
        assert_eq!(contents(&q), vec!["crit1", "crit2", "flood"]);
        assert!(q.push(Ranked(2, "crit3")));
        assert_eq!(contents(&q), vec!["crit1", "crit2", "crit3"]);
        // All critical: a new critical drops the oldest one (nothing is worth more).
        assert!(q.push(Ranked(2, "crit4")));
        assert_eq!(contents(&q), vec!["crit2", "crit3", "crit4"]);
        assert_eq!(dropped.get(), 105);
    }

    #[test]
    fn the_queue_is_bounded_in_bytes_as_well_as_in_count() {
        let dropped = Counter::default();
        let q = Queue::new(100, dropped.clone());
        let big = (MAX_QUEUE_BYTES / 3) as i32;
        for _ in 0..3 {
            assert!(!q.push(big));
        }
        assert!(q.push(big), "the fourth third pushes the oldest out");
        assert_eq!(dropped.get(), 1);
        assert_eq!(q.lock().bytes, 3 * big as usize);
    }

    #[test]
    fn full_queue_drops_the_oldest_and_counts_it() {
        let dropped = Counter::default();
        let q = Queue::new(2, dropped.clone());
        assert!(!q.push(1));
        assert!(!q.push(2));
        assert!(q.push(3));
        assert_eq!(dropped.get(), 1);
        assert_eq!(q.pop(), Some(2));
        q.done();
        q.close();
        assert_eq!(q.pop(), Some(3));
        q.done();
        assert_eq!(q.pop(), None);
        assert!(q.drain(Instant::now()));
    }

    #[test]
    fn an_abandoned_queue_drops_its_entries_and_cuts_a_pause_short() {
        let dropped = Counter::default();
        let q = Arc::new(Queue::new(10, dropped.clone()));
        q.push(1);
        q.push(2);
        let pausing = {
            let q = q.clone();
            std::thread::spawn(move || q.pause(Duration::from_secs(600)))
        };
        std::thread::sleep(Duration::from_millis(50));
        q.abandon();
        assert!(
            !pausing.join().unwrap(),
            "the pause ends at once, saying stop"
        );
        assert_eq!(dropped.get(), 2);
        assert_eq!(q.pop(), None);
        assert!(!q.pause(Duration::from_secs(600)));
    }
}
