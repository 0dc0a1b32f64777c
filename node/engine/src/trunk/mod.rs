//! The router's trunk: the forward pass with a KV cache, calling out for experts.
//!
//! One module per architecture holds its token mixers ([`qwen3moe`]: attention; [`qwen35moe`]:
//! Gated DeltaNet, gated attention and the shared expert); [`blocks`] holds what they share;
//! [`mtp`] the multi-token-prediction block and its forward; `cache` a sequence's state and
//! its exact rollback. This module runs the layers: embedding, mixer, the MoE block, output
//! head.
//!
//! Per layer: `h = rms(x, attn_norm)`, `x += mixer(h)`; then `h = rms(x, ffn_norm)`, the gate
//! (top-k, weights), the [`ExpertExecutor`] for the unweighted expert outputs, the canonical
//! combine, plus the shared expert where the layer has one, residual. Finally
//! `rms(x, output_norm)` and the output head (the token embedding when `output.weight` is
//! absent). Projections stay quantized ([`Projection`]); embeddings are dequantized one row
//! at a time.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::error::{bail, Context, Result};
use crate::projection::Projection;
use moeswarm_model::gguf::{GgmlType, MappedGguf};
use moeswarm_model::hparams::KNOWN_ARCHITECTURES;
use moeswarm_model::qwen35::LayerKind;
use moeswarm_protocol::HyperParams;

use crate::executor::{ExpertExecutor, ExpertRequest};
use crate::kernels::on_pool;
use crate::layer::MoeGate;
use crate::moe::{combine, DispatchPlan};
use crate::ops::rms_norm;
use crate::quant::dequantize;
use blocks::{expect_dims, matmul, norm_weights, project};
pub use cache::{KvCache, LayerCache};
pub use mtp::MtpOutput;

pub mod blocks;
mod cache;
mod each;
pub mod mtp;
pub mod qwen35moe;
pub mod qwen3moe;

/// What mixes tokens in a layer.
enum Mixer {
    /// qwen3moe's attention.
    Attention(qwen3moe::Attention),
    /// qwen35moe's gated full attention.
    GatedAttention(qwen35moe::GatedAttention),
    /// qwen35moe's Gated DeltaNet.
    DeltaNet(qwen35moe::DeltaNet),
}

/// One layer: its mixer (the architecture's) and its MoE block's norm, gate and shared expert.
struct TrunkLayer {
    attn_norm: Vec<f32>,
    mixer: Mixer,
    ffn_norm: Vec<f32>,
    gate: MoeGate,
    shared: Option<qwen35moe::SharedExpert>,
}

/// The residual stream after the last layer of a step's rows, before the output norm.
#[derive(Debug, Clone)]
pub struct Hidden {
    rows: Vec<f32>,
    /// Where each sequence's rows start, and the end.
    starts: Vec<usize>,
    n_embd: usize,
}

impl Hidden {
    /// Sequence `i`'s rows, `[tokens][n_embd]`.
    pub fn of(&self, i: usize) -> &[f32] {
        &self.rows[self.starts[i] * self.n_embd..self.starts[i + 1] * self.n_embd]
    }
}

/// What a layer's MoE block adds to its routed experts: which layer's slabs, and its shared
/// expert.
#[derive(Clone, Copy)]
struct FfnParts<'a> {
    layer: u32,
    shared: Option<&'a qwen35moe::SharedExpert>,
}

/// The trunk's weights, loaded from a trunk blob or a whole model GGUF.
pub struct Trunk {
    hyper: HyperParams,
    embd: crate::kernels::WeightBytes,
    embd_type: GgmlType,
    embd_row_bytes: usize,
    layers: Vec<TrunkLayer>,
    output_norm: Vec<f32>,
    output: Projection,
    /// The first multi-token-prediction block, where the file has one.
    mtp: Option<mtp::MtpBlock>,
    /// Forward passes started, numbering each pass's expert requests.
    steps: AtomicU64,
}

/// An intermediate tensor of the forward pass, named as the reference layer dumps name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tap {
    /// DeltaNet: the conv output after silu, before the q/k L2 norms (`[C]` per token).
    ConvSilu,
    /// DeltaNet: the recurrence's output of every v head, before the gated norm.
    DeltaNetCore,
    /// The token mixer's output (after its out-projection).
    MixerOut,
    /// The MoE input (the FFN norm's output).
    MoeInput,
    /// The router's softmax over all experts.
    MoeProbs,
    /// The routed experts' weighted sum.
    MoeOut,
    /// The routed part plus the gated shared expert.
    FfnOut,
    /// The residual stream after the layer.
    LayerOut,
}

/// Watches a forward pass: receives each [`Tap`]'s rows as they are computed, in token order
/// (a tensor may arrive in several calls, each a whole number of rows).
pub trait Probe: Send {
    /// Rows of `tap` in layer `layer`.
    fn tensor(&mut self, layer: usize, tap: Tap, rows: &[f32]);
    /// The routing of layer `layer` (its chosen experts by descending probability).
    fn routing(&mut self, _layer: usize, _routing: &crate::moe::Routing<f32>) {}
}

/// A [`Probe`] that ignores everything.
pub struct NoProbe;

impl Probe for NoProbe {
    fn tensor(&mut self, _: usize, _: Tap, _: &[f32]) {}
}

/// Where forward time went, summed over layers.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ForwardTiming {
    /// Attention layers: their norm, projections, RoPE and attention.
    pub attention: Duration,
    /// Gated DeltaNet layers: their norm, projections, conv and recurrence.
    pub deltanet: Duration,
    /// Router logits, top-k, dispatch plan and combine.
    pub gating: Duration,
    /// The shared expert (computed while the routed experts are in flight).
    pub shared_expert: Duration,
    /// The expert executor: its first poll (all of a local executor's work; a remote one's
    /// sending) and the wait after the shared expert (the part of the round trip it did not
    /// hide).
    pub experts: Duration,
    /// Output norm and head.
    pub head: Duration,
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
        let e = hyper.n_embd as u64;
        let qwen35 = if arch == moeswarm_model::qwen35::ARCH {
            let shape = moeswarm_model::qwen35::Qwen35Shape::from_gguf(&g.header)?;
            shape.check_tensors(&g.header)?;
            if shape.kinds.len() != hyper.n_layer as usize {
                bail!(
                    "the manifest says {} layers, the trunk's metadata {}",
                    hyper.n_layer,
                    shape.kinds.len()
                );
            }
            Some(shape)
        } else {
            qwen3moe::Attention::check_shape(hyper)?;
            None
        };
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
            expect_dims(g, &n("attn_norm"), &[e])?;
            let (mixer, ffn_norm) = match &qwen35 {
                None => (
                    Mixer::Attention(qwen3moe::Attention::from_gguf(g, l, hyper)?),
                    "ffn_norm",
                ),
                Some(q) => (
                    match q.kinds[l as usize] {
                        LayerKind::Linear => {
                            Mixer::DeltaNet(qwen35moe::DeltaNet::from_gguf(g, l, hyper, q)?)
                        }
                        LayerKind::Full => Mixer::GatedAttention(
                            qwen35moe::GatedAttention::from_gguf(g, l, hyper, q)?,
                        ),
                    },
                    qwen35moe::moe_norm_name(arch),
                ),
            };
            expect_dims(g, &n(ffn_norm), &[e])?;
            expect_dims(g, &n("ffn_gate_inp"), &[e, hyper.n_expert as u64])?;
            layers.push(TrunkLayer {
                attn_norm: norm_weights(g, &n("attn_norm"))?,
                mixer,
                shared: qwen35moe::SharedExpert::from_gguf(g, l, hyper)?,
                ffn_norm: norm_weights(g, &n(ffn_norm))?,
                gate: MoeGate::from_gguf(g, l, hyper.n_expert_used as usize)?,
            });
        }
        // The first MTP block, when the file has one and its tensors (a trunk sliced before
        // MTP blocks were kept lacks them: the model then runs without).
        let mtp = match &qwen35 {
            Some(q)
                if q.nextn_layers > 0
                    && g.header
                        .tensor(&format!("blk.{}.nextn.eh_proj.weight", hyper.n_layer))
                        .is_some() =>
            {
                Some(mtp::MtpBlock::from_gguf(g, hyper.n_layer, hyper, q)?)
            }
            _ => None,
        };
        Ok(Self {
            mtp,
            hyper: hyper.clone(),
            embd: crate::kernels::WeightBytes::in_file(g, embd.data),
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
            layers: vec![LayerCache::default(); self.layers.len()],
            ..KvCache::default()
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
                &self.embd.as_slice()[s..s + self.embd_row_bytes],
                self.embd_type,
                &[self.hyper.n_embd as u64],
            )?);
        }
        Ok(x)
    }

    /// Each layer's token mixer, in order.
    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::DeltaNet(_) => LayerKind::Linear,
                Mixer::Attention(_) | Mixer::GatedAttention(_) => LayerKind::Full,
            })
            .collect()
    }

    /// Runs `tokens` at the next positions of `cache`, returning their logits `[tokens][n_vocab]`.
    pub async fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
    ) -> Result<Vec<f32>> {
        self.forward_probed(cache, tokens, exec, timing, &mut NoProbe)
            .await
    }

    /// [`Trunk::forward`], showing `probe` the intermediate tensors.
    pub async fn forward_probed(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
        probe: &mut dyn Probe,
    ) -> Result<Vec<f32>> {
        let mut batch = [(cache, tokens)];
        self.step(&mut batch, exec, timing, probe)
            .await?
            .0
            .pop()
            .unwrap_or_else(|| Ok(Vec::new()))
    }

    /// One step of several sequences at once: each `(cache, tokens)` runs its tokens at the
    /// next positions of its own cache; the logits `[tokens][n_vocab]` of each, in order.
    ///
    /// The rows of all sequences go through each layer together: norms, projections, gating
    /// and the experts (one [`ExpertRequest`] per layer for every row, so a remote executor
    /// sends one dispatch per worker per layer) over the stacked rows, the token mixer
    /// (attention, DeltaNet) per sequence over its own cache. Every kernel computes a row the
    /// same way whatever rows are beside it, so each sequence's logits are bit for bit what
    /// [`Trunk::forward`] gives it alone.
    pub async fn forward_batch(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
    ) -> Result<Vec<Vec<f32>>> {
        Ok(self.forward_batch_hidden(batch, exec, timing).await?.0)
    }

    /// [`Trunk::forward_batch`], also giving the rows' residual stream after the last layer
    /// (before the output norm): what the MTP block reads.
    pub async fn forward_batch_hidden(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
    ) -> Result<(Vec<Vec<f32>>, Hidden)> {
        let (each, hidden) = self.step(batch, exec, timing, &mut NoProbe).await?;
        Ok((each.into_iter().collect::<Result<_>>()?, hidden))
    }

    /// [`Trunk::forward_batch_hidden`] where one sequence's failure is its own: each sequence
    /// gets its logits, or the error its own rows met (see `each`); the others' logits are
    /// bit for bit what they get alone. Only a batch of one fails as a whole.
    pub async fn forward_batch_each(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
    ) -> Result<(Vec<Result<Vec<f32>>>, Hidden)> {
        self.step(batch, exec, timing, &mut NoProbe).await
    }

    /// A layer's experts for rows `hn` routed by `routing`: the dispatch started first, the
    /// shared expert computed while it is in flight, then the canonical combine plus the
    /// shared part.
    #[allow(clippy::too_many_arguments)]
    async fn experts(
        &self,
        ffn: FfnParts<'_>,
        step: u64,
        hn: &[f32],
        routing: &crate::moe::Routing<f32>,
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
        probe: &mut dyn Probe,
    ) -> Result<Vec<f32>> {
        let n_embd = self.hyper.n_embd as usize;
        let l = ffn.layer;
        let plan = DispatchPlan::new(routing);
        let t2 = Instant::now();
        // Start the dispatch (its first poll sends the requests), then compute the shared
        // expert while the routed experts are in flight.
        let dispatch = exec.compute(ExpertRequest {
            step,
            layer: l,
            x: hn,
            n_embd,
            plan: &plan,
        });
        let mut dispatch = std::pin::pin!(dispatch);
        let first = std::future::poll_fn(|cx| Poll::Ready(dispatch.as_mut().poll(cx))).await;
        let t_sent = Instant::now();
        let shared = match ffn.shared {
            Some(shared) => Some(on_pool(|| shared.forward(hn, n_embd))?),
            None => None,
        };
        let t3 = Instant::now();
        let outputs = match first {
            Poll::Ready(r) => r,
            Poll::Pending => dispatch.await,
        }
        .with_context(|| format!("experts of layer {l}"))?;
        let t4 = Instant::now();
        let mut moe = combine(routing, &plan, &outputs, n_embd)?;
        probe.tensor(l as usize, Tap::MoeOut, &moe);
        if let Some(shared) = shared {
            for (mv, sv) in moe.iter_mut().zip(shared) {
                *mv += sv;
            }
        }
        probe.tensor(l as usize, Tap::FfnOut, &moe);
        timing.gating += t4.elapsed();
        timing.shared_expert += t3 - t_sent;
        timing.experts += (t_sent - t2) + (t4 - t3);
        Ok(moe)
    }

    async fn step(
        &self,
        batch: &mut [(&mut KvCache, &[u32])],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
        probe: &mut dyn Probe,
    ) -> Result<(Vec<Result<Vec<f32>>>, Hidden)> {
        let h = &self.hyper;
        let n_embd = h.n_embd as usize;
        let step = self.steps.fetch_add(1, Ordering::Relaxed);
        let tokens: Vec<u32> = batch.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let lens: Vec<usize> = batch.iter().map(|(_, t)| t.len()).collect();
        let mut seqs = Vec::with_capacity(lens.len());
        for &n in &lens {
            let start = seqs.last().map_or(0, |r: &std::ops::Range<usize>| r.end);
            seqs.push(start..start + n);
        }
        let mut failed: Vec<Option<crate::error::Error>> = lens.iter().map(|_| None).collect();
        let mut x = self.embed(&tokens)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let t0 = Instant::now();
            // The layer's compute up to the dispatch, on the thread pool in one go.
            let (hn, routing, t1) = on_pool(|| -> Result<_> {
                let hn = rms_norm(&x, &layer.attn_norm, h.rms_eps);
                let mut o = Vec::with_capacity(hn.len());
                let mut row = 0;
                for ((cache, _), &n) in batch.iter_mut().zip(&lens) {
                    let (pos0, lc) = (cache.len, &mut cache.layers[l]);
                    let rows = &hn[row * n_embd..(row + n) * n_embd];
                    row += n;
                    o.extend(match &layer.mixer {
                        Mixer::Attention(a) => a.forward(rows, &mut lc.k, &mut lc.v, pos0, h)?,
                        Mixer::GatedAttention(a) => a.forward(rows, lc, pos0, h)?,
                        Mixer::DeltaNet(d) => {
                            d.forward(rows, lc, h, &mut |tap, r| probe.tensor(l, tap, r))?
                        }
                    });
                }
                probe.tensor(l, Tap::MixerOut, &o);
                for (xv, ov) in x.iter_mut().zip(&o) {
                    *xv += ov;
                }
                let t1 = Instant::now();
                let hn = rms_norm(&x, &layer.ffn_norm, h.rms_eps);
                probe.tensor(l, Tap::MoeInput, &hn);
                let routing = layer.gate.route(&hn, n_embd)?;
                probe.tensor(l, Tap::MoeProbs, &routing.probs);
                probe.routing(l, &routing);
                Ok((hn, routing, t1))
            })?;
            match layer.mixer {
                Mixer::DeltaNet(_) => timing.deltanet += t1 - t0,
                _ => timing.attention += t1 - t0,
            }
            timing.gating += t1.elapsed();
            let ffn = FfnParts {
                layer: l as u32,
                shared: layer.shared.as_ref(),
            };
            let work = each::Layer {
                ffn,
                step,
                hn: &hn,
                routing: &routing,
            };
            let moe = self
                .experts_each(work, &seqs, &mut failed, exec, timing, probe)
                .await?;
            for (xv, mv) in x.iter_mut().zip(&moe) {
                *xv += mv;
            }
            probe.tensor(l, Tap::LayerOut, &x);
        }
        for ((cache, _), &n) in batch.iter_mut().zip(&lens) {
            cache.len += n;
        }
        let t0 = Instant::now();
        let logits = project(
            &self.output,
            &rms_norm(&x, &self.output_norm, h.rms_eps),
            n_embd,
        )?;
        timing.head += t0.elapsed();
        let vocab = h.n_vocab as usize;
        let mut out = Vec::with_capacity(lens.len());
        let mut starts = vec![0];
        for (n, failure) in lens.into_iter().zip(failed) {
            let row = starts[starts.len() - 1];
            out.push(match failure {
                Some(e) => Err(e),
                None => Ok(logits[row * vocab..(row + n) * vocab].to_vec()),
            });
            starts.push(row + n);
        }
        let hidden = Hidden {
            rows: x,
            starts,
            n_embd,
        };
        Ok((out, hidden))
    }
}
