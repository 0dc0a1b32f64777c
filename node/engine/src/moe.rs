//! Gating, dispatch grouping and combine of a MoE layer, generic over f32 and f64.
//!
//! The math follows llama.cpp's qwen3moe: `p = softmax(router logits)` over all experts, the
//! top k of `p` by descending probability (ties to the lower index), weights
//! `p[top] / max(sum(p[top]), 6.103515625e-5)`, output `Σ_j w_j · expert_j(x)` summed in
//! slot order `j = 0..k`. That order is the canonical combine: a run whose experts are computed
//! anywhere, in any grouping, combines to the same bits.

use crate::error::{bail, Result};
use num_traits::Float;

/// The smallest weight sum llama.cpp divides by.
pub const MIN_WEIGHT_SUM: f64 = 6.103515625e-5;

/// The router's decision for a batch of tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing<T> {
    /// Tokens in the batch.
    pub n_tokens: usize,
    /// Experts per token.
    pub k: usize,
    /// `[token][slot]` expert ids, by descending probability.
    pub experts: Vec<u32>,
    /// `[token][slot]` combine weights.
    pub weights: Vec<T>,
    /// `[token][expert]` softmax probabilities.
    pub probs: Vec<T>,
}

impl<T: Copy> Routing<T> {
    /// The experts of token `t`.
    pub fn experts_of(&self, t: usize) -> &[u32] {
        &self.experts[t * self.k..(t + 1) * self.k]
    }

    /// The routing of the tokens in `rows` only (in that order), as if they were the batch.
    pub fn rows(&self, rows: &[std::ops::Range<usize>]) -> Self {
        let n_expert = self.probs.len() / self.n_tokens.max(1);
        Self {
            n_tokens: rows.iter().map(|r| r.len()).sum(),
            k: self.k,
            experts: gather_rows(&self.experts, rows, self.k),
            weights: gather_rows(&self.weights, rows, self.k),
            probs: gather_rows(&self.probs, rows, n_expert),
        }
    }
}

/// The rows `rows` of `v` (`[rows][width]`), one after another.
pub fn gather_rows<V: Copy>(v: &[V], rows: &[std::ops::Range<usize>], width: usize) -> Vec<V> {
    rows.iter()
        .flat_map(|r| v[r.start * width..r.end * width].iter().copied())
        .collect()
}

/// Softmax over each row of `logits` (`[n_tokens][n_expert]`), then top-k and weights.
pub fn route<T: Float>(logits: &[T], n_expert: usize, k: usize) -> Routing<T> {
    assert!(k >= 1 && k <= n_expert && logits.len().is_multiple_of(n_expert));
    let n_tokens = logits.len() / n_expert;
    let mut probs = Vec::with_capacity(logits.len());
    let mut experts = Vec::with_capacity(n_tokens * k);
    let mut weights = Vec::with_capacity(n_tokens * k);
    let min_sum = T::from(MIN_WEIGHT_SUM).expect("representable");
    for row in logits.chunks_exact(n_expert) {
        let max = row.iter().copied().fold(T::neg_infinity(), T::max);
        let exps: Vec<T> = row.iter().map(|&v| (v - max).exp()).collect();
        let sum: f64 = exps.iter().map(|e| e.to_f64().expect("finite")).sum();
        let scale = T::from(1.0 / sum).expect("representable");
        let p: Vec<T> = exps.iter().map(|&e| e * scale).collect();
        let mut order: Vec<u32> = (0..n_expert as u32).collect();
        order.sort_by(|&a, &b| {
            p[b as usize]
                .partial_cmp(&p[a as usize])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        let top = &order[..k];
        let total = top.iter().fold(T::zero(), |acc, &e| acc + p[e as usize]);
        let denom = total.max(min_sum);
        experts.extend_from_slice(top);
        weights.extend(top.iter().map(|&e| p[e as usize] / denom));
        probs.extend_from_slice(&p);
    }
    Routing {
        n_tokens,
        k,
        experts,
        weights,
        probs,
    }
}

/// The token rows one expert computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertRows {
    /// Expert id.
    pub expert: u32,
    /// Token indices, ascending.
    pub tokens: Vec<u32>,
}

/// Token rows grouped by expert: one group per expert used, experts ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchPlan {
    /// The groups.
    pub groups: Vec<ExpertRows>,
}

impl DispatchPlan {
    /// Groups a routing's (token, expert) pairs by expert.
    pub fn new<T: Copy>(routing: &Routing<T>) -> Self {
        let mut by_expert: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
        for t in 0..routing.n_tokens {
            for &e in routing.experts_of(t) {
                by_expert.entry(e).or_default().push(t as u32);
            }
        }
        Self {
            groups: by_expert
                .into_iter()
                .map(|(expert, tokens)| ExpertRows { expert, tokens })
                .collect(),
        }
    }

    /// The rows of `x` (`[n_tokens][n_embd]`) that group `g` computes, concatenated.
    pub fn gather<T: Copy>(&self, g: &ExpertRows, x: &[T], n_embd: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(g.tokens.len() * n_embd);
        for row in self.rows(g, x, n_embd) {
            out.extend_from_slice(row);
        }
        out
    }

    /// The rows of `x` (`[n_tokens][n_embd]`) that group `g` computes, one by one (for a
    /// caller that copies them somewhere of its own, once).
    pub fn rows<'x, T>(
        &self,
        g: &'x ExpertRows,
        x: &'x [T],
        n_embd: usize,
    ) -> impl Iterator<Item = &'x [T]> + 'x {
        g.tokens.iter().map(move |&t| {
            let t = t as usize;
            &x[t * n_embd..(t + 1) * n_embd]
        })
    }

    /// The plan restricted to some of its groups (what one worker is sent).
    pub fn subset(&self, keep: impl Fn(usize, &ExpertRows) -> bool) -> Self {
        Self {
            groups: self
                .groups
                .iter()
                .enumerate()
                .filter(|(i, g)| keep(*i, g))
                .map(|(_, g)| g.clone())
                .collect(),
        }
    }
}

/// Computes the unweighted outputs of one layer's experts in a plan, synchronously: for each
/// group, its rows' outputs `[rows][n_embd]`, in the group's token order. The trunk reaches
/// experts through the async [`super::ExpertExecutor`]; this is the per-layer compute under it
/// and the oracle's.
pub trait ExpertCompute<T> {
    /// `x`: the layer input `[n_tokens][n_embd]`.
    fn compute(&self, x: &[T], n_embd: usize, plan: &DispatchPlan) -> Result<Vec<Vec<T>>>;
}

/// Combines expert outputs into the layer output `[n_tokens][n_embd]`, in canonical order.
///
/// `outputs[i]` answers `plan.groups[i]`. Every (token, slot) must be answered; a missing or
/// misshapen output is an error, never a silently dropped expert.
pub fn combine<T: Float>(
    routing: &Routing<T>,
    plan: &DispatchPlan,
    outputs: &[Vec<T>],
    n_embd: usize,
) -> Result<Vec<T>> {
    if outputs.len() != plan.groups.len() {
        bail!(
            "{} expert outputs for {} groups",
            outputs.len(),
            plan.groups.len()
        );
    }
    for (g, o) in plan.groups.iter().zip(outputs) {
        if o.len() != g.tokens.len() * n_embd {
            bail!(
                "expert {} answered {} values for {} rows of {n_embd}",
                g.expert,
                o.len(),
                g.tokens.len()
            );
        }
    }
    let mut out = vec![T::zero(); routing.n_tokens * n_embd];
    for t in 0..routing.n_tokens {
        let acc = &mut out[t * n_embd..(t + 1) * n_embd];
        for (j, &e) in routing.experts_of(t).iter().enumerate() {
            let gi = plan
                .groups
                .binary_search_by_key(&e, |g| g.expert)
                .map_err(|_| {
                    crate::error::Error::invalid(format!(
                        "token {t} routed to expert {e}, which no group computes"
                    ))
                })?;
            let g = &plan.groups[gi];
            let row = g.tokens.binary_search(&(t as u32)).map_err(|_| {
                crate::error::Error::invalid(format!("expert {e} did not compute token {t}"))
            })?;
            let y = &outputs[gi][row * n_embd..(row + 1) * n_embd];
            let w = routing.weights[t * routing.k + j];
            if j == 0 {
                for (a, &v) in acc.iter_mut().zip(y) {
                    *a = w * v;
                }
            } else {
                for (a, &v) in acc.iter_mut().zip(y) {
                    *a = *a + w * v;
                }
            }
        }
    }
    Ok(out)
}

/// Runs the experts of a plan on several executors (as if on several workers) and combines:
/// group `i` goes to executor `assign(i)`.
pub fn run_split<T: Float, E: ExpertCompute<T>>(
    routing: &Routing<T>,
    x: &[T],
    n_embd: usize,
    executors: &[E],
    assign: impl Fn(usize) -> usize,
) -> Result<Vec<T>> {
    let plan = DispatchPlan::new(routing);
    let mut outputs: Vec<Option<Vec<T>>> = vec![None; plan.groups.len()];
    for (w, exec) in executors.iter().enumerate() {
        let idx: Vec<usize> = (0..plan.groups.len()).filter(|&i| assign(i) == w).collect();
        let sub = plan.subset(|i, _| assign(i) == w);
        for (i, o) in idx.into_iter().zip(exec.compute(x, n_embd, &sub)?) {
            outputs[i] = Some(o);
        }
    }
    let outputs: Option<Vec<Vec<T>>> = outputs.into_iter().collect();
    let outputs = outputs.ok_or_else(|| {
        crate::error::Error::invalid("some expert group was assigned to no executor")
    })?;
    combine(routing, &plan, &outputs, n_embd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A stand-in expert with exact, distinct outputs: y = (e + 1) * x.
    struct Scale;
    impl ExpertCompute<f64> for Scale {
        fn compute(&self, x: &[f64], n: usize, plan: &DispatchPlan) -> Result<Vec<Vec<f64>>> {
            Ok(plan
                .groups
                .iter()
                .map(|g| {
                    plan.gather(g, x, n)
                        .iter()
                        .map(|v| v * (g.expert as f64 + 1.0))
                        .collect()
                })
                .collect())
        }
    }

    proptest! {
        #[test]
        fn routing_picks_the_largest_and_weights_sum_to_one(
            logits in proptest::collection::vec(-8.0f64..8.0, 8 * 5), k in 1usize..8,
        ) {
            let r = route(&logits, 8, k);
            for t in 0..5 {
                let p = &r.probs[t * 8..(t + 1) * 8];
                prop_assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
                let chosen = r.experts_of(t);
                let min_chosen = chosen.iter().map(|&e| p[e as usize]).fold(f64::INFINITY, f64::min);
                for e in 0..8u32 {
                    if !chosen.contains(&e) {
                        prop_assert!(p[e as usize] <= min_chosen);
                    }
                }
                let w: f64 = r.weights[t * k..(t + 1) * k].iter().sum();
                prop_assert!((w - 1.0).abs() < 1e-12);
            }
        }

        #[test]
        fn any_split_combines_to_the_same_bits(
            x in proptest::collection::vec(-4.0f64..4.0, 6 * 3),
            logits in proptest::collection::vec(-8.0f64..8.0, 6 * 8),
            workers in 1usize..4, salt in any::<u64>(),
        ) {
            let r = route(&logits, 8, 3);
            let one = run_split(&r, &x, 3, &[Scale], |_| 0).unwrap();
            let execs: Vec<Scale> = (0..workers).map(|_| Scale).collect();
            let many = run_split(&r, &x, 3, &execs, |i| ((i as u64 ^ salt) % workers as u64) as usize).unwrap();
            prop_assert_eq!(one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            many.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            // And the canonical sum is Σ_j w_j (e_j + 1) x.
            for t in 0..6 {
                let s: f64 = (0..3).map(|j| r.weights[t * 3 + j] * (r.experts[t * 3 + j] as f64 + 1.0)).sum();
                for c in 0..3 {
                    prop_assert!((one[t * 3 + c] - s * x[t * 3 + c]).abs() < 1e-9);
                }
            }
        }
    }

    #[test]
    fn missing_or_misshapen_outputs_are_errors() {
        let r = route(&[0.0, 1.0, 2.0, 3.0], 4, 2);
        let plan = DispatchPlan::new(&r);
        assert!(combine(&r, &plan, &[], 2).is_err());
        let short = vec![vec![1.0]; plan.groups.len()];
        assert!(combine(&r, &plan, &short, 2).is_err());
    }

    #[test]
    fn tiny_weight_sums_are_clamped() {
        // Identical logits: every probability is 1/n; weights are p / max(sum, MIN).
        let r = route(&[0.0f64; 4], 4, 2);
        assert_eq!(r.experts, vec![0, 1]);
        assert!((r.weights[0] - 0.5).abs() < 1e-15);
    }
}
