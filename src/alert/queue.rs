//! A bounded queue between the daemon loop and one sink's worker thread. Pushing never waits for
//! the worker: when the queue is full the oldest entry is dropped (and counted), so a sink that
//! hangs costs the loop one short, uncontended lock per notification and nothing more.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;

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
    /// An entry the worker has taken and not finished.
    in_flight: bool,
    closed: bool,
}

impl<T> Queue<T> {
    pub fn new(capacity: usize, dropped: Counter) -> Queue<T> {
        Queue {
            inner: Mutex::new(Inner {
                items: VecDeque::new(),
                in_flight: false,
                closed: false,
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

    /// Adds an entry; returns true if the oldest one was dropped to make room.
    pub fn push(&self, item: T) -> bool {
        let mut inner = self.lock();
        let dropped = inner.items.len() >= self.capacity;
        if dropped {
            inner.items.pop_front();
            self.dropped.inc();
        }
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

    pub fn len(&self) -> usize {
        self.lock().items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
