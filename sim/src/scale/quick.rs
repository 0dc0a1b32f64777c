//! The market's choice for one node without a look at every slab, where that gives the same
//! answer as [`decide`](moeswarm_market::choice::decide) over the views of all of them.
//!
//! A round at scale runs `decide` over 12,288 slabs (a tie hash each, a sort), and a swarm of
//! thousands decides millions of times a day. Without demand a slab's place in a node's order
//! depends only on how many others hold it and on the tie, so the slabs sorted by their count
//! ([`Counts`], kept in step with the view) give the node's groups of equal rank in order, and
//! within a group the tie settles it. These cases are answered here, each exactly:
//!
//! - **Room for a whole round's fetches**: the first `max_fetches` slabs the node lacks, in
//!   its order (nothing is dropped). A small group is scanned; a large one is walked in the
//!   node's [`TieOrder`] (its slabs sorted by tie as far as read), which finds the first of a
//!   group holding a share `g` of the slabs after about `1 / g` steps.
//! - **Room for part of a round, or none**: the slabs that fit, then swaps: each further
//!   candidate displaces the least wanted victim it may drop if it beats it, until one does
//!   not; a repair may also displace a victim within its hold time of which the node is an
//!   excess holder (found from the victim's holders' ties, as the market's `is_excess`).
//!   Most rounds of a full node end at once: the fewest and most holders of any slab rule out
//!   a swap for every node, or this node's best candidate beats none of its victims of age
//!   (both before any tie is computed).
//! - Anything else (demand, over budget) is left to `decide`: `None`.
//!
//! `tests.rs` holds the property that it agrees with `decide` wherever it answers.

use std::collections::BTreeMap;

use moeswarm_market::choice::{Decision, NodeClass, Policy, Rank, SlabKey, TieSeed};
use moeswarm_protocol::{ModelId, NodeKey};

mod bits;
pub mod counts;
mod order;
pub use bits::SlabBits;
pub use counts::Counts;
pub use order::TieOrder;

/// Groups with more members than this are walked in the node's tie order, not scanned.
pub const SCAN_LIMIT: usize = 256;

/// The deciding node.
pub struct Me<'a> {
    /// Its key.
    pub key: NodeKey,
    /// Its ties over this model's slabs.
    pub seed: TieSeed,
    /// Phone or computer.
    pub class: NodeClass,
    /// Bytes it may hold.
    pub budget: u64,
    /// Unix seconds now.
    pub now: u64,
    /// The slabs it holds, with since when.
    pub held: &'a BTreeMap<u32, u64>,
    /// The same slabs as bits, for a quick look.
    pub holds: &'a SlabBits,
    /// The slabs the view counts it as holding, ascending.
    pub counted: &'a [u32],
    /// Those of them it no longer holds (dropped, its new record not arrived), ascending.
    pub ghosts: &'a [u32],
    /// Who the view counts as holding each slab.
    pub holders: &'a dyn Holders,
}

impl Me<'_> {
    fn holds(&self, s: u32) -> bool {
        self.holds.contains(s)
    }

    /// How many other nodes hold slab `s`: its live holders less this node, if the view
    /// counts it (its record names `s`).
    fn others(&self, counts: &Counts, s: u32) -> usize {
        counts.of(s) - usize::from(self.counted.binary_search(&s).is_ok())
    }
}

/// Who the view counts as holding each slab.
pub trait Holders {
    /// The live holders of slab `s` (may name the deciding node).
    fn of(&self, s: u32) -> Vec<NodeKey>;
}

/// The model's slabs: `layer × experts + expert`, all of `slab_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// The model (its id is in every tie).
    pub model: ModelId,
    /// Experts a layer.
    pub experts: u32,
    /// Bytes of every slab.
    pub slab_bytes: u64,
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
    let rank = |r: usize| Rank::of(r, 0.0, me.class, policy);
    if room == 0 {
        if k == 0 || policy.max_swaps == 0 || no_swap_anywhere(counts, &rank, policy) {
            return Some(Decision::default());
        }
        // Most rounds of a full node end here, before any tie is computed: the best
        // candidate's rank is its group's.
        let mut groups = Groups::new(counts, policy);
        let best = std::iter::from_fn(|| groups.next())
            .find(|&(lo, hi)| Group { me, counts, lo, hi }.any());
        match best {
            None => return Some(Decision::default()),
            Some((lo, _)) if full_and_idle(me, counts, policy, rank(lo)) => {
                return Some(Decision::default())
            }
            Some(_) => {}
        }
    }
    // The first `k` slabs lacked, in the node's order: the first `room` of them fit, the
    // others may each displace a victim; past them `decide` does nothing more.
    let mut candidates = Vec::new();
    let mut groups = Groups::new(counts, policy);
    while candidates.len() < k {
        let Some((lo, hi)) = groups.next() else { break };
        let group = Group { me, counts, lo, hi };
        let m = k - candidates.len();
        group.best(m, shape, order, scan_limit, &mut candidates);
    }
    let take = room.min(candidates.len());
    let (mut fetch, mut drop) = (candidates[..take].to_vec(), Vec::new());
    swaps(
        me,
        shape,
        counts,
        policy,
        &candidates[take..],
        &mut fetch,
        &mut drop,
    );
    let slab = |s: u32| SlabKey {
        model: shape.model,
        layer: s / shape.experts,
        expert: s % shape.experts,
    };
    fetch.sort_unstable();
    drop.sort_unstable();
    Some(Decision {
        fetch: fetch.into_iter().map(slab).collect(),
        drop: drop.into_iter().map(slab).collect(),
    })
}

/// Plays out the swaps of a node without room for `candidates` (the next slabs it lacks, in
/// its order), as `decide` does: each displaces the least wanted victim it may drop if it
/// beats it, until one does not, or the round's swaps are spent.
fn swaps(
    me: &Me<'_>,
    shape: Shape,
    counts: &Counts,
    policy: &Policy,
    candidates: &[u32],
    fetch: &mut Vec<u32>,
    drop: &mut Vec<u32>,
) {
    let Some(&first) = candidates.first().filter(|_| policy.max_swaps > 0) else {
        return;
    };
    let rank = |r: usize| Rank::of(r, 0.0, me.class, policy);
    let others = |s: u32| me.others(counts, s);
    if full_and_idle(me, counts, policy, rank(others(first))) {
        return;
    }
    let mut victims = victims(me, counts, policy, shape);
    let mut excess = None;
    for &c in candidates {
        if drop.len() >= policy.max_swaps {
            break;
        }
        let wanted = rank(others(c));
        // A repair may also displace a victim within its hold time that is an excess replica.
        let usable = |v: &Victim| {
            v.aged
                || (wanted.tier <= 1
                    && excess
                        .get_or_insert_with(|| Excess::of(me, counts, policy))
                        .is(me, shape, v, policy.target))
        };
        let Some(at) = victims.iter().position(usable) else {
            break;
        };
        if !wanted.beats(&rank(victims[at].others), policy.swap_gain) {
            break;
        }
        drop.push(victims.remove(at).slab);
        fetch.push(c);
    }
}

/// Whether the fewest and most holders of any slab rule out a swap for every full node: a
/// candidate has at least one holder fewer than the fewest (the node's own record may still
/// count it), a victim at most the most, and without a repair the best cannot beat the worst.
fn no_swap_anywhere(counts: &Counts, rank: &impl Fn(usize) -> Rank, policy: &Policy) -> bool {
    let best = rank(counts.fewest().saturating_sub(1));
    best.tier == 2 && !best.beats(&rank(counts.most()), policy.swap_gain)
}

/// Whether a candidate of rank `candidate` (and so any after it) beats no victim the node
/// may drop.
fn full_and_idle(me: &Me<'_>, counts: &Counts, policy: &Policy, candidate: Rank) -> bool {
    let (mut victims, mut worst_aged) = (false, None);
    // Both ascending: one walk over the two.
    let mut counted = me.counted.iter().peekable();
    for (&s, &since) in me.held {
        while counted.next_if(|&&c| c < s).is_some() {}
        let others = counts.of(s) - usize::from(counted.peek() == Some(&&s));
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
        // excess replica.
        return !victims;
    }
    let rank = |r: usize| Rank::of(r, 0.0, me.class, policy);
    worst_aged.is_none_or(|r| !candidate.beats(&rank(r), policy.swap_gain))
}

/// Which of a slab's holders may drop it for a repair within the hold time, as the market's
/// [`is_excess`](moeswarm_market::choice::is_excess) tells over the view: the first in tie
/// order among those that could use the room, as many as it has replicas to spare.
struct Excess {
    /// The other nodes that could not: they hold every slab short of its target (at most
    /// the few holders of one such slab).
    cannot: Vec<NodeKey>,
}

impl Excess {
    /// Found when a repair is wanted (so some slab is short, and the node lacks it).
    fn of(me: &Me<'_>, counts: &Counts, policy: &Policy) -> Self {
        let mut cannot: Option<Vec<NodeKey>> = None;
        // A short slab's others and own copy are fewer than the target: its count is at most
        // the target.
        for c in 0..=policy.target {
            for &s in counts.with(c) {
                if me.others(counts, s) + usize::from(me.holds(s)) >= policy.target {
                    continue;
                }
                let holders = me.holders.of(s);
                match &mut cannot {
                    None => {
                        cannot = Some(holders.iter().copied().filter(|k| *k != me.key).collect())
                    }
                    Some(list) => list.retain(|k| holders.contains(k)),
                }
                if cannot.as_ref().is_some_and(Vec::is_empty) {
                    return Self { cannot: Vec::new() };
                }
            }
        }
        Self {
            cannot: cannot.unwrap_or_default(),
        }
    }

    /// Whether `me` is an excess holder of victim `v`.
    fn is(&self, me: &Me<'_>, shape: Shape, v: &Victim, target: usize) -> bool {
        let spare = (1 + v.others).saturating_sub(target);
        let (layer, expert) = (v.slab / shape.experts, v.slab % shape.experts);
        let mine = me.seed.tie(layer, expert);
        let ahead = me
            .holders
            .of(v.slab)
            .iter()
            .filter(|o| **o != me.key && !self.cannot.contains(o))
            .filter(|o| TieSeed::of(o, &shape.model).tie(layer, expert) < mine)
            .count();
        ahead < spare
    }
}

/// A held slab with replicas to spare, which a swap may drop.
struct Victim {
    slab: u32,
    others: usize,
    aged: bool,
}

/// The node's victims, least wanted first: the most others holding them, then the tie and
/// the slab from the last (the reverse of the order it takes slabs in).
fn victims(me: &Me<'_>, counts: &Counts, policy: &Policy, shape: Shape) -> Vec<Victim> {
    let mut out: Vec<(Victim, u64)> = me
        .held
        .iter()
        .filter_map(|(&s, &since)| {
            let others = me.others(counts, s);
            let aged = me.now >= since.saturating_add(policy.min_hold_secs);
            let tie = me.seed.tie(s / shape.experts, s % shape.experts);
            let v = Victim {
                slab: s,
                others,
                aged,
            };
            (others >= policy.target).then_some((v, tie))
        })
        .collect();
    out.sort_unstable_by(|(a, ta), (b, tb)| (b.others, tb, b.slab).cmp(&(a.others, ta, a.slab)));
    out.into_iter().map(|(v, _)| v).collect()
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
        if self.me.holds(s) {
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
            .filter(|&s| !self.me.holds(s) && !self.ghost(s));
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
            if let Some(order) = order {
                let mut left = m;
                order.walk(|s| {
                    if self.has(s) {
                        out.push(s);
                        left -= 1;
                    }
                    left > 0
                });
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
