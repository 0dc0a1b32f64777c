//! The router's count of the rows it sent to each slab, over a sliding window.
//!
//! The window is cut in slots; a row counts in the slot of the second it was sent, and slots
//! older than the window fall away. [`DemandCounter::record`] turns the window into the signed
//! demand record the router publishes.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use moeswarm_protocol::{Demand, Manifest, ModelId, NodeKey};

/// Rows per slab over the last `window`. See the module docs.
#[derive(Debug)]
pub struct DemandCounter {
    n_layer: usize,
    n_expert: usize,
    slot_secs: u64,
    slots: usize,
    /// `(slot number, counts [layer * n_expert + expert])`, oldest first.
    window: Mutex<VecDeque<(u64, Vec<u64>)>>,
}

impl DemandCounter {
    /// A counter for `manifest`'s model over `window` (cut in at most 12 slots).
    pub fn new(manifest: &Manifest, window: Duration) -> Self {
        Self::of_shape(manifest.slab_layers(), manifest.hyper.n_expert, window)
    }

    /// A counter for a model of `n_layer × n_expert` slabs over `window` (cut in at most 12
    /// slots).
    pub fn of_shape(n_layer: u32, n_expert: u32, window: Duration) -> Self {
        let secs = window.as_secs().max(1);
        let slot_secs = secs.div_ceil(12).max(1);
        Self {
            n_layer: n_layer as usize,
            n_expert: n_expert as usize,
            slot_secs,
            slots: secs.div_ceil(slot_secs) as usize,
            window: Mutex::new(VecDeque::new()),
        }
    }

    /// The window's length in seconds.
    pub fn window_secs(&self) -> u64 {
        self.slot_secs * self.slots as u64
    }

    /// Counts `rows` sent to (`layer`, `expert`) at unix second `now`.
    pub fn add(&self, layer: u32, expert: u32, rows: u64, now: u64) {
        let (l, e) = (layer as usize, expert as usize);
        if l >= self.n_layer || e >= self.n_expert {
            return;
        }
        let slot = now / self.slot_secs;
        let Ok(mut w) = self.window.lock() else {
            return;
        };
        if w.back().is_none_or(|(s, _)| *s < slot) {
            w.push_back((slot, vec![0; self.n_layer * self.n_expert]));
        }
        while w.len() > self.slots {
            w.pop_front();
        }
        if let Some((_, counts)) = w.back_mut() {
            counts[l * self.n_expert + e] += rows;
        }
    }

    /// The counts `[layer][expert]` of the window ending at `now`.
    pub fn counts(&self, now: u64) -> Vec<Vec<u64>> {
        let mut out = vec![vec![0u64; self.n_expert]; self.n_layer];
        let first = (now / self.slot_secs).saturating_sub(self.slots as u64 - 1);
        if let Ok(w) = self.window.lock() {
            for (_, counts) in w.iter().filter(|(s, _)| *s >= first) {
                for (i, &c) in counts.iter().enumerate() {
                    out[i / self.n_expert][i % self.n_expert] += c;
                }
            }
        }
        out
    }

    /// The demand record of the window ending at `now`, from `router`, with sequence `seq`,
    /// living `ttl`; `None` when nothing was sent in the window.
    pub fn record(
        &self,
        manifest: &Manifest,
        router: NodeKey,
        seq: u64,
        now: u64,
        ttl: Duration,
    ) -> Option<Demand> {
        self.record_of(manifest.id(), router, seq, now, ttl)
    }

    /// As [`DemandCounter::record`], for the model `model` (of this counter's shape).
    pub fn record_of(
        &self,
        model: ModelId,
        router: NodeKey,
        seq: u64,
        now: u64,
        ttl: Duration,
    ) -> Option<Demand> {
        let (slabs, total_rows) = Demand::entries_of(&self.counts(now));
        (total_rows > 0).then(|| Demand {
            model,
            router,
            n_layer: self.n_layer as u32,
            n_expert: self.n_expert as u32,
            window_secs: self.window_secs(),
            total_rows,
            slabs,
            issued_at: now,
            seq,
            expires_at: now + ttl.as_secs().max(1),
        })
    }
}
