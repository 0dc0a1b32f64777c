//! Raw GGUF tensor bytes to candle quantized tensors, and dequantization.

use std::borrow::Cow;

use crate::error::{bail, Context, Result};
use candle_core::quantized::{QStorage, QTensor};
use candle_core::Device;

use moeswarm_model::gguf::GgmlType;

/// The environment variable that pins candle's x86 kernels to its AVX2 family.
pub const PIN_KERNELS_VAR: &str = "MISTRALRS_FORCE_AVX2";

/// Pins candle's x86 quantized kernels to the AVX2 family, whatever the CPU offers.
///
/// On CPUs with AVX512-VNNI or AVX-VNNI, candle 0.11 computes Q8_0 weights (rows a multiple of
/// 256) with Q8_K-rounded activations instead of ggml's Q8_0 rounding: results then differ from
/// llama.cpp's (logit cosine 0.9998 instead of 1.0000) and from any AVX2-only machine in the
/// swarm. Pinning keeps every x86 node on the same arithmetic, the one llama.cpp uses. Candle
/// reads the variable once, at its first quantized matmul, so this must run before that: the
/// `moeswarm` binary calls it first thing in `main`; the tests set the variable in
/// `.cargo/config.toml`. It only sets the variable when it is unset: `MISTRALRS_FORCE_AVX2=0`
/// opts out (faster on VNNI CPUs, see `docs/benchmarks.md`, but no longer llama.cpp's rounding).
pub fn pin_kernels() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os(PIN_KERNELS_VAR).is_none() {
            // SAFETY-relevant: setting the environment races with other threads reading it;
            // callers run this before starting threads (see above).
            std::env::set_var(PIN_KERNELS_VAR, "1");
        }
    });
}

/// Whether candle's kernels are pinned (see [`pin_kernels`]).
pub fn kernels_pinned() -> bool {
    std::env::var(PIN_KERNELS_VAR).as_deref() == Ok("1")
}

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
