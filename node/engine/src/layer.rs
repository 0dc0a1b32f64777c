//! A MoE layer of a sliced model: the router's gate from the trunk, experts from slabs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{bail, Context, Result};
use crate::projection::Projection;
use moeswarm_protocol::Manifest;

use super::expert::{ExpertWeights, LocalExperts};
use super::moe::{combine, route, DispatchPlan, ExpertCompute, Routing};
use super::oracle::{ExpertF64, Rounding};
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::store::Store;
use moeswarm_model::SlabView;

/// The router side of one MoE layer: gate weights and top-k.
pub struct MoeGate {
    router: Projection,
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
            router: Projection::in_file(g, t.data, t.dtype, t.dims)
                .with_context(|| format!("router of layer {layer}"))?,
            n_expert: t.dims[1] as usize,
            k,
        })
    }

    /// Router logits, softmax, top-k and weights for rows `x` (`[n_tokens][n_embd]`).
    pub fn route(&self, x: &[f32], n_embd: usize) -> Result<Routing<f32>> {
        if self.router.n_in() != n_embd {
            bail!(
                "a router of input width {} given rows of {n_embd}",
                self.router.n_in()
            );
        }
        let logits = self.router.apply(x)?;
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

/// Loads expert `expert` of `layer` from its slab in the store (checked against the manifest).
/// Every path that computes experts from a store (local runs, workers, the router's fallback)
/// loads them here.
pub fn load_expert(
    store: &Store,
    manifest: &Manifest,
    layer: u32,
    expert: u32,
) -> Result<ExpertWeights> {
    ExpertWeights::from_slab_bytes(&read_slab(store, manifest, layer, expert)?)
        .with_context(|| format!("loading expert {expert} of layer {layer}"))
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
        local.insert(e, load_expert(store, manifest, layer, e)?);
    }
    Ok(local)
}

/// Experts of one model loaded from a store on first use and kept (shared by reference), for
/// a node that computes only the few experts it is asked for.
pub struct ExpertCache {
    store: Arc<Store>,
    manifest: Arc<Manifest>,
    loaded: Mutex<HashMap<(u32, u32), Arc<ExpertWeights>>>,
}

impl ExpertCache {
    /// An empty cache over `store`'s slabs of `manifest`'s model.
    pub fn new(store: Arc<Store>, manifest: Arc<Manifest>) -> Self {
        Self {
            store,
            manifest,
            loaded: Mutex::default(),
        }
    }

    /// Expert `expert` of `layer`, loaded now if it was not yet.
    pub fn get(&self, layer: u32, expert: u32) -> Result<Arc<ExpertWeights>> {
        let known = self
            .loaded
            .lock()
            .ok()
            .and_then(|m| m.get(&(layer, expert)).cloned());
        if let Some(w) = known {
            return Ok(w);
        }
        // Loaded without the lock held: a slow read must not hold up the cached experts.
        let w = Arc::new(load_expert(&self.store, &self.manifest, layer, expert)?);
        if let Ok(mut m) = self.loaded.lock() {
            m.insert((layer, expert), w.clone());
        }
        Ok(w)
    }
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
