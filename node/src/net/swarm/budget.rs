//! How many pages of records a node hands out: answers of holdings, demand and models are
//! made on the swarm task, so each peer has a budget of them (and all peers without standing
//! together another), refilled over time. A peer past its budget is answered "busy", which
//! costs nothing. A peer with standing (it has served this node bytes that verified) draws on
//! its own budget only: PeerIds made for free can spend the strangers' budget, never a known
//! node's.

use std::collections::HashMap;
use std::time::Instant;

use libp2p::PeerId;
use moeswarm_relay::registry::TokenBucket;

/// Pages one peer may ask for per second, once its burst is spent.
pub const PAGES_PER_PEER_PER_SEC: u64 = 16;
/// Pages one peer may ask for at once: a newcomer reading a full table of several models.
pub const PAGE_BURST_PER_PEER: u64 = 64;
/// Pages all peers without standing together may ask for per second.
pub const PAGES_PER_SEC: u64 = 256;
/// And at once.
pub const PAGE_BURST: u64 = 1024;
/// Peers with a budget remembered at most (the longest idle forgotten first).
const MAX_TRACKED: usize = 4096;

/// The budgets.
#[derive(Debug)]
pub struct PageBudget {
    all: TokenBucket,
    peers: HashMap<PeerId, (TokenBucket, Instant)>,
}

impl PageBudget {
    /// Full budgets at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            all: TokenBucket::new(PAGES_PER_SEC, PAGE_BURST, now),
            peers: HashMap::new(),
        }
    }

    /// Whether `peer` (`known`: with standing here) may have one more page at `now` (counted
    /// if so).
    pub fn allow(&mut self, peer: PeerId, known: bool, now: Instant) -> bool {
        if self.peers.len() >= MAX_TRACKED && !self.peers.contains_key(&peer) {
            if let Some(idlest) = self.peers.iter().min_by_key(|(_, b)| b.1).map(|(p, _)| *p) {
                self.peers.remove(&idlest);
            }
        }
        let (bucket, last) = self.peers.entry(peer).or_insert_with(|| {
            (
                TokenBucket::new(PAGES_PER_PEER_PER_SEC, PAGE_BURST_PER_PEER, now),
                now,
            )
        });
        *last = now;
        bucket.try_take(1, now) && (known || self.all.try_take(1, now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_peer_gets_its_burst_then_its_rate_and_others_still_get_theirs() {
        let t0 = Instant::now();
        let mut b = PageBudget::new(t0);
        let greedy = PeerId::random();
        let granted = (0..1000).filter(|_| b.allow(greedy, false, t0)).count() as u64;
        assert_eq!(granted, PAGE_BURST_PER_PEER);
        // A second later, a second's worth more.
        let t1 = t0 + Duration::from_secs(1);
        let more = (0..1000).filter(|_| b.allow(greedy, false, t1)).count() as u64;
        assert_eq!(more, PAGES_PER_PEER_PER_SEC);
        // Someone else is answered meanwhile.
        assert!(b.allow(PeerId::random(), false, t1));
    }

    #[test]
    fn many_peers_together_stay_within_the_whole_budget_and_the_table_is_bounded() {
        let t0 = Instant::now();
        let mut b = PageBudget::new(t0);
        let granted = (0..10_000)
            .filter(|_| b.allow(PeerId::random(), false, t0))
            .count() as u64;
        assert_eq!(granted, PAGE_BURST);
        assert!(b.peers.len() <= MAX_TRACKED);
    }

    #[test]
    fn sixteen_throwaway_peers_spend_the_strangers_budget_but_a_known_node_is_still_answered() {
        let t0 = Instant::now();
        let mut b = PageBudget::new(t0);
        let throwaway: Vec<PeerId> = (0..16).map(|_| PeerId::random()).collect();
        let mut granted = 0;
        for p in &throwaway {
            granted += (0..1000).filter(|_| b.allow(*p, false, t0)).count() as u64;
        }
        assert_eq!(granted, PAGE_BURST);
        assert!(!b.allow(PeerId::random(), false, t0), "strangers wait");
        let known = PeerId::random();
        let pages = (0..1000).filter(|_| b.allow(known, true, t0)).count() as u64;
        assert_eq!(
            pages, PAGE_BURST_PER_PEER,
            "a known node has its own budget"
        );
    }
}
