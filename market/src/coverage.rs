//! The coverage map of one model: for every slab, the nodes that hold it now.
//!
//! Built from verified [`Holdings`] records (verification is the protocol crate's): the
//! newest record of each node replaces its older one, expired records drop out, and records
//! that do not fit the model are refused and counted. Pure and deterministic: the same set of
//! records gives the same map whatever order they arrive in.

use std::collections::BTreeMap;

use moeswarm_protocol::{Holdings, ModelId, NodeKey};
use serde::Serialize;

/// Why a verified record was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Refusal {
    /// For another model.
    OtherModel,
    /// Its shape (layers, experts) is not the model's.
    WrongShape,
    /// Not newer than the record already held for that node.
    NotNewer,
    /// Already expired.
    Expired,
    /// From a signer not yet known when the most signers kept are.
    TooMany,
}

/// Counts of refused records, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RefusalCounts {
    /// [`Refusal::OtherModel`].
    pub other_model: u64,
    /// [`Refusal::WrongShape`].
    pub wrong_shape: u64,
    /// [`Refusal::NotNewer`].
    pub not_newer: u64,
    /// [`Refusal::Expired`].
    pub expired: u64,
    /// [`Refusal::TooMany`].
    pub too_many: u64,
}

impl RefusalCounts {
    /// Counts one refusal.
    pub fn count(&mut self, r: Refusal) {
        *match r {
            Refusal::OtherModel => &mut self.other_model,
            Refusal::WrongShape => &mut self.wrong_shape,
            Refusal::NotNewer => &mut self.not_newer,
            Refusal::Expired => &mut self.expired,
            Refusal::TooMany => &mut self.too_many,
        } += 1;
    }
}

/// Who holds what of one model.
#[derive(Debug, Clone)]
pub struct CoverageMap {
    model: ModelId,
    n_layer: u32,
    n_expert: u32,
    nodes: BTreeMap<NodeKey, Holdings>,
    refused: RefusalCounts,
}

/// One slab with too few replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Shortage {
    /// Layer.
    pub layer: u32,
    /// Expert.
    pub expert: u32,
    /// Replicas it has.
    pub replicas: usize,
}

impl CoverageMap {
    /// An empty map for a model of `n_layer` layers × `n_expert` experts.
    pub fn new(model: ModelId, n_layer: u32, n_expert: u32) -> Self {
        Self {
            model,
            n_layer,
            n_expert,
            nodes: BTreeMap::new(),
            refused: RefusalCounts::default(),
        }
    }

    /// The model this map is of.
    pub fn model(&self) -> ModelId {
        self.model
    }

    /// Applies a verified record at time `now` (unix seconds).
    pub fn apply(&mut self, h: Holdings, now: u64) -> Result<(), Refusal> {
        let refusal = if h.model != self.model {
            Some(Refusal::OtherModel)
        } else if h.layers.len() != self.n_layer as usize || h.n_expert != self.n_expert {
            Some(Refusal::WrongShape)
        } else if h.expires_at <= now {
            Some(Refusal::Expired)
        } else if self.nodes.get(&h.node).is_some_and(|old| old.seq >= h.seq) {
            Some(Refusal::NotNewer)
        } else {
            None
        };
        match refusal {
            Some(r) => {
                self.refused.count(r);
                Err(r)
            }
            None => {
                self.nodes.insert(h.node, h);
                Ok(())
            }
        }
    }

    /// Applies each of `records` that is newer than what the map holds of its node (older
    /// ones are skipped quietly: a merge of what several peers know sees the same record many
    /// times); the rest are checked as [`CoverageMap::apply`] checks them. Returns how many
    /// were applied.
    pub fn merge(&mut self, records: impl IntoIterator<Item = Holdings>, now: u64) -> usize {
        let mut applied = 0;
        for h in records {
            if self.last_seq(&h.node).is_none_or(|s| h.seq > s) && self.apply(h, now).is_ok() {
                applied += 1;
            }
        }
        applied
    }

    /// Drops every record expired at `now`; returns how many.
    pub fn expire(&mut self, now: u64) -> usize {
        let before = self.nodes.len();
        self.nodes.retain(|_, h| h.expires_at > now);
        before - self.nodes.len()
    }

    /// Forgets `node`'s record (its place in a full table went to another).
    pub fn remove(&mut self, node: &NodeKey) -> Option<Holdings> {
        self.nodes.remove(node)
    }

    /// How many nodes' records are held.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The last sequence number applied from `node`.
    pub fn last_seq(&self, node: &NodeKey) -> Option<u64> {
        self.nodes.get(node).map(|h| h.seq)
    }

    /// The current record of `node`.
    pub fn record(&self, node: &NodeKey) -> Option<&Holdings> {
        self.nodes.get(node)
    }

    /// The nodes holding (`layer`, `expert`), in key order.
    pub fn holders(&self, layer: u32, expert: u32) -> Vec<NodeKey> {
        self.nodes
            .values()
            .filter(|h| h.layers.get(layer as usize).is_some_and(|b| b.has(expert)))
            .map(|h| h.node)
            .collect()
    }

    /// Replica counts `[layer][expert]`.
    pub fn replicas(&self) -> Vec<Vec<usize>> {
        let mut counts = vec![vec![0usize; self.n_expert as usize]; self.n_layer as usize];
        for h in self.nodes.values() {
            for (l, e) in h.slabs() {
                if let Some(c) = counts
                    .get_mut(l as usize)
                    .and_then(|r| r.get_mut(e as usize))
                {
                    *c += 1;
                }
            }
        }
        counts
    }

    /// Slabs with fewer than `r` replicas (`r = 1`: the uncovered ones).
    pub fn under_replicated(&self, r: usize) -> Vec<Shortage> {
        let mut out = Vec::new();
        for (l, row) in self.replicas().iter().enumerate() {
            for (e, &n) in row.iter().enumerate() {
                if n < r {
                    out.push(Shortage {
                        layer: l as u32,
                        expert: e as u32,
                        replicas: n,
                    });
                }
            }
        }
        out
    }

    /// Nodes with a live record.
    pub fn nodes(&self) -> impl Iterator<Item = &Holdings> {
        self.nodes.values()
    }

    /// Refused records so far.
    pub fn refused(&self) -> RefusalCounts {
        self.refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeswarm_protocol::holdings::LayerBits;
    use moeswarm_protocol::{BlobId, Reach};
    use proptest::prelude::*;

    const NOW: u64 = 1_000;

    fn holdings(node: u8, seq: u64, held: &[(u32, u32)], expires_at: u64) -> Holdings {
        let mut layers = vec![LayerBits::empty(16); 3];
        for &(l, e) in held {
            layers[l as usize].set(e);
        }
        Holdings {
            model: ModelId(BlobId::of(b"m")),
            node: NodeKey([node; 32]),
            n_expert: 16,
            layers,
            used_bytes: 0,
            free_bytes: 0,
            addrs: vec![],
            reach: Reach::Direct,
            seq,
            expires_at,
        }
    }

    fn slab() -> impl Strategy<Value = (u32, u32)> {
        (0u32..3, 0u32..16)
    }

    proptest! {
        #[test]
        fn coverage_is_the_truth_of_the_newest_live_records_in_any_order(
            recs in proptest::collection::vec(
                (0u8..5, 0u64..6, proptest::collection::vec(slab(), 0..20), NOW + 1..NOW + 50), 0..30),
            shuffle in any::<u64>(), later in 0u64..60,
        ) {
            let records: Vec<Holdings> = recs.iter().map(|(n, s, held, exp)| holdings(*n, *s, held, *exp)).collect();
            // Truth: per node, the record with the highest seq (first such in input order wins ties).
            let mut truth: BTreeMap<NodeKey, &Holdings> = BTreeMap::new();
            for r in &records {
                if truth.get(&r.node).is_none_or(|old| r.seq > old.seq) {
                    truth.insert(r.node, r);
                }
            }
            let mut a = CoverageMap::new(ModelId(BlobId::of(b"m")), 3, 16);
            for r in &records {
                let _ = a.apply(r.clone(), NOW);
            }
            a.expire(NOW + later);
            let live: Vec<&&Holdings> = truth.values().filter(|h| h.expires_at > NOW + later).collect();
            for l in 0..3 {
                for e in 0..16 {
                    let want: Vec<NodeKey> = live.iter().filter(|h| h.layers[l as usize].has(e)).map(|h| h.node).collect();
                    prop_assert_eq!(a.holders(l, e), want);
                }
            }
            // Another arrival order with distinct seqs per node gives the same map.
            let mut distinct = records.clone();
            distinct.sort_by_key(|r| (r.node, r.seq));
            distinct.dedup_by_key(|r| (r.node, r.seq));
            let mut shuffled = distinct.clone();
            let n = shuffled.len().max(1);
            shuffled.rotate_left((shuffle as usize) % n);
            let (mut x, mut y) = (CoverageMap::new(a.model, 3, 16), CoverageMap::new(a.model, 3, 16));
            for r in distinct { let _ = x.apply(r, NOW); }
            for r in shuffled { let _ = y.apply(r, NOW); }
            prop_assert_eq!(x.replicas(), y.replicas());
            // Merging the same records twice over gives the same map, counting no stale ones.
            let mut m = CoverageMap::new(a.model, 3, 16);
            m.merge(records.clone(), NOW);
            m.merge(records, NOW);
            m.expire(NOW + later);
            prop_assert_eq!(m.replicas(), a.replicas());
            prop_assert_eq!(m.refused().not_newer, 0);
        }
    }

    #[test]
    fn refusals_are_counted_and_shortages_listed() {
        let mut m = CoverageMap::new(ModelId(BlobId::of(b"m")), 3, 16);
        assert_eq!(
            m.apply(holdings(1, 2, &[(0, 0), (2, 15)], NOW + 10), NOW),
            Ok(())
        );
        assert_eq!(
            m.apply(holdings(1, 2, &[], NOW + 10), NOW),
            Err(Refusal::NotNewer)
        );
        assert_eq!(
            m.apply(holdings(2, 1, &[], NOW), NOW),
            Err(Refusal::Expired)
        );
        let mut other = holdings(3, 1, &[], NOW + 10);
        other.model = ModelId(BlobId::of(b"other"));
        assert_eq!(m.apply(other, NOW), Err(Refusal::OtherModel));
        let mut shape = holdings(4, 1, &[], NOW + 10);
        shape.layers.pop();
        assert_eq!(m.apply(shape, NOW), Err(Refusal::WrongShape));
        assert_eq!(
            m.refused(),
            RefusalCounts {
                other_model: 1,
                wrong_shape: 1,
                not_newer: 1,
                expired: 1,
                too_many: 0,
            }
        );
        assert_eq!(m.apply(holdings(5, 1, &[(0, 0)], NOW + 10), NOW), Ok(()));
        assert_eq!(m.holders(0, 0), vec![NodeKey([1; 32]), NodeKey([5; 32])]);
        let short = m.under_replicated(2);
        assert_eq!(short.len(), 3 * 16 - 1);
        assert!(short.contains(&Shortage {
            layer: 2,
            expert: 15,
            replicas: 1
        }));
        assert_eq!(m.under_replicated(1).len(), 3 * 16 - 2);
    }
}
