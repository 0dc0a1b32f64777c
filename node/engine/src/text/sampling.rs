//! Choosing the next token from logits: greedy, or temperature with top-k, top-p and a
//! repetition penalty, from a seeded generator (the same seed gives the same text).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1.0: all).
    pub top_p: f32,
    /// llama.cpp's penalty: a seen token's positive logit is divided by it, a negative one
    /// multiplied (1.0: off).
    pub repetition_penalty: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl SamplingConfig {
    /// Checks every parameter, naming the one that is wrong: a temperature that is finite and
    /// not negative, a top-p in (0, 1], a repetition penalty that is finite and positive.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature {} is not a number ≥ 0 (0: greedy)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p {} is outside (0, 1]", self.top_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(format!(
                "repetition penalty {} is not a number > 0 (1: off)",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

/// A sampler with its generator state.
pub struct Sampler {
    config: SamplingConfig,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler for `config`.
    pub fn new(config: SamplingConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Self { config, rng }
    }

    /// The next token, given one position's logits and the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let (order, probs) = match self.candidates(logits, history) {
            Candidates::Greedy(t) => return t,
            Candidates::Weighted { order, probs } => (order, probs),
        };
        self.draw(&order, &probs)
    }

    /// Speculative sampling's test of a drafted token (drafted deterministically, so its
    /// draft probability is 1): kept with the model's probability of it, else replaced by a
    /// draw from the model's distribution without it. Either way the token that comes out is
    /// distributed exactly as [`Sampler::sample`]'s. Greedy: kept when it is the argmax.
    /// `Ok(())` when kept, `Err(token)` with the replacement when not.
    pub fn check_draft(&mut self, logits: &[f32], history: &[u32], draft: u32) -> Result<(), u32> {
        let (order, mut probs) = match self.candidates(logits, history) {
            Candidates::Greedy(t) if t == draft => return Ok(()),
            Candidates::Greedy(t) => return Err(t),
            Candidates::Weighted { order, probs } => (order, probs),
        };
        let total: f64 = probs.iter().sum();
        let at = order.iter().position(|&t| t == draft as usize);
        let p = at.map_or(0.0, |i| probs[i] / total);
        if self.rng.random::<f64>() < p {
            return Ok(());
        }
        if let Some(i) = at {
            probs[i] = 0.0;
        }
        Err(self.draw(&order, &probs))
    }

    /// The tokens the configuration lets through, with their weights.
    fn candidates(&self, logits: &[f32], history: &[u32]) -> Candidates {
        let c = &self.config;
        let mut l = logits.to_vec();
        if c.repetition_penalty != 1.0 {
            for &t in history {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = if *v > 0.0 {
                        *v / c.repetition_penalty
                    } else {
                        *v * c.repetition_penalty
                    };
                }
            }
        }
        if c.temperature <= 0.0 {
            let argmax = l
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map(|(i, _)| i as u32)
                .unwrap_or(0);
            return Candidates::Greedy(argmax);
        }
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        if c.top_k > 0 {
            order.truncate(c.top_k);
        }
        let max = l[order[0]];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| (((l[i] - max) / c.temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    acc += p;
                    acc >= c.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
        }
        Candidates::Weighted { order, probs }
    }

    /// A draw from `order` weighted by `probs` (not necessarily summing to 1).
    fn draw(&mut self, order: &[usize], probs: &[f64]) -> u32 {
        let total: f64 = probs.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (i, p) in probs.iter().enumerate() {
            r -= p;
            if r <= 0.0 && *p > 0.0 {
                return order[i] as u32;
            }
        }
        let last = probs
            .iter()
            .rposition(|&p| p > 0.0)
            .unwrap_or(probs.len() - 1);
        order[last] as u32
    }
}

/// What a position's logits allow after the sampling configuration.
enum Candidates {
    /// Temperature 0: this token.
    Greedy(u32),
    /// Tokens by descending weight, and their weights.
    Weighted { order: Vec<usize>, probs: Vec<f64> },
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn samples_stay_inside_top_k_and_greedy_is_argmax(
            logits in proptest::collection::vec(-10.0f32..10.0, 2..64), k in 1usize..8, seed in any::<u64>(),
        ) {
            let mut greedy = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
            let best = greedy.sample(&logits, &[]) as usize;
            prop_assert!(logits.iter().all(|&v| v <= logits[best]));
            let mut s = Sampler::new(SamplingConfig { temperature: 0.8, top_k: k, top_p: 1.0, seed, ..Default::default() });
            let mut sorted = logits.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let kth = sorted[k.min(sorted.len()) - 1];
            for _ in 0..8 {
                prop_assert!(logits[s.sample(&logits, &[]) as usize] >= kth);
            }
        }

        #[test]
        fn the_same_seed_gives_the_same_tokens(logits in proptest::collection::vec(-3.0f32..3.0, 2..64), seed in any::<u64>()) {
            let cfg = SamplingConfig { temperature: 1.0, top_k: 0, top_p: 0.9, seed, ..Default::default() };
            let (mut a, mut b) = (Sampler::new(cfg.clone()), Sampler::new(cfg));
            for _ in 0..8 {
                prop_assert_eq!(a.sample(&logits, &[]), b.sample(&logits, &[]));
            }
        }
    }

    #[test]
    fn a_checked_draft_comes_out_distributed_as_the_model_samples() {
        // Softmax of these logits at temperature 1 (all tokens, no top-p).
        let logits = [1.0f32, 0.5, 0.0, -0.5, -2.0];
        let max = 1.0f64;
        let w: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let want: Vec<f64> = w.iter().map(|x| x / total).collect();
        let cfg = SamplingConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 7,
            ..Default::default()
        };
        let n = 200_000;
        for draft in [0u32, 2, 4] {
            let mut s = Sampler::new(cfg.clone());
            let mut counts = [0usize; 5];
            let mut kept = 0;
            for _ in 0..n {
                let t = match s.check_draft(&logits, &[], draft) {
                    Ok(()) => {
                        kept += 1;
                        draft
                    }
                    Err(t) => {
                        assert_ne!(t, draft, "a rejected draft is never the replacement");
                        t
                    }
                };
                counts[t as usize] += 1;
            }
            let kept = kept as f64 / n as f64;
            assert!((kept - want[draft as usize]).abs() < 0.005, "kept {kept}");
            // Chi-square against the softmax, 4 degrees of freedom: under 13.28 is p > 0.01.
            let chi2: f64 = counts
                .iter()
                .zip(&want)
                .map(|(&c, p)| (c as f64 - p * n as f64).powi(2) / (p * n as f64))
                .sum();
            assert!(
                chi2 < 13.28,
                "draft {draft}: chi-square {chi2}, counts {counts:?}"
            );
        }
        // Greedy: kept exactly when it is the argmax.
        let mut g = Sampler::new(SamplingConfig::default());
        assert_eq!(g.check_draft(&logits, &[], 0), Ok(()));
        assert_eq!(g.check_draft(&logits, &[], 3), Err(0));
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplingConfig {
            repetition_penalty: 4.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[2.0, 1.0, -1.0], &[0]), 1);
        assert_eq!(s.sample(&[2.0, 1.0, -1.0], &[]), 0);
    }
}
