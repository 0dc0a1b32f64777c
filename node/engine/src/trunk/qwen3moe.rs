//! qwen3moe's attention: per-head RMS-normed q and k, NEOX RoPE, grouped-query causal
//! attention over an f32 KV cache, as llama.cpp computes it.

use crate::error::{bail, Result};
use crate::projection::Projection;
use moeswarm_model::gguf::MappedGguf;
use moeswarm_protocol::HyperParams;

use super::blocks::{causal_attention, expect_dims, matmul, norm_weights, project};
use crate::ops::{rms_norm_in_place, rope_neox};

/// One layer's attention weights.
pub struct Attention {
    q: Projection,
    k: Projection,
    v: Projection,
    o: Projection,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

impl Attention {
    /// Refuses hyper-parameters that are not a grouped-query shape with even heads.
    pub fn check_shape(hyper: &HyperParams) -> Result<()> {
        let hd = hyper.head_dim as u64;
        if hyper.n_head_kv == 0
            || !hyper.n_head.is_multiple_of(hyper.n_head_kv)
            || !hd.is_multiple_of(2)
        {
            bail!(
                "{} heads over {} kv heads of size {hd}: not a grouped-query shape with even heads",
                hyper.n_head,
                hyper.n_head_kv
            );
        }
        Ok(())
    }

    /// Layer `l`'s attention tensors, their shapes checked against `hyper`.
    pub fn from_gguf(g: &MappedGguf, l: u32, hyper: &HyperParams) -> Result<Self> {
        let (e, hd) = (hyper.n_embd as u64, hyper.head_dim as u64);
        let (q_w, kv_w) = (hyper.n_head as u64 * hd, hyper.n_head_kv as u64 * hd);
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        for (name, want) in [
            ("attn_q", vec![e, q_w]),
            ("attn_k", vec![e, kv_w]),
            ("attn_v", vec![e, kv_w]),
            ("attn_output", vec![q_w, e]),
            ("attn_q_norm", vec![hd]),
            ("attn_k_norm", vec![hd]),
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

    /// The attention output (before the residual) for rows `x` (already normed) at positions `pos0..`,
    /// appending their keys and values to the layer's cache `kc`, `vc`.
    pub fn forward(
        &self,
        x: &[f32],
        kc: &mut Vec<f32>,
        vc: &mut Vec<f32>,
        pos0: usize,
        h: &HyperParams,
    ) -> Result<Vec<f32>> {
        let (n_embd, hd) = (h.n_embd as usize, h.head_dim as usize);
        let (n_head, n_kv) = (h.n_head as usize, h.n_head_kv as usize);
        let (q_w, kv_w) = (n_head * hd, n_kv * hd);
        let n_tok = x.len() / n_embd;
        let mut q = project(&self.q, x, n_embd)?;
        let mut k = project(&self.k, x, n_embd)?;
        let v = project(&self.v, x, n_embd)?;
        rms_norm_in_place(&mut q, &self.q_norm, h.rms_eps);
        rms_norm_in_place(&mut k, &self.k_norm, h.rms_eps);
        for t in 0..n_tok {
            for head in q[t * q_w..(t + 1) * q_w].chunks_exact_mut(hd) {
                rope_neox(head, pos0 + t, h.rope_freq_base);
            }
            for head in k[t * kv_w..(t + 1) * kv_w].chunks_exact_mut(hd) {
                rope_neox(head, pos0 + t, h.rope_freq_base);
            }
        }
        kc.extend_from_slice(&k);
        vc.extend_from_slice(&v);
        let attn = causal_attention(&q, kc, vc, pos0, n_head, n_kv, hd);
        project(&self.o, &attn, q_w)
    }
}
