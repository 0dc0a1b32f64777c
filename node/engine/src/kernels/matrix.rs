//! A weight matrix on its stored bytes, applied to rows of activations over threads.

use std::sync::Arc;

use rayon::prelude::*;

use super::act::{prepare, vec_dot_type};
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
        match g.offset_in_map(data) {
            Some(start) => Self {
                owner: g.shared_map(),
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
        if !x.len().is_multiple_of(self.n_in) {
            bail!(
                "{} activations are not whole rows of {}",
                x.len(),
                self.n_in
            );
        }
        let n_tok = x.len() / self.n_in;
        let act = prepare(self.dtype, x, self.n_in);
        let path = current_path();
        let w = self.bytes.as_slice();
        // out_t[o][t]: each task owns whole weight rows, which stay in cache across tokens.
        let mut out_t = vec![0f32; self.n_out * n_tok];
        let run = |(chunk, out): (&[u8], &mut [f32])| {
            dot_rows(
                path,
                self.dtype,
                chunk,
                self.row_bytes,
                &act,
                n_tok,
                self.n_in,
                out,
            )
        };
        if self.n_out * n_tok * self.n_in < 1 << 16 {
            run((w, &mut out_t));
        } else {
            w.par_chunks(self.row_bytes * ROWS_PER_TASK)
                .zip(out_t.par_chunks_mut(n_tok * ROWS_PER_TASK))
                .for_each(run);
        }
        if n_tok == 1 {
            return Ok(out_t);
        }
        let mut out = vec![0f32; n_tok * self.n_out];
        for (o, col) in out_t.chunks_exact(n_tok).enumerate() {
            for (t, &v) in col.iter().enumerate() {
                out[t * self.n_out + o] = v;
            }
        }
        Ok(out)
    }
}
