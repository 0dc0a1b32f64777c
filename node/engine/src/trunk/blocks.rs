//! Building blocks every trunk architecture loads and runs its layers with.

use rayon::prelude::*;

use crate::error::{bail, Context, Result};
use moeswarm_model::gguf::MappedGguf;

use crate::ops::{dot, rms_norm_in_place, rope_neox, softmax_in_place};
use crate::projection::Projection;
use crate::quant::dequantize;
use moeswarm_protocol::HyperParams;

/// Refuses a tensor whose shape is not what the hyper-parameters imply (no panic later).
pub fn expect_dims(g: &MappedGguf, name: &str, want: &[u64]) -> Result<()> {
    let t = g.tensor(name)?;
    if t.dims != want {
        bail!(
            "{name} has shape {:?}, the model's hyper-parameters want {want:?}",
            t.dims
        );
    }
    Ok(())
}

/// A norm's weights, dequantized to f32.
pub fn norm_weights(g: &MappedGguf, name: &str) -> Result<Vec<f32>> {
    let t = g.tensor(name)?;
    dequantize(t.data, t.dtype, t.dims)
}

/// A projection, kept quantized.
pub fn matmul(g: &MappedGguf, name: &str) -> Result<Projection> {
    let t = g.tensor(name)?;
    Projection::in_file(g, t.data, t.dtype, t.dims).with_context(|| name.to_string())
}

/// `m · x` for rows `x` of width `n_in`.
pub fn project(m: &Projection, x: &[f32], n_in: usize) -> Result<Vec<f32>> {
    let [y] = project_all([m], x, n_in)?;
    Ok(y)
}

/// Each of `ms` applied to rows `x` of width `n_in`, in one pass over the threads.
pub fn project_all<const N: usize>(
    ms: [&Projection; N],
    x: &[f32],
    n_in: usize,
) -> Result<[Vec<f32>; N]> {
    if let Some(m) = ms.iter().find(|m| m.n_in() != n_in) {
        bail!(
            "a projection of input width {} given rows of {n_in}",
            m.n_in()
        );
    }
    Projection::apply_n(ms, x)
}

/// An attention layer's projections and per-head q/k norms, as both architectures store them.
pub struct AttentionWeights {
    /// Queries (in qwen35moe interleaved per head with the output gate).
    pub q: Projection,
    k: Projection,
    v: Projection,
    o: Projection,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

impl AttentionWeights {
    /// Layer `l`'s, shapes checked against `hyper`; the query projection has `q_factor` ×
    /// `n_head · head_dim` outputs (2 where it also carries an output gate).
    pub fn from_gguf(g: &MappedGguf, l: u32, hyper: &HyperParams, q_factor: u64) -> Result<Self> {
        let (e, d) = (hyper.n_embd as u64, hyper.head_dim as u64);
        let (q_w, kv_w) = (hyper.n_head as u64 * d, hyper.n_head_kv as u64 * d);
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        for (name, want) in [
            ("attn_q", vec![e, q_factor * q_w]),
            ("attn_k", vec![e, kv_w]),
            ("attn_v", vec![e, kv_w]),
            ("attn_output", vec![q_w, e]),
            ("attn_q_norm", vec![d]),
            ("attn_k_norm", vec![d]),
        ] {
            expect_dims(g, &n(name), &want)?;
        }
        Ok(Self {
            q: matmul(g, &n("attn_q"))?,
            k: matmul(g, &n("attn_k"))?,
            v: matmul(g, &n("attn_v"))?,
            o: matmul(g, &n("attn_output"))?,
            q_norm: norm_weights(g, &n("attn_q_norm"))?,
            k_norm: norm_weights(g, &n("attn_k_norm"))?,
        })
    }

    /// The query, key and value projections of rows `x`, in one pass.
    pub fn qkv(&self, x: &[f32], n_embd: usize) -> Result<[Vec<f32>; 3]> {
        project_all([&self.q, &self.k, &self.v], x, n_embd)
    }

    /// The heads' outputs for queries `q` (`[n_tok][n_head·d]`) and keys `k` and values `v`
    /// of the same rows (see [`AttentionWeights::qkv`]): q and the keys RMS-normed per head and rotated on their first `rope_dims` dims at
    /// positions `pos0..`, the keys and values appended to the cache `kc`, `vc`, then causal
    /// attention over it.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        mut q: Vec<f32>,
        mut k: Vec<f32>,
        v: Vec<f32>,
        kc: &mut Vec<f32>,
        vc: &mut Vec<f32>,
        pos0: usize,
        h: &HyperParams,
        rope_dims: usize,
    ) -> Result<Vec<f32>> {
        let d = h.head_dim as usize;
        let (n_head, n_kv) = (h.n_head as usize, h.n_head_kv as usize);
        let (q_w, kv_w) = (n_head * d, n_kv * d);
        rms_norm_in_place(&mut q, &self.q_norm, h.rms_eps);
        rms_norm_in_place(&mut k, &self.k_norm, h.rms_eps);
        for t in 0..q.len() / q_w {
            for head in q[t * q_w..(t + 1) * q_w].chunks_exact_mut(d) {
                rope_neox(&mut head[..rope_dims], pos0 + t, h.rope_freq_base);
            }
            for head in k[t * kv_w..(t + 1) * kv_w].chunks_exact_mut(d) {
                rope_neox(&mut head[..rope_dims], pos0 + t, h.rope_freq_base);
            }
        }
        kc.extend_from_slice(&k);
        vc.extend_from_slice(&v);
        Ok(causal_attention(&q, kc, vc, pos0, n_head, n_kv, d))
    }

    /// The output projection of the heads' outputs.
    pub fn output(&self, attn: &[f32]) -> Result<Vec<f32>> {
        project(&self.o, attn, self.o.n_in())
    }
}

/// Grouped-query causal softmax attention of rows `q` (`[n_tok][n_head·d]`, at positions
/// `pos0..`) over the cached keys and values of every position up to each row's own
/// (`[pos][n_kv·d]`), scaled by `1/sqrt(d)`: `[n_tok][n_head·d]`.
pub fn causal_attention(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    pos0: usize,
    n_head: usize,
    n_kv: usize,
    d: usize,
) -> Vec<f32> {
    let (q_w, kv_w) = (n_head * d, n_kv * d);
    let group = n_head / n_kv;
    let n_tok = q.len() / q_w;
    let scale = 1.0 / (d as f32).sqrt();
    let mut attn = vec![0f32; n_tok * q_w];
    // One (token, head) per task; each output is computed by one thread in one order.
    let one = |scores: &mut Vec<f32>, (i, out): (usize, &mut [f32])| {
        let (t, head) = (i / n_head, i % n_head);
        let p = pos0 + t;
        let kvh = head / group;
        let qv = &q[t * q_w + head * d..t * q_w + (head + 1) * d];
        scores.clear();
        scores.extend(
            (0..=p).map(|j| dot(qv, &kc[j * kv_w + kvh * d..j * kv_w + (kvh + 1) * d]) * scale),
        );
        softmax_in_place(scores);
        for (j, &sc) in scores.iter().enumerate() {
            let vr = &vc[j * kv_w + kvh * d..j * kv_w + (kvh + 1) * d];
            for (o, &vv) in out.iter_mut().zip(vr) {
                *o += sc * vv;
            }
        }
    };
    let scores = || Vec::with_capacity(pos0 + n_tok);
    if n_tok * n_head * (pos0 + n_tok) * d < 1 << 16 {
        let mut s = scores();
        attn.chunks_mut(d).enumerate().for_each(|c| one(&mut s, c));
    } else {
        attn.par_chunks_mut(d)
            .enumerate()
            .for_each_init(scores, one);
    }
    attn
}
