//! qwen3moe's attention: per-head RMS-normed q and k, NEOX RoPE, grouped-query causal
//! attention over an f32 KV cache, as llama.cpp computes it.

use crate::error::{bail, Result};
use moeswarm_model::gguf::MappedGguf;
use moeswarm_protocol::HyperParams;

use super::blocks::AttentionWeights;

/// One layer's attention weights.
pub struct Attention(AttentionWeights);

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
        Ok(Self(AttentionWeights::from_gguf(g, l, hyper, 1)?))
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
        let [q, k, v] = self.0.qkv(x, h.n_embd as usize)?;
        let attn = self
            .0
            .attend(q, k, v, kc, vc, pos0, h, h.head_dim as usize)?;
        self.0.output(&attn)
    }
}
