//! A linear map `y = W · x` on a weight tensor as stored: the engine's own kernels
//! ([`crate::kernels`]) for the types they compute, candle's for the rest.

use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};

use crate::error::{bail, Context, Result};
use crate::kernels::{self, Matrix, WeightBytes};
use crate::quant::qtensor;
use moeswarm_model::gguf::GgmlType;

/// A 2-D weight `[n_in, n_out]`, ready to apply to rows of `n_in` activations.
pub enum Projection {
    /// On the engine's kernels: bit-identical on every CPU.
    Kernel(Matrix),
    /// On candle's quantized matmul (types the kernels do not cover).
    Candle {
        /// The matmul.
        matmul: QMatMul,
        /// Input width.
        n_in: usize,
    },
}

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
        if kernels::supports(dtype)
            && n_in.is_multiple_of(kernels::act::vec_dot_type(dtype).block_size())
        {
            return Ok(Self::Kernel(Matrix::new(bytes, dtype, n_in, n_out)?));
        }
        Ok(Self::Candle {
            matmul: QMatMul::from_qtensor(qtensor(bytes.as_slice(), dtype, &[n_in, n_out])?)?,
            n_in: n_in as usize,
        })
    }

    /// Input width.
    pub fn n_in(&self) -> usize {
        match self {
            Self::Kernel(m) => m.n_in(),
            Self::Candle { n_in, .. } => *n_in,
        }
    }

    /// `W · x` for each row of `x` (`[rows][n_in]`): `[rows][n_out]`.
    pub fn apply(&self, x: &[f32]) -> Result<Vec<f32>> {
        match self {
            Self::Kernel(m) => m.apply(x),
            Self::Candle { matmul, n_in } => {
                if !x.len().is_multiple_of(*n_in) {
                    bail!("{} activations are not whole rows of {n_in}", x.len());
                }
                let t = Tensor::from_slice(x, (x.len() / n_in, *n_in), &Device::Cpu)?;
                Ok(matmul
                    .forward(&t)
                    .context("candle matmul")?
                    .flatten_all()?
                    .to_vec1::<f32>()?)
            }
        }
    }

    /// [`Projection::apply_all`] for a fixed number of projections.
    pub fn apply_n<const N: usize>(ps: [&Projection; N], x: &[f32]) -> Result<[Vec<f32>; N]> {
        let ys = Self::apply_all(&ps, x)?;
        match ys.try_into() {
            Ok(ys) => Ok(ys),
            Err(ys) => bail!("{N} projections gave {} outputs", ys.len()),
        }
    }

    /// Each of `ps` applied to the same rows `x`: on the kernels in one pass over the threads
    /// ([`Matrix::apply_all`]) when all are kernel projections, one after another otherwise.
    pub fn apply_all(ps: &[&Projection], x: &[f32]) -> Result<Vec<Vec<f32>>> {
        let kernel: Option<Vec<&Matrix>> = ps
            .iter()
            .map(|p| match p {
                Self::Kernel(m) => Some(m),
                Self::Candle { .. } => None,
            })
            .collect();
        match kernel {
            Some(ms) => Matrix::apply_all(&ms, x),
            None => ps.iter().map(|p| p.apply(x)).collect(),
        }
    }
}
