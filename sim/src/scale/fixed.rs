//! A fixed swarm, to compare the simulator with real nodes: given nodes (keys and budgets)
//! join one at a time over one model that one seeder holds whole, and never leave; what each
//! holds once all have settled.
//!
//! It is what `moeswarm_sim::local` starts as real processes: the router (the seeder) and
//! workers that join one by one, each after the previous one has settled. The market's choice
//! depends only on what a node sees, so when each joiner sees the records of all before it,
//! the simulator and the real nodes must end with the same slabs on each node.

use std::collections::BTreeSet;

use moeswarm_market::choice::NodeClass;
use moeswarm_market::demand::DemandBook;
use moeswarm_protocol::{ModelId, NodeKey};

use super::queue::Millis;
use super::scenario::{Nat, Scenario};
use super::view::View;
use super::world::{Event, World};
use super::{handle, EXPIRY_SWEEP_MS};

/// The swarm.
#[derive(Debug, Clone)]
pub struct FixedSwarm {
    /// The model and its shape (every slab of `slab_bytes`).
    pub model: ModelId,
    pub layers: u32,
    pub experts: u32,
    pub slab_bytes: u64,
    /// Who holds the whole model from the start.
    pub seeder: NodeKey,
    /// The market nodes in the order they join, each with the bytes it gives the model and
    /// its class (a node reached only through a relay is a phone to the market).
    pub nodes: Vec<(NodeKey, u64, NodeClass)>,
    /// Seconds between one node's join and the next's (long enough for each to settle).
    pub join_every_secs: f64,
}

/// The slabs each node holds (as `layer × experts + expert`) once the last has settled.
pub fn run_fixed(f: &FixedSwarm) -> Vec<BTreeSet<u32>> {
    let mut sc = Scenario::default_scenario();
    sc.model.layers = f.layers;
    sc.model.experts = f.experts;
    sc.model.slab_bytes = f.slab_bytes;
    sc.serving = None;
    sc.seeders.count = 1;
    // One class, on fast lines, that stays.
    let mut class = sc.classes[0].clone();
    class.share = 1.0;
    class.phone = false;
    class.nat = Nat::None;
    class.session_hours = 1e9;
    class.crash = 0.0;
    sc.classes = vec![class];
    let n = f.nodes.len();
    let mut w = World::new(sc, n, 0);
    w.model = f.model;
    for (node, &(key, budget, class)) in w.nodes.iter_mut().zip(&f.nodes) {
        node.key = key;
        node.capacity = budget;
        node.market_class = class;
    }
    w.nodes[n].key = f.seeder;
    let keys = w.nodes.iter().map(|n| n.key).collect();
    w.view = View::new(f.model, f.layers, f.experts, keys);
    w.demand = DemandBook::new(f.model, f.layers, f.experts);
    w.start_seeders(n);
    let every = (f.join_every_secs * 1000.0) as Millis;
    for i in 0..n {
        w.queue.at(every * (i as Millis + 1), Event::Join(i));
    }
    w.queue.at(EXPIRY_SWEEP_MS, Event::Expire);
    let horizon = every * (n as Millis + 2);
    while let Some(e) = w.queue.pop_until(horizon) {
        handle(&mut w, e, horizon);
    }
    w.nodes[..n]
        .iter()
        .map(|node| node.held.keys().copied().collect())
        .collect()
}
