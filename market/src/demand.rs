//! The demand of one model: the verified demand records of every router, merged.
//!
//! Each router's record says how many rows it sent to each slab over its window. Merging turns
//! them into one figure per slab, in rows per window, such that no router can steer the market
//! alone: a router's counts are scaled to its share of rows per slab and weighed by its total,
//! capped at the median total of all routers (so one router that claims a million rows
//! counts as much as a typical one, not more), and decayed by the age of its record (half its
//! weight per window of age). The sum runs over routers in key order: the same records give
//! the same figures bit for bit, whatever order they arrived in.

use std::collections::BTreeMap;

use moeswarm_protocol::{Demand, ModelId, NodeKey};

use crate::coverage::{Refusal, RefusalCounts};

/// Most routers whose demand one node keeps per model: a further router's record takes the
/// place of the one issued longest ago, if it is newer.
pub const MAX_ROUTERS_PER_MODEL: usize = 64;

/// How far ahead of this node's clock a record may say it was issued (clocks differ); one
/// issued further ahead is refused, so that no record stays young (undecayed) for ever.
pub const ISSUED_AHEAD_SECS: u64 = 60;

/// The routers' demand of one model. See the module docs.
#[derive(Debug, Clone)]
pub struct DemandBook {
    model: ModelId,
    n_layer: u32,
    n_expert: u32,
    routers: BTreeMap<NodeKey, Demand>,
    refused: RefusalCounts,
}

impl DemandBook {
    /// An empty book for a model of `n_layer` × `n_expert` slabs.
    pub fn new(model: ModelId, n_layer: u32, n_expert: u32) -> Self {
        Self {
            model,
            n_layer,
            n_expert,
            routers: BTreeMap::new(),
            refused: RefusalCounts::default(),
        }
    }

    /// Applies a verified record at `now`. A router not yet known, when
    /// [`MAX_ROUTERS_PER_MODEL`] are, takes the place of the one whose record was issued
    /// longest ago if its own is newer, and is refused ([`Refusal::TooMany`]) otherwise. A
    /// record issued more than [`ISSUED_AHEAD_SECS`] ahead of `now` is refused as
    /// [`Refusal::Expired`] (outside its time).
    pub fn apply(&mut self, d: Demand, now: u64) -> Result<(), Refusal> {
        let refusal = if d.model != self.model {
            Some(Refusal::OtherModel)
        } else if d.n_layer != self.n_layer || d.n_expert != self.n_expert {
            Some(Refusal::WrongShape)
        } else if d.expires_at <= now || d.issued_at > now.saturating_add(ISSUED_AHEAD_SECS) {
            Some(Refusal::Expired)
        } else if self
            .routers
            .get(&d.router)
            .is_some_and(|old| old.seq >= d.seq)
        {
            Some(Refusal::NotNewer)
        } else {
            None
        };
        if let Some(r) = refusal {
            self.refused.count(r);
            return Err(r);
        }
        self.expire(now);
        if !self.routers.contains_key(&d.router) && self.routers.len() >= MAX_ROUTERS_PER_MODEL {
            // The stalest record (issued longest ago; the greater key among equals) gives way
            // to a newer one.
            let stalest = self
                .routers
                .values()
                .min_by_key(|o| (o.issued_at, std::cmp::Reverse(o.router)))
                .map(|o| (o.issued_at, o.router));
            match stalest {
                Some((issued, key)) if issued < d.issued_at => {
                    self.routers.remove(&key);
                }
                _ => {
                    self.refused.count(Refusal::TooMany);
                    return Err(Refusal::TooMany);
                }
            }
        }
        self.routers.insert(d.router, d);
        Ok(())
    }

    /// Drops the records expired at `now`; returns how many.
    pub fn expire(&mut self, now: u64) -> usize {
        let before = self.routers.len();
        self.routers.retain(|_, d| d.expires_at > now);
        before - self.routers.len()
    }

    /// The last sequence number applied from `router`.
    pub fn last_seq(&self, router: &NodeKey) -> Option<u64> {
        self.routers.get(router).map(|d| d.seq)
    }

    /// Forgets `router`'s record.
    pub fn remove(&mut self, router: &NodeKey) -> Option<Demand> {
        self.routers.remove(router)
    }

    /// How many routers' records are held.
    pub fn len(&self) -> usize {
        self.routers.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.routers.is_empty()
    }

    /// The live records, in router order.
    pub fn records(&self) -> impl Iterator<Item = &Demand> {
        self.routers.values()
    }

    /// Refused records so far, by reason.
    pub fn refused(&self) -> RefusalCounts {
        self.refused
    }

    /// The merged demand `[layer][expert]` at `now`, in rows per window. See the module docs.
    pub fn merged(&self, now: u64) -> Vec<Vec<f64>> {
        merge(self.routers.values(), self.n_layer, self.n_expert, now)
    }
}

/// Merges demand records (in the order given, which callers keep fixed) into rows per slab.
pub fn merge<'a>(
    records: impl IntoIterator<Item = &'a Demand>,
    n_layer: u32,
    n_expert: u32,
    now: u64,
) -> Vec<Vec<f64>> {
    let live: Vec<&Demand> = records
        .into_iter()
        .filter(|d| d.expires_at > now && d.n_layer == n_layer && d.n_expert == n_expert)
        .collect();
    let mut out = vec![vec![0.0f64; n_expert as usize]; n_layer as usize];
    // Routers that sent nothing have no say in the cap either.
    let mut totals: Vec<u64> = live
        .iter()
        .map(|d| d.total_rows)
        .filter(|&t| t > 0)
        .collect();
    totals.sort_unstable();
    let Some(&cap) = totals.get(totals.len() / 2) else {
        return out;
    };
    for d in live {
        if d.total_rows == 0 {
            continue;
        }
        let age = now.saturating_sub(d.issued_at) as f64;
        let decay = 0.5f64.powf(age / d.window_secs.max(1) as f64);
        let weight = d.total_rows.min(cap.max(1)) as f64 * decay;
        for e in &d.slabs {
            if let Some(cell) = out
                .get_mut(e.0 as usize)
                .and_then(|row| row.get_mut(e.1 as usize))
            {
                *cell += weight * (e.2 as f64 / d.total_rows as f64);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeswarm_protocol::{BlobId, DemandEntry};
    use proptest::prelude::*;

    const NOW: u64 = 10_000;

    fn demand(router: u8, seq: u64, slabs: &[(u32, u32, u32)], issued_at: u64) -> Demand {
        let mut slabs: Vec<DemandEntry> = slabs
            .iter()
            .map(|&(l, e, n)| DemandEntry(l, e, n))
            .collect();
        slabs.sort_by_key(|d| (d.0, d.1));
        slabs.dedup_by_key(|d| (d.0, d.1));
        Demand {
            model: ModelId(BlobId::of(b"m")),
            router: NodeKey([router; 32]),
            n_layer: 2,
            n_expert: 8,
            window_secs: 60,
            total_rows: slabs.iter().map(|d| d.2 as u64).sum(),
            slabs,
            issued_at,
            seq,
            expires_at: issued_at + 600,
        }
    }

    #[test]
    fn one_router_is_its_own_counts_and_a_loud_one_is_capped() {
        let mut b = DemandBook::new(ModelId(BlobId::of(b"m")), 2, 8);
        b.apply(demand(1, 1, &[(0, 1, 30), (1, 7, 10)], NOW), NOW)
            .unwrap();
        let m = b.merged(NOW);
        assert_eq!((m[0][1], m[1][7], m[0][0]), (30.0, 10.0, 0.0));
        // Two ordinary routers and one that claims a million rows on one slab.
        b.apply(demand(2, 1, &[(0, 2, 40)], NOW), NOW).unwrap();
        b.apply(demand(3, 1, &[(1, 0, 1_000_000)], NOW), NOW)
            .unwrap();
        let m = b.merged(NOW);
        assert_eq!(m[1][0], 40.0, "capped at the median total");
        assert_eq!(m[0][2], 40.0);
        // Stale, replayed, foreign and misshapen records are refused and counted.
        assert_eq!(
            b.apply(demand(1, 1, &[(0, 1, 99)], NOW), NOW),
            Err(Refusal::NotNewer)
        );
        let mut other = demand(4, 1, &[], NOW);
        other.model = ModelId(BlobId::of(b"other"));
        assert_eq!(b.apply(other, NOW), Err(Refusal::OtherModel));
        let mut shape = demand(4, 1, &[], NOW);
        shape.n_expert = 9;
        assert_eq!(b.apply(shape, NOW), Err(Refusal::WrongShape));
        assert_eq!(
            b.apply(demand(4, 1, &[], NOW - 700), NOW),
            Err(Refusal::Expired)
        );
        assert_eq!(b.refused().not_newer, 1);
    }

    #[test]
    fn old_counts_fade_and_no_more_routers_than_the_cap_are_kept() {
        let mut b = DemandBook::new(ModelId(BlobId::of(b"m")), 2, 8);
        b.apply(demand(1, 1, &[(0, 0, 64)], NOW - 120), NOW)
            .unwrap();
        assert_eq!(b.merged(NOW)[0][0], 16.0, "two windows old: a quarter");
        for r in 0..MAX_ROUTERS_PER_MODEL as u8 + 5 {
            let _ = b.apply(demand(r + 10, 1, &[(0, 0, 1)], NOW), NOW);
        }
        assert_eq!(b.records().count(), MAX_ROUTERS_PER_MODEL);
        // The two-windows-old record gave way to a newer one; the rest, no newer than those
        // kept, were refused.
        assert_eq!(b.last_seq(&demand(1, 1, &[], NOW).router), None);
        assert_eq!(b.refused().too_many, 5);
    }

    #[test]
    fn a_full_book_of_old_records_makes_room_for_a_fresh_router_and_none_stays_young_for_ever() {
        let mut b = DemandBook::new(ModelId(BlobId::of(b"m")), 2, 8);
        // Filled by routers that spoke once, a while ago (records that live a day).
        for r in 0..MAX_ROUTERS_PER_MODEL as u8 {
            let mut d = demand(r, 1, &[(0, 1, 5)], NOW - 3600);
            d.expires_at = NOW + 20 * 3600;
            b.apply(d, NOW).unwrap();
        }
        // A router using the model now gets in.
        b.apply(demand(200, 1, &[(0, 0, 8)], NOW), NOW).unwrap();
        assert!(b.last_seq(&demand(200, 1, &[], NOW).router).is_some());
        assert_eq!(b.len(), MAX_ROUTERS_PER_MODEL);
        // A record claiming to be issued an hour from now is refused: it would never decay.
        assert_eq!(
            b.apply(demand(201, 1, &[(0, 0, 8)], NOW + 3600), NOW),
            Err(Refusal::Expired)
        );
        // A minute of clock skew is not refused.
        b.apply(demand(202, 1, &[(0, 0, 8)], NOW + ISSUED_AHEAD_SECS), NOW)
            .unwrap();
    }

    proptest! {
        #[test]
        fn the_merge_is_order_free_bounded_and_monotone_in_each_router(
            recs in proptest::collection::vec(
                (0u8..6, proptest::collection::vec((0u32..2, 0u32..8, 1u32..1000), 0..10), 0u64..300),
                0..8),
            rot in 0usize..8,
        ) {
            let ds: Vec<Demand> = recs.iter().map(|(r, s, age)| demand(*r, 1, s, NOW - age)).collect();
            let mut a = DemandBook::new(ModelId(BlobId::of(b"m")), 2, 8);
            for d in &ds { let _ = a.apply(d.clone(), NOW); }
            let mut rotated = ds.clone();
            let n = rotated.len().max(1);
            rotated.rotate_left(rot % n);
            let mut b = DemandBook::new(ModelId(BlobId::of(b"m")), 2, 8);
            for d in &rotated { let _ = b.apply(d.clone(), NOW); }
            let (ma, mb) = (a.merged(NOW), b.merged(NOW));
            // The first record of a router wins either way only when seqs tie: compare the books.
            let same: bool = a.records().zip(b.records()).all(|(x, y)| x == y);
            if same {
                prop_assert_eq!(&ma, &mb);
            }
            // No router adds more than the median total over all slabs.
            let mut totals: Vec<u64> = a.records().map(|d| d.total_rows).filter(|&t| t > 0).collect();
            totals.sort_unstable();
            let cap = totals.get(totals.len() / 2).copied().unwrap_or(0).max(1) as f64;
            let sum: f64 = ma.iter().flatten().sum();
            prop_assert!(sum <= cap * a.records().count() as f64 + 1e-6);
            prop_assert!(ma.iter().flatten().all(|v| v.is_finite() && *v >= 0.0));
        }
    }
}
