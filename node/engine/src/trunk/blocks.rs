//! Building blocks every trunk architecture loads and runs its layers with.

use crate::error::{bail, Context, Result};
use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};
use moeswarm_model::gguf::MappedGguf;

use crate::quant::{dequantize, qtensor};

/// Refuses a tensor whose shape is not what the hyper-parameters imply (no panic later).
pub fn expect_dims(g: &MappedGguf, name: &str, want: &[u64]) -> Result<()> {
    let t = g.tensor(name)?;
    if t.dims != want {
        bail!(
            "{name} has shape {:?}, the model's hyper-parameters want {want:?}",
            t.dims
        );
    }
    Ok(())
}

/// A norm's weights, dequantized to f32.
pub fn norm_weights(g: &MappedGguf, name: &str) -> Result<Vec<f32>> {
    let t = g.tensor(name)?;
    dequantize(t.data, t.dtype, t.dims)
}

/// A projection, kept quantized.
pub fn matmul(g: &MappedGguf, name: &str) -> Result<QMatMul> {
    let t = g.tensor(name)?;

    Ok(QMatMul::from_qtensor(
        qtensor(t.data, t.dtype, t.dims).with_context(|| name.to_string())?,
    )?)
}

/// `x · m` for rows `x` of width `n_in`.
pub fn project(m: &QMatMul, x: &[f32], n_in: usize) -> Result<Vec<f32>> {
    let rows = x.len() / n_in;
    let t = Tensor::from_slice(x, (rows, n_in), &Device::Cpu)?;
    Ok(m.forward(&t)?.flatten_all()?.to_vec1::<f32>()?)
}
