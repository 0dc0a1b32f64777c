//! What the nodes know of each other: the holdings records that have reached them (kept in the
//! market's own [`CoverageMap`], with its rules for newer, expired and misshapen records) and
//! which nodes they count as live, folded into one index of live holders per slab.
//!
//! One view serves every node: a record reaches all of them after the same gossip delay, drawn
//! per record (the simulator does not model who hears what first), and a node is counted dead
//! by all at the same moment, [`super::scenario::Market::live_for_secs`] after its last
//! heartbeat. Each change bumps an epoch, so that a node can tell nothing has changed since it
//! last found nothing to do.

use moeswarm_market::coverage::CoverageMap;
use moeswarm_protocol::{Holdings, ModelId, NodeKey};

use super::quick::Counts;

/// The shared view. Nodes are named by their index; `keys[i]` is node `i`'s key.
pub struct View {
    coverage: CoverageMap,
    keys: Vec<NodeKey>,
    by_key: std::collections::HashMap<NodeKey, usize>,
    experts: u32,
    /// Whether each node is counted live.
    live: Vec<bool>,
    /// The slabs each node counts as holding in `holders` now (its record's, while live).
    counted: Vec<Vec<u32>>,
    /// Live holders of each slab, by node index, ascending.
    holders: Vec<Vec<u32>>,
    /// The slabs by how many live holders they have.
    counts: Counts,
    /// What changed in `counted` since the last [`View::take_changes`]: (node, slab, whether
    /// it came or left).
    changes: Vec<(u32, u32, bool)>,
    epoch: u64,
}

impl View {
    /// An empty view of a model of `layers × experts` slabs among the nodes `keys`.
    pub fn new(model: ModelId, layers: u32, experts: u32, keys: Vec<NodeKey>) -> Self {
        let slabs = layers as usize * experts as usize;
        let by_key = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        Self {
            coverage: CoverageMap::new(model, layers, experts),
            live: vec![false; keys.len()],
            counted: vec![Vec::new(); keys.len()],
            keys,
            by_key,
            experts,
            holders: vec![Vec::new(); slabs],
            counts: Counts::new(slabs),
            changes: Vec::new(),
            epoch: 0,
        }
    }

    /// Bumped by every change of who is counted as holding what.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Live holders of slab `s`, by node index.
    pub fn holders(&self, s: usize) -> &[u32] {
        &self.holders[s]
    }

    /// Live holders of slab `s`, by key.
    pub fn holder_keys(&self, s: usize) -> Vec<NodeKey> {
        self.holders[s]
            .iter()
            .map(|&i| self.keys[i as usize])
            .collect()
    }

    /// The slabs by how many live holders they have.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// The slabs node `i` is counted as holding, ascending.
    pub fn counted(&self, i: usize) -> &[u32] {
        &self.counted[i]
    }

    /// The changes to what nodes are counted as holding since the last call: (node, slab,
    /// whether it came or left), in the order they happened.
    pub fn take_changes(&mut self) -> Vec<(u32, u32, bool)> {
        std::mem::take(&mut self.changes)
    }

    /// The live nodes with a record (those a node's market round knows of).
    pub fn known(&self) -> impl Iterator<Item = NodeKey> + '_ {
        self.coverage
            .nodes()
            .map(|h| h.node)
            .filter(|k| self.by_key.get(k).is_some_and(|&i| self.live[i]))
    }

    /// A record arrives at `now` (unix-like seconds of the simulation); whether it was
    /// applied (an older one arriving after a newer one is not).
    pub fn arrive(&mut self, record: Holdings, now: u64) -> bool {
        let Some(&i) = self.by_key.get(&record.node) else {
            return false;
        };
        if self.coverage.apply(record, now).is_err() {
            return false;
        }
        self.recount(i);
        true
    }

    /// Node `i` counted live or dead from now.
    pub fn set_live(&mut self, i: usize, live: bool) {
        if self.live[i] != live {
            self.live[i] = live;
            self.recount(i);
        }
    }

    /// Drops the records expired at `now`.
    pub fn expire(&mut self, now: u64) {
        let gone: Vec<usize> = self
            .coverage
            .nodes()
            .filter(|h| h.expires_at <= now)
            .filter_map(|h| self.by_key.get(&h.node).copied())
            .collect();
        if gone.is_empty() {
            return;
        }
        self.coverage.expire(now);
        for i in gone {
            self.recount(i);
        }
    }

    /// Brings node `i`'s entries in the holder index in line with its record and liveness.
    fn recount(&mut self, i: usize) {
        let now: Vec<u32> = match (self.live[i], self.coverage.record(&self.keys[i])) {
            (true, Some(h)) => held_slabs(h, self.experts),
            _ => Vec::new(),
        };
        let before = std::mem::take(&mut self.counted[i]);
        let (mut a, mut b) = (0, 0);
        let mut changed = false;
        // Both ascending: a merge walk finds what left and what came.
        while a < before.len() || b < now.len() {
            let (x, y) = (before.get(a).copied(), now.get(b).copied());
            if x.is_some() && x == y {
                a += 1;
                b += 1;
            } else if let Some(x) = x.filter(|&x| y.is_none_or(|y| x < y)) {
                self.remove(x as usize, i);
                changed = true;
                a += 1;
            } else if let Some(y) = y {
                self.insert(y as usize, i);
                changed = true;
                b += 1;
            }
        }
        self.counted[i] = now;
        if changed {
            self.epoch += 1;
        }
    }

    fn insert(&mut self, s: usize, i: usize) {
        let list = &mut self.holders[s];
        if let Err(at) = list.binary_search(&(i as u32)) {
            list.insert(at, i as u32);
            self.counts.up(s as u32);
            self.changes.push((i as u32, s as u32, true));
        }
    }

    fn remove(&mut self, s: usize, i: usize) {
        let list = &mut self.holders[s];
        if let Ok(at) = list.binary_search(&(i as u32)) {
            list.remove(at);
            self.counts.down(s as u32);
            self.changes.push((i as u32, s as u32, false));
        }
    }
}

impl super::quick::Holders for View {
    fn of(&self, s: u32) -> Vec<NodeKey> {
        self.holder_keys(s as usize)
    }
}

/// The slabs a record names, as indices `layer × experts + expert`, ascending.
pub fn held_slabs(h: &Holdings, experts: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for (l, bits) in h.layers.iter().enumerate() {
        // Eight bytes at a time: most of a record's words are empty.
        for (w, chunk) in bits.0.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            let mut b = u64::from_le_bytes(word);
            while b != 0 {
                let e = w as u32 * 64 + b.trailing_zeros();
                b &= b - 1;
                if e < experts {
                    out.push(l as u32 * experts + e);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeswarm_protocol::holdings::LayerBits;
    use moeswarm_protocol::{BlobId, Reach};

    fn record(node: NodeKey, slabs: &[u32], seq: u64) -> Holdings {
        let mut layers = vec![LayerBits::empty(8); 2];
        for &s in slabs {
            layers[(s / 8) as usize].set(s % 8);
        }
        Holdings {
            model: ModelId(BlobId::of(b"m")),
            node,
            n_expert: 8,
            layers,
            used_bytes: 0,
            free_bytes: 0,
            addrs: Vec::new(),
            reach: Reach::Direct,
            seq,
            expires_at: 100,
        }
    }

    #[test]
    fn holders_are_the_live_nodes_whose_newest_unexpired_record_names_the_slab() {
        let keys = vec![NodeKey([1; 32]), NodeKey([2; 32])];
        let mut v = View::new(ModelId(BlobId::of(b"m")), 2, 8, keys.clone());
        assert!(v.arrive(record(keys[0], &[1, 9], 1), 10));
        assert!(v.holders(1).is_empty(), "not live yet");
        v.set_live(0, true);
        assert_eq!((v.holders(1), v.holders(9)), (&[0u32][..], &[0u32][..]));
        let e = v.epoch();
        assert!(!v.arrive(record(keys[0], &[2], 1), 10), "not newer");
        assert!(v.arrive(record(keys[0], &[2, 9], 2), 10));
        assert!(v.holders(1).is_empty() && v.holders(2) == [0] && v.holders(9) == [0]);
        assert!(v.epoch() > e);
        v.set_live(1, true);
        assert!(v.arrive(record(keys[1], &[9], 1), 10));
        assert_eq!(v.holders(9), &[0, 1]);
        assert_eq!(v.holder_keys(9), keys);
        v.set_live(0, false);
        assert_eq!(v.holders(9), &[1], "dead: not counted");
        v.expire(100);
        assert!(v.holders(9).is_empty(), "expired");
        assert_eq!(v.known().count(), 0);
        assert_eq!(
            held_slabs(&record(keys[0], &[0, 7, 8, 15], 1), 8),
            vec![0, 7, 8, 15]
        );
    }
}
