//! Strangers asking for a place in a full node table. A record whose signer this node has
//! never met waits here until a dial to an address the record gives proves that its signer
//! runs a node there (the libp2p handshake proves the key); then it is taken in as a met
//! node's record is. Records made up by the thousand cost a bounded queue and a few short
//! dials at a time, picked at random so a flood cannot keep one honest record waiting for
//! ever, and a signer whose dial failed is not dialed again for a while.
//!
//! Pure bookkeeping: the swarm task does the dials and reports how they ended.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::{Multiaddr, PeerId};
use moeswarm_protocol::ModelId;
use rand::Rng;

/// Strangers waiting or being dialed at most.
pub const MAX_CANDIDATES: usize = 1024;
/// Bytes of records held for them at most.
pub const MAX_CANDIDATE_BYTES: usize = 8 << 20;
/// Dials under way at once.
pub const MAX_DIALS: usize = 8;
/// A dial not connected by then counts as failed.
pub const DIAL_DEADLINE: Duration = Duration::from_secs(5);
/// A signer whose dial failed is not dialed again before this.
pub const RETRY_AFTER: Duration = Duration::from_secs(600);
/// Addresses of one record tried.
const MAX_ADDRS: usize = 4;
/// Failed signers remembered at most (the oldest forgotten first).
const MAX_FAILED: usize = 8192;

/// One stranger: where to dial it and the records it would have taken in (one per model).
#[derive(Debug)]
struct Candidate {
    addrs: Vec<Multiaddr>,
    records: Vec<(ModelId, Vec<u8>)>,
}

impl Candidate {
    fn bytes(&self) -> usize {
        self.records.iter().map(|(_, w)| w.len()).sum()
    }
}

/// What became of a stranger's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// It waits for a dial (or one is under way).
    Queued,
    /// Not taken: no address to dial, or the signer's dial failed lately.
    Refused,
}

/// The queue of strangers and the dials under way.
#[derive(Debug, Default)]
pub struct Vetting {
    waiting: HashMap<PeerId, Candidate>,
    dialing: HashMap<PeerId, (Candidate, Instant)>,
    failed: HashMap<PeerId, Instant>,
    bytes: usize,
}

impl Vetting {
    /// Strangers waiting or being dialed.
    pub fn len(&self) -> usize {
        self.waiting.len() + self.dialing.len()
    }

    /// Bytes of records held for them.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Takes `peer`'s record `wire` of `model` to wait for a dial to `addrs`; when the queue
    /// is full, a waiting stranger picked at random makes room.
    pub fn offer(
        &mut self,
        peer: PeerId,
        model: ModelId,
        wire: Vec<u8>,
        addrs: Vec<Multiaddr>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Offer {
        if self
            .failed
            .get(&peer)
            .is_some_and(|at| now.duration_since(*at) < RETRY_AFTER)
        {
            return Offer::Refused;
        }
        let known = self
            .waiting
            .get_mut(&peer)
            .or_else(|| self.dialing.get_mut(&peer).map(|(c, _)| c));
        if let Some(c) = known {
            // A newer record of the same signer replaces the one held (the table checks which
            // is newer when it takes it in).
            let before = c.bytes();
            c.records.retain(|(m, _)| *m != model);
            c.records.push((model, wire));
            c.records.truncate(4);
            let after = c.bytes();
            self.bytes = self.bytes + after - before;
            self.make_room(rng);
            return Offer::Queued;
        }
        let addrs: Vec<Multiaddr> = addrs.into_iter().take(MAX_ADDRS).collect();
        if addrs.is_empty() {
            return Offer::Refused;
        }
        self.bytes += wire.len();
        self.waiting.insert(
            peer,
            Candidate {
                addrs,
                records: vec![(model, wire)],
            },
        );
        self.make_room(rng);
        if self.waiting.contains_key(&peer) || self.dialing.contains_key(&peer) {
            Offer::Queued
        } else {
            Offer::Refused
        }
    }

    /// Drops waiting strangers picked at random until the bounds hold.
    fn make_room(&mut self, rng: &mut impl Rng) {
        while (self.len() > MAX_CANDIDATES || self.bytes > MAX_CANDIDATE_BYTES)
            && !self.waiting.is_empty()
        {
            let i = rng.random_range(0..self.waiting.len());
            let Some(peer) = self.waiting.keys().nth(i).copied() else {
                return;
            };
            if let Some(c) = self.waiting.remove(&peer) {
                self.bytes -= c.bytes();
            }
        }
    }

    /// Dials that have passed their deadline count as failed; then the strangers to dial now
    /// (picked at random), at most [`MAX_DIALS`] under way in all.
    pub fn next_dials(
        &mut self,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Vec<(PeerId, Vec<Multiaddr>)> {
        let late: Vec<PeerId> = self
            .dialing
            .iter()
            .filter(|(_, (_, since))| now.duration_since(*since) >= DIAL_DEADLINE)
            .map(|(p, _)| *p)
            .collect();
        for p in late {
            self.dial_failed(p, now);
        }
        let mut out = Vec::new();
        while self.dialing.len() < MAX_DIALS && !self.waiting.is_empty() {
            let i = rng.random_range(0..self.waiting.len());
            let Some(peer) = self.waiting.keys().nth(i).copied() else {
                break;
            };
            if let Some(c) = self.waiting.remove(&peer) {
                out.push((peer, c.addrs.clone()));
                self.dialing.insert(peer, (c, now));
            }
        }
        out
    }

    /// Whether a dial to `peer` is under way.
    pub fn is_dialing(&self, peer: &PeerId) -> bool {
        self.dialing.contains_key(peer)
    }

    /// `peer` is connected (its key proven): the records it waited with, to take in now.
    pub fn connected(&mut self, peer: &PeerId) -> Vec<(ModelId, Vec<u8>)> {
        let c = self
            .dialing
            .remove(peer)
            .map(|(c, _)| c)
            .or_else(|| self.waiting.remove(peer));
        self.failed.remove(peer);
        match c {
            Some(c) => {
                self.bytes -= c.bytes();
                c.records
            }
            None => Vec::new(),
        }
    }

    /// The dial to `peer` failed (or ran out of time): its records are dropped and it is not
    /// dialed again before [`RETRY_AFTER`].
    pub fn dial_failed(&mut self, peer: PeerId, now: Instant) {
        let Some((c, _)) = self.dialing.remove(&peer) else {
            return;
        };
        self.bytes -= c.bytes();
        if self.failed.len() >= MAX_FAILED {
            self.failed
                .retain(|_, at| now.duration_since(*at) < RETRY_AFTER);
            if self.failed.len() >= MAX_FAILED {
                if let Some(oldest) = self
                    .failed
                    .iter()
                    .min_by_key(|(_, at)| **at)
                    .map(|(p, _)| *p)
                {
                    self.failed.remove(&oldest);
                }
            }
        }
        self.failed.insert(peer, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn addr() -> Vec<Multiaddr> {
        vec!["/ip4/127.0.0.1/tcp/9".parse().unwrap()]
    }

    const MODEL: ModelId = ModelId(moeswarm_protocol::BlobId([7; 32]));

    #[test]
    fn a_stranger_waits_is_dialed_and_is_handed_back_when_connected() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut v = Vetting::default();
        let now = Instant::now();
        let p = PeerId::random();
        assert_eq!(
            v.offer(p, MODEL, vec![1; 10], addr(), now, &mut rng),
            Offer::Queued
        );
        // A newer record of the same signer replaces the first.
        assert_eq!(
            v.offer(p, MODEL, vec![2; 20], addr(), now, &mut rng),
            Offer::Queued
        );
        assert_eq!((v.len(), v.bytes()), (1, 20));
        let dials = v.next_dials(now, &mut rng);
        assert_eq!(dials, vec![(p, addr())]);
        assert!(v.is_dialing(&p));
        assert_eq!(v.connected(&p), vec![(MODEL, vec![2; 20])]);
        assert_eq!((v.len(), v.bytes()), (0, 0));
    }

    #[test]
    fn a_failed_or_late_dial_is_not_tried_again_for_a_while() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let mut v = Vetting::default();
        let now = Instant::now();
        let (a, b) = (PeerId::random(), PeerId::random());
        v.offer(a, MODEL, vec![0; 8], addr(), now, &mut rng);
        v.offer(b, MODEL, vec![0; 8], addr(), now, &mut rng);
        assert_eq!(v.next_dials(now, &mut rng).len(), 2);
        v.dial_failed(a, now);
        // b never connects: its deadline passes.
        assert!(v.next_dials(now + DIAL_DEADLINE, &mut rng).is_empty());
        assert_eq!((v.len(), v.bytes()), (0, 0));
        for p in [a, b] {
            let later = now + DIAL_DEADLINE;
            assert_eq!(
                v.offer(p, MODEL, vec![0; 8], addr(), later, &mut rng),
                Offer::Refused
            );
            let much_later = now + DIAL_DEADLINE + RETRY_AFTER;
            assert_eq!(
                v.offer(p, MODEL, vec![0; 8], addr(), much_later, &mut rng),
                Offer::Queued
            );
        }
        // No address: nothing to dial.
        let c = PeerId::random();
        assert_eq!(
            v.offer(c, MODEL, vec![0; 8], Vec::new(), now, &mut rng),
            Offer::Refused
        );
    }

    proptest::proptest! {
        #[test]
        fn a_flood_stays_within_bounds_and_every_stranger_has_a_chance(
            seed in 0u64..1000, flood in 1usize..4000, dials in 0usize..300,
        ) {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut v = Vetting::default();
            let now = Instant::now();
            let honest = PeerId::random();
            v.offer(honest, MODEL, vec![0; 100], addr(), now, &mut rng);
            let mut seen_honest = false;
            for i in 0..flood {
                let p = PeerId::random();
                v.offer(p, MODEL, vec![0; 100 + i % 7], addr(), now, &mut rng);
                proptest::prop_assert!(v.len() <= MAX_CANDIDATES);
                proptest::prop_assert!(v.bytes() <= MAX_CANDIDATE_BYTES);
                if i < dials {
                    for (p, _) in v.next_dials(now, &mut rng) {
                        seen_honest |= p == honest;
                        v.dial_failed(p, now);
                    }
                }
            }
            proptest::prop_assert!(v.dialing.len() <= MAX_DIALS);
            // With no flood beyond the queue's size, the honest record is still there or was
            // dialed.
            if flood < MAX_CANDIDATES - MAX_DIALS {
                proptest::prop_assert!(seen_honest || v.waiting.contains_key(&honest));
            }
        }
    }
}
