//! What a node should hold: the market's slab choice, one round at a time.
//!
//! Each round a node looks at every slab of the models it takes part in (how many other nodes
//! hold it, its merged demand, whether and since when it holds it) and at its own budget, and
//! [`decide`]s what to fetch and what to drop. The rules:
//!
//! - **What the swarm wants most**, in tiers: slabs nobody else holds, then slabs other nodes
//!   hold fewer than the replica target times, then the rest by demand per replica (the
//!   demand shared by the replicas there would be with this node's). Within the first two
//!   tiers computers take hot slabs first and phones (and nodes reached only through a relay)
//!   cold ones; past the target phones take the slabs with the fewest replicas, whatever their
//!   demand, leaving the hot ones to computers. Ties go by a hash of (node, slab), so nodes
//!   that decide at the same moment on the same view pick different slabs.
//! - **Free room is filled** in that order, at most `max_fetches` slabs a round: the node
//!   decides again once they are held and advertised, on a view that shows them, so nodes
//!   deciding at about the same time do not all pile onto the same few slabs.
//! - **Hysteresis**: a held slab is dropped only to make room for a better one, only when the
//!   newcomer is in a better tier or worth `1 + swap_gain` times as much, never when the other
//!   nodes hold it fewer than target times (this node's drop would put it below), never
//!   within `min_hold_secs` of fetching it, and at most `max_swaps` a round.
//! - **Repair beats hold**: to fetch a slab short of its target (after a crash, say), a spare
//!   replica may be dropped within `min_hold_secs`, by as many of its holders as it has
//!   replicas to spare only, the first in the tie order among those that lack a slab short
//!   of its target ([`is_excess`]): a full swarm whose holders of a slab died restores it at
//!   once instead of waiting out the hold time; the nodes that see the same shortage at the
//!   same moment never drop the same slab below its target together; and nothing flaps,
//!   since such a swap only moves a replica from a slab above the target to one below it.
//! - **Never over budget**: a node over its budget (its capacity shrank) drops its least wanted
//!   slabs until it fits, before anything else.
//!
//! Pure and deterministic: the same views give the same decision, in any order.

use moeswarm_protocol::{ModelId, NodeKey};
use serde::Serialize;

mod view;
pub use view::{views, SlabState};

/// One slab of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct SlabKey {
    /// The model.
    pub model: ModelId,
    /// Layer.
    pub layer: u32,
    /// Expert.
    pub expert: u32,
}

/// What kind of device decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeClass {
    /// Reached directly, computes fast: takes hot slabs.
    Computer,
    /// A phone, or any node reached only through a relay: takes cold slabs.
    Phone,
}

/// What the node knows of one slab now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlabView {
    /// The slab.
    pub slab: SlabKey,
    /// Its bytes.
    pub bytes: u64,
    /// Replicas on other nodes.
    pub others: usize,
    /// Merged demand, rows per window.
    pub demand: f64,
    /// Unix seconds since this node holds it; `None` when it does not.
    pub held_since: Option<u64>,
    /// Whether this node is one of the holders of this slab that may drop it for a repair
    /// within the hold time ([`is_excess`]): at most as many as it has replicas to spare,
    /// so that nodes repairing at once after a crash never all drop the same one.
    pub excess: bool,
}

/// The deciding node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeView {
    /// Its key (for the tie hash).
    pub node: NodeKey,
    /// What kind of device it is.
    pub class: NodeClass,
    /// Bytes it may give to these slabs in all.
    pub budget: u64,
    /// Unix seconds now.
    pub now: u64,
}

/// The market's knobs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Policy {
    /// Replicas every slab should have.
    pub target: usize,
    /// A swap within one tier needs the newcomer worth `1 + swap_gain` times the slab dropped.
    pub swap_gain: f64,
    /// A slab is kept at least this long once fetched.
    pub min_hold_secs: u64,
    /// Most swaps (drops to make room) in one round.
    pub max_swaps: usize,
    /// Most slabs fetched in one round (whether into free room or by a swap).
    pub max_fetches: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            target: 2,
            swap_gain: 0.5,
            min_hold_secs: 300,
            max_swaps: 4,
            max_fetches: 2,
        }
    }
}

/// What to do this round.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Decision {
    /// Slabs to fetch, ascending.
    pub fetch: Vec<SlabKey>,
    /// Slabs to drop, ascending.
    pub drop: Vec<SlabKey>,
}

impl Decision {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.fetch.is_empty() && self.drop.is_empty()
    }
}

/// The order in which holders of `slab` keep it: a hash of (holder, slab), so that it
/// differs from slab to slab and every node computes the same. See [`TieSeed`].
pub fn tie(node: &NodeKey, slab: &SlabKey) -> u64 {
    TieSeed::of(node, &slab.model).tie(slab.layer, slab.expert)
}

/// The part of [`tie`] fixed by the node and the model, computed once for many slabs.
///
/// The tie only has to spread: two nodes deciding on the same view should rank slabs in
/// unrelated orders, and every node must compute the same. It is no defence against a node
/// that picks its key to rank first (one can grind keys against any hash), so it is a
/// 64-bit mix (splitmix64's finalizer) rather than a cryptographic hash: a round over
/// thousands of slabs hashes every one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TieSeed(u64);

impl TieSeed {
    /// The seed of `node`'s ties over the slabs of `model`.
    pub fn of(node: &NodeKey, model: &ModelId) -> Self {
        let fold = |bytes: &[u8; 32], mut h: u64| {
            for word in bytes.chunks_exact(8) {
                let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
                h = mix(h ^ w);
            }
            h
        };
        Self(fold(&model.0 .0, fold(&node.0, 0x6d6f_6573_7761_726d)))
    }

    /// The tie of slab (`layer`, `expert`).
    pub fn tie(self, layer: u32, expert: u32) -> u64 {
        let slab = u64::from(layer) << 32 | u64::from(expert);
        mix(mix(self.0 ^ slab) ^ self.0)
    }
}

/// splitmix64's finalizer: every input bit moves every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Whether `me`, holding `slab` beside `others`, is one of its holders that may let it go
/// for a repair: of the holders that could use the room (`can_repair`: they lack some slab
/// short of its target), the first in [`tie`] order, as many as the slab has replicas to
/// spare over `target`. Nodes that decide at once on the same view so never drop it below
/// its target together, and a shortage that some holder of a spare replica could fill always
/// has such a holder allowed to.
pub fn is_excess(
    me: &NodeKey,
    others: &[NodeKey],
    slab: &SlabKey,
    target: usize,
    can_repair: impl Fn(&NodeKey) -> bool,
) -> bool {
    let holders = 1 + others.iter().filter(|o| *o != me).count();
    let spare = holders.saturating_sub(target);
    if spare == 0 || !can_repair(me) {
        return false;
    }
    let mine = tie(me, slab);
    let ahead = others
        .iter()
        .filter(|o| *o != me && can_repair(o) && tie(o, slab) < mine)
        .count();
    ahead < spare
}

/// Demand a slab has before anyone used it: with no demand at all, slabs with fewer replicas
/// still come first.
const PRIOR_ROWS: f64 = 1.0;

/// How much the swarm wants a node to hold one slab, before the tie: its tier (0: nobody
/// else holds it, 1: fewer than the target do, 2: the rest) and its score within the tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rank {
    /// Lower is wanted more.
    pub tier: u8,
    /// Within a tier, higher is wanted more.
    pub score: f64,
}

impl Rank {
    /// The rank of a slab that `others` other nodes hold, with merged `demand`, for a node
    /// of `class`.
    pub fn of(others: usize, demand: f64, class: NodeClass, policy: &Policy) -> Self {
        let r = others;
        let tier = if r == 0 {
            0
        } else if r < policy.target {
            1
        } else {
            2
        };
        let demand = demand.max(0.0);
        let score = match (tier, class) {
            (0 | 1, NodeClass::Computer) => demand,
            (0 | 1, NodeClass::Phone) => -demand,
            (_, NodeClass::Computer) => (demand + PRIOR_ROWS) / (r + 1) as f64,
            (_, NodeClass::Phone) => PRIOR_ROWS / (r + 1) as f64,
        };
        Self { tier, score }
    }

    /// Whether holding a slab of this rank instead of one of rank `held` is worth a swap:
    /// a better tier, or within one `1 + gain` times the score.
    pub fn beats(&self, held: &Self, gain: f64) -> bool {
        self.tier < held.tier
            || (self.tier == held.tier && self.score > held.score * (1.0 + gain.max(0.0)))
    }
}

/// How much the swarm wants this node to hold one slab: its rank, then the tie.
#[derive(Debug, Clone, Copy)]
struct Want {
    rank: Rank,
    tie: u64,
}

impl Want {
    fn of(s: &SlabView, node: &NodeView, policy: &Policy) -> Self {
        Self {
            rank: Rank::of(s.others, s.demand, node.class, policy),
            tie: tie(&node.node, &s.slab),
        }
    }

    /// Best first: tier, then score highest first (in `f64::total_cmp`'s order), then the tie
    /// hash, as one ascending key.
    fn key(&self) -> (u8, u64, u64) {
        let bits = self.rank.score.to_bits();
        // total_cmp's order as an unsigned one: negatives flipped whole, positives' sign set.
        let ascending = if bits >> 63 == 1 {
            !bits
        } else {
            bits | 1 << 63
        };
        (self.rank.tier, !ascending, self.tie)
    }

    /// Whether holding `self` instead of `held` is worth a swap.
    fn beats(&self, held: &Self, gain: f64) -> bool {
        self.rank.beats(&held.rank, gain)
    }
}

/// This round's fetches and drops for `node`. See the module docs.
pub fn decide(node: &NodeView, slabs: &[SlabView], policy: &Policy) -> Decision {
    let wants: Vec<Want> = slabs.iter().map(|s| Want::of(s, node, policy)).collect();
    let by_want = |idx: &mut Vec<usize>| {
        let mut keyed: Vec<_> = idx.iter().map(|&i| (wants[i].key(), i)).collect();
        // The keys differ wherever the ties do; the slab settles the rest, so the order is total.
        keyed.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| slabs[a.1].slab.cmp(&slabs[b.1].slab))
        });
        *idx = keyed.into_iter().map(|(_, i)| i).collect();
    };
    let mut held: Vec<usize> = (0..slabs.len())
        .filter(|&i| slabs[i].held_since.is_some())
        .collect();
    by_want(&mut held);
    let mut candidates: Vec<usize> = (0..slabs.len())
        .filter(|&i| slabs[i].held_since.is_none())
        .collect();
    by_want(&mut candidates);

    let mut used: u64 = held.iter().map(|&i| slabs[i].bytes).sum();
    let mut dropped = vec![false; slabs.len()];
    let mut out = Decision::default();
    // Over budget: the least wanted go first, whatever else holds.
    for &i in held.iter().rev() {
        if used <= node.budget {
            break;
        }
        dropped[i] = true;
        used -= slabs[i].bytes;
        out.drop.push(slabs[i].slab);
    }
    let aged = |i: usize| {
        slabs[i]
            .held_since
            .is_some_and(|t| node.now >= t.saturating_add(policy.min_hold_secs))
    };
    // Victims for swaps: held slabs with replicas to spare, least wanted first.
    let mut victims: Vec<usize> = held
        .iter()
        .rev()
        .copied()
        .filter(|&i| !dropped[i] && slabs[i].others >= policy.target)
        .collect();
    let mut free = node.budget - used;
    let mut swaps = 0;
    for &c in &candidates {
        if out.fetch.len() >= policy.max_fetches {
            break;
        }
        let need = slabs[c].bytes;
        if need <= free {
            free -= need;
            out.fetch.push(slabs[c].slab);
            continue;
        }
        if swaps >= policy.max_swaps {
            continue;
        }
        // A slab short of its target may displace a replica held for less than the hold time,
        // of which this node is an excess holder.
        let repair = wants[c].rank.tier <= 1;
        let usable = || {
            victims
                .iter()
                .copied()
                .filter(move |&v| aged(v) || (repair && slabs[v].excess))
        };
        let Some(worst) = usable().next() else {
            continue;
        };
        if !wants[c].beats(&wants[worst], policy.swap_gain) {
            // Later candidates are wanted less (and have no more victims): none beats it.
            break;
        }
        let mut room = free;
        let mut take = Vec::new();
        for v in usable() {
            if room >= need || !wants[c].beats(&wants[v], policy.swap_gain) {
                break;
            }
            room += slabs[v].bytes;
            take.push(v);
        }
        if room < need {
            continue;
        }
        for v in take {
            dropped[v] = true;
            out.drop.push(slabs[v].slab);
        }
        victims.retain(|v| !dropped[*v]);
        free = room - need;
        out.fetch.push(slabs[c].slab);
        swaps += 1;
    }
    out.fetch.sort();
    out.drop.sort();
    out
}

#[cfg(test)]
mod tests;
