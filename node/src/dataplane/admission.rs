//! Who a worker takes a dispatch from: the check made after a frame's header is read and
//! before its payload is.
//!
//! A dispatch is admitted when whoever asks holds less than its fair share of the slots and of
//! the buffered bytes (each divided among the askers with dispatches in flight, at least one
//! slot each; one alone gets three quarters, so that another finds room at once), a compute
//! slot is free, and the memory it takes ([`memory_of`] its payload) fits in what this worker
//! gives to dispatches at once. Anything else is answered busy at once, without reading the
//! payload, so that no router, honest or not, makes the worker hold more than [`Admission`]'s
//! bounds or starve the others.
//!
//! Who asks is a [`ShareKey`], something hard to make many of: a router this worker has
//! answered often enough is itself; any other shares with every router reaching the worker
//! from the same address (or through a relay), so that PeerIds made for free do not multiply
//! shares. An admitted dispatch's payload must then come at a steady pace (see `worker`), so a
//! header alone holds a slot for seconds, not the whole read deadline.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use moeswarm_market::share::fair_share as share;
use moeswarm_relay::PeerId;

/// The bounds of one worker's admission.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    /// Dispatches computed or waiting at once.
    pub slots: usize,
    /// Memory the dispatches admitted may take at once (each counted by [`memory_of`]).
    pub memory_bytes: u64,
}

/// Memory one dispatch takes per byte of its payload, counted when it is admitted: the payload
/// read, its rows decoded, the outputs, and the reply encoded from them (the expert's own
/// intermediates are narrower than its rows on every model we run).
pub const MEMORY_PER_PAYLOAD_BYTE: u64 = 4;

/// The memory a dispatch of `payload_len` bytes is counted at.
pub const fn memory_of(payload_len: u64) -> u64 {
    MEMORY_PER_PAYLOAD_BYTE.saturating_mul(payload_len)
}

/// Memory the admitted dispatches of a worker may take at once unless told otherwise: two of
/// the largest frames (512 MiB). A router alone gets three quarters of it, so one largest frame
/// at a time.
pub const DEFAULT_MEMORY_BYTES: u64 = 2 * memory_of(moeswarm_protocol::dispatch::MAX_PAYLOAD_BYTES);

/// Who a share of a worker's slots and bytes belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShareKey {
    /// A router this worker has answered often enough ([`Proven`]).
    Router(PeerId),
    /// Every router not yet proven reaching the worker from this address.
    Address(IpAddr),
    /// Every router not yet proven reaching the worker through a relay.
    Relayed,
}

/// Answers after which a router has its own share (rather than its address's).
pub const PROVEN_AFTER: u32 = 8;
/// Routers remembered as answered at most (the least answered are forgotten first).
const MAX_REMEMBERED: usize = 4096;

/// The routers a worker has answered, and how often: those answered [`PROVEN_AFTER`] times
/// have a share of their own.
#[derive(Debug, Default)]
pub struct Proven(Mutex<HashMap<PeerId, u32>>);

impl Proven {
    /// `router`'s dispatch was answered.
    pub fn answered(&self, router: PeerId) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= MAX_REMEMBERED && !m.contains_key(&router) {
            if let Some(least) = m.iter().min_by_key(|(_, n)| **n).map(|(k, _)| *k) {
                m.remove(&least);
            }
        }
        let n = m.entry(router).or_default();
        *n = n.saturating_add(1);
    }

    /// The share `router`'s dispatch draws on, reaching the worker from `from` (`None`:
    /// through a relay).
    pub fn key(&self, router: PeerId, from: Option<IpAddr>) -> ShareKey {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match (m.get(&router).copied().unwrap_or(0) >= PROVEN_AFTER, from) {
            (true, _) => ShareKey::Router(router),
            (false, Some(ip)) => ShareKey::Address(ip),
            (false, None) => ShareKey::Relayed,
        }
    }
}

#[derive(Debug, Default)]
struct InFlight {
    by_router: HashMap<ShareKey, usize>,
    bytes_by_router: HashMap<ShareKey, u64>,
    slots: usize,
    bytes: u64,
}

/// The slots and bytes taken now, shared by every stream of a worker.
#[derive(Debug, Clone)]
pub struct Admission {
    limits: AdmissionLimits,
    now: Arc<Mutex<InFlight>>,
}

/// Why a dispatch was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotAdmitted {
    /// Every slot is taken.
    Full,
    /// The router holds its fair share already.
    OverShare,
    /// The payload does not fit in the bytes buffered at once.
    TooManyBytes,
}

/// One admitted dispatch; its slot and bytes come back when it is dropped.
#[derive(Debug)]
pub struct Admitted {
    router: ShareKey,
    bytes: u64,
    now: Arc<Mutex<InFlight>>,
}

impl Admission {
    /// An empty admission with `limits` (at least one slot).
    pub fn new(mut limits: AdmissionLimits) -> Self {
        limits.slots = limits.slots.max(1);
        Self {
            limits,
            now: Arc::default(),
        }
    }

    /// Takes a slot and `bytes` for a dispatch drawing on share `router`, or says why not.
    pub fn admit(&self, router: ShareKey, bytes: u64) -> Result<Admitted, NotAdmitted> {
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        let mine = now.by_router.get(&router).copied().unwrap_or(0);
        let routers = now.by_router.len() + usize::from(mine == 0);
        if mine >= share(self.limits.slots as u64, routers) as usize {
            return Err(NotAdmitted::OverShare);
        }
        if now.slots >= self.limits.slots {
            return Err(NotAdmitted::Full);
        }
        let my_bytes = now.bytes_by_router.get(&router).copied().unwrap_or(0);
        if now.bytes + bytes > self.limits.memory_bytes
            || my_bytes + bytes > share(self.limits.memory_bytes, routers)
        {
            return Err(NotAdmitted::TooManyBytes);
        }
        now.slots += 1;
        now.bytes += bytes;
        *now.by_router.entry(router).or_default() += 1;
        *now.bytes_by_router.entry(router).or_default() += bytes;
        Ok(Admitted {
            router,
            bytes,
            now: self.now.clone(),
        })
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        now.slots -= 1;
        now.bytes -= self.bytes;
        if let Some(n) = now.by_router.get_mut(&self.router) {
            *n -= 1;
            if *n == 0 {
                now.by_router.remove(&self.router);
            }
        }
        if let Some(b) = now.bytes_by_router.get_mut(&self.router) {
            *b -= self.bytes;
            if !now.by_router.contains_key(&self.router) {
                now.bytes_by_router.remove(&self.router);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn peers(n: usize) -> Vec<ShareKey> {
        (0..n).map(|_| ShareKey::Router(PeerId::random())).collect()
    }

    #[test]
    fn fresh_peer_ids_from_one_address_share_one_share_and_a_proven_router_has_its_own() {
        let proven = Proven::default();
        let ip: IpAddr = [10, 0, 0, 7].into();
        let (a, b, honest) = (PeerId::random(), PeerId::random(), PeerId::random());
        assert_eq!(proven.key(a, Some(ip)), proven.key(b, Some(ip)));
        assert_eq!(proven.key(a, None), ShareKey::Relayed);
        for _ in 0..PROVEN_AFTER {
            proven.answered(honest);
        }
        assert_eq!(proven.key(honest, Some(ip)), ShareKey::Router(honest));
        // Two fresh keys of one address, four dispatches each, on a worker of four slots:
        // they hold three between them, and the proven router still finds its slot.
        let w = Admission::new(AdmissionLimits {
            slots: 4,
            memory_bytes: 100,
        });
        let mut held = Vec::new();
        for k in [a, b] {
            for _ in 0..4 {
                held.extend(w.admit(proven.key(k, Some(ip)), 1).ok());
            }
        }
        assert_eq!(held.len(), 3);
        assert!(w.admit(proven.key(honest, Some(ip)), 1).is_ok());
    }

    #[test]
    fn a_router_alone_takes_three_quarters_and_leaves_the_rest_to_the_next() {
        let a = Admission::new(AdmissionLimits {
            slots: 8,
            memory_bytes: 100,
        });
        let [r1, r2] = peers(2).try_into().unwrap();
        let held: Vec<_> = (0..6).map(|_| a.admit(r1, 1).unwrap()).collect();
        assert_eq!(a.admit(r1, 1).unwrap_err(), NotAdmitted::OverShare);
        let others: Vec<_> = (0..2).map(|_| a.admit(r2, 1).unwrap()).collect();
        assert_eq!(a.admit(r2, 1).unwrap_err(), NotAdmitted::Full);
        drop((held, others));
        assert!(a.admit(r1, 1).is_ok());
        // One slot is one slot: a router alone may take it.
        let one = Admission::new(AdmissionLimits {
            slots: 1,
            memory_bytes: 100,
        });
        assert!(one.admit(r1, 1).is_ok());
    }

    #[test]
    fn a_router_holding_the_bytes_leaves_room_for_anothers_payload() {
        let a = Admission::new(AdmissionLimits {
            slots: 8,
            memory_bytes: 100,
        });
        let [r1, r2] = peers(2).try_into().unwrap();
        let _big = a.admit(r1, 70).unwrap();
        assert_eq!(a.admit(r1, 10).unwrap_err(), NotAdmitted::TooManyBytes);
        assert!(a.admit(r2, 25).is_ok());
    }

    #[test]
    fn a_second_router_gets_its_share_once_the_first_gives_slots_back() {
        let a = Admission::new(AdmissionLimits {
            slots: 4,
            memory_bytes: 100,
        });
        let [r1, r2] = peers(2).try_into().unwrap();
        let mut first: Vec<_> = (0..2).map(|_| a.admit(r1, 1).unwrap()).collect();
        // r1 holds half: with r2 in flight it may not take a third.
        let second = a.admit(r2, 1).unwrap();
        assert_eq!(a.admit(r1, 1).unwrap_err(), NotAdmitted::OverShare);
        assert!(a.admit(r2, 1).is_ok());
        first.clear();
        drop(second);
        assert!(a.admit(r1, 1).is_ok());
    }

    #[test]
    fn payloads_beyond_the_byte_bound_are_not_admitted() {
        let a = Admission::new(AdmissionLimits {
            slots: 8,
            memory_bytes: 100,
        });
        let r = peers(1)[0];
        let _big = a.admit(r, 70).unwrap();
        assert_eq!(a.admit(r, 31).unwrap_err(), NotAdmitted::TooManyBytes);
        assert!(a.admit(r, 5).is_ok());
    }

    proptest! {
        #[test]
        fn bounds_hold_and_everything_comes_back(
            slots in 1usize..8,
            asks in proptest::collection::vec((0usize..4, 0u64..50, any::<bool>()), 0..64),
        ) {
            let a = Admission::new(AdmissionLimits { slots, memory_bytes: 120 });
            let routers = peers(4);
            let mut held: Vec<Admitted> = Vec::new();
            for (r, bytes, release) in asks {
                if release && !held.is_empty() {
                    held.remove(0);
                }
                if let Ok(x) = a.admit(routers[r], bytes) {
                    held.push(x);
                }
                let now = a.now.lock().unwrap();
                prop_assert!(now.slots <= slots);
                prop_assert!(now.bytes <= 120);
                prop_assert_eq!(now.slots, held.len());
                prop_assert_eq!(now.by_router.values().sum::<usize>(), held.len());
                prop_assert_eq!(now.bytes_by_router.values().sum::<u64>(), now.bytes);
                // A router alone never takes every slot (of two or more): a newcomer finds
                // room at once.
                if now.by_router.len() == 1 && slots >= 2 {
                    prop_assert!(now.slots < slots);
                }
            }
            held.clear();
            let now = a.now.lock().unwrap();
            prop_assert_eq!((now.slots, now.bytes, now.by_router.len()), (0, 0, 0));
            prop_assert!(now.bytes_by_router.is_empty());
        }
    }
}
