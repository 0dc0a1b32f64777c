//! The router's trunk: the qwen3moe forward pass with a KV cache, calling out for experts.
//!
//! Per layer: `h = rms(x, attn_norm)`; q, k, v projections; per-head RMS norm of q and k;
//! NEOX RoPE; grouped-query causal attention over the cache; output projection; residual.
//! Then `h = rms(x, ffn_norm)`, the gate (top-k, weights), the [`ExpertExecutor`] for the
//! unweighted expert outputs, the canonical combine, residual. Finally `rms(x, output_norm)`
//! and the output head (the token embedding when `output.weight` is absent). Projections stay
//! quantized (candle `QMatMul`); embeddings are dequantized one row at a time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};
use moeswarm_protocol::HyperParams;

use super::executor::{ExpertExecutor, ExpertRequest};
use super::layer::MoeGate;
use super::moe::{combine, DispatchPlan};
use super::ops::{dot, rms_norm, rms_norm_in_place, rope_neox, softmax_in_place};
use super::quant::{dequantize, qtensor};
use moeswarm_model::gguf::{GgmlType, MappedGguf};
use moeswarm_model::hparams::KNOWN_ARCHITECTURES;

struct TrunkLayer {
    attn_norm: Vec<f32>,
    q: QMatMul,
    k: QMatMul,
    v: QMatMul,
    o: QMatMul,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    gate: MoeGate,
}

/// The trunk's weights, loaded from a trunk blob or a whole model GGUF.
pub struct Trunk {
    hyper: HyperParams,
    embd: Vec<u8>,
    embd_type: GgmlType,
    embd_row_bytes: usize,
    layers: Vec<TrunkLayer>,
    output_norm: Vec<f32>,
    output: QMatMul,
    /// Forward passes started, numbering each pass's expert requests.
    steps: AtomicU64,
}

/// Keys and values of every past position, per layer.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where forward time went, summed over layers.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ForwardTiming {
    /// Norms, projections, RoPE and attention.
    pub attention: Duration,
    /// Router logits, top-k, dispatch plan and combine.
    pub gating: Duration,
    /// Awaiting the expert executor.
    pub experts: Duration,
    /// Output norm and head.
    pub head: Duration,
}

/// Refuses a tensor whose shape is not what the hyper-parameters imply (no panic later).
fn expect_dims(g: &MappedGguf, name: &str, want: &[u64]) -> Result<()> {
    let t = g.tensor(name)?;
    if t.dims != want {
        bail!(
            "{name} has shape {:?}, the model's hyper-parameters want {want:?}",
            t.dims
        );
    }
    Ok(())
}

fn norm_weights(g: &MappedGguf, name: &str) -> Result<Vec<f32>> {
    let t = g.tensor(name)?;
    dequantize(t.data, t.dtype, t.dims)
}

fn matmul(g: &MappedGguf, name: &str) -> Result<QMatMul> {
    let t = g.tensor(name)?;

    Ok(QMatMul::from_qtensor(
        qtensor(t.data, t.dtype, t.dims).with_context(|| name.to_string())?,
    )?)
}

fn project(m: &QMatMul, x: &[f32], n_in: usize) -> Result<Vec<f32>> {
    let rows = x.len() / n_in;
    let t = Tensor::from_slice(x, (rows, n_in), &Device::Cpu)?;
    Ok(m.forward(&t)?.flatten_all()?.to_vec1::<f32>()?)
}

impl Trunk {
    /// Loads the trunk tensors of `g` for a model of shape `hyper`.
    pub fn from_gguf(g: &MappedGguf, hyper: &HyperParams) -> Result<Self> {
        let arch = g.header.architecture().unwrap_or_default();
        if !KNOWN_ARCHITECTURES.contains(&arch) {
            bail!(
                "architecture {arch:?} has no trunk forward pass here (known: {})",
                KNOWN_ARCHITECTURES.join(", ")
            );
        }
        let embd = g.tensor("token_embd.weight")?;
        if embd.dims != [hyper.n_embd as u64, hyper.n_vocab as u64] {
            bail!(
                "token_embd.weight has shape {:?}, want [{}, {}]",
                embd.dims,
                hyper.n_embd,
                hyper.n_vocab
            );
        }
        let embd_row_bytes = embd
            .dtype
            .row_bytes(hyper.n_embd as u64)
            .context("embedding rows are not whole blocks")? as usize;
        let output = if g.header.tensor("output.weight").is_some() {
            expect_dims(
                g,
                "output.weight",
                &[hyper.n_embd as u64, hyper.n_vocab as u64],
            )?;
            matmul(g, "output.weight")?
        } else {
            matmul(g, "token_embd.weight")?
        };
        let (e, hd) = (hyper.n_embd as u64, hyper.head_dim as u64);
        let (q_w, kv_w) = (hyper.n_head as u64 * hd, hyper.n_head_kv as u64 * hd);
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
        if hyper.n_expert_used == 0 || hyper.n_expert_used > hyper.n_expert {
            bail!(
                "top-{} of {} experts is not a routing",
                hyper.n_expert_used,
                hyper.n_expert
            );
        }
        expect_dims(g, "output_norm.weight", &[e])?;
        let mut layers = Vec::with_capacity(hyper.n_layer as usize);
        for l in 0..hyper.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            if g.header.tensor(&n("ffn_gate_inp")).is_none() {
                bail!("layer {l} has no router (ffn_gate_inp): dense FFN layers are not supported");
            }
            for (name, want) in [
                ("attn_norm", vec![e]),
                ("attn_q", vec![e, q_w]),
                ("attn_k", vec![e, kv_w]),
                ("attn_v", vec![e, kv_w]),
                ("attn_output", vec![q_w, e]),
                ("attn_q_norm", vec![hd]),
                ("attn_k_norm", vec![hd]),
                ("ffn_norm", vec![e]),
                ("ffn_gate_inp", vec![e, hyper.n_expert as u64]),
            ] {
                expect_dims(g, &n(name), &want)?;
            }
            layers.push(TrunkLayer {
                attn_norm: norm_weights(g, &n("attn_norm"))?,
                q: matmul(g, &n("attn_q"))?,
                k: matmul(g, &n("attn_k"))?,
                v: matmul(g, &n("attn_v"))?,
                o: matmul(g, &n("attn_output"))?,
                q_norm: norm_weights(g, &n("attn_q_norm"))?,
                k_norm: norm_weights(g, &n("attn_k_norm"))?,
                ffn_norm: norm_weights(g, &n("ffn_norm"))?,
                gate: MoeGate::from_gguf(g, l, hyper.n_expert_used as usize)?,
            });
        }
        Ok(Self {
            hyper: hyper.clone(),
            embd: embd.data.to_vec(),
            embd_type: embd.dtype,
            embd_row_bytes,
            layers,
            output_norm: norm_weights(g, "output_norm.weight")?,
            output,
            steps: AtomicU64::new(0),
        })
    }

    /// The model's shape.
    pub fn hyper(&self) -> &HyperParams {
        &self.hyper
    }

    /// An empty cache for this trunk.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            k: vec![Vec::new(); self.layers.len()],
            v: vec![Vec::new(); self.layers.len()],
            len: 0,
        }
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut x = Vec::with_capacity(tokens.len() * self.hyper.n_embd as usize);
        for &t in tokens {
            if t >= self.hyper.n_vocab {
                bail!(
                    "token id {t} is outside the vocabulary of {}",
                    self.hyper.n_vocab
                );
            }
            let s = t as usize * self.embd_row_bytes;
            x.extend(dequantize(
                &self.embd[s..s + self.embd_row_bytes],
                self.embd_type,
                &[self.hyper.n_embd as u64],
            )?);
        }
        Ok(x)
    }

    /// Runs `tokens` at the next positions of `cache`, returning their logits `[tokens][n_vocab]`.
    pub async fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
    ) -> Result<Vec<f32>> {
        let h = &self.hyper;
        let (n_embd, hd) = (h.n_embd as usize, h.head_dim as usize);
        let (n_head, n_kv) = (h.n_head as usize, h.n_head_kv as usize);
        let (q_w, kv_w) = (n_head * hd, n_kv * hd);
        let group = n_head / n_kv;
        let n_tok = tokens.len();
        let pos0 = cache.len;
        let scale = 1.0 / (hd as f32).sqrt();
        let step = self.steps.fetch_add(1, Ordering::Relaxed);
        let mut x = self.embed(tokens)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let t0 = Instant::now();
            let hn = rms_norm(&x, &layer.attn_norm, h.rms_eps);
            let mut q = project(&layer.q, &hn, n_embd)?;
            let mut k = project(&layer.k, &hn, n_embd)?;
            let v = project(&layer.v, &hn, n_embd)?;
            rms_norm_in_place(&mut q, &layer.q_norm, h.rms_eps);
            rms_norm_in_place(&mut k, &layer.k_norm, h.rms_eps);
            for t in 0..n_tok {
                for head in q[t * q_w..(t + 1) * q_w].chunks_exact_mut(hd) {
                    rope_neox(head, pos0 + t, h.rope_freq_base);
                }
                for head in k[t * kv_w..(t + 1) * kv_w].chunks_exact_mut(hd) {
                    rope_neox(head, pos0 + t, h.rope_freq_base);
                }
            }
            cache.k[l].extend_from_slice(&k);
            cache.v[l].extend_from_slice(&v);
            let (kc, vc) = (&cache.k[l], &cache.v[l]);
            let mut attn = vec![0f32; n_tok * q_w];
            let mut scores = Vec::with_capacity(pos0 + n_tok);
            for t in 0..n_tok {
                let p = pos0 + t;
                for head in 0..n_head {
                    let kvh = head / group;
                    let qv = &q[t * q_w + head * hd..t * q_w + (head + 1) * hd];
                    scores.clear();
                    scores.extend((0..=p).map(|j| {
                        dot(qv, &kc[j * kv_w + kvh * hd..j * kv_w + (kvh + 1) * hd]) * scale
                    }));
                    softmax_in_place(&mut scores);
                    let out = &mut attn[t * q_w + head * hd..t * q_w + (head + 1) * hd];
                    for (j, &s) in scores.iter().enumerate() {
                        let vr = &vc[j * kv_w + kvh * hd..j * kv_w + (kvh + 1) * hd];
                        for (o, &vv) in out.iter_mut().zip(vr) {
                            *o += s * vv;
                        }
                    }
                }
            }
            let o = project(&layer.o, &attn, q_w)?;
            for (xv, ov) in x.iter_mut().zip(&o) {
                *xv += ov;
            }
            let t1 = Instant::now();
            timing.attention += t1 - t0;

            let hn = rms_norm(&x, &layer.ffn_norm, h.rms_eps);
            let routing = layer.gate.route(&hn, n_embd)?;
            let plan = DispatchPlan::new(&routing);
            let t2 = Instant::now();
            let outputs = exec
                .compute(ExpertRequest {
                    step,
                    layer: l as u32,
                    x: &hn,
                    n_embd,
                    plan: &plan,
                })
                .await
                .with_context(|| format!("experts of layer {l}"))?;
            let t3 = Instant::now();
            let moe = combine(&routing, &plan, &outputs, n_embd)?;
            for (xv, mv) in x.iter_mut().zip(&moe) {
                *xv += mv;
            }
            timing.gating += (t2 - t1) + t3.elapsed();
            timing.experts += t3 - t2;
        }
        cache.len += n_tok;
        let t0 = Instant::now();
        rms_norm_in_place(&mut x, &self.output_norm, h.rms_eps);
        let logits = project(&self.output, &x, n_embd)?;
        timing.head += t0.elapsed();
        Ok(logits)
    }
}
