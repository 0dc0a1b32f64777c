//! The expert executor: the hook the swarm hangs on.
//!
//! Once per MoE layer the trunk hands over the rows of all tokens and the dispatch plan (which
//! rows each expert computes) and awaits the unweighted expert outputs; gating and combine stay
//! in the trunk. The call is async and batch-shaped so a remote executor, whose answers come
//! over the network, plugs in unchanged. [`LocalExecutor`] answers from slabs in memory.

use std::future::Future;

use crate::error::{Context, Result};
use moeswarm_protocol::Manifest;

use super::expert::{ExpertWeights, LocalExperts};
use super::layer::load_experts;
use super::moe::{DispatchPlan, ExpertCompute};
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::slab_layers;
use moeswarm_model::store::Store;

/// One layer's expert work.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRequest<'a> {
    /// Which forward pass of the trunk this is (unique per trunk, growing): with the layer it
    /// names the request, so the answers of two passes running at once never mix.
    pub step: u64,
    /// Layer index.
    pub layer: u32,
    /// The layer's MoE input, `[n_tokens][n_embd]`.
    pub x: &'a [f32],
    /// Hidden size.
    pub n_embd: usize,
    /// Which token rows each expert computes.
    pub plan: &'a DispatchPlan,
}

/// Computes the experts of a layer: for each group of the plan, its rows' outputs
/// `[rows][n_embd]`, in the group's token order.
pub trait ExpertExecutor {
    /// Answers one layer's request.
    fn compute(&self, req: ExpertRequest<'_>)
        -> impl Future<Output = Result<Vec<Vec<f32>>>> + Send;
}

/// Every layer's experts held in this process.
#[derive(Default, Clone)]
pub struct LocalExecutor {
    layers: Vec<Option<LocalExperts>>,
}

impl LocalExecutor {
    /// All experts of a monolithic GGUF, from its 3-D tensors.
    pub fn from_gguf(src: &MappedGguf) -> Result<Self> {
        let mut layers = Vec::new();
        for l in slab_layers(&src.header)? {
            let mut experts = LocalExperts::default();
            for e in 0..l.n_expert {
                let w = ExpertWeights::in_file(src, &l.expert(src, e))
                    .with_context(|| format!("loading expert {e} of layer {}", l.layer))?;
                experts.insert(e as u32, w);
            }
            layers.resize(l.layer as usize + 1, None);
            layers[l.layer as usize] = Some(experts);
        }
        Ok(Self { layers })
    }

    /// All experts of a sliced model, from the store's slabs.
    pub fn from_store(store: &Store, manifest: &Manifest) -> Result<Self> {
        let mut layers = Vec::new();
        for (l, slabs) in manifest.slabs.iter().enumerate() {
            layers.push(if slabs.is_empty() {
                None
            } else {
                Some(load_experts(
                    store,
                    manifest,
                    l as u32,
                    0..slabs.len() as u32,
                )?)
            });
        }
        Ok(Self { layers })
    }
}

impl ExpertExecutor for LocalExecutor {
    fn compute(
        &self,
        req: ExpertRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Vec<f32>>>> + Send {
        let result = self
            .layers
            .get(req.layer as usize)
            .and_then(Option::as_ref)
            .with_context(|| format!("layer {} has no experts here", req.layer))
            .and_then(|experts| experts.compute(req.x, req.n_embd, req.plan));
        std::future::ready(result)
    }
}
