//! Peers that keep lying are banned for a while: every record a peer forwards that fails
//! verification, and every bad answer it gives, is a strike; too many strikes in a window and
//! the node closes its connections to the peer and refuses new ones until the ban ends.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::PeerId;

/// Strikes within [`STRIKE_WINDOW`] that get a peer banned.
pub const STRIKES_TO_BAN: u32 = 16;
/// How long strikes count.
pub const STRIKE_WINDOW: Duration = Duration::from_secs(60);
/// How long a ban lasts.
pub const BAN_FOR: Duration = Duration::from_secs(10 * 60);
/// Peers remembered at most (the oldest strikes are forgotten first).
const MAX_TRACKED: usize = 4096;

/// Strikes and bans, by peer.
#[derive(Debug, Default)]
pub struct Bans {
    strikes: HashMap<PeerId, (u32, Instant)>,
    banned: HashMap<PeerId, Instant>,
}

impl Bans {
    /// Counts a strike against `peer` at `now`; true when it gets it banned.
    pub fn strike(&mut self, peer: PeerId, now: Instant) -> bool {
        if self.is_banned(&peer, now) {
            return false;
        }
        if self.strikes.len() >= MAX_TRACKED && !self.strikes.contains_key(&peer) {
            if let Some(oldest) = self
                .strikes
                .iter()
                .min_by_key(|(_, s)| s.1)
                .map(|(p, _)| *p)
            {
                self.strikes.remove(&oldest);
            }
        }
        let s = self.strikes.entry(peer).or_insert((0, now));
        if now.duration_since(s.1) > STRIKE_WINDOW {
            *s = (0, now);
        }
        s.0 += 1;
        if s.0 >= STRIKES_TO_BAN {
            self.strikes.remove(&peer);
            self.banned.retain(|_, until| *until > now);
            self.banned.insert(peer, now + BAN_FOR);
            return true;
        }
        false
    }

    /// How `peer` stands at `now`: its strikes within the window, `u32::MAX` while banned.
    pub fn strikes(&self, peer: &PeerId, now: Instant) -> u32 {
        if self.is_banned(peer, now) {
            return u32::MAX;
        }
        self.strikes
            .get(peer)
            .filter(|(_, since)| now.duration_since(*since) <= STRIKE_WINDOW)
            .map_or(0, |(n, _)| *n)
    }

    /// Whether `peer` is banned at `now`.
    pub fn is_banned(&self, peer: &PeerId, now: Instant) -> bool {
        self.banned.get(peer).is_some_and(|until| *until > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enough_strikes_in_the_window_ban_a_peer_for_a_while() {
        let (mut b, t0, p) = (Bans::default(), Instant::now(), PeerId::random());
        for i in 1..STRIKES_TO_BAN {
            assert!(!b.strike(p, t0 + Duration::from_millis(i as u64)));
        }
        assert!(b.strike(p, t0 + Duration::from_secs(1)));
        assert!(b.is_banned(&p, t0 + Duration::from_secs(2)));
        assert_eq!(b.strikes(&p, t0 + Duration::from_secs(2)), u32::MAX);
        assert!(!b.is_banned(&p, t0 + BAN_FOR + Duration::from_secs(2)));
        // Strikes further apart than the window never add up.
        let q = PeerId::random();
        for i in 0..(3 * STRIKES_TO_BAN) {
            let at = t0 + (STRIKE_WINDOW + Duration::from_secs(1)) * i;
            assert!(!b.strike(q, at));
            assert_eq!(b.strikes(&q, at), 1);
        }
    }
}
