//! Which experts a token goes to: a skewed distribution per layer, as a trained model's
//! routing is (a few experts of each layer take most tokens).
//!
//! Each layer ranks its experts in an order of its own, drawn once from the seed, and picks
//! each of a token's experts with weight `1 / rank^s` (Zipf; `s = 0` is uniform) among those
//! not yet picked for that token: `k` distinct experts, as top-k routing gives. Pure: the
//! draws come from the caller's generator.

use rand::seq::SliceRandom;
use rand::Rng;

/// The routing of a model: per layer, its experts' cumulative weights in rank order.
#[derive(Debug, Clone)]
pub struct Routing {
    experts: u32,
    /// Per layer: expert of each rank.
    order: Vec<Vec<u32>>,
    /// Per layer: cumulative weight up to and including each rank.
    cumulative: Vec<Vec<f64>>,
}

impl Routing {
    /// `layers × experts`, skew `s`, each layer's order drawn from `rng`.
    pub fn new(layers: u32, experts: u32, s: f64, rng: &mut impl Rng) -> Self {
        let mut order = Vec::with_capacity(layers as usize);
        let mut cumulative = Vec::with_capacity(layers as usize);
        for _ in 0..layers {
            let mut o: Vec<u32> = (0..experts).collect();
            o.shuffle(rng);
            order.push(o);
            let mut acc = 0.0;
            cumulative.push(
                (0..experts)
                    .map(|r| {
                        acc += weight(r, s);
                        acc
                    })
                    .collect(),
            );
        }
        Self {
            experts,
            order,
            cumulative,
        }
    }

    /// The share of a layer's picks that goes to its expert of rank `rank` when one expert
    /// is picked per token (rank 0: the most chosen).
    pub fn share(&self, layer: usize, rank: usize) -> f64 {
        let c = &self.cumulative[layer];
        let below = if rank == 0 { 0.0 } else { c[rank - 1] };
        (c[rank] - below) / c[c.len() - 1]
    }

    /// The expert of rank `rank` in `layer`.
    pub fn expert_of_rank(&self, layer: usize, rank: usize) -> u32 {
        self.order[layer][rank]
    }

    /// `k` distinct experts of `layer` for one token, appended to `out` (all of them when `k`
    /// is not below the layer's experts).
    pub fn pick(&self, layer: usize, k: u32, rng: &mut impl Rng, out: &mut Vec<u32>) {
        let start = out.len();
        if k >= self.experts {
            out.extend(0..self.experts);
            return;
        }
        let c = &self.cumulative[layer];
        let total = c[c.len() - 1];
        // Drawing again on a repeat is exact sampling without replacement, and cheap while
        // the chosen few hold little of the weight; past a bound, draw from what is left.
        let mut tries = 0;
        while out.len() - start < k as usize && tries < 16 * k {
            tries += 1;
            let x = rng.random::<f64>() * total;
            let rank = c.partition_point(|&w| w <= x).min(c.len() - 1);
            let e = self.order[layer][rank];
            if !out[start..].contains(&e) {
                out.push(e);
            }
        }
        while out.len() - start < k as usize {
            let left: Vec<usize> = (0..c.len())
                .filter(|&r| !out[start..].contains(&self.order[layer][r]))
                .collect();
            let w = |r: usize| c[r] - if r == 0 { 0.0 } else { c[r - 1] };
            let sum: f64 = left.iter().map(|&r| w(r)).sum();
            let mut x = rng.random::<f64>() * sum;
            let mut chosen = left[left.len() - 1];
            for &r in &left {
                if x < w(r) {
                    chosen = r;
                    break;
                }
                x -= w(r);
            }
            out.push(self.order[layer][chosen]);
        }
    }
}

/// The weight of rank `r` (from 0) under skew `s`.
fn weight(r: u32, s: f64) -> f64 {
    (r as f64 + 1.0).powf(-s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    proptest! {
        #[test]
        fn a_token_gets_k_distinct_experts_of_the_layer(
            seed in any::<u64>(), experts in 1u32..64, k in 1u32..12, s in 0.0f64..3.0,
        ) {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let r = Routing::new(3, experts, s, &mut rng);
            for layer in 0..3 {
                let mut out = Vec::new();
                r.pick(layer, k, &mut rng, &mut out);
                prop_assert_eq!(out.len(), k.min(experts) as usize);
                let mut sorted = out.clone();
                sorted.sort_unstable();
                sorted.dedup();
                prop_assert_eq!(sorted.len(), out.len(), "distinct");
                prop_assert!(out.iter().all(|&e| e < experts));
            }
        }
    }

    #[test]
    fn picks_follow_the_ranks_weights() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let r = Routing::new(2, 64, 1.0, &mut rng);
        let mut counts = [0u32; 64];
        let n = 40_000;
        for _ in 0..n {
            let mut out = Vec::new();
            r.pick(1, 1, &mut rng, &mut out);
            counts[out[0] as usize] += 1;
        }
        for rank in [0, 1, 7, 63] {
            let e = r.expert_of_rank(1, rank) as usize;
            let want = r.share(1, rank) * n as f64;
            let got = counts[e] as f64;
            // Within five standard deviations of the binomial count.
            let sd = (want * (1.0 - r.share(1, rank))).sqrt();
            assert!(
                (got - want).abs() < 5.0 * sd + 1.0,
                "rank {rank}: {got} vs {want}"
            );
        }
        assert!(r.share(1, 0) > 4.0 * r.share(1, 7), "skewed");
        // Layers rank their experts differently.
        assert_ne!(r.order[0], r.order[1]);
    }

    #[test]
    fn a_hot_layer_still_gives_eight_distinct_experts_of_sixteen() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let r = Routing::new(1, 16, 3.0, &mut rng);
        let mut out = Vec::new();
        r.pick(0, 15, &mut rng, &mut out);
        let mut s = out.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 15);
    }
}
