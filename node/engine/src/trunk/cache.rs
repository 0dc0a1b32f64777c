//! One sequence's state ([`KvCache`]): per layer the keys and values of every past position
//! (attention) or the conv window and recurrent state (Gated DeltaNet), and the MTP block's
//! keys and values; and dropping the positions a speculative pass ran past what it kept
//! ([`Trunk::checkpoint`], [`Trunk::rollback`]), exactly.

use super::{Mixer, Trunk};
use crate::error::{bail, Result};

/// One sequence's state: per layer, the keys and values of every past position (attention)
/// or the conv window and recurrent state (DeltaNet, fixed size).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub(super) layers: Vec<LayerCache>,
    pub(super) len: usize,
    /// The MTP block's keys and values, and the positions they hold.
    pub(super) mtp: LayerCache,
    pub(super) mtp_len: usize,
    /// The length at the last checkpoint, while one is held.
    pub(super) checkpoint: Option<usize>,
}

/// One layer's part of a [`KvCache`].
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    /// Keys of past positions (attention layers).
    pub(crate) k: Vec<f32>,
    /// Values of past positions (attention layers).
    pub(crate) v: Vec<f32>,
    /// The last conv-window rows of the in-projection (DeltaNet layers).
    pub(crate) conv: Vec<f32>,
    /// The recurrent state of every v head (DeltaNet layers).
    pub(crate) ssm: Vec<f32>,
    /// Since a checkpoint (DeltaNet layers): the state then, and the inputs of every row run
    /// since, to rebuild the state after any prefix of them.
    pub(crate) pending: Option<Box<DeltaLog>>,
}

/// A DeltaNet layer's state at a checkpoint and the in-projection, beta and alpha rows run
/// since (`[rows][C]`, `[rows][Hv]`, `[rows][Hv]`).
#[derive(Debug, Clone, Default)]
pub(crate) struct DeltaLog {
    pub(crate) conv: Vec<f32>,
    pub(crate) ssm: Vec<f32>,
    pub(crate) m: Vec<f32>,
    pub(crate) beta: Vec<f32>,
    pub(crate) alpha: Vec<f32>,
}

impl LayerCache {
    /// Keeps the keys and values of the first `keep` positions (`kv_w` values each).
    pub(super) fn truncate_kv(&mut self, keep: usize, kv_w: usize) {
        self.k.truncate(keep * kv_w);
        self.v.truncate(keep * kv_w);
    }
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

    /// Positions the MTP block has seen.
    pub fn mtp_len(&self) -> usize {
        self.mtp_len
    }
}

impl Trunk {
    /// Marks `cache`'s state as one [`Trunk::rollback`] can return to: the positions run
    /// after it (a speculative pass) can then be dropped exactly. Costs one copy of each
    /// DeltaNet layer's state (conv window and recurrent state) and, per row run after it,
    /// that row's in-projection, beta and alpha inputs of each DeltaNet layer; attention
    /// layers need nothing (their caches are cut).
    pub fn checkpoint(&self, cache: &mut KvCache) {
        for (layer, lc) in self.layers.iter().zip(&mut cache.layers) {
            if let Mixer::DeltaNet(_) = layer.mixer {
                lc.pending = Some(Box::new(DeltaLog {
                    conv: lc.conv.clone(),
                    ssm: lc.ssm.clone(),
                    ..DeltaLog::default()
                }));
            }
        }
        cache.checkpoint = Some(cache.len);
    }

    /// Keeps the first `keep` positions of `cache` (at least its checkpoint's, at most what
    /// it holds) and drops the rest, leaving exactly the state running only those positions
    /// would have left: attention caches are cut, DeltaNet states rebuilt from the
    /// checkpoint. The checkpoint is released (keeping every position is how a pass is
    /// committed; until then each row run adds to what the checkpoint holds).
    pub fn rollback(&self, cache: &mut KvCache, keep: usize) -> Result<()> {
        let Some(start) = cache.checkpoint else {
            bail!("no checkpoint to roll back to");
        };
        if keep < start || keep > cache.len {
            bail!(
                "cannot keep {keep} positions: the checkpoint is at {start}, the cache holds {}",
                cache.len
            );
        }
        cache.checkpoint = None;
        let eps = self.hyper.rms_eps;
        for (layer, lc) in self.layers.iter().zip(&mut cache.layers) {
            match &layer.mixer {
                Mixer::DeltaNet(d) if keep < cache.len => d.replay(lc, keep - start, eps),
                Mixer::DeltaNet(_) => lc.pending = None,
                Mixer::Attention(_) | Mixer::GatedAttention(_) => {
                    lc.truncate_kv(keep, self.kv_width())
                }
            }
        }
        cache.len = keep;
        Ok(())
    }

    /// Key (and value) values a position holds in an attention layer's cache.
    pub(super) fn kv_width(&self) -> usize {
        (self.hyper.n_head_kv * self.hyper.head_dim) as usize
    }
}
