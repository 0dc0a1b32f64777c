//! Row dot products, one per weight type, written once and compiled for each [`Path`].
//!
//! The integer part of each block (int8 × 4/5/6/8-bit products summed in i32) is exact, so
//! however the compiler vectorizes it for a path, it gives the same integer. The float part —
//! scales times those integers, summed block after block — is written as plain sequential f32
//! arithmetic, which Rust never reassociates or fuses: the same on every path. Float weights
//! sum into 16 independent lanes (lane-wise, so vectorizing does not reorder anything) and
//! reduce in a fixed tree.

use moeswarm_model::gguf::GgmlType;

use super::act::{Activations, Q8KBlock, Q8_0Block, QK_K};
use super::Path;

/// IEEE half to single, exactly (every half is a single), without a call.
#[inline(always)]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if man == 0 => sign,
        // Subnormal: man × 2^-24, exact in f32.
        0 => {
            let v = man as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        0x1f => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[inline(always)]
pub(super) fn f16_at(b: &[u8], o: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[o], b[o + 1]]))
}

/// Q8_0 block bytes: f16 scale, 32 int8.
pub(super) const Q8_0_BYTES: usize = 34;
/// Q4_0 block bytes: f16 scale, 16 bytes of nibbles (value `j` in the low nibble of byte `j`,
/// value `j + 16` in its high nibble, both offset by 8).
pub(super) const Q4_0_BYTES: usize = 18;
/// Q4_K superblock bytes: f16 d, f16 dmin, 12 scale bytes, 128 nibble bytes.
const Q4_K_BYTES: usize = 144;
/// Q5_K superblock bytes: Q4_K's plus 32 bytes of high bits.
const Q5_K_BYTES: usize = 176;
/// Q6_K superblock bytes: 128 low nibbles, 64 high bit pairs, 16 int8 scales, f16 d.
const Q6_K_BYTES: usize = 210;

/// ggml's `get_scale_min_k4`: sub-block `j`'s 6-bit scale and min.
#[inline(always)]
pub(super) fn scale_min_k4(j: usize, s: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((s[j] & 63) as i32, (s[j + 4] & 63) as i32)
    } else {
        (
            ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)) as i32,
            ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as i32,
        )
    }
}

/// Value `i` (0..32) of a Q8_0 (`NIBBLES = false`) or Q4_0 (`NIBBLES = true`) block.
#[inline(always)]
fn q8_0_like<const NIBBLES: bool>(b: &[u8], i: usize) -> i32 {
    if NIBBLES {
        let q = b[2 + i % 16];
        (if i < 16 { q & 0xF } else { q >> 4 }) as i32 - 8
    } else {
        b[2 + i] as i8 as i32
    }
}

/// Q8_0 and Q4_0 (both against Q8_0 activations) sum in 2 × 8 lanes: lane `k` of a block is
/// the exact integer sum of its values `4k..4k+4` (what AVX2's `maddubs` + `madd` leave in
/// i32 lane `k`), scaled and added to float lane `k` of set `i mod 2` for block `i` (two
/// sets, so consecutive blocks do not wait on each other's adds); at the end of the row the
/// sets are added lane by lane and the lanes meet in a fixed tree.
#[inline(always)]
fn row_q8_0<const NIBBLES: bool>(w: &[u8], x: &[Q8_0Block]) -> f32 {
    let bytes = if NIBBLES { Q4_0_BYTES } else { Q8_0_BYTES };
    let mut lanes = [[0f32; 8]; 2];
    for (i, (b, xb)) in w.chunks_exact(bytes).zip(x).enumerate() {
        let d = f16_at(b, 0) * xb.d;
        for (k, lane) in lanes[i % 2].iter_mut().enumerate() {
            let isum: i32 = (4 * k..4 * k + 4)
                .map(|i| q8_0_like::<NIBBLES>(b, i) * (xb.qs[i] as i32))
                .sum();
            *lane += d * isum as f32;
        }
    }
    let mut sum = [0f32; 8];
    for k in 0..8 {
        sum[k] = lanes[0][k] + lanes[1][k];
    }
    reduce_8(sum)
}

/// The fixed tree over 8 lanes: 4 + 2 + 1.
#[inline(always)]
pub(super) fn reduce_8(mut acc: [f32; 8]) -> f32 {
    let mut width = 4;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// The K-quants' order (Q4_K, Q5_K, Q6_K) in 8 lanes: lane `k` of a superblock is the exact
/// integer sum, over its 32-value groups `g`, of `scale(g) × Σ q·y` over the group's values
/// `4k..4k+4` (what AVX2's `maddubs` + `madd` by the scale leave in i32 lane `k`, added group
/// after group); it is scaled by `d · x.d` and added to float lane `k`. The mins (Q4_K, Q5_K)
/// go in 4 lanes the same way: lane `c` holds `min(2c) · P(2c) + min(2c+1) · P(2c+1)`, `P(j)`
/// the sum of the activations of sub-block `j`, scaled by `dmin · x.d`. At the end of the row
/// the lanes meet in [`reduce_8`] and [`reduce_4`] and the mins are subtracted. No horizontal
/// sum inside the row.
#[derive(Default)]
pub(super) struct KLanes {
    lanes: [f32; 8],
    mins: [f32; 4],
}

impl KLanes {
    /// Adds a superblock's integer lanes scaled by `d` and its mins lanes scaled by `dmin`.
    #[inline(always)]
    pub(super) fn add(&mut self, d: f32, isum: [i32; 8], dmin: f32, msum: [i32; 4]) {
        for (l, i) in self.lanes.iter_mut().zip(isum) {
            *l += d * i as f32;
        }
        for (l, m) in self.mins.iter_mut().zip(msum) {
            *l += dmin * m as f32;
        }
    }

    /// The row's sum.
    #[inline(always)]
    pub(super) fn finish(self) -> f32 {
        reduce_8(self.lanes) - reduce_4(self.mins)
    }
}

/// The fixed tree over 4 lanes: 2 + 1.
#[inline(always)]
pub(super) fn reduce_4(acc: [f32; 4]) -> f32 {
    (acc[0] + acc[2]) + (acc[1] + acc[3])
}

/// Adds `scale × Σ q·y` over a 32-value group into the 8 lanes of 4 values each.
#[inline(always)]
fn group_lanes(isum: &mut [i32; 8], scale: i32, q: impl Fn(usize) -> i32, y: &[i8]) {
    for (k, s) in isum.iter_mut().enumerate() {
        let p: i32 = (4 * k..4 * k + 4).map(|l| q(l) * y[l] as i32).sum();
        *s += scale * p;
    }
}

/// Q4_K (`HIGH = false`) and Q5_K (`HIGH = true`: a fifth bit per value from `qh`) × Q8_K:
/// the same superblock layout but for those 32 bytes of high bits.
#[inline(always)]
fn row_q4_q5_k<const HIGH: bool>(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let (block, qs_at) = if HIGH {
        (Q5_K_BYTES, 48)
    } else {
        (Q4_K_BYTES, 16)
    };
    let mut acc = KLanes::default();
    for (b, xb) in w.chunks_exact(block).zip(x) {
        let scales = &b[4..16];
        let qh = &b[16..48];
        let qs = &b[qs_at..block];
        let (mut isum, mut msum) = ([0i32; 8], [0i32; 4]);
        for c in 0..4 {
            let q = &qs[c * 32..c * 32 + 32];
            let y = &xb.qs[c * 64..c * 64 + 64];
            let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
            let high = |l: usize, u: u8| if HIGH && qh[l] & u != 0 { 16 } else { 0 };
            let (s1, m1) = scale_min_k4(2 * c, scales);
            let (s2, m2) = scale_min_k4(2 * c + 1, scales);
            group_lanes(
                &mut isum,
                s1,
                |l| (q[l] & 0xF) as i32 + high(l, u1),
                &y[..32],
            );
            group_lanes(
                &mut isum,
                s2,
                |l| (q[l] >> 4) as i32 + high(l, u2),
                &y[32..],
            );
            msum[c] = m1 * xb.sums32[2 * c] as i32 + m2 * xb.sums32[2 * c + 1] as i32;
        }
        acc.add(f16_at(b, 0) * xb.d, isum, f16_at(b, 2) * xb.d, msum);
    }
    acc.finish()
}

/// Q6_K × Q8_K, in [`KLanes`]' order (16-value scales: each 32-value group has two, on
/// lanes 0–3 and 4–7).
#[inline(always)]
fn row_q6_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let mut acc = KLanes::default();
    for (b, xb) in w.chunks_exact(Q6_K_BYTES).zip(x) {
        let mut isum = [0i32; 8];
        for n in 0..2 {
            let ql = &b[n * 64..n * 64 + 64];
            let qh = &b[128 + n * 32..128 + n * 32 + 32];
            let sc = &b[192 + n * 8..192 + n * 8 + 8];
            let y = &xb.qs[n * 128..n * 128 + 128];
            // Group k of this half: (low nibbles of ql[0..32], qh bits 0-1), (ql[32..64],
            // bits 2-3), (high nibbles of ql[0..32], bits 4-5), (ql[32..64] high, bits 6-7).
            for k in 0..4 {
                let q = |l: usize| {
                    let lo = if k % 2 == 0 { ql[l] } else { ql[l + 32] };
                    let lo = if k < 2 { lo & 0xF } else { lo >> 4 };
                    ((lo | (((qh[l] >> (2 * k)) & 3) << 4)) as i32) - 32
                };
                let yk = &y[32 * k..32 * k + 32];
                let (sa, sb) = (sc[2 * k] as i8 as i32, sc[2 * k + 1] as i8 as i32);
                for (lane, s) in isum.iter_mut().enumerate() {
                    let scale = if lane < 4 { sa } else { sb };
                    let p: i32 = (4 * lane..4 * lane + 4).map(|l| q(l) * yk[l] as i32).sum();
                    *s += scale * p;
                }
            }
        }
        acc.add(f16_at(b, 208) * xb.d, isum, 0.0, [0; 4]);
    }
    acc.finish()
}

/// Lanes of the float dot products.
pub(super) const LANES: usize = 16;

/// The fixed tree that sums the lanes: halves added pairwise, 8 + 4 + 2 + 1.
#[inline(always)]
pub(super) fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// Lane-wise sums of `w[i] · x[i]` (lane `i mod 16`), then a fixed tree.
#[inline(always)]
fn lanes_dot(w: impl Fn(usize) -> f32, x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let full = x.len() / LANES * LANES;
    for base in (0..full).step_by(LANES) {
        for (i, a) in acc.iter_mut().enumerate() {
            *a += w(base + i) * x[base + i];
        }
    }
    for (i, a) in acc.iter_mut().enumerate().take(x.len() - full) {
        *a += w(full + i) * x[full + i];
    }
    reduce_lanes(acc)
}

#[inline(always)]
fn row_f32(w: &[u8], x: &[f32]) -> f32 {
    lanes_dot(
        |i| f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
        x,
    )
}

#[inline(always)]
fn row_f16(w: &[u8], x: &[f32]) -> f32 {
    lanes_dot(|i| f16_at(w, 2 * i), x)
}

#[inline(always)]
fn row_bf16(w: &[u8], x: &[f32]) -> f32 {
    lanes_dot(
        |i| f32::from_bits((u16::from_le_bytes([w[2 * i], w[2 * i + 1]]) as u32) << 16),
        x,
    )
}

/// One weight row against activation row `t`.
#[inline(always)]
fn row(dtype: GgmlType, w: &[u8], act: &Activations, t: usize, n_in: usize) -> f32 {
    match (dtype, act) {
        (GgmlType::Q8_0, Activations::Q8_0(b)) => {
            let per = n_in / 32;
            row_q8_0::<false>(w, &b[t * per..(t + 1) * per])
        }
        (GgmlType::Q4_0, Activations::Q8_0(b)) => {
            let per = n_in / 32;
            row_q8_0::<true>(w, &b[t * per..(t + 1) * per])
        }
        (GgmlType::Q4_K, Activations::Q8K(b)) => {
            let per = n_in / QK_K;
            row_q4_q5_k::<false>(w, &b[t * per..(t + 1) * per])
        }
        (GgmlType::Q5_K, Activations::Q8K(b)) => {
            let per = n_in / QK_K;
            row_q4_q5_k::<true>(w, &b[t * per..(t + 1) * per])
        }
        (GgmlType::Q6_K, Activations::Q8K(b)) => {
            let per = n_in / QK_K;
            row_q6_k(w, &b[t * per..(t + 1) * per])
        }
        (GgmlType::F32, Activations::F32(x)) => row_f32(w, &x[t * n_in..(t + 1) * n_in]),
        (GgmlType::F16, Activations::F32(x)) => row_f16(w, &x[t * n_in..(t + 1) * n_in]),
        (GgmlType::BF16, Activations::F32(x)) => row_bf16(w, &x[t * n_in..(t + 1) * n_in]),
        _ => unreachable!("activations are prepared for the weight type"),
    }
}

/// Weight rows `w` (`row_bytes` each) against every activation row: `out[o][t]`.
#[inline(always)]
fn rows(
    dtype: GgmlType,
    w: &[u8],
    row_bytes: usize,
    act: &Activations,
    n_tok: usize,
    n_in: usize,
    out: &mut [f32],
) {
    for (wr, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n_tok)) {
        for (t, y) in o.iter_mut().enumerate() {
            *y = row(dtype, wr, act, t, n_in);
        }
    }
}

/// [`rows`] with the row dots of an x86 SIMD path (each weight block unpacked once for a
/// tile of tokens).
///
/// # Safety
/// The CPU must have the path's flags ([`Path::available`]); `path` is not `Baseline`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_x86(
    path: Path,
    dtype: GgmlType,
    w: &[u8],
    row_bytes: usize,
    act: &Activations,
    n_tok: usize,
    n_in: usize,
    out: &mut [f32],
) {
    use super::{avx2, avx512, vnni};
    use GgmlType as G;
    use Path as P;
    let fma = std::is_x86_feature_detected!("fma");
    match (path, dtype, act) {
        (P::Avx512, G::Q4_K, Activations::Q8K(b)) => {
            avx512::rows_q4_q5_k::<false>(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (P::Avx512, G::Q5_K, Activations::Q8K(b)) => {
            avx512::rows_q4_q5_k::<true>(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (P::Avx512, G::Q6_K, Activations::Q8K(b)) => {
            avx512::rows_q6_k(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (P::Avx512, G::Q8_0, Activations::Q8_0(b)) => {
            avx512::rows_q8_0::<false>(w, row_bytes, b, n_in / 32, n_tok, out)
        }
        (P::Avx512, G::Q4_0, Activations::Q8_0(b)) => {
            avx512::rows_q8_0::<true>(w, row_bytes, b, n_in / 32, n_tok, out)
        }
        (P::Avx512, G::F32, Activations::F32(x)) => {
            avx512::rows_float::<{ avx512::F32 }>(w, row_bytes, x, n_in, n_tok, out)
        }
        (P::Avx512, G::F16, Activations::F32(x)) => {
            avx512::rows_float::<{ avx512::F16 }>(w, row_bytes, x, n_in, n_tok, out)
        }
        (P::Avx512, G::BF16, Activations::F32(x)) => {
            avx512::rows_float::<{ avx512::BF16 }>(w, row_bytes, x, n_in, n_tok, out)
        }
        (P::AvxVnni, G::Q4_K, Activations::Q8K(b)) => {
            vnni::rows_q4_q5_k::<false>(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (P::AvxVnni, G::Q5_K, Activations::Q8K(b)) => {
            vnni::rows_q4_q5_k::<true>(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (P::AvxVnni, G::Q6_K, Activations::Q8K(b)) => {
            vnni::rows_q6_k(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (P::AvxVnni, G::Q8_0, Activations::Q8_0(b)) => {
            vnni::rows_q8_0::<false>(w, row_bytes, b, n_in / 32, n_tok, out)
        }
        (P::AvxVnni, G::Q4_0, Activations::Q8_0(b)) => {
            vnni::rows_q8_0::<true>(w, row_bytes, b, n_in / 32, n_tok, out)
        }
        // The AVX2 code: that path's own types, and the float types on the VNNI path.
        (_, G::Q4_K, Activations::Q8K(b)) => {
            avx2::rows_q4_q5_k::<false>(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (_, G::Q5_K, Activations::Q8K(b)) => {
            avx2::rows_q4_q5_k::<true>(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (_, G::Q6_K, Activations::Q8K(b)) => {
            avx2::rows_q6_k(w, row_bytes, b, n_in / QK_K, n_tok, out)
        }
        (_, G::Q8_0, Activations::Q8_0(b)) => {
            avx2::rows_q8_0::<false>(w, row_bytes, b, n_in / 32, n_tok, out)
        }
        (_, G::Q4_0, Activations::Q8_0(b)) => {
            avx2::rows_q8_0::<true>(w, row_bytes, b, n_in / 32, n_tok, out)
        }
        (_, G::F32, Activations::F32(x)) => {
            avx2::rows_float::<{ avx2::F32 }>(w, row_bytes, x, n_in, n_tok, out)
        }
        (_, G::F16, Activations::F32(x)) if fma => {
            avx2::rows_f16_fused(w, row_bytes, x, n_in, n_tok, out)
        }
        (_, G::F16, Activations::F32(x)) => {
            avx2::rows_float::<{ avx2::F16 }>(w, row_bytes, x, n_in, n_tok, out)
        }
        (_, G::BF16, Activations::F32(x)) => {
            avx2::rows_float::<{ avx2::BF16 }>(w, row_bytes, x, n_in, n_tok, out)
        }
        _ => unreachable!("activations are prepared for the weight type"),
    }
}

/// Weight rows `w` (whole rows of `row_bytes`, type `dtype`, `n_in` values each) against the
/// `n_tok` rows of `act` on `path`: `out[o × n_tok + t]`. `path` must be available (see
/// [`Path::available`]); the bits do not depend on it.
#[allow(clippy::too_many_arguments)]
pub fn dot_rows(
    path: Path,
    dtype: GgmlType,
    w: &[u8],
    row_bytes: usize,
    act: &Activations,
    n_tok: usize,
    n_in: usize,
    out: &mut [f32],
) {
    debug_assert!(path.available());
    if super::DEQUANTIZED.contains(&dtype) {
        // Whole blocks of a type candle knows (checked by `Matrix::new`), so this succeeds;
        // NaN rather than a panic if it ever did not.
        let rows = w.len() / row_bytes;
        let values = crate::quant::dequantize(w, dtype, &[n_in as u64, rows as u64])
            .unwrap_or_else(|_| vec![f32::NAN; rows * n_in]);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        return dot_rows(path, GgmlType::F32, &bytes, 4 * n_in, act, n_tok, n_in, out);
    }
    match path {
        Path::Baseline => rows(dtype, w, row_bytes, act, n_tok, n_in, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller runs only paths this CPU has (`Path::available`).
        _ => unsafe { rows_x86(path, dtype, w, row_bytes, act, n_tok, n_in, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => rows(dtype, w, row_bytes, act, n_tok, n_in, out),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn f16_conversion_is_exact_for_every_half() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = super::f16_to_f32(h);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} vs {want}"
            );
        }
    }
}
