//! One simulated node: who it is (key, class, links, NAT, latency, compute), what it holds
//! (with since when, and as bits for quick look-ups), what it fetches and what it last
//! advertised. What happens to it is in [`super::world`] and the round module.

use std::collections::BTreeMap;

use moeswarm_market::choice::NodeClass;
use moeswarm_protocol::NodeKey;

use super::dispatch::{Calendar, End};
use super::queue::Millis;
use super::quick::SlabBits;
use super::scenario::{Compute, Nat};

/// One node.
pub struct Node {
    pub key: NodeKey,
    /// Its class (`None`: a seeder).
    pub class: Option<usize>,
    pub capacity: u64,
    /// Link rates, bytes a millisecond.
    pub up: f64,
    pub down: f64,
    pub nat: Nat,
    pub market_class: NodeClass,
    /// One-way latency to the internet, ms, and its region.
    pub latency_ms: f64,
    pub region: usize,
    /// How fast it computes, and the compute it has booked.
    pub compute: Compute,
    pub calendar: Calendar,
    /// Cut off from the routers' side by a partition.
    pub cut: bool,
    /// It answers dispatches wrong (at the scenario's lie rate).
    pub liar: bool,
    /// Its compute is this many times slower (a `slow` fault).
    pub slow: f64,
    /// When a router first sent it a dispatch, and first caught it answering wrong (ms).
    pub first_dispatch_ms: Option<f64>,
    pub caught_ms: Option<f64>,
    pub online: bool,
    pub session: u64,
    /// Slabs held, with since when (unix seconds); change with [`Node::hold`] and
    /// [`Node::unhold`], which keep `holds` in step.
    pub held: BTreeMap<u32, u64>,
    /// The same slabs as bits.
    pub(super) holds: SlabBits,
    /// Slabs being fetched.
    pub inflight: Vec<u32>,
    /// Slabs the view still counts it as holding that it dropped, ascending.
    pub(super) ghosts: Vec<u32>,
    /// Whether this round fetched anything yet.
    pub(super) fetched_this_round: bool,
    pub up_free: Millis,
    pub down_free: Millis,
    pub(super) seq: u64,
    /// The slabs its latest record names.
    pub published: Vec<u32>,
    /// After a round that found nothing to do: the view's epoch then, and when a held slab
    /// next comes of age (the only other things a decision depends on).
    pub(super) idle: Option<(u64, u64)>,
}

impl Node {
    /// Holds slab `s` from `since` (unix seconds); held, it is no ghost.
    pub fn hold(&mut self, s: u32, since: u64) {
        self.held.insert(s, since);
        self.holds.insert(s);
        if let Ok(at) = self.ghosts.binary_search(&s) {
            self.ghosts.remove(at);
        }
    }

    /// Whether it holds slab `s`.
    pub fn holds_slab(&self, s: u32) -> bool {
        self.holds.contains(s)
    }

    /// Drops slab `s`; whether it was held.
    pub fn unhold(&mut self, s: u32) -> bool {
        self.holds.remove(s);
        self.held.remove(&s).is_some()
    }

    pub(super) fn new(
        key: NodeKey,
        class: Option<usize>,
        capacity: u64,
        up: f64,
        down: f64,
        nat: Nat,
        market_class: NodeClass,
    ) -> Self {
        Self {
            key,
            class,
            capacity,
            up,
            down,
            nat,
            market_class,
            online: false,
            session: 0,
            held: BTreeMap::new(),
            inflight: Vec::new(),
            ghosts: Vec::new(),
            holds: SlabBits::default(),
            fetched_this_round: false,
            up_free: 0,
            down_free: 0,
            seq: 0,
            published: Vec::new(),
            idle: None,
            latency_ms: 0.0,
            region: 0,
            compute: Compute::default(),
            calendar: Calendar::default(),
            cut: false,
            liar: false,
            slow: 1.0,
            first_dispatch_ms: None,
            caught_ms: None,
        }
    }

    /// Whether it can reach `other` now (both on the same side of any partition).
    pub fn reaches(&self, other: &Node) -> bool {
        self.cut == other.cut
    }

    /// Its end of a dispatch.
    pub fn end(&self) -> End {
        End {
            latency_ms: self.latency_ms,
            region: self.region,
            up: self.up,
            down: self.down,
            nat: self.nat,
        }
    }
}
