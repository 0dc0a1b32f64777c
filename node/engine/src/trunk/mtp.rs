//! The multi-token-prediction block (`nextn_predict_layers`, qwen35moe's `blk.L.nextn.*` with
//! `L` = the layers that run): it reads the main model's residual stream after its last layer
//! at position t and the embedding of token t + 1, and predicts token t + 2. As DeepSeek-V3
//! and Qwen3-Next define it:
//!
//! ```text
//! x      = eh_proj · [rms(embed(token t+1), enorm); rms(h_t, hnorm)]
//! x     += GatedAttention(rms(x, attn_norm))          its own KV cache, positions as the main model's
//! x     += MoE(rms(x, post_attention_norm)) + shared  its routed experts are slabs of layer L
//! logits = output · rms(x, shared_head_norm)
//! ```
//!
//! `x` before the head norm is the stream a chained draft feeds back as `h` for the token after.
//! This module holds the block's weights; the trunk runs it (its experts go through the same
//! executor as every layer's).

use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::qwen35::Qwen35Shape;
use moeswarm_protocol::HyperParams;

use super::blocks::{expect_dims, matmul, norm_weights};
use super::qwen35moe::{GatedAttention, SharedExpert, FFN_NORM};
use crate::error::Result;
use crate::layer::MoeGate;
use crate::projection::Projection;

/// One MTP block's weights.
pub struct MtpBlock {
    /// The block's index in the file: its experts are the slabs of this layer.
    pub(crate) layer: u32,
    pub(crate) enorm: Vec<f32>,
    pub(crate) hnorm: Vec<f32>,
    /// `[2·n_embd → n_embd]`: the normed embedding first, then the normed stream.
    pub(crate) eh_proj: Projection,
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) attention: GatedAttention,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate: MoeGate,
    pub(crate) shared: Option<SharedExpert>,
    pub(crate) head_norm: Vec<f32>,
}

impl MtpBlock {
    /// Block `l`'s tensors (a full-attention block with the `nextn.*` ones), shapes checked.
    pub fn from_gguf(g: &MappedGguf, l: u32, hyper: &HyperParams, q: &Qwen35Shape) -> Result<Self> {
        let e = hyper.n_embd as u64;
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        for t in [
            "nextn.enorm",
            "nextn.hnorm",
            "nextn.shared_head_norm",
            "attn_norm",
            FFN_NORM,
        ] {
            expect_dims(g, &n(t), &[e])?;
        }
        expect_dims(g, &n("nextn.eh_proj"), &[2 * e, e])?;
        expect_dims(g, &n("ffn_gate_inp"), &[e, hyper.n_expert as u64])?;
        Ok(Self {
            layer: l,
            enorm: norm_weights(g, &n("nextn.enorm"))?,
            hnorm: norm_weights(g, &n("nextn.hnorm"))?,
            eh_proj: matmul(g, &n("nextn.eh_proj"))?,
            attn_norm: norm_weights(g, &n("attn_norm"))?,
            attention: GatedAttention::from_gguf(g, l, hyper, q)?,
            ffn_norm: norm_weights(g, &n(FFN_NORM))?,
            gate: MoeGate::from_gguf(g, l, hyper.n_expert_used as usize)?,
            shared: SharedExpert::from_gguf(g, l, hyper)?,
            head_norm: norm_weights(g, &n("nextn.shared_head_norm"))?,
        })
    }

    /// The block's layer index (where its slabs are).
    pub fn layer(&self) -> u32 {
        self.layer
    }
}
