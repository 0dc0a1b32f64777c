//! Finding the swarm again: a node that has lost every connection (its laptop slept, its
//! Wi-Fi dropped, the process was paused past the transport's idle timeout) dials its bootstrap
//! nodes and the peers its DHT table remembers, at growing intervals, until one answers.
//!
//! Pure timing: the swarm task does the dials.

use std::time::{Duration, Instant};

/// The first wait after a try; doubled after each try that found no one, up to [`LONGEST`].
const FIRST: Duration = Duration::from_secs(2);
/// The longest wait between two tries.
const LONGEST: Duration = Duration::from_secs(60);

/// When to try again to find the swarm.
#[derive(Debug)]
pub(super) struct Rejoin {
    next: Instant,
    wait: Duration,
}

impl Rejoin {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            next: now + FIRST,
            wait: FIRST,
        }
    }

    /// Whether to try now, given how many peers are connected at `now`. Being connected
    /// resets the waits: the next loss is answered at once.
    pub(super) fn due(&mut self, connected: usize, now: Instant) -> bool {
        if connected > 0 {
            self.wait = FIRST;
            self.next = now;
            return false;
        }
        if now < self.next {
            return false;
        }
        self.next = now + self.wait;
        self.wait = (self.wait * 2).min(LONGEST);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_node_tries_at_once_then_waits_longer_up_to_a_minute() {
        let t0 = Instant::now();
        let mut r = Rejoin::new(t0);
        assert!(!r.due(3, t0), "connected: nothing to do");
        assert!(r.due(0, t0), "the first loss is answered at once");
        assert!(!r.due(0, t0 + Duration::from_secs(1)));
        let mut t = t0;
        let mut waits = Vec::new();
        let mut last = t0;
        while t < t0 + Duration::from_secs(600) {
            t += Duration::from_millis(500);
            if r.due(0, t) {
                waits.push((t - last).as_secs());
                last = t;
            }
        }
        assert_eq!(&waits[..6], &[2, 4, 8, 16, 32, 60]);
        assert!(waits[6..].iter().all(|w| *w == 60), "{waits:?}");
        // Found again, then lost again: at once.
        assert!(!r.due(1, t));
        assert!(r.due(0, t + Duration::from_millis(1)));
    }
}
