//! One sequence's failure is its own: when a layer's experts cannot be had for the whole
//! batch, each sequence's rows are asked for alone, and only the sequences whose own rows
//! fail are marked failed (their rows are left out of every later layer's dispatch). The
//! others go on with exactly the rows they would have had alone.

use std::ops::Range;

use super::{FfnParts, NoProbe, Probe, Trunk};
use crate::error::{Error, Result};
use crate::executor::ExpertExecutor;
use crate::moe::{gather_rows, Routing};
use crate::trunk::ForwardTiming;

/// A layer's expert work for a batch of sequences.
pub(super) struct Layer<'a> {
    pub(super) ffn: FfnParts<'a>,
    pub(super) step: u64,
    pub(super) hn: &'a [f32],
    pub(super) routing: &'a Routing<f32>,
}

impl Trunk {
    /// The layer's experts (and shared expert) for every sequence not yet failed: all rows
    /// in one request while none has failed; when that request fails (or some have), those
    /// still going together, and if that fails too, each alone. A batch of one fails as a
    /// whole (its error is the step's). Rows of failed sequences are zero.
    pub(super) async fn experts_each(
        &self,
        layer: Layer<'_>,
        seqs: &[Range<usize>],
        failed: &mut [Option<Error>],
        exec: &impl ExpertExecutor,
        timing: &mut ForwardTiming,
        probe: &mut dyn Probe,
    ) -> Result<Vec<f32>> {
        let Layer {
            ffn,
            step,
            hn,
            routing,
        } = layer;
        let n_embd = self.hyper.n_embd as usize;
        let alive: Vec<usize> = (0..seqs.len()).filter(|&i| failed[i].is_none()).collect();
        if alive.len() == seqs.len() {
            match self
                .experts(ffn, step, hn, routing, exec, timing, probe)
                .await
            {
                Ok(moe) => return Ok(moe),
                Err(e) if seqs.len() == 1 => return Err(e),
                Err(e) => tracing::debug!(
                    "layer {}: the batch's experts failed ({e:#}); asking for each sequence's",
                    ffn.layer
                ),
            }
        }
        let mut moe = vec![0f32; hn.len()];
        let place = |moe: &mut [f32], part: &[f32], rows: &[Range<usize>]| {
            let mut at = 0;
            for r in rows {
                let n = r.len() * n_embd;
                moe[r.start * n_embd..r.end * n_embd].copy_from_slice(&part[at..at + n]);
                at += n;
            }
        };
        let rows: Vec<Range<usize>> = alive.iter().map(|&i| seqs[i].clone()).collect();
        if rows.len() > 1 && alive.len() < seqs.len() {
            let (x, r) = (gather_rows(hn, &rows, n_embd), routing.rows(&rows));
            let mut quiet = NoProbe;
            let together = self.experts(ffn, step, &x, &r, exec, timing, &mut quiet);
            if let Ok(part) = together.await {
                place(&mut moe, &part, &rows);
                return Ok(moe);
            }
        }
        for (&i, one) in alive.iter().zip(&rows) {
            let one = std::slice::from_ref(one);
            let (x, r) = (gather_rows(hn, one, n_embd), routing.rows(one));
            match self
                .experts(ffn, step, &x, &r, exec, timing, &mut NoProbe)
                .await
            {
                Ok(part) => place(&mut moe, &part, one),
                Err(e) => failed[i] = Some(e),
            }
        }
        Ok(moe)
    }
}
