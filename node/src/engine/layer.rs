//! A MoE layer of a sliced model: the router's gate from the trunk, experts from slabs.

use anyhow::{bail, Context, Result};
use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};
use moeswarm_protocol::Manifest;

use super::expert::{ExpertWeights, LocalExperts};
use super::moe::{combine, route, DispatchPlan, ExpertCompute, Routing};
use super::oracle::{ExpertF64, Rounding};
use super::quant::qtensor;
use crate::gguf::MappedGguf;
use crate::model::SlabView;
use crate::store::Store;

/// The router side of one MoE layer: gate weights and top-k.
pub struct MoeGate {
    router: QMatMul,
    n_expert: usize,
    k: usize,
}

impl MoeGate {
    /// The gate of `layer`, from a trunk (or any GGUF holding `blk.L.ffn_gate_inp.weight`).
    pub fn from_gguf(g: &MappedGguf, layer: u32, k: usize) -> Result<Self> {
        let t = g.tensor(&format!("blk.{layer}.ffn_gate_inp.weight"))?;
        if t.dims.len() != 2 {
            bail!("router of layer {layer} has shape {:?}, want 2-D", t.dims);
        }
        Ok(Self {
            router: QMatMul::from_qtensor(qtensor(t.data, t.dtype, t.dims)?)?,
            n_expert: t.dims[1] as usize,
            k,
        })
    }

    /// Router logits, softmax, top-k and weights for rows `x` (`[n_tokens][n_embd]`).
    pub fn route(&self, x: &[f32], n_embd: usize) -> Result<Routing<f32>> {
        let rows = x.len() / n_embd;
        let xt = Tensor::from_slice(x, (rows, n_embd), &Device::Cpu)?;
        let logits = self.router.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(route(&logits, self.n_expert, self.k))
    }
}

/// Gating, experts (by `exec`) and canonical combine for rows `x`.
pub fn moe_forward(
    gate: &MoeGate,
    x: &[f32],
    n_embd: usize,
    exec: &impl ExpertCompute<f32>,
) -> Result<(Routing<f32>, Vec<f32>)> {
    let routing = gate.route(x, n_embd)?;
    let plan = DispatchPlan::new(&routing);
    let outputs = exec.compute(x, n_embd, &plan)?;
    let out = combine(&routing, &plan, &outputs, n_embd)?;
    Ok((routing, out))
}

/// Reads the slab of (`layer`, `expert`) from the store, checking it is the one the manifest names.
pub fn read_slab(store: &Store, manifest: &Manifest, layer: u32, expert: u32) -> Result<Vec<u8>> {
    let r = manifest
        .slab(layer, expert)
        .with_context(|| format!("the model has no expert {expert} in layer {layer}"))?;
    let bytes = store.read(&r.id)?;
    let v = SlabView::parse(&bytes)?;
    if (v.layer, v.expert) != (layer, expert) || v.source_header != manifest.source_header {
        bail!(
            "slab {} says it is layer {} expert {} of source {}, the manifest says layer {layer} expert {expert}",
            r.id.short(), v.layer, v.expert, v.source_header.short()
        );
    }
    Ok(bytes)
}

/// Loads the given experts of `layer` from the store into a candle executor.
pub fn load_experts(
    store: &Store,
    manifest: &Manifest,
    layer: u32,
    experts: impl IntoIterator<Item = u32>,
) -> Result<LocalExperts> {
    let mut local = LocalExperts::default();
    for e in experts {
        let bytes = read_slab(store, manifest, layer, e)?;
        local.insert(e, ExpertWeights::from_slab_bytes(&bytes)?);
    }
    Ok(local)
}

/// Loads one expert of `layer` from the store in f64.
pub fn load_expert_f64(
    store: &Store,
    manifest: &Manifest,
    layer: u32,
    e: u32,
    rounding: Rounding,
) -> Result<ExpertF64> {
    let bytes = read_slab(store, manifest, layer, e)?;
    ExpertF64::new(&SlabView::parse(&bytes)?.matrices, rounding)
}
