//! The float64 oracle: the MoE layer computed in f64 from weights dequantized by ggml's own
//! definition (candle's dequantizers, widened), with plain loops and no candle compute.
//!
//! Two flavours, by [`Rounding`]: `Exact` is the mathematical answer for the dequantized
//! weights; `LikeKernels` first rounds each matmul input the way the kernels do (the engine's
//! own, [`crate::kernels::act`], for the types they compute: Q8_0 or Q8_K blocks, f16/bf16
//! rounding; nothing for the types they compute on dequantized values), then computes in f64.
//! The second is what a correct quantized engine must reproduce closely; the first differs from any such engine by the activation quantization (about 1e-2).

use crate::error::Result;

use super::moe::{DispatchPlan, ExpertCompute, Routing};
use super::quant::dequantize;
use moeswarm_model::gguf::{GgmlType, RawTensor};
use moeswarm_model::SlabMatrix;

/// Widened dequantized values of a tensor, row-major.
pub fn dequantize_f64(t: &RawTensor<'_>) -> Result<Vec<f64>> {
    Ok(dequantize(t.data, t.dtype, t.dims)?
        .into_iter()
        .map(f64::from)
        .collect())
}

/// How matmul inputs are treated by the oracle (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// No rounding: exact math on the dequantized weights.
    Exact,
    /// Round inputs to the kernels' vec-dot block type first.
    LikeKernels,
}

/// `x` rounded as the kernel for weights of type `weight` rounds its input, per row of `n`
/// (see [`crate::kernels::act`]; types computed on their dequantized values take `x` as f32).
pub fn round_input(x: &[f64], n: usize, weight: GgmlType, rounding: Rounding) -> Result<Vec<f64>> {
    if rounding == Rounding::LikeKernels
        && crate::kernels::supports(weight)
        && n.is_multiple_of(crate::kernels::act::vec_dot_type(weight).block_size() as usize)
    {
        let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        return Ok(crate::kernels::act::prepare(weight, &xf, n).widened());
    }
    Ok(x.to_vec())
}

/// One expert in f64.
pub struct ExpertF64 {
    gate: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
    n_embd: usize,
    n_ff: usize,
    types: [GgmlType; 3],
    rounding: Rounding,
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl ExpertF64 {
    /// Dequantizes the expert's three matrices.
    pub fn new(m: &[SlabMatrix<'_>; 3], rounding: Rounding) -> Result<Self> {
        let deq = |m: &SlabMatrix<'_>| -> Result<Vec<f64>> {
            dequantize_f64(&RawTensor {
                dims: &m.dims,
                dtype: m.dtype,
                data: m.data,
            })
        };
        Ok(Self {
            gate: deq(&m[0])?,
            up: deq(&m[1])?,
            down: deq(&m[2])?,
            n_embd: m[0].dims[0] as usize,
            n_ff: m[0].dims[1] as usize,
            types: [m[0].dtype, m[1].dtype, m[2].dtype],
            rounding,
        })
    }

    /// One row: `down(silu(gate x) * up x)`.
    pub fn forward_row(&self, x: &[f64]) -> Result<Vec<f64>> {
        let (e, f) = (self.n_embd, self.n_ff);
        let xg = round_input(x, e, self.types[0], self.rounding)?;
        let xu = round_input(x, e, self.types[1], self.rounding)?;
        let h: Vec<f64> = (0..f)
            .map(|i| {
                silu(dot(&self.gate[i * e..(i + 1) * e], &xg))
                    * dot(&self.up[i * e..(i + 1) * e], &xu)
            })
            .collect();
        let h = round_input(&h, f, self.types[2], self.rounding)?;
        Ok((0..e)
            .map(|o| dot(&self.down[o * f..(o + 1) * f], &h))
            .collect())
    }
}

/// `γ · shared(x)` per row of `x`, `γ = σ(gate · x)`: a layer's shared expert in f64.
pub fn shared_expert_f64(
    t: &crate::trunk::qwen35moe::SharedTensors<'_>,
    x: &[f64],
    n_embd: usize,
    rounding: Rounding,
) -> Result<Vec<f64>> {
    let ffn = ExpertF64::new(&t.ffn, rounding)?;
    let gate = dequantize_f64(&t.gate)?;
    let xr = round_input(x, n_embd, t.gate.dtype, rounding)?;
    let mut out = Vec::with_capacity(x.len());
    for (row, row_r) in x.chunks_exact(n_embd).zip(xr.chunks_exact(n_embd)) {
        let gamma = 1.0 / (1.0 + (-dot(&gate, row_r)).exp());
        out.extend(ffn.forward_row(row)?.into_iter().map(|v| gamma * v));
    }
    Ok(out)
}

/// `W x` for a row-major `[n_out][n_in]` matrix and each row of `x`.
pub fn matvec_rows(w: &[f64], n_in: usize, x: &[f64]) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len() / n_in * (w.len() / n_in));
    for row in x.chunks_exact(n_in) {
        out.extend(w.chunks_exact(n_in).map(|wr| dot(wr, row)));
    }
    out
}

/// The MoE layer computed monolithically: each (token, slot) evaluated by its expert directly,
/// experts loaded one at a time by `load`, summed per token in slot order.
pub fn moe_monolithic(
    routing: &Routing<f64>,
    x: &[f64],
    n_embd: usize,
    mut load: impl FnMut(u32) -> Result<ExpertF64>,
) -> Result<Vec<f64>> {
    let k = routing.k;
    let mut y: Vec<Option<Vec<f64>>> = vec![None; routing.n_tokens * k];
    let mut used: Vec<u32> = routing.experts.clone();
    used.sort_unstable();
    used.dedup();
    for e in used {
        let expert = load(e)?;
        for (slot, _) in routing.experts.iter().enumerate().filter(|(_, &x)| x == e) {
            let t = slot / k;
            y[slot] = Some(expert.forward_row(&x[t * n_embd..(t + 1) * n_embd])?);
        }
    }
    let mut out = vec![0.0; routing.n_tokens * n_embd];
    for t in 0..routing.n_tokens {
        for j in 0..k {
            let w = routing.weights[t * k + j];
            let v = y[t * k + j].as_ref().expect("every slot computed");
            for (c, &yv) in v.iter().enumerate() {
                let term = w * yv;
                out[t * n_embd + c] = if j == 0 {
                    term
                } else {
                    out[t * n_embd + c] + term
                };
            }
        }
    }
    Ok(out)
}

/// An f64 executor that loads each expert when its group comes up (one in memory at a time).
pub struct LazyExpertsF64<F> {
    load: F,
}

impl<F: Fn(u32) -> Result<ExpertF64>> LazyExpertsF64<F> {
    /// An executor whose experts come from `load`.
    pub fn new(load: F) -> Self {
        Self { load }
    }
}

impl<F: Fn(u32) -> Result<ExpertF64>> ExpertCompute<f64> for LazyExpertsF64<F> {
    fn compute(&self, x: &[f64], n_embd: usize, plan: &DispatchPlan) -> Result<Vec<Vec<f64>>> {
        plan.groups
            .iter()
            .map(|g| {
                let expert = (self.load)(g.expert)?;
                let rows = plan.gather(g, x, n_embd);
                let mut out = Vec::with_capacity(rows.len());
                for r in rows.chunks_exact(n_embd) {
                    out.extend(expert.forward_row(r)?);
                }
                Ok(out)
            })
            .collect()
    }
}

/// max|a-b|, max|a-b| / max|b|, and cosine of two equally long vectors.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Agreement {
    /// Largest absolute difference.
    pub max_abs: f64,
    /// `max_abs` relative to the reference's largest magnitude.
    pub max_rel: f64,
    /// Cosine similarity.
    pub cosine: f64,
}

impl Agreement {
    /// Compares `a` against the reference `b`.
    pub fn of(a: &[f64], b: &[f64]) -> Self {
        assert_eq!(a.len(), b.len());
        let max_abs = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
        let (na, nb) = (dot(a, a).sqrt(), dot(b, b).sqrt());
        let cosine = if na == 0.0 && nb == 0.0 {
            1.0
        } else {
            dot(a, b) / (na * nb)
        };
        Self {
            max_abs,
            max_rel: if scale > 0.0 {
                max_abs / scale
            } else {
                max_abs
            },
            cosine,
        }
    }
}
