//! The AVX2 path: the same row dot products as the generic code in `dot`, with the integer
//! block dots in AVX2 intrinsics (exact: no product or partial sum can overflow its lane) and
//! the float steps in the generic code's order.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::act::{Q8KBlock, Q8_0Block};
use super::dot::{f16_at, reduce_lanes, LANES, Q4_0_BYTES, Q8_0_BYTES};

#[inline(always)]
pub(super) unsafe fn load(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    _mm256_loadu_si256(p.as_ptr().cast())
}

#[inline(always)]
pub(super) unsafe fn load_i8(p: &[i8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    _mm256_loadu_si256(p.as_ptr().cast())
}

/// Asks for the cache lines `PREFETCH` bytes past `b` (weights stream through once, and
/// the hardware's own prefetch does not run far enough ahead of a row's dependent chain).
#[inline(always)]
pub(super) unsafe fn prefetch(b: &[u8]) {
    let p = b.as_ptr().wrapping_add(PREFETCH);
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64).cast());
}

const PREFETCH: usize = 2048;

/// The 8 float lanes summed in `dot::reduce_8`'s tree.
#[inline(always)]
pub(super) unsafe fn reduce_8_ps(v: __m256) -> f32 {
    // Lane i + lane i+4, then the 4-lane tree.
    reduce_4_ps(_mm_add_ps(
        _mm256_castps256_ps128(v),
        _mm256_extractf128_ps(v, 1),
    ))
}

/// The 8 six-bit scales (bytes 0–7) and 8 mins (bytes 8–15) of a K-quant superblock's 12
/// scale bytes, all at once, in a register (the same integers as `dot::scale_min_k4` for each
/// sub-block; built in registers, so no load waits on two narrower stores).
#[inline(always)]
pub(super) unsafe fn scales_mins_k4(s: &[u8]) -> __m128i {
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc_lo = u0 & M1;
    let sc_hi = (u2 & M2) | (((u0 >> 6) & M3) << 4);
    let mn_lo = u1 & M1;
    let mn_hi = ((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4);
    _mm_setr_epi32(sc_lo as i32, sc_hi as i32, mn_lo as i32, mn_hi as i32)
}

/// The 4 integer mins lanes of `dot::KLanes`: lane `c` = `mins[2c] · P(2c) + mins[2c+1] ·
/// P(2c+1)`, `P(j)` the sum of sub-block `j`'s activations (`sums32`), as floats.
#[inline(always)]
pub(super) unsafe fn mins_lanes(mins: __m128i, sums32: &[i16; 8]) -> __m128 {
    let p = _mm_loadu_si128(sums32.as_ptr().cast());
    _mm_cvtepi32_ps(_mm_madd_epi16(mins, p))
}

/// The mins of [`scales_mins_k4`] as i16.
#[inline(always)]
pub(super) unsafe fn mins_i16(sm: __m128i) -> __m128i {
    _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm))
}

/// Mins lanes: `acc + dmin × m`, lane by lane.
#[inline(always)]
pub(super) unsafe fn add_mins(acc: __m128, dmin: f32, m: __m128) -> __m128 {
    _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(dmin), m))
}

/// `dot::reduce_4` on a register.
#[inline(always)]
pub(super) unsafe fn reduce_4_ps(v: __m128) -> f32 {
    // (lane 0 + lane 2) + (lane 1 + lane 3).
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)))
}

/// Two halves at `b[o..o + 4]` as singles, with F16C (exact, like `dot::f16_to_f32`).
#[inline(always)]
pub(super) unsafe fn f16_pair(b: &[u8], o: usize) -> (f32, f32) {
    let h = i32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(h));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)))
}

/// One half at `b[o..o + 2]` as a single, with F16C.
#[inline(always)]
pub(super) unsafe fn f16_one(b: &[u8], o: usize) -> f32 {
    let h = u16::from_le_bytes([b[o], b[o + 1]]) as i32;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
}

/// The 8 scales of [`scales_mins_k4`] as i16 in both halves of a register;
/// `_mm256_shuffle_epi8` by [`scale_mask`] `(j)` then broadcasts scale `j`.
#[inline(always)]
unsafe fn scales_i16(sm: __m128i) -> __m256i {
    _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm))
}

#[inline(always)]
unsafe fn scale_mask(j: usize) -> __m256i {
    _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16)
}

/// Float lanes of a row (see `dot::KLanes`): `acc + d × isum`, lane by lane.
#[inline(always)]
pub(super) unsafe fn add_lanes(acc: __m256, d: f32, isum: __m256i) -> __m256 {
    _mm256_add_ps(
        acc,
        _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum)),
    )
}

/// Float weight kinds for [`rows_float`].
pub const F32: u8 = 0;
/// See [`F32`].
pub const F16: u8 = 1;
/// See [`F32`].
pub const BF16: u8 = 2;

/// Weights `i..i + 8` of a float row as singles (all three conversions are exact).
#[inline(always)]
unsafe fn float8<const KIND: u8>(w: &[u8], i: usize) -> __m256 {
    match KIND {
        F32 => _mm256_loadu_ps(w.as_ptr().add(4 * i).cast()),
        F16 => _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(2 * i).cast())),
        _ => {
            let h = _mm_loadu_si128(w.as_ptr().add(2 * i).cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
}

/// Weight `i` of a float row as a single.
#[inline(always)]
pub(super) fn float1<const KIND: u8>(w: &[u8], i: usize) -> f32 {
    match KIND {
        F32 => f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
        F16 => f16_at(w, 2 * i),
        _ => f32::from_bits((u16::from_le_bytes([w[2 * i], w[2 * i + 1]]) as u32) << 16),
    }
}

/// Float rows (`KIND`: [`F32`], [`F16`] or [`BF16`]; activations already rounded to the
/// weight type) against `n_tok` activation rows of `n_in` values: `out[r × n_tok + t]`. Each
/// token sums in the generic code's 16 lanes (see `dot::lanes_dot`: lanes 0–7 and 8–15 in two
/// registers, the tail added lane by lane, then the fixed tree), so the bits are the same;
/// tokens go in tiles of up to 4, so each weight vector is loaded and converted once per tile.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn rows_float<const KIND: u8>(
    w: &[u8],
    row_bytes: usize,
    x: &[f32],
    n_in: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    in_tiles!(float_tile, KIND, false; w, row_bytes, x, n_in, n_tok, out);
}

/// [`rows_float`] for f16 weights with fused multiply-adds, for CPUs with FMA. The same bits:
/// a product of two halves (the activations are rounded to f16) has at most 22 significant
/// bits and lies far inside f32's normal range, so it is exact in f32, and
/// `fma(w, x, acc)` rounds `acc + w·x` once, as `acc + round(w·x)` does. (Not for bf16: its
/// products can fall below f32's normal range, where the separate multiply rounds.)
#[target_feature(enable = "avx2,f16c,fma")]
pub unsafe fn rows_f16_fused(
    w: &[u8],
    row_bytes: usize,
    x: &[f32],
    n_in: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    in_tiles!(float_tile, F16, true; w, row_bytes, x, n_in, n_tok, out);
}

/// One float row against `T` consecutive tokens (`x[t × n + i]`).
#[inline(always)]
unsafe fn float_tile<const T: usize, const KIND: u8, const FUSED: bool>(
    wr: &[u8],
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let full = n / LANES * LANES;
    let x = &x[..T * n];
    let mut a0 = [_mm256_setzero_ps(); T];
    let mut a1 = [_mm256_setzero_ps(); T];
    let mut i = 0;
    while i < full {
        prefetch(&wr[i * (if KIND == F32 { 4 } else { 2 })..]);
        let w0 = float8::<KIND>(wr, i);
        let w1 = float8::<KIND>(wr, i + 8);
        for t in 0..T {
            let xt = x.as_ptr().add(t * n + i);
            let (x0, x1) = (_mm256_loadu_ps(xt), _mm256_loadu_ps(xt.add(8)));
            if FUSED {
                a0[t] = _mm256_fmadd_ps(w0, x0, a0[t]);
                a1[t] = _mm256_fmadd_ps(w1, x1, a1[t]);
            } else {
                a0[t] = _mm256_add_ps(a0[t], _mm256_mul_ps(w0, x0));
                a1[t] = _mm256_add_ps(a1[t], _mm256_mul_ps(w1, x1));
            }
        }
        i += LANES;
    }
    for t in 0..T {
        let mut acc = [0f32; LANES];
        _mm256_storeu_ps(acc.as_mut_ptr(), a0[t]);
        _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1[t]);
        let xt = &x[t * n..(t + 1) * n];
        for (j, a) in acc.iter_mut().enumerate().take(n - full) {
            *a += float1::<KIND>(wr, full + j) * xt[full + j];
        }
        out[t] = reduce_lanes(acc);
    }
}

/// Sub-blocks `2c` (the low nibbles of `qs[0..32]`) and `2c + 1` (their high nibbles) of a
/// Q4_K (`HIGH = false`) or Q5_K superblock as u8 values, Q5_K's fifth bits (bits `2c` and
/// `2c + 1` of `qh`) added.
#[inline(always)]
pub(super) unsafe fn q4_q5_pair<const HIGH: bool>(
    qs: &[u8],
    qh: __m256i,
    c: usize,
) -> (__m256i, __m256i) {
    let low = _mm256_set1_epi8(0x0F);
    let bits = load(qs);
    let mut lo = _mm256_and_si256(bits, low);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
    if HIGH {
        let one = _mm256_set1_epi8(1);
        let hl = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32)), one);
        let hh = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32 + 1)),
            one,
        );
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(hl, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(hh, 4));
    }
    (lo, hi)
}

/// Q4_K (`HIGH = false`) or Q5_K (`HIGH = true`) rows against `n_tok` activation rows at
/// once (`x`: `per` blocks per token): `out[r × n_tok + t]`, in `dot::KLanes`' order. Tokens
/// go in tiles of up to 4 whose accumulators stay in registers, so each superblock is
/// unpacked once per tile.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn rows_q4_q5_k<const HIGH: bool>(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8KBlock],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    in_tiles!(q4_q5_k_tile, HIGH; w, row_bytes, x, per, n_tok, out);
}

/// One Q4_K/Q5_K row against `T` consecutive tokens' blocks (`x[t × per + i]`).
#[inline(always)]
unsafe fn q4_q5_k_tile<const T: usize, const HIGH: bool>(
    wr: &[u8],
    x: &[Q8KBlock],
    per: usize,
    out: &mut [f32],
) {
    let (block, qs_at) = if HIGH { (176, 48) } else { (144, 16) };
    let masks: [__m256i; 8] = std::array::from_fn(|j| scale_mask(j));
    let mut lanes = [_mm256_setzero_ps(); T];
    let mut mins = [_mm_setzero_ps(); T];
    for (i, b) in wr.chunks_exact(block).enumerate() {
        prefetch(b);
        let sm = scales_mins_k4(&b[4..16]);
        let mn = mins_i16(sm);
        let sc = scales_i16(sm);
        let qh = if HIGH {
            load(&b[16..])
        } else {
            _mm256_setzero_si256()
        };
        let mut acc = [_mm256_setzero_si256(); T];
        for c in 0..4 {
            let (lo, hi) = q4_q5_pair::<HIGH>(&b[qs_at + c * 32..], qh, c);
            let (sl, sh) = (
                _mm256_shuffle_epi8(sc, masks[2 * c]),
                _mm256_shuffle_epi8(sc, masks[2 * c + 1]),
            );
            for (t, a) in acc.iter_mut().enumerate() {
                let y = &x[t * per + i].qs;
                let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load_i8(&y[c * 64..])), sl);
                let ph =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load_i8(&y[c * 64 + 32..])), sh);
                *a = _mm256_add_epi32(*a, _mm256_add_epi32(pl, ph));
            }
        }
        let (d, dmin) = f16_pair(b, 0);
        for t in 0..T {
            let xb = &x[t * per + i];
            lanes[t] = add_lanes(lanes[t], d * xb.d, acc[t]);
            mins[t] = add_mins(mins[t], dmin * xb.d, mins_lanes(mn, &xb.sums32));
        }
    }
    for t in 0..T {
        out[t] = reduce_8_ps(lanes[t]) - reduce_4_ps(mins[t]);
    }
}

/// A Q6_K superblock's 8 groups of 32 values, as u8 (`q + 32`), with their scale registers
/// (two 16-value scales per group).
#[inline(always)]
pub(super) unsafe fn q6_k_unpack(b: &[u8]) -> ([__m256i; 8], [__m256i; 8]) {
    let low = _mm256_set1_epi8(0x0F);
    let three = _mm256_set1_epi8(3);
    let mut q = [_mm256_setzero_si256(); 8];
    let mut sc = [_mm256_setzero_si256(); 8];
    for n in 0..2 {
        let ql1 = load(&b[n * 64..]);
        let ql2 = load(&b[n * 64 + 32..]);
        let qh = load(&b[128 + n * 32..]);
        let hi = |s: i32| {
            let v = match s {
                0 => qh,
                2 => _mm256_srli_epi16(qh, 2),
                4 => _mm256_srli_epi16(qh, 4),
                _ => _mm256_srli_epi16(qh, 6),
            };
            _mm256_slli_epi16(_mm256_and_si256(v, three), 4)
        };
        q[4 * n] = _mm256_or_si256(_mm256_and_si256(ql1, low), hi(0));
        q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(ql2, low), hi(2));
        q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), hi(4));
        q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql2, 4), low), hi(6));
        let s = &b[192 + n * 8..192 + n * 8 + 8];
        for k in 0..4 {
            let (sa, sb) = (s[2 * k] as i8 as i16, s[2 * k + 1] as i8 as i16);
            sc[4 * n + k] = _mm256_setr_epi16(
                sa, sa, sa, sa, sa, sa, sa, sa, sb, sb, sb, sb, sb, sb, sb, sb,
            );
        }
    }
    (q, sc)
}

/// The integer lanes of a Q6_K superblock against one token's block.
#[inline(always)]
unsafe fn q6_k_lanes(q: &[__m256i; 8], sc: &[__m256i; 8], xb: &Q8KBlock) -> __m256i {
    let m32 = _mm256_set1_epi8(32);
    let mut acc = _mm256_setzero_si256();
    for j in 0..8 {
        let yv = load_i8(&xb.qs[j * 32..]);
        let p = _mm256_sub_epi16(
            _mm256_maddubs_epi16(q[j], yv),
            _mm256_maddubs_epi16(m32, yv),
        );
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc[j]));
    }
    acc
}

/// Q6_K rows against `n_tok` activation rows at once, as [`rows_q4_q5_k`].
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn rows_q6_k(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8KBlock],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    in_tiles!(q6_k_tile; w, row_bytes, x, per, n_tok, out);
}

/// One Q6_K row against `T` consecutive tokens' blocks.
#[inline(always)]
unsafe fn q6_k_tile<const T: usize>(wr: &[u8], x: &[Q8KBlock], per: usize, out: &mut [f32]) {
    let mut lanes = [_mm256_setzero_ps(); T];
    for (i, b) in wr.chunks_exact(210).enumerate() {
        prefetch(b);
        let d = f16_one(b, 208);
        let (q, sc) = q6_k_unpack(b);
        for (t, l) in lanes.iter_mut().enumerate() {
            let xb = &x[t * per + i];
            *l = add_lanes(*l, d * xb.d, q6_k_lanes(&q, &sc, xb));
        }
    }
    for t in 0..T {
        out[t] = reduce_8_ps(lanes[t]);
    }
}

/// Q8_0 (`NIBBLES = false`) or Q4_0 (`NIBBLES = true`) rows against `n_tok` activation
/// rows at once, as [`rows_q4_q5_k`], in the generic code's 2 × 8 lanes.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn rows_q8_0<const NIBBLES: bool>(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8_0Block],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    in_tiles!(q8_0_tile, NIBBLES; w, row_bytes, x, per, n_tok, out);
}

/// A Q8_0 block's 32 int8 values, or a Q4_0 block's 32 nibbles less 8, in value order.
#[inline(always)]
pub(super) unsafe fn q8_0_values<const NIBBLES: bool>(b: &[u8]) -> __m256i {
    if NIBBLES {
        debug_assert!(b.len() >= Q4_0_BYTES);
        let q = _mm_loadu_si128(b[2..].as_ptr().cast());
        let mask = _mm_set1_epi8(0xF);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8))
    } else {
        load(&b[2..])
    }
}

/// One Q8_0/Q4_0 row against `T` consecutive tokens' blocks: block `i` adds to lane set
/// `i mod 2`.
#[inline(always)]
unsafe fn q8_0_tile<const T: usize, const NIBBLES: bool>(
    wr: &[u8],
    x: &[Q8_0Block],
    per: usize,
    out: &mut [f32],
) {
    #[inline(always)]
    unsafe fn block<const T: usize, const NIBBLES: bool>(
        b: &[u8],
        x: &[Q8_0Block],
        per: usize,
        i: usize,
        acc: &mut [__m256; T],
    ) {
        let ones = _mm256_set1_epi16(1);
        let qx = q8_0_values::<NIBBLES>(b);
        let ax = _mm256_sign_epi8(qx, qx);
        let d = f16_one(b, 0);
        for (t, a) in acc.iter_mut().enumerate() {
            let xb = &x[t * per + i];
            let p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(load_i8(&xb.qs), qx));
            let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
            *a = _mm256_add_ps(*a, _mm256_mul_ps(_mm256_set1_ps(d * xb.d), lanes));
        }
    }
    let bytes = if NIBBLES { Q4_0_BYTES } else { Q8_0_BYTES };
    let mut a0 = [_mm256_setzero_ps(); T];
    let mut a1 = [_mm256_setzero_ps(); T];
    let n = wr.len() / bytes;
    let mut i = 0;
    while i + 2 <= n {
        prefetch(&wr[i * bytes..]);
        block::<T, NIBBLES>(&wr[i * bytes..], x, per, i, &mut a0);
        block::<T, NIBBLES>(&wr[(i + 1) * bytes..], x, per, i + 1, &mut a1);
        i += 2;
    }
    if i < n {
        block::<T, NIBBLES>(&wr[i * bytes..], x, per, i, &mut a0);
    }
    for t in 0..T {
        out[t] = reduce_8_ps(_mm256_add_ps(a0[t], a1[t]));
    }
}
