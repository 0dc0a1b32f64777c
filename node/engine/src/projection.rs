//! A linear map `y = W · x` on a weight tensor as stored, on the engine's own kernels
//! ([`crate::kernels`]): the same bits on every CPU, for every type candle knows.

use crate::error::{bail, Result};
use crate::kernels::{self, Matrix, WeightBytes};
use moeswarm_model::gguf::GgmlType;

/// A 2-D weight `[n_in, n_out]`, ready to apply to rows of `n_in` activations.
#[derive(Clone)]
pub struct Projection(Matrix);

impl Projection {
    /// The weight of ggml-order shape `dims` (`[n_in, n_out]`, or `[n_in]` for one output)
    /// and type `dtype` in `data` (copied).
    pub fn new(data: &[u8], dtype: GgmlType, dims: &[u64]) -> Result<Self> {
        Self::from_bytes(WeightBytes::owned(data.to_vec()), dtype, dims)
    }

    /// [`Projection::new`] on the bytes of a mapped file `g`, computed in place.
    pub fn in_file(
        g: &moeswarm_model::gguf::MappedGguf,
        data: &[u8],
        dtype: GgmlType,
        dims: &[u64],
    ) -> Result<Self> {
        Self::from_bytes(WeightBytes::in_file(g, data), dtype, dims)
    }

    /// [`Projection::new`] on shared bytes.
    pub fn from_bytes(bytes: WeightBytes, dtype: GgmlType, dims: &[u64]) -> Result<Self> {
        let (n_in, n_out) = match *dims {
            [n] => (n, 1),
            [n, m] => (n, m),
            _ => bail!("a projection weight is 2-D, not {dims:?}"),
        };
        if !kernels::supports(dtype) {
            bail!(
                "tensor type {dtype} has no kernel here (supported: {})",
                kernels::TYPES
                    .iter()
                    .chain(&kernels::DEQUANTIZED)
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(Self(Matrix::new(bytes, dtype, n_in, n_out)?))
    }

    /// Input width.
    pub fn n_in(&self) -> usize {
        self.0.n_in()
    }

    /// `W · x` for each row of `x` (`[rows][n_in]`): `[rows][n_out]`.
    pub fn apply(&self, x: &[f32]) -> Result<Vec<f32>> {
        self.0.apply(x)
    }

    /// [`Projection::apply_all`] for a fixed number of projections.
    pub fn apply_n<const N: usize>(ps: [&Projection; N], x: &[f32]) -> Result<[Vec<f32>; N]> {
        let ys = Self::apply_all(&ps, x)?;
        match ys.try_into() {
            Ok(ys) => Ok(ys),
            Err(ys) => bail!("{N} projections gave {} outputs", ys.len()),
        }
    }

    /// Each of `ps` applied to the same rows `x`, in one pass over the threads
    /// ([`Matrix::apply_all`]).
    pub fn apply_all(ps: &[&Projection], x: &[f32]) -> Result<Vec<Vec<f32>>> {
        let ms: Vec<&Matrix> = ps.iter().map(|p| &p.0).collect();
        Matrix::apply_all(&ms, x)
    }
}
