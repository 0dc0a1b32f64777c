//! Raw GGUF tensor bytes to candle quantized tensors, and dequantization.

use std::borrow::Cow;

use crate::error::{bail, Context, Result};
use candle_core::quantized::{QStorage, QTensor};
use candle_core::Device;

use moeswarm_model::gguf::GgmlType;

/// The candle type that computes a ggml type, if candle's CPU kernels cover it.
pub fn candle_dtype(t: GgmlType) -> Option<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as C;
    Some(match t {
        GgmlType::F32 => C::F32,
        GgmlType::F16 => C::F16,
        GgmlType::BF16 => C::BF16,
        GgmlType::Q4_0 => C::Q4_0,
        GgmlType::Q4_1 => C::Q4_1,
        GgmlType::Q5_0 => C::Q5_0,
        GgmlType::Q5_1 => C::Q5_1,
        GgmlType::Q8_0 => C::Q8_0,
        GgmlType::Q8_1 => C::Q8_1,
        GgmlType::Q2_K => C::Q2K,
        GgmlType::Q3_K => C::Q3K,
        GgmlType::Q4_K => C::Q4K,
        GgmlType::Q5_K => C::Q5K,
        GgmlType::Q6_K => C::Q6K,
        GgmlType::Q8_K => C::Q8K,
        _ => return None,
    })
}

/// The candle type for `dtype`, or a clear error when no CPU kernel computes it.
pub fn candle_type(dtype: GgmlType) -> Result<candle_core::quantized::GgmlDType> {
    candle_dtype(dtype).with_context(|| {
        format!("tensor type {dtype} has no CPU kernel here (supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q8_1, q2_k..q8_k)")
    })
}

/// A candle quantized tensor holding a copy of `data`, a tensor of ggml-order shape `dims`.
pub fn qtensor(data: &[u8], dtype: GgmlType, dims: &[u64]) -> Result<QTensor> {
    let ct = candle_type(dtype)?;
    let expected = moeswarm_model::gguf::TensorInfo {
        name: String::new(),
        dims: dims.to_vec(),
        dtype,
        offset: 0,
    }
    .n_bytes();
    if data.len() as u64 != expected {
        bail!(
            "tensor of shape {dims:?} {dtype} needs {expected} bytes, got {}",
            data.len()
        );
    }
    // candle wants the bytes aligned for its block type; copy into 8-byte aligned memory if not.
    let storage = if (data.as_ptr() as usize).is_multiple_of(8) {
        QStorage::from_data(Cow::Borrowed(data), &Device::Cpu, ct)?
    } else {
        let mut words = vec![0u64; data.len().div_ceil(8)];
        // SAFETY: `words` owns at least `data.len()` initialized bytes, u8 has no alignment.
        let view =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), data.len()) };
        view.copy_from_slice(data);
        QStorage::from_data(Cow::Borrowed(view), &Device::Cpu, ct)?
    };
    let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
    Ok(QTensor::new(storage, shape)?)
}

/// Dequantizes a tensor to f32 (ggml's own definition of its values), row-major.
pub fn dequantize(data: &[u8], dtype: GgmlType, dims: &[u64]) -> Result<Vec<f32>> {
    let t = qtensor(data, dtype, dims)?.dequantize(&Device::Cpu)?;
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_agree_with_candle() {
        for t in GgmlType::all() {
            if let Some(c) = candle_dtype(t) {
                assert_eq!(c.block_size() as u64, t.block_size(), "{t}");
                assert_eq!(c.type_size() as u64, t.block_bytes(), "{t}");
            }
        }
    }
}
