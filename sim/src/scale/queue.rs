//! The simulator's event queue: a binary heap of (time, sequence, event), earliest first, and
//! among events at the same millisecond the one scheduled first. The sequence makes the order
//! total, so one seed gives one history.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Simulated time in milliseconds since the start.
pub type Millis = u64;

struct Entry<E> {
    at: Millis,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<E> Eq for Entry<E> {}

impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Entry<E> {
    /// Reversed: the heap's greatest is the earliest.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// Events waiting for their time.
pub struct Queue<E> {
    heap: BinaryHeap<Entry<E>>,
    next_seq: u64,
    now: Millis,
}

impl<E> Default for Queue<E> {
    fn default() -> Self {
        Self {
            heap: BinaryHeap::new(),
            next_seq: 0,
            now: 0,
        }
    }
}

impl<E> Queue<E> {
    /// The time of the event last taken (0 before any).
    pub fn now(&self) -> Millis {
        self.now
    }

    /// Schedules `event` at `at` (never before now: an event in the past happens now).
    pub fn at(&mut self, at: Millis, event: E) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Entry {
            at: at.max(self.now),
            seq,
            event,
        });
    }

    /// Schedules `event` `delay` ms from now.
    pub fn after(&mut self, delay: Millis, event: E) {
        self.at(self.now.saturating_add(delay), event);
    }

    /// The next event, if any falls at or before `until`; time moves to it.
    pub fn pop_until(&mut self, until: Millis) -> Option<E> {
        if self.heap.peek()?.at > until {
            return None;
        }
        let e = self.heap.pop()?;
        self.now = e.at;
        Some(e.event)
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn events_come_out_by_time_then_by_the_order_they_were_scheduled(
            times in proptest::collection::vec(0u64..50, 0..200),
        ) {
            let mut q = Queue::default();
            for (i, &t) in times.iter().enumerate() {
                q.at(t, i);
            }
            let mut out = Vec::new();
            while let Some(i) = q.pop_until(u64::MAX) {
                out.push(i);
            }
            let mut expected: Vec<usize> = (0..times.len()).collect();
            expected.sort_by_key(|&i| (times[i], i));
            prop_assert_eq!(out, expected);
        }
    }

    #[test]
    fn nothing_comes_out_past_the_horizon_and_the_past_is_now() {
        let mut q = Queue::default();
        q.at(10, "a");
        q.at(30, "b");
        assert_eq!(q.pop_until(20), Some("a"));
        assert_eq!(q.pop_until(20), None);
        q.at(5, "late");
        assert_eq!(q.pop_until(20), Some("late"), "scheduled in the past: now");
        assert_eq!(q.now(), 10);
        assert_eq!(q.len(), 1);
    }
}
