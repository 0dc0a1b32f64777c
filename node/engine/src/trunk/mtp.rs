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

use std::sync::atomic::Ordering;
use std::time::Instant;

use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::qwen35::Qwen35Shape;
use moeswarm_protocol::HyperParams;

use super::blocks::{expect_dims, matmul, norm_weights, project};
use super::qwen35moe::{GatedAttention, SharedExpert, FFN_NORM};
use super::{FfnParts, ForwardTiming, KvCache, NoProbe, Trunk};
use crate::error::Context;
use crate::error::{bail, Result};
use crate::executor::ExpertExecutor;
use crate::kernels::on_pool;
use crate::layer::MoeGate;
use crate::ops::rms_norm;
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
}

/// What the MTP block gives for its rows.
#[derive(Debug, Clone)]
pub struct MtpOutput {
    /// `[rows][n_vocab]`: each row's logits for the token after next.
    pub logits: Vec<f32>,
    /// `[rows][n_embd]`: the block's stream before its head norm, the `hidden` of a chained
    /// draft's next row.
    pub hidden: Vec<f32>,
}

impl Trunk {
    /// Keeps the first `keep` positions of the MTP block's cache (a chained draft's rows
    /// dropped).
    pub fn mtp_truncate(&self, cache: &mut KvCache, keep: usize) {
        let keep = keep.min(cache.mtp_len);
        cache.mtp.truncate_kv(keep, self.kv_width());
        cache.mtp_len = keep;
    }

    /// Whether the model has an MTP block this trunk runs.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Runs the MTP block over rows at its next positions: row i reads `hidden` row i (the
    /// main model's stream at position `cache.mtp_len() + i`, or a chained draft's) and the
    /// embedding of `next[i]` (the token after that position), and predicts the token after
    /// `next[i]`. Its keys and values go to `cache`'s MTP part.
    pub async fn mtp_forward(
        &self,
        cache: &mut KvCache,
        hidden: &[f32],
        next: &[u32],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
    ) -> Result<MtpOutput> {
        let m = self.mtp.as_ref().context("this model has no MTP block")?;
        let h = &self.hyper;
        let n_embd = h.n_embd as usize;
        if hidden.len() != next.len() * n_embd {
            bail!(
                "{} hidden values for {} MTP rows of {n_embd}",
                hidden.len(),
                next.len()
            );
        }
        let step = self.steps.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let (hn, routing, mut x) = on_pool(|| -> Result<_> {
            let e = rms_norm(&self.embed(next)?, &m.enorm, h.rms_eps);
            let hs = rms_norm(hidden, &m.hnorm, h.rms_eps);
            let mut both = Vec::with_capacity(2 * e.len());
            for (er, hr) in e.chunks_exact(n_embd).zip(hs.chunks_exact(n_embd)) {
                both.extend_from_slice(er);
                both.extend_from_slice(hr);
            }
            let mut x = project(&m.eh_proj, &both, 2 * n_embd)?;
            let a = rms_norm(&x, &m.attn_norm, h.rms_eps);
            let o = m.attention.forward(&a, &mut cache.mtp, cache.mtp_len, h)?;
            for (xv, ov) in x.iter_mut().zip(&o) {
                *xv += ov;
            }
            let hn = rms_norm(&x, &m.ffn_norm, h.rms_eps);
            let routing = m.gate.route(&hn, n_embd)?;
            Ok((hn, routing, x))
        })?;
        timing.attention += t0.elapsed();
        let ffn = FfnParts {
            layer: m.layer,
            shared: m.shared.as_ref(),
        };
        let moe = self
            .experts(ffn, step, &hn, &routing, exec, timing, &mut NoProbe)
            .await?;
        for (xv, mv) in x.iter_mut().zip(&moe) {
            *xv += mv;
        }
        cache.mtp_len += next.len();
        let t0 = Instant::now();
        let logits = project(&self.output, &rms_norm(&x, &m.head_norm, h.rms_eps), n_embd)?;
        timing.head += t0.elapsed();
        Ok(MtpOutput { logits, hidden: x })
    }
}
