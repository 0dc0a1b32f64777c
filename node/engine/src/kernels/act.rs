//! Activations rounded to a weight type's "vec-dot" type, as llama.cpp rounds them on x86:
//! f32 weights take f32, f16 and bf16 weights take the activations rounded to f16 / bf16,
//! Q8_0 weights take Q8_0 blocks of 32, K-quants take Q8_K blocks of 256 with their sums of 16.
//! Plain scalar code: the same bits on every CPU.

use moeswarm_model::gguf::GgmlType;

/// Values in a K-quant superblock.
pub const QK_K: usize = 256;
/// Values in a Q8_0 block.
pub const QK8_0: usize = 32;

/// 32 activations as int8 with one scale (ggml's `block_q8_0`; the scale is the f16 value,
/// widened).
#[derive(Debug, Clone, Copy)]
pub struct Q8_0Block {
    /// Scale: value = `d × q`.
    pub d: f32,
    /// The quantized values.
    pub qs: [i8; QK8_0],
}

/// 256 activations as int8 with one f32 scale and the sums of each 16 (ggml's `block_q8_K`).
#[derive(Debug, Clone, Copy)]
pub struct Q8KBlock {
    /// Scale: value = `d × q`.
    pub d: f32,
    /// The quantized values.
    pub qs: [i8; QK_K],
    /// Sums of each 16 consecutive values of `qs`.
    pub bsums: [i16; QK_K / 16],
    /// Sums of each 32 consecutive values of `qs` (pairs of `bsums`): what the K-quants'
    /// mins multiply, summed once here rather than once per weight row.
    pub sums32: [i16; QK_K / 32],
}

/// Rows of activations, prepared for one weight type.
#[derive(Debug, Clone)]
pub enum Activations {
    /// f32 values (already rounded to f16 or bf16 for those weight types).
    F32(Vec<f32>),
    /// Q8_0 blocks, each row a whole number of them.
    Q8_0(Vec<Q8_0Block>),
    /// Q8_K blocks, each row a whole number of them.
    Q8K(Vec<Q8KBlock>),
}

impl Activations {
    /// The values the kernels compute with, widened: the f32 values, or `d × q` per block.
    pub fn widened(&self) -> Vec<f64> {
        match self {
            Activations::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Activations::Q8_0(b) => b
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
                .collect(),
            Activations::Q8K(b) => b
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
                .collect(),
        }
    }
}

/// ggml's `nearest_int`: round half to even through the float mantissa (|v| < 2^22).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `quantize_row_q8_K_ref` for one block.
pub fn quantize_q8k(x: &[f32]) -> Q8KBlock {
    debug_assert_eq!(x.len(), QK_K);
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    let mut b = Q8KBlock {
        d: 0.0,
        qs: [0; QK_K],
        bsums: [0; QK_K / 16],
        sums32: [0; QK_K / 32],
    };
    if amax == 0.0 {
        return b;
    }
    let iscale = -127.0f32 / max;
    for (q, &v) in b.qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, chunk) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = chunk.iter().map(|&q| q as i16).sum();
    }
    for (s, pair) in b.sums32.iter_mut().zip(b.bsums.chunks_exact(2)) {
        *s = pair[0] + pair[1];
    }
    b.d = 1.0 / iscale;
    b
}

/// ggml's x86 `quantize_row_q8_0` for one block: scale `amax / 127` stored as f16, values
/// `x × 127 / amax` rounded half to even.
pub fn quantize_q8_0(x: &[f32]) -> Q8_0Block {
    debug_assert_eq!(x.len(), QK8_0);
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = half::f16::from_f32(amax / 127.0).to_f32();
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut qs = [0i8; QK8_0];
    for (q, &v) in qs.iter_mut().zip(x) {
        // Half to even, saturating like ggml's packs (and like `round_ties_even() as i8`).
        *q = nearest_int(v * id).clamp(-128, 127) as i8;
    }
    Q8_0Block { d, qs }
}

/// The vec-dot type llama.cpp rounds activations to for weights of type `w` (for the types
/// computed on their dequantized values, [`super::DEQUANTIZED`], the type itself: the
/// activations stay f32).
pub fn vec_dot_type(w: GgmlType) -> GgmlType {
    match w {
        GgmlType::Q8_0 | GgmlType::Q4_0 => GgmlType::Q8_0,
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => GgmlType::Q8_K,
        other => other,
    }
}

/// Prepares rows `x` (`[rows][n_in]`) for weights of type `w` (`n_in` a multiple of the
/// block size). Types without a kernel of their own ([`super::DEQUANTIZED`]) take the f32
/// activations as they are.
pub fn prepare(w: GgmlType, x: &[f32], n_in: usize) -> Activations {
    match w {
        GgmlType::F16 => {
            Activations::F32(x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect())
        }
        GgmlType::BF16 => Activations::F32(
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect(),
        ),
        GgmlType::Q8_0 | GgmlType::Q4_0 => Activations::Q8_0(
            x.chunks_exact(n_in)
                .flat_map(|row| row.chunks_exact(QK8_0).map(quantize_q8_0))
                .collect(),
        ),
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => Activations::Q8K(
            x.chunks_exact(n_in)
                .flat_map(|row| row.chunks_exact(QK_K).map(quantize_q8k))
                .collect(),
        ),
        _ => Activations::F32(x.to_vec()),
    }
}
