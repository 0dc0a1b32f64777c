//! `verify`: the MoE layer three ways, compared.
//!
//! Each is the layer's whole MoE output: the routed experts' combine plus, where the layer has
//! one (qwen35moe), its gated shared expert.
//!
//! 1. the f64 oracle, monolithic, from the original GGUF's 3-D expert tensors;
//! 2. the f64 oracle over the slabs in the store, split between two executors (as if on two
//!    workers) and combined: must equal (1) to 1e-12 relative, since regrouping is exact;
//! 3. the candle f32 path (the one the swarm runs) over the slabs: cosine ≥ 0.9999 against (1)
//!    computed with the kernels' input rounding ([`Rounding::LikeKernels`]), on every token
//!    whose top-k the f32 and f64 gates agree on. Its distance to the exact oracle is reported
//!    beside it.

use std::path::Path;

use crate::error::{Context, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;

use crate::layer::{load_expert_f64, load_experts, moe_forward, MoeGate};
use crate::moe::{route, run_split};
use crate::ops::rms_norm;
use crate::oracle::{
    dequantize_f64, matvec_rows, moe_monolithic, round_input, shared_expert_f64, Agreement,
    ExpertF64, LazyExpertsF64, Rounding,
};
use crate::quant::dequantize;
use crate::trunk::qwen35moe::{moe_norm_name, SharedExpert, SharedTensors};
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::slab_layers;
use moeswarm_model::store::Store;

/// Regrouping must be exact to this relative difference.
pub const REGROUP_MAX_REL: f64 = 1e-12;
/// The candle path must reach this cosine against the oracle.
pub const CANDLE_MIN_COSINE: f64 = 0.9999;

/// Options for [`verify`].
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// One layer, or every expert layer.
    pub layer: Option<u32>,
    /// Random input rows.
    pub tokens: usize,
    /// Seed of the input rows.
    pub seed: u64,
}

/// One layer's comparison.
#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    /// Layer index.
    pub layer: u32,
    /// Types of gate, up, down.
    pub expert_types: [String; 3],
    /// Slabs-in-f64 split over two executors vs monolithic f64.
    pub regroup: Agreement,
    /// candle f32 vs monolithic f64 with the kernels' input rounding, on the tokens compared.
    pub candle: Agreement,
    /// candle f32 vs exact monolithic f64, on the same tokens (information only).
    pub candle_vs_exact: Agreement,
    /// Tokens compared for `candle`.
    pub tokens_compared: usize,
    /// Tokens whose f32 top-k differs from f64's (near ties), with the f64 gap between
    /// the k-th and (k+1)-th probability.
    pub topk_near_ties: Vec<(usize, f64)>,
    /// Whether both checks pass.
    pub passed: bool,
}

/// The whole verification.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// Model id checked.
    pub model_id: String,
    /// Per layer.
    pub layers: Vec<LayerReport>,
    /// All layers passed.
    pub passed: bool,
}

fn add(acc: &mut [f64], v: &[f64]) {
    for (a, b) in acc.iter_mut().zip(v) {
        *a += b;
    }
}

/// Runs the three-way comparison for the model sliced from `source` into `store`.
pub fn verify(source: &Path, store: &Store, opts: &VerifyOptions) -> Result<VerifyReport> {
    let src = MappedGguf::open(source)?;
    let model = store
        .model_for_source(&src.header.header_id)?
        .with_context(|| {
            format!(
                "{} has not been sliced into this store; run `moeswarm slice` first",
                source.display()
            )
        })?;
    let manifest = store.manifest(&model)?;
    let trunk = MappedGguf::open(&store.blob_path(&manifest.trunk.id))?;
    let h = &manifest.hyper;
    let n_embd = h.n_embd as usize;
    let layers = slab_layers(&src.header)?;
    let chosen: Vec<_> = match opts.layer {
        Some(l) => vec![layers
            .iter()
            .find(|t| t.layer == l)
            .with_context(|| format!("layer {l} has no routed experts"))?],
        None => layers.iter().collect(),
    };

    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let raw: Vec<f32> = (0..opts.tokens * n_embd)
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();

    let mut reports = Vec::new();
    for tensors in chosen {
        reports.push(verify_layer(
            &src,
            &trunk,
            store,
            &manifest,
            tensors,
            &raw,
            opts.tokens,
        )?);
    }
    let passed = reports.iter().all(|r| r.passed);
    Ok(VerifyReport {
        model_id: model.to_string(),
        layers: reports,
        passed,
    })
}

/// The three-way comparison of one layer's MoE over the normalized rows of `raw`.
fn verify_layer(
    src: &MappedGguf,
    trunk: &MappedGguf,
    store: &Store,
    manifest: &moeswarm_protocol::Manifest,
    tensors: &moeswarm_model::hparams::ExpertTensors<'_>,
    raw: &[f32],
    tokens: usize,
) -> Result<LayerReport> {
    let h = &manifest.hyper;
    let (n_embd, k) = (h.n_embd as usize, h.n_expert_used as usize);
    let l = tensors.layer;
    let norm_name = moe_norm_name(&manifest.architecture);
    let norm = trunk.tensor(&format!("blk.{l}.{norm_name}.weight"))?;
    let x = rms_norm(
        raw,
        &dequantize(norm.data, norm.dtype, norm.dims)?,
        h.rms_eps,
    );
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();

    // (1) monolithic f64 from the source file.
    let router = src.tensor(&format!("blk.{l}.ffn_gate_inp.weight"))?;
    let xr = round_input(&x64, n_embd, router.dtype, Rounding::LikeKernels)?;
    let r64 = route(
        &matvec_rows(&dequantize_f64(&router)?, n_embd, &xr),
        h.n_expert as usize,
        k,
    );
    let source_expert = |e: u32, rounding| ExpertF64::new(&tensors.expert(src, e as u64), rounding);
    let mut mono = moe_monolithic(&r64, &x64, n_embd, |e| source_expert(e, Rounding::Exact))?;
    let mut mono_kernels = moe_monolithic(&r64, &x64, n_embd, |e| {
        source_expert(e, Rounding::LikeKernels)
    })?;
    // The shared expert joins the combine where the layer has one: from the source file
    // for (1), from the trunk for (2) and (3).
    let source_shared = SharedTensors::of(src, l, h.n_embd as u64)?;
    let trunk_shared = SharedTensors::of(trunk, l, h.n_embd as u64)?;
    if let Some(t) = &source_shared {
        add(
            &mut mono,
            &shared_expert_f64(t, &x64, n_embd, Rounding::Exact)?,
        );
        add(
            &mut mono_kernels,
            &shared_expert_f64(t, &x64, n_embd, Rounding::LikeKernels)?,
        );
    }

    // (2) f64 over slabs, two executors, gated from the trunk's router.
    let router = trunk.tensor(&format!("blk.{l}.ffn_gate_inp.weight"))?;
    let xr = round_input(&x64, n_embd, router.dtype, Rounding::LikeKernels)?;
    let r64_trunk = route(
        &matvec_rows(&dequantize_f64(&router)?, n_embd, &xr),
        h.n_expert as usize,
        k,
    );
    let load = |e| load_expert_f64(store, manifest, l, e, Rounding::Exact);
    let workers = [LazyExpertsF64::new(load), LazyExpertsF64::new(load)];
    let mut split = run_split(&r64_trunk, &x64, n_embd, &workers, |i| i % 2)?;
    if let Some(t) = &trunk_shared {
        add(
            &mut split,
            &shared_expert_f64(t, &x64, n_embd, Rounding::Exact)?,
        );
    }
    let regroup = Agreement::of(&split, &mono);

    // (3) candle f32 over slabs.
    let gate = MoeGate::from_gguf(trunk, l, k)?;
    let r32 = gate.route(&x, n_embd)?;
    let mut used = r32.experts.clone();
    used.sort_unstable();
    used.dedup();
    let exec = load_experts(store, manifest, l, used)?;
    let (r32, mut out32) = moe_forward(&gate, &x, n_embd, &exec)?;
    if let Some(shared) = SharedExpert::from_gguf(trunk, l, h)? {
        for (o, s) in out32.iter_mut().zip(shared.forward(&x, n_embd)?) {
            *o += s;
        }
    }
    let mut a = Vec::new();
    let mut b = Vec::new();
    let mut b_exact = Vec::new();
    let mut near = Vec::new();
    for t in 0..tokens {
        if r32.experts_of(t) == r64.experts_of(t) {
            a.extend(
                out32[t * n_embd..(t + 1) * n_embd]
                    .iter()
                    .map(|&v| v as f64),
            );
            b.extend_from_slice(&mono_kernels[t * n_embd..(t + 1) * n_embd]);
            b_exact.extend_from_slice(&mono[t * n_embd..(t + 1) * n_embd]);
        } else {
            let mut p: Vec<f64> =
                r64.probs[t * h.n_expert as usize..(t + 1) * h.n_expert as usize].to_vec();
            p.sort_by(|x, y| y.total_cmp(x));
            near.push((t, p[k - 1] - p.get(k).copied().unwrap_or(0.0)));
        }
    }
    let candle = Agreement::of(&a, &b);
    let candle_vs_exact = Agreement::of(&a, &b_exact);
    let passed = regroup.max_rel <= REGROUP_MAX_REL
        && candle.cosine >= CANDLE_MIN_COSINE
        && a.len() >= n_embd * tokens.div_ceil(2);
    Ok(LayerReport {
        layer: l,
        expert_types: tensors.matrices.map(|m| m.tensor.dtype.name()),
        regroup,
        candle,
        candle_vs_exact,
        tokens_compared: a.len() / n_embd,
        topk_near_ties: near,
        passed,
    })
}
