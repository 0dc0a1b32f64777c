//! The market's choice for one node without a look at every slab, where that gives the same
//! answer as [`decide`](moeswarm_market::choice::decide) over the views of all of them.
//!
//! A round at scale runs `decide` over 12,288 slabs (a tie hash each, a sort), and a swarm of
//! thousands decides millions of times a day. Without demand a slab's place in a node's order
//! depends only on how many others hold it and on the tie, so the slabs sorted by their count
//! ([`Counts`], kept in step with the view) give the node's groups of equal rank in order, and
//! within a group the tie settles it. Three cases are answered here, each exactly:
//!
//! - **Room for a whole round's fetches**: the first `max_fetches` slabs the node lacks, in its
//!   order (nothing is dropped). A small group is scanned; a large one is walked in the node's
//!   [`TieOrder`] (its slabs sorted by tie once), which finds the first of a group holding a
//!   share `g` of the slabs after about `1 / g` steps.
//! - **Full, nothing worth a swap**: empty. Either the fewest and most holders of any slab
//!   already rule out a swap for every node, or this node's best candidate does not beat its
//!   least wanted victim of age.
//! - Anything else (demand, over budget, room for part of a round, a swap, a repair that may
//!   drop a spare replica early) is left to `decide`: `None`.
//!
//! `tests.rs` holds the property that it agrees with `decide` wherever it answers.

use std::collections::BTreeMap;

use moeswarm_market::choice::{Decision, NodeClass, Policy, Rank, SlabKey, TieSeed};
use moeswarm_protocol::ModelId;

pub mod counts;
pub use counts::Counts;

/// Groups with more members than this are walked in the node's tie order, not scanned.
pub const SCAN_LIMIT: usize = 256;

/// The deciding node.
pub struct Me<'a> {
    /// Its ties over this model's slabs.
    pub seed: TieSeed,
    pub class: NodeClass,
    /// Bytes it may hold.
    pub budget: u64,
    /// Unix seconds now.
    pub now: u64,
    /// The slabs it holds, with since when.
    pub held: &'a BTreeMap<u32, u64>,
    /// The slabs the view counts it as holding, ascending.
    pub counted: &'a [u32],
    /// Those of them it no longer holds (dropped, its new record not arrived), ascending.
    pub ghosts: &'a [u32],
}

/// The model's slabs: `layer × experts + expert`, all of `slab_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub model: ModelId,
    pub experts: u32,
    pub slab_bytes: u64,
}

/// A node's slabs sorted by (tie, slab): the order in which it takes slabs of equal rank.
pub struct TieOrder(Box<[u16]>);

impl TieOrder {
    /// The order of `slabs` slabs (`None` past what 16 bits number).
    pub fn of(seed: TieSeed, slabs: usize, experts: u32) -> Option<Self> {
        if slabs > usize::from(u16::MAX) + 1 {
            return None;
        }
        let mut keyed: Vec<(u64, u16)> = (0..slabs as u32)
            .map(|s| (seed.tie(s / experts, s % experts), s as u16))
            .collect();
        keyed.sort_unstable();
        Some(Self(keyed.into_iter().map(|(_, s)| s).collect()))
    }
}

/// This round's decision for `me`, where it can be told without `decide`; `None` otherwise.
/// `order` is the node's [`TieOrder`], made here the first time a large group needs it.
pub fn quick(
    me: &Me<'_>,
    shape: Shape,
    counts: &Counts,
    policy: &Policy,
    order: &mut Option<TieOrder>,
    scan_limit: usize,
) -> Option<Decision> {
    let used = me.held.len() as u64 * shape.slab_bytes;
    if used > me.budget || shape.slab_bytes == 0 {
        return None;
    }
    let room = ((me.budget - used) / shape.slab_bytes) as usize;
    let k = policy.max_fetches;
    if room >= k {
        let mut groups = Groups::new(counts, policy);
        let mut fetch = Vec::new();
        while fetch.len() < k {
            let Some((lo, hi)) = groups.next() else { break };
            let group = Group { me, counts, lo, hi };
            group.best(k - fetch.len(), shape, order, scan_limit, &mut fetch);
        }
        let slab = |s: u32| SlabKey {
            model: shape.model,
            layer: s / shape.experts,
            expert: s % shape.experts,
        };
        fetch.sort_unstable();
        return Some(Decision {
            fetch: fetch.into_iter().map(slab).collect(),
            drop: Vec::new(),
        });
    }
    if room > 0 {
        return None;
    }
    full_and_idle(me, counts, policy).then(Decision::default)
}

/// Whether a node without room would surely do nothing: no candidate, or its best one beats
/// no victim it may drop.
fn full_and_idle(me: &Me<'_>, counts: &Counts, policy: &Policy) -> bool {
    if policy.max_swaps == 0 {
        return true;
    }
    let rank = |r: usize| Rank::of(r, 0.0, me.class, policy);
    // A candidate has at least one holder fewer than the fewest (the node's own record may
    // still count it), a victim at most the most.
    let best = rank(counts.fewest().saturating_sub(1));
    if best.tier == 2 && !best.beats(&rank(counts.most()), policy.swap_gain) {
        return true;
    }
    let mut groups = Groups::new(counts, policy);
    let Some(lo) = std::iter::from_fn(|| groups.next())
        .find(|&(lo, hi)| Group { me, counts, lo, hi }.any())
        .map(|(lo, _)| lo)
    else {
        return true;
    };
    let candidate = rank(lo);
    let (mut victims, mut worst_aged) = (false, None);
    for (&s, &since) in me.held {
        let others = counts.of(s) - usize::from(me.counted.binary_search(&s).is_ok());
        if others < policy.target {
            continue;
        }
        victims = true;
        if me.now >= since.saturating_add(policy.min_hold_secs) {
            worst_aged = worst_aged.max(Some(others));
        }
    }
    if candidate.tier <= 1 {
        // A repair: any victim of age is swapped, and one within its hold time may be an
        // excess replica (which `decide` tells).
        return !victims;
    }
    worst_aged.is_none_or(|r| !candidate.beats(&rank(r), policy.swap_gain))
}

/// The node's groups of candidates of equal rank, best first, as ranges of how many others
/// hold them: nobody, fewer than the target, then each count from the target up.
struct Groups {
    next: usize,
    most: usize,
    target: usize,
}

impl Groups {
    fn new(counts: &Counts, policy: &Policy) -> Self {
        // Groups below the fewest holders less one have no members.
        let floor = counts.fewest().saturating_sub(1);
        let target = policy.target.max(1);
        let next = if floor >= 1 && floor < target {
            1
        } else {
            floor
        };
        Self {
            next,
            most: counts.most(),
            target,
        }
    }

    fn next(&mut self) -> Option<(usize, usize)> {
        let lo = self.next;
        if lo > self.most {
            return None;
        }
        let hi = if lo == 0 || lo >= self.target {
            lo
        } else {
            self.target - 1
        };
        self.next = hi + 1;
        Some((lo, hi))
    }
}

/// The slabs `me` lacks that `lo..=hi` others hold.
struct Group<'a, 'b> {
    me: &'a Me<'b>,
    counts: &'a Counts,
    lo: usize,
    hi: usize,
}

impl Group<'_, '_> {
    fn ghost(&self, s: u32) -> bool {
        self.me.ghosts.binary_search(&s).is_ok()
    }

    /// Whether `me` lacks `s` and it is in this group.
    fn has(&self, s: u32) -> bool {
        if self.me.held.contains_key(&s) {
            return false;
        }
        let others = self.counts.of(s) - usize::from(self.ghost(s));
        (self.lo..=self.hi).contains(&others)
    }

    /// Every member: those counted at `lo..=hi` the node's record does not name, and its
    /// ghosts counted one higher.
    fn members(&self) -> impl Iterator<Item = u32> + '_ {
        let counted = (self.lo..=self.hi)
            .flat_map(|c| self.counts.with(c).iter().copied())
            .filter(|&s| !self.me.held.contains_key(&s) && !self.ghost(s));
        let ghosts = self.me.ghosts.iter().copied().filter(|&s| self.has(s));
        counted.chain(ghosts)
    }

    fn any(&self) -> bool {
        self.members().next().is_some()
    }

    /// Appends the group's first `m` members in tie order (fewer if it has fewer).
    fn best(
        &self,
        m: usize,
        shape: Shape,
        order: &mut Option<TieOrder>,
        scan_limit: usize,
        out: &mut Vec<u32>,
    ) {
        let size: usize = (self.lo..=self.hi).map(|c| self.counts.with(c).len()).sum();
        if size > scan_limit {
            let slabs = self.counts.slabs();
            if order.is_none() {
                *order = TieOrder::of(self.me.seed, slabs, shape.experts);
            }
            if let Some(TieOrder(order)) = order {
                let found = order.iter().map(|&s| u32::from(s)).filter(|&s| self.has(s));
                out.extend(found.take(m));
                return;
            }
        }
        let tie = |s: u32| self.me.seed.tie(s / shape.experts, s % shape.experts);
        let mut found: Vec<(u64, u32)> = self.members().map(|s| (tie(s), s)).collect();
        found.sort_unstable();
        out.extend(found.into_iter().take(m).map(|(_, s)| s));
    }
}

#[cfg(test)]
mod tests;
