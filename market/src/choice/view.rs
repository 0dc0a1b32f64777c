//! What a node sees of each slab before it decides: the [`SlabView`]s [`super::decide`] takes,
//! built from the coverage (who holds each slab), what the node holds itself and the merged
//! demand. The node's market rounds and the scale simulator build them here, the same way.

use std::collections::HashSet;

use moeswarm_protocol::NodeKey;

use super::{is_excess, SlabKey, SlabView};

/// One slab as the node knows it, before its view is built.
#[derive(Debug, Clone)]
pub struct SlabState<'a> {
    /// The slab.
    pub slab: SlabKey,
    /// Its bytes.
    pub bytes: u64,
    /// Its live holders in the node's coverage (may name the node itself; any order).
    pub holders: &'a [NodeKey],
    /// Since when the node holds it (by its own store); `None` when it does not.
    pub held_since: Option<u64>,
    /// Merged demand, rows per window.
    pub demand: f64,
}

/// The views of `slabs` for node `me`: `known` are the nodes of its coverage (whose records
/// it holds), `target` the replica target. See [`is_excess`] for who may drop a spare replica
/// for a repair.
pub fn views(
    me: &NodeKey,
    slabs: &[SlabState<'_>],
    known: impl IntoIterator<Item = NodeKey>,
    target: usize,
) -> Vec<SlabView> {
    let can_repair = repairers(me, slabs, known, target);
    slabs
        .iter()
        .map(|s| {
            let others = s.holders.iter().filter(|k| *k != me).count();
            // Only a holder of a slab with replicas to spare may be an excess one.
            let excess = s.held_since.is_some()
                && others + 1 > target
                && is_excess(me, s.holders, &s.slab, target, |k| can_repair.contains(k));
            SlabView {
                slab: s.slab,
                bytes: s.bytes,
                others,
                demand: s.demand,
                held_since: s.held_since,
                excess,
            }
        })
        .collect()
}

/// The nodes (`me`, by what it holds; the `known` others, by the coverage) that lack some slab
/// held fewer than `target` times: those that could use a spare replica's room for a repair.
fn repairers(
    me: &NodeKey,
    slabs: &[SlabState<'_>],
    known: impl IntoIterator<Item = NodeKey>,
    target: usize,
) -> HashSet<NodeKey> {
    let short: Vec<&SlabState> = slabs
        .iter()
        .filter(|s| {
            s.holders.iter().filter(|k| *k != me).count() + usize::from(s.held_since.is_some())
                < target
        })
        .collect();
    if short.is_empty() {
        return HashSet::new();
    }
    let mut out: HashSet<NodeKey> = known
        .into_iter()
        .filter(|k| k != me && short.iter().any(|s| !s.holders.contains(k)))
        .collect();
    if short.iter().any(|s| s.held_since.is_none()) {
        out.insert(*me);
    }
    out
}
