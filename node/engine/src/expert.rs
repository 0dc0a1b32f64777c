//! The SwiGLU expert `down(silu(gate x) * up x)` on the engine's projections.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::{Context, Result};

use super::moe::{DispatchPlan, ExpertCompute};
use crate::projection::Projection;
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::{SlabMatrix, SlabView};

/// One expert's weights, ready to compute.
pub struct ExpertWeights {
    gate: Projection,
    up: Projection,
    down: Projection,
    n_embd: usize,
}

impl ExpertWeights {
    /// Loads the expert in slab bytes.
    pub fn from_slab_bytes(bytes: &[u8]) -> Result<Self> {
        Self::from_view(&SlabView::parse(bytes)?)
    }

    /// Loads the expert of a parsed slab.
    pub fn from_view(v: &SlabView<'_>) -> Result<Self> {
        Self::from_matrices(&v.matrices)
            .with_context(|| format!("loading expert {} of layer {}", v.expert, v.layer))
    }

    /// Loads an expert from its three matrices `[gate, up, down]` (copied).
    pub fn from_matrices(m: &[SlabMatrix<'_>; 3]) -> Result<Self> {
        Self::with(m, |m| Projection::new(m.data, m.dtype, &m.dims))
    }

    /// Loads an expert whose matrices lie in the mapped file `g`, computing on them in place.
    pub fn in_file(g: &MappedGguf, m: &[SlabMatrix<'_>; 3]) -> Result<Self> {
        Self::with(m, |m| Projection::in_file(g, m.data, m.dtype, &m.dims))
    }

    fn with(
        m: &[SlabMatrix<'_>; 3],
        project: impl Fn(&SlabMatrix<'_>) -> Result<Projection>,
    ) -> Result<Self> {
        Ok(Self {
            gate: project(&m[0])?,
            up: project(&m[1])?,
            down: project(&m[2])?,
            n_embd: m[0].dims[0] as usize,
        })
    }

    /// Hidden size.
    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// Rows as a flat f32 slice `[rows][n_embd]` in and out.
    pub fn forward_rows(&self, x: &[f32]) -> Result<Vec<f32>> {
        if !x.len().is_multiple_of(self.n_embd) {
            crate::error::bail!("{} values are not whole rows of {}", x.len(), self.n_embd);
        }
        let [mut h, u] = Projection::apply_n([&self.gate, &self.up], x)?;
        for (g, u) in h.iter_mut().zip(&u) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
        self.down.apply(&h)
    }
}

/// An executor holding some experts of one layer in memory.
#[derive(Default, Clone)]
pub struct LocalExperts {
    experts: HashMap<u32, Arc<ExpertWeights>>,
}

impl LocalExperts {
    /// Adds expert `e`.
    pub fn insert(&mut self, e: u32, w: ExpertWeights) {
        self.experts.insert(e, Arc::new(w));
    }

    /// Whether expert `e` is held.
    pub fn holds(&self, e: u32) -> bool {
        self.experts.contains_key(&e)
    }
}

impl ExpertCompute<f32> for LocalExperts {
    fn compute(&self, x: &[f32], n_embd: usize, plan: &DispatchPlan) -> Result<Vec<Vec<f32>>> {
        let jobs = plan
            .groups
            .iter()
            .map(|g| {
                let w = self
                    .experts
                    .get(&g.expert)
                    .with_context(|| format!("expert {} is not loaded here", g.expert))?;
                Ok((&**w, plan.gather(g, x, n_embd)))
            })
            .collect::<Result<Vec<_>>>()?;
        forward_each(&jobs)
    }
}

/// Each job's expert on its rows: whole experts in parallel on the kernels' pool (one
/// fork-join for them all, not one per matrix; each matrix still splits its rows when threads
/// are idle). The same bits as computing them one after the other.
pub fn forward_each<X: AsRef<[f32]> + Sync>(jobs: &[(&ExpertWeights, X)]) -> Result<Vec<Vec<f32>>> {
    crate::kernels::on_pool(|| {
        jobs.par_iter()
            .map(|(w, rows)| w.forward_rows(rows.as_ref()))
            .collect()
    })
}
