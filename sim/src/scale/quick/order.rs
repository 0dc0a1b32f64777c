//! A node's slabs in its tie order, sorted only as far as it is read: the slabs are bucketed
//! by their tie's top bits once (a counting sort), and each bucket is sorted the first time a
//! walk reaches it. A walk that stops early (the usual case: the first lacked slab of a large
//! group) sorts a few buckets of a dozen slabs, not all of them.

use moeswarm_market::choice::TieSeed;

/// Top bits of a tie that pick its bucket.
const BUCKET_BITS: u32 = 10;

/// A node's slabs sorted by (tie, slab), as far as read.
pub struct TieOrder {
    seed: TieSeed,
    experts: u32,
    /// By bucket, ascending; buckets `..sorted` each sorted by (tie, slab).
    slabs: Box<[u16]>,
    /// Bucket `b` holds `slabs[starts[b]..starts[b + 1]]`.
    starts: Box<[u32]>,
    sorted: usize,
}

impl TieOrder {
    /// The order of `slabs` slabs (`None` past what 16 bits number).
    pub fn of(seed: TieSeed, slabs: usize, experts: u32) -> Option<Self> {
        if slabs > usize::from(u16::MAX) + 1 || experts == 0 {
            return None;
        }
        let buckets = 1usize << BUCKET_BITS;
        let bucket = |s: u32| (seed.tie(s / experts, s % experts) >> (64 - BUCKET_BITS)) as usize;
        let of: Vec<u16> = (0..slabs as u32).map(|s| bucket(s) as u16).collect();
        let mut starts = vec![0u32; buckets + 1];
        for &b in &of {
            starts[b as usize + 1] += 1;
        }
        for b in 0..buckets {
            starts[b + 1] += starts[b];
        }
        let mut next: Vec<u32> = starts[..buckets].to_vec();
        let mut sorted = vec![0u16; slabs];
        for (s, &b) in of.iter().enumerate() {
            sorted[next[b as usize] as usize] = s as u16;
            next[b as usize] += 1;
        }
        Some(Self {
            seed,
            experts,
            slabs: sorted.into(),
            starts: starts.into(),
            sorted: 0,
        })
    }

    /// Visits the slabs in (tie, slab) order while `visit` says to go on.
    pub fn walk(&mut self, mut visit: impl FnMut(u32) -> bool) {
        for b in 0..self.starts.len() - 1 {
            let range = self.starts[b] as usize..self.starts[b + 1] as usize;
            if b >= self.sorted {
                let (seed, experts) = (self.seed, self.experts);
                let tie = |s: u16| seed.tie(u32::from(s) / experts, u32::from(s) % experts);
                self.slabs[range.clone()].sort_unstable_by_key(|&s| (tie(s), s));
                self.sorted = b + 1;
            }
            for &s in &self.slabs[range] {
                if !visit(u32::from(s)) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeswarm_protocol::{BlobId, ModelId, NodeKey};

    #[test]
    fn a_walk_visits_every_slab_once_in_tie_order_however_far_earlier_walks_went() {
        let seed = TieSeed::of(&NodeKey([3; 32]), &ModelId(BlobId::of(b"m")));
        let mut expected: Vec<u32> = (0..3000).collect();
        expected.sort_by_key(|&s| (seed.tie(s / 100, s % 100), s));
        let mut order = TieOrder::of(seed, 3000, 100).unwrap();
        for stop in [0, 1, 17, 500, 3000] {
            let mut seen = Vec::new();
            order.walk(|s| {
                seen.push(s);
                seen.len() < stop.max(1)
            });
            assert_eq!(seen[..], expected[..seen.len()]);
        }
        let mut all = Vec::new();
        order.walk(|s| {
            all.push(s);
            true
        });
        assert_eq!(all, expected);
    }
}
