//! qwen35moe's two token mixers, as llama.cpp computes them: the Gated DeltaNet (linear
//! attention with a recurrent state per head, after a short causal convolution) and gated full
//! attention (partial rotary, per-head q/k norms, a sigmoid output gate); and the shared expert
//! every layer adds to its routed ones.
//!
//! The math is the reference README's (`node/testkit/data/qwen35moe/README.md`); projections
//! stay quantized ([`Projection`], which rounds their inputs the way ggml does), everything
//! else is f32.

use rayon::prelude::*;

use crate::projection::Projection;
use moeswarm_model::gguf::{MappedGguf, RawTensor};
use moeswarm_model::qwen35::Qwen35Shape;
use moeswarm_model::SlabMatrix;
use moeswarm_protocol::HyperParams;

use super::blocks::{expect_dims, matmul, norm_weights, project, project_all, AttentionWeights};
use super::{LayerCache, Tap};
use crate::error::{bail, Result};
use crate::expert::ExpertWeights;
use crate::ops::{dot, rms_norm_in_place};

fn sigmoid(u: f32) -> f32 {
    1.0 / (1.0 + (-u).exp())
}

fn silu(u: f32) -> f32 {
    u / (1.0 + (-u).exp())
}

/// `ln(1 + e^u)`, `u` itself past 20 (as llama.cpp).
fn softplus(u: f32) -> f32 {
    if u > 20.0 {
        u
    } else {
        u.exp().ln_1p()
    }
}

/// Scales each head of `S` values to unit L2 norm (eps added to the sum of squares).
fn l2_norm_heads(x: &mut [f32], s: usize, eps: f32) {
    for head in x.chunks_exact_mut(s) {
        let sum: f32 = head.iter().map(|v| v * v).sum();
        let inv = 1.0 / (sum + eps).sqrt();
        for v in head {
            *v *= inv;
        }
    }
}

/// The sizes a DeltaNet layer computes with.
#[derive(Debug, Clone, Copy)]
struct DeltaSizes {
    /// Head dim of q, k and v.
    s: usize,
    /// q/k heads.
    hk: usize,
    /// v heads.
    hv: usize,
    /// Conv window.
    kc: usize,
    /// Conv channels.
    c: usize,
}

/// One Gated DeltaNet layer's weights.
pub struct DeltaNet {
    qkv: Projection,
    gate: Projection,
    beta: Projection,
    alpha: Projection,
    dt_bias: Vec<f32>,
    a: Vec<f32>,
    /// `[C][Kc]`: channel `j`'s taps, the last for the current token.
    conv: Vec<f32>,
    norm: Vec<f32>,
    out: Projection,
    sizes: DeltaSizes,
}

impl DeltaNet {
    /// Layer `l`'s DeltaNet tensors, their shapes checked.
    pub fn from_gguf(g: &MappedGguf, l: u32, hyper: &HyperParams, q: &Qwen35Shape) -> Result<Self> {
        let e = hyper.n_embd as u64;
        let (s, hk, hv, kc) = (
            q.ssm_head_dim as u64,
            q.ssm_qk_heads as u64,
            q.ssm_v_heads as u64,
            q.conv_kernel as u64,
        );
        let c = q.conv_channels() as u64;
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        for (name, want) in [
            (n("attn_qkv"), vec![e, c]),
            (n("attn_gate"), vec![e, hv * s]),
            (n("ssm_conv1d"), vec![kc, c]),
            (n("ssm_beta"), vec![e, hv]),
            (n("ssm_alpha"), vec![e, hv]),
            (format!("blk.{l}.ssm_dt.bias"), vec![hv]),
            (format!("blk.{l}.ssm_a"), vec![hv]),
            (n("ssm_norm"), vec![s]),
            (n("ssm_out"), vec![hv * s, e]),
        ] {
            expect_dims(g, &name, &want)?;
        }
        Ok(Self {
            qkv: matmul(g, &n("attn_qkv"))?,
            gate: matmul(g, &n("attn_gate"))?,
            beta: matmul(g, &n("ssm_beta"))?,
            alpha: matmul(g, &n("ssm_alpha"))?,
            dt_bias: norm_weights(g, &format!("blk.{l}.ssm_dt.bias"))?,
            a: norm_weights(g, &format!("blk.{l}.ssm_a"))?,
            conv: norm_weights(g, &n("ssm_conv1d"))?,
            norm: norm_weights(g, &n("ssm_norm"))?,
            out: matmul(g, &n("ssm_out"))?,
            sizes: DeltaSizes {
                s: s as usize,
                hk: hk as usize,
                hv: hv as usize,
                kc: kc as usize,
                c: c as usize,
            },
        })
    }

    /// The mixer output for rows `x` (already normed), carrying the conv window and the
    /// recurrent state of `cache` forward; `tap` sees the conv output and the core output.
    /// While `cache` holds a checkpoint, the rows' recurrence inputs are kept beside it, so
    /// [`DeltaNet::replay`] can rebuild the state after any prefix of them.
    pub fn forward(
        &self,
        x: &[f32],
        cache: &mut LayerCache,
        h: &HyperParams,
        tap: &mut dyn FnMut(Tap, &[f32]),
    ) -> Result<Vec<f32>> {
        let DeltaSizes { s, hv, kc, c, .. } = self.sizes;
        let n_embd = h.n_embd as usize;
        let [m, z, beta, alpha] =
            project_all([&self.qkv, &self.gate, &self.beta, &self.alpha], x, n_embd)?;
        if cache.conv.is_empty() {
            (cache.conv, cache.ssm) = self.zero_state();
        }
        if cache.conv.len() != (kc - 1) * c || cache.ssm.len() != hv * s * s {
            bail!("the sequence state does not fit this DeltaNet layer");
        }
        let us = self.convolve(&m, &mut cache.conv, h.rms_eps, tap);
        if let Some(log) = cache.pending.as_mut() {
            log.m.extend_from_slice(&m);
            log.beta.extend_from_slice(&beta);
            log.alpha.extend_from_slice(&alpha);
        }
        let mut y = self.recur(&us, &beta, &alpha, &mut cache.ssm);
        tap(Tap::DeltaNetCore, &y);
        // Gated RMSNorm per v head, then the out-projection.
        rms_norm_in_place(&mut y, &self.norm, h.rms_eps);
        for (yv, &zv) in y.iter_mut().zip(&z) {
            *yv *= silu(zv);
        }
        project(&self.out, &y, hv * s)
    }

    /// The state before the first token: an empty conv window (`(Kc-1)·C` zeros) and zero
    /// recurrent matrices (`Hv·S²`).
    fn zero_state(&self) -> (Vec<f32>, Vec<f32>) {
        let DeltaSizes { s, hv, kc, c, .. } = self.sizes;
        (vec![0.0; (kc - 1) * c], vec![0.0; hv * s * s])
    }

    /// The causal convolution of in-projection rows `m` after the window (the last Kc-1
    /// rows before them, oldest first, carried forward), silu, and the q/k heads L2-normed:
    /// `[rows][C]`.
    fn convolve(
        &self,
        m: &[f32],
        window: &mut Vec<f32>,
        eps: f32,
        tap: &mut dyn FnMut(Tap, &[f32]),
    ) -> Vec<f32> {
        let DeltaSizes { s, hk, kc, c, .. } = self.sizes;
        let mut us = vec![0f32; m.len()];
        for (mt, u) in m.chunks_exact(c).zip(us.chunks_exact_mut(c)) {
            window.extend_from_slice(mt);
            for (j, uj) in u.iter_mut().enumerate() {
                let mut sum = 0f32;
                for i in 0..kc {
                    sum += window[i * c + j] * self.conv[j * kc + i];
                }
                *uj = silu(sum);
            }
            window.drain(..c);
            tap(Tap::ConvSilu, u);
            let (q, rest) = u.split_at_mut(hk * s);
            let k = &mut rest[..hk * s];
            l2_norm_heads(q, s, eps);
            l2_norm_heads(k, s, eps);
        }
        us
    }

    /// Each v head's recurrence over rows `us` (from [`DeltaNet::convolve`]) with their
    /// `beta` and `alpha` projections, carrying `state` forward: `[rows][Hv·S]`. Heads run
    /// over threads, each in one order, so the bits do not depend on the thread count.
    fn recur(&self, us: &[f32], beta: &[f32], alpha: &[f32], state: &mut [f32]) -> Vec<f32> {
        let DeltaSizes { s, hk, hv, c, .. } = self.sizes;
        let n_tok = us.len() / c;
        let scale = 1.0 / (s as f32).sqrt();
        let one_head = |(head, state): (usize, &mut [f32])| {
            let n = head % hk;
            let mut out = vec![0f32; n_tok * s];
            for (t, o) in out.chunks_exact_mut(s).enumerate() {
                let u = &us[t * c..(t + 1) * c];
                let (qn, kn) = (&u[n * s..(n + 1) * s], &u[(hk + n) * s..(hk + n + 1) * s]);
                let vh = &u[(2 * hk + head) * s..(2 * hk + head + 1) * s];
                let b = sigmoid(beta[t * hv + head]);
                let g = self.a[head] * softplus(alpha[t * hv + head] + self.dt_bias[head]);
                let decay = g.exp();
                for v in state.iter_mut() {
                    *v *= decay;
                }
                for i in 0..s {
                    let row = &mut state[i * s..(i + 1) * s];
                    let delta = b * (vh[i] - dot(row, kn));
                    for (r, &kj) in row.iter_mut().zip(kn) {
                        *r += delta * kj;
                    }
                    o[i] = dot(row, qn) * scale;
                }
            }
            out
        };
        let per_head: Vec<Vec<f32>> = if n_tok * hv * s * s < 1 << 16 {
            state
                .chunks_exact_mut(s * s)
                .enumerate()
                .map(one_head)
                .collect()
        } else {
            state
                .par_chunks_exact_mut(s * s)
                .enumerate()
                .map(one_head)
                .collect()
        };
        let mut y = vec![0f32; n_tok * hv * s];
        for (head, out) in per_head.iter().enumerate() {
            for (t, o) in out.chunks_exact(s).enumerate() {
                y[(t * hv + head) * s..(t * hv + head + 1) * s].copy_from_slice(o);
            }
        }
        y
    }

    /// The conv window and recurrent state after the first `keep` rows run since `cache`'s
    /// checkpoint, rebuilt from the checkpoint and those rows' kept inputs: the same bits as
    /// if only they had run.
    pub fn replay(&self, cache: &mut LayerCache, keep: usize, eps: f32) {
        let Some(log) = cache.pending.take() else {
            return;
        };
        let DeltaSizes { hv, c, .. } = self.sizes;
        let (mut conv, mut ssm) = match log.conv.is_empty() {
            true => self.zero_state(),
            false => (log.conv, log.ssm),
        };
        let us = self.convolve(&log.m[..keep * c], &mut conv, eps, &mut |_, _| {});
        self.recur(
            &us,
            &log.beta[..keep * hv],
            &log.alpha[..keep * hv],
            &mut ssm,
        );
        cache.conv = conv;
        cache.ssm = ssm;
    }
}

/// One gated full-attention layer's weights.
pub struct GatedAttention {
    /// Its query projection carries the output gate, interleaved per head.
    w: AttentionWeights,
    rope_dims: usize,
}

impl GatedAttention {
    /// Layer `l`'s attention tensors, their shapes checked.
    pub fn from_gguf(g: &MappedGguf, l: u32, hyper: &HyperParams, q: &Qwen35Shape) -> Result<Self> {
        let (hq, hkv) = (hyper.n_head, hyper.n_head_kv);
        if hkv == 0 || hq % hkv != 0 {
            bail!(
                "metadata qwen35moe.attention.head_count = {hq} is not a multiple of attention.head_count_kv = {hkv}"
            );
        }
        Ok(Self {
            w: AttentionWeights::from_gguf(g, l, hyper, 2)?,
            rope_dims: q.rope_dims as usize,
        })
    }

    /// The mixer output for rows `x` (already normed) at positions `pos0..`, appending keys
    /// and values to `cache`.
    pub fn forward(
        &self,
        x: &[f32],
        cache: &mut LayerCache,
        pos0: usize,
        h: &HyperParams,
    ) -> Result<Vec<f32>> {
        let (n_embd, d) = (h.n_embd as usize, h.head_dim as usize);
        let q_w = h.n_head as usize * d;
        let n_tok = x.len() / n_embd;
        let [r, k, v] = self.w.qkv(x, n_embd)?;
        let mut q = vec![0f32; n_tok * q_w];
        let mut gate = vec![0f32; n_tok * q_w];
        for t in 0..n_tok {
            for j in 0..h.n_head as usize {
                let src = &r[t * 2 * q_w + 2 * d * j..];
                q[t * q_w + j * d..t * q_w + (j + 1) * d].copy_from_slice(&src[..d]);
                gate[t * q_w + j * d..t * q_w + (j + 1) * d].copy_from_slice(&src[d..2 * d]);
            }
        }
        let (kc, vc) = (&mut cache.k, &mut cache.v);
        let mut attn = self.w.attend(q, k, v, kc, vc, pos0, h, self.rope_dims)?;
        for (a, &g) in attn.iter_mut().zip(&gate) {
            *a *= sigmoid(g);
        }
        self.w.output(&attn)
    }
}

/// The shared expert of a layer and its sigmoid gate: computed by the router for every token.
pub struct SharedExpert {
    ffn: ExpertWeights,
    gate: Projection,
}

/// Layer `l`'s shared-expert tensors, shapes checked: gate, up and down, and the gate vector.
pub struct SharedTensors<'a> {
    /// `[gate, up, down]` of the shared expert.
    pub ffn: [SlabMatrix<'a>; 3],
    /// The `n_embd` weights of its sigmoid gate.
    pub gate: RawTensor<'a>,
}

impl<'a> SharedTensors<'a> {
    /// Layer `l`'s shared expert, or `None` if it has none.
    pub fn of(g: &'a MappedGguf, l: u32, n_embd: u64) -> Result<Option<Self>> {
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        if g.header.tensor(&n("ffn_gate_shexp")).is_none() {
            return Ok(None);
        }
        let e = n_embd;
        let gate = g.tensor(&n("ffn_gate_inp_shexp"))?;
        if gate.dims != [e] && gate.dims != [e, 1] {
            bail!(
                "{} has shape {:?}, want [{e}] or [{e}, 1]",
                n("ffn_gate_inp_shexp"),
                gate.dims
            );
        }
        let mut mats = Vec::with_capacity(3);
        for t in ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] {
            let raw = g.tensor(&n(t))?;
            if raw.dims.len() != 2 {
                bail!("{} has shape {:?}, want 2-D", n(t), raw.dims);
            }
            mats.push(SlabMatrix {
                dims: [raw.dims[0], raw.dims[1]],
                dtype: raw.dtype,
                data: raw.data,
            });
        }
        let ff = mats[0].dims[1];
        if mats[0].dims != [e, ff] || mats[1].dims != [e, ff] || mats[2].dims != [ff, e] {
            bail!("layer {l}'s shared expert shapes disagree with each other or with n_embd {e}");
        }
        let ffn: [SlabMatrix<'_>; 3] = mats
            .try_into()
            .map_err(|_| crate::Error::invalid("three"))?;
        Ok(Some(Self { ffn, gate }))
    }
}

impl SharedExpert {
    /// Layer `l`'s shared expert, or `None` if it has none.
    pub fn from_gguf(g: &MappedGguf, l: u32, hyper: &HyperParams) -> Result<Option<Self>> {
        let e = hyper.n_embd as u64;
        let Some(t) = SharedTensors::of(g, l, e)? else {
            return Ok(None);
        };
        let gate = Projection::in_file(g, t.gate.data, t.gate.dtype, &[e, 1])?;
        Ok(Some(Self {
            ffn: ExpertWeights::in_file(g, &t.ffn)?,
            gate,
        }))
    }

    /// `γ · shared(x)` for rows `x` (the MoE input), `γ = σ(gate · x)` per row.
    pub fn forward(&self, x: &[f32], n_embd: usize) -> Result<Vec<f32>> {
        let mut out = self.ffn.forward_rows(x)?;
        let gates = project(&self.gate, x, n_embd)?;
        for (row, &g) in out.chunks_exact_mut(n_embd).zip(&gates) {
            let gamma = sigmoid(g);
            for v in row {
                *v *= gamma;
            }
        }
        Ok(out)
    }
}

/// The MoE input norm's name in qwen35moe (qwen3moe calls it `ffn_norm`).
pub const FFN_NORM: &str = "post_attention_norm";

/// The MoE input norm's name (`blk.L.<name>.weight`) in architecture `arch`.
pub fn moe_norm_name(arch: &str) -> &'static str {
    if arch == moeswarm_model::qwen35::ARCH {
        FFN_NORM
    } else {
        "ffn_norm"
    }
}
