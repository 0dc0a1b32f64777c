//! A weight matrix on its stored bytes, applied to rows of activations over threads.

use std::sync::Arc;

use rayon::prelude::*;

use super::act::{prepare, vec_dot_type, Activations};
use super::dot::dot_rows;
use super::{current_path, supports};
use crate::error::{bail, Result};
use moeswarm_model::gguf::GgmlType;

/// Bytes of weights: shared (a mapped file or a slab read into memory), never copied.
#[derive(Clone)]
pub struct WeightBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl WeightBytes {
    /// Takes `bytes`.
    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self {
            owner: Arc::new(bytes),
            start: 0,
            len,
        }
    }

    /// `len` bytes at `start` of `owner`'s bytes.
    pub fn shared(
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        start: usize,
        len: usize,
    ) -> Result<Self> {
        let total = (*owner).as_ref().len();
        if start.checked_add(len).is_none_or(|end| end > total) {
            bail!("weight bytes {start}..+{len} lie outside the {total} bytes held");
        }
        Ok(Self { owner, start, len })
    }

    /// `data`, borrowed from the mapped file `g` when it lies in it (copied otherwise).
    pub fn in_file(g: &moeswarm_model::gguf::MappedGguf, data: &[u8]) -> Self {
        match g.shared_map_of(data) {
            Some((owner, start)) => Self {
                owner,
                start,
                len: data.len(),
            },
            None => Self::owned(data.to_vec()),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
}

/// A 2-D weight `[n_in, n_out]` (ggml order: `n_out` rows of `n_in` values) of a type the
/// kernels compute, on its bytes as stored.
#[derive(Clone)]
pub struct Matrix {
    bytes: WeightBytes,
    dtype: GgmlType,
    n_in: usize,
    n_out: usize,
    row_bytes: usize,
}

/// Output rows per thread task: enough work to amortize the task, small enough to balance.
const ROWS_PER_TASK: usize = 64;

impl Matrix {
    /// A matrix of `n_out` rows of `n_in` values of `dtype` in `bytes`, sizes checked.
    pub fn new(bytes: WeightBytes, dtype: GgmlType, n_in: u64, n_out: u64) -> Result<Self> {
        if !supports(dtype) {
            bail!("no kernel here computes {dtype} weights");
        }
        let Some(row_bytes) = dtype.row_bytes(n_in) else {
            bail!("{dtype} rows of {n_in} values are not whole blocks");
        };
        let want = row_bytes.checked_mul(n_out);
        if want != Some(bytes.as_slice().len() as u64) {
            bail!(
                "a {dtype} matrix of {n_out} rows of {n_in} needs {want:?} bytes, got {}",
                bytes.as_slice().len()
            );
        }
        let block = vec_dot_type(dtype).block_size();
        if !n_in.is_multiple_of(block) {
            bail!("{dtype} rows of {n_in} values are not whole blocks of the activations' type");
        }
        Ok(Self {
            bytes,
            dtype,
            n_in: n_in as usize,
            n_out: n_out as usize,
            row_bytes: row_bytes as usize,
        })
    }

    /// Input width.
    pub fn n_in(&self) -> usize {
        self.n_in
    }

    /// Output width.
    pub fn n_out(&self) -> usize {
        self.n_out
    }

    /// The weight type.
    pub fn dtype(&self) -> GgmlType {
        self.dtype
    }

    /// `W · x` for each row of `x` (`[rows][n_in]`): `[rows][n_out]`.
    pub fn apply(&self, x: &[f32]) -> Result<Vec<f32>> {
        let mut out = Self::apply_all(&[self], x)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Each of `ms` applied to the same rows `x`, in one pass over the threads: the
    /// activations are prepared once per activation type and every matrix's rows are split
    /// into one pool of tasks (one fork-join, not one per matrix). The same bits as applying
    /// each alone.
    pub fn apply_all(ms: &[&Matrix], x: &[f32]) -> Result<Vec<Vec<f32>>> {
        let Some(first) = ms.first() else {
            return Ok(Vec::new());
        };
        let n_in = first.n_in;
        if let Some(m) = ms.iter().find(|m| m.n_in != n_in) {
            bail!(
                "matrices of input widths {n_in} and {} applied to the same rows",
                m.n_in
            );
        }
        if !x.len().is_multiple_of(n_in) {
            bail!("{} activations are not whole rows of {n_in}", x.len());
        }
        let n_tok = x.len() / n_in;
        let mut acts: Vec<(GgmlType, Activations)> = Vec::new();
        for m in ms {
            let kind = vec_dot_type(m.dtype);
            if !acts.iter().any(|(k, _)| *k == kind) {
                acts.push((kind, prepare(m.dtype, x, n_in)));
            }
        }
        let act_of = |m: &Matrix| {
            let kind = vec_dot_type(m.dtype);
            &acts
                .iter()
                .find(|(k, _)| *k == kind)
                .expect("prepared above")
                .1
        };
        let path = current_path();
        // out_t[o][t]: each task owns whole weight rows, which stay in cache across tokens.
        let mut outs: Vec<Vec<f32>> = ms.iter().map(|m| vec![0f32; m.n_out * n_tok]).collect();
        let mut tasks: Vec<(&Matrix, &[u8], &mut [f32])> = Vec::new();
        for (m, out) in ms.iter().zip(outs.iter_mut()) {
            let w = m.bytes.as_slice();
            for (chunk, o) in w
                .chunks(m.row_bytes * ROWS_PER_TASK)
                .zip(out.chunks_mut(n_tok * ROWS_PER_TASK))
            {
                tasks.push((m, chunk, o));
            }
        }
        let run = |(m, chunk, out): (&Matrix, &[u8], &mut [f32])| {
            dot_rows(
                path,
                m.dtype,
                chunk,
                m.row_bytes,
                act_of(m),
                n_tok,
                n_in,
                out,
            )
        };
        let work: usize = ms.iter().map(|m| m.n_out * n_tok * n_in).sum();
        if work < 1 << 16 {
            tasks.into_iter().for_each(run);
        } else {
            tasks.into_par_iter().for_each(run);
        }
        if n_tok == 1 {
            return Ok(outs);
        }
        Ok(ms
            .iter()
            .zip(&outs)
            .map(|(m, out_t)| {
                let mut out = vec![0f32; n_tok * m.n_out];
                for (o, col) in out_t.chunks_exact(n_tok).enumerate() {
                    for (t, &v) in col.iter().enumerate() {
                        out[t * m.n_out + o] = v;
                    }
                }
                out
            })
            .collect())
    }
}
