//! The AVX-VNNI path: the AVX2 path's tiles with the integer block dots in AVX-VNNI's 256-bit
//! `vpdpbusd` (four u8 × i8 products summed into an i32 lane: what AVX2's `maddubs` + `madd`
//! by ones leave there) and `vpdpwssd` (the scale applied and added in one step). The lane
//! sums are the same exact integers, in the same lanes, and the float steps are the AVX2
//! path's, so the bits are the baseline's. Float weights run the AVX2 code.
//!
//! A 4-value lane sum is at most 4 × 63 × 128 = 32,256 in magnitude for every type here
//! (Q6_K's offset values included), so it fits the low 16 bits of its i32 lane and
//! `vpdpwssd` against a register of `(scale, 0)` pairs multiplies it exactly.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::act::{Q8KBlock, Q8_0Block};
use super::avx2::{
    add_lanes, add_mins, f16_one, f16_pair, load, load_i8, mins_i16, mins_lanes, prefetch,
    q4_q5_pair, q8_0_values, reduce_4_ps, reduce_8_ps, scales_mins_k4,
};
use super::dot::{Q4_0_BYTES, Q8_0_BYTES};

/// Lane `k` = Σ of the four products `q[4k..4k+4] · y[4k..4k+4]` (`q` unsigned).
#[inline(always)]
unsafe fn dot4(q: __m256i, y: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, y)
}

/// `acc + p × s`, lane by lane, for lane values `p` that fit i16 and `s` of `(scale, 0)` pairs.
#[inline(always)]
unsafe fn add_scaled(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
    _mm256_dpwssd_avx_epi32(acc, p, s)
}

/// Q4_K (`HIGH = false`) or Q5_K (`HIGH = true`) rows against `n_tok` activation rows, as
/// `avx2::rows_q4_q5_k`.
#[target_feature(enable = "avx2,f16c,avxvnni")]
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
    let mut lanes = [_mm256_setzero_ps(); T];
    let mut mins = [_mm_setzero_ps(); T];
    for (i, b) in wr.chunks_exact(block).enumerate() {
        prefetch(b);
        let sm = scales_mins_k4(&b[4..16]);
        let mn = mins_i16(sm);
        // Lane j: scale j as an i32, that is the pair (scale, 0).
        let sc = _mm256_cvtepu8_epi32(sm);
        let qh = if HIGH {
            load(&b[16..])
        } else {
            _mm256_setzero_si256()
        };
        let mut acc = [_mm256_setzero_si256(); T];
        for c in 0..4 {
            let (lo, hi) = q4_q5_pair::<HIGH>(&b[qs_at + c * 32..], qh, c);
            let sl = _mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(2 * c as i32));
            let sh = _mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(2 * c as i32 + 1));
            for (t, a) in acc.iter_mut().enumerate() {
                let y = &x[t * per + i].qs;
                *a = add_scaled(*a, dot4(lo, load_i8(&y[c * 64..])), sl);
                *a = add_scaled(*a, dot4(hi, load_i8(&y[c * 64 + 32..])), sh);
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

/// Q6_K rows against `n_tok` activation rows, as `avx2::rows_q6_k`.
#[target_feature(enable = "avx2,f16c,avxvnni")]
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
    let m32 = _mm256_set1_epi8(32);
    let mut lanes = [_mm256_setzero_ps(); T];
    for (i, b) in wr.chunks_exact(210).enumerate() {
        prefetch(b);
        let d = f16_one(b, 208);
        let (q, _) = super::avx2::q6_k_unpack(b);
        // Scale j (signed) as the pair (scale, 0) in i32 lane j of two registers.
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b[192..].as_ptr().cast()));
        let sc = [
            _mm256_cvtepu16_epi32(_mm256_castsi256_si128(sc16)),
            _mm256_cvtepu16_epi32(_mm256_extracti128_si256(sc16, 1)),
        ];
        // Group j (of 32 values) uses scales 2j (lanes 0–3) and 2j + 1 (lanes 4–7).
        let s: [__m256i; 8] = std::array::from_fn(|j| {
            let k = (2 * j % 8) as i32;
            _mm256_permutevar8x32_epi32(
                sc[j / 4],
                _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1),
            )
        });
        for (t, l) in lanes.iter_mut().enumerate() {
            let xb = &x[t * per + i];
            let mut acc = _mm256_setzero_si256();
            for j in 0..8 {
                let y = load_i8(&xb.qs[j * 32..]);
                let p = _mm256_sub_epi32(dot4(q[j], y), dot4(m32, y));
                acc = add_scaled(acc, p, s[j]);
            }
            *l = add_lanes(*l, d * xb.d, acc);
        }
    }
    for t in 0..T {
        out[t] = reduce_8_ps(lanes[t]);
    }
}

/// A Q8_0 activation block laid out for [`q8_0_tile`]: its values offset to unsigned
/// (`y + 128`, the operand `vpdpbusd` takes unsigned) and its scale in every lane. Built once
/// per call for every row of it.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct OffsetBlock {
    yu: [u8; 32],
    dx: [f32; 8],
}

thread_local! {
    /// Each thread's [`OffsetBlock`]s, reused from call to call.
    static BLOCKS: std::cell::RefCell<Vec<OffsetBlock>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Q8_0 (`NIBBLES = false`) or Q4_0 (`NIBBLES = true`) rows against `n_tok` activation
/// rows, as `avx2::rows_q8_0`.
#[target_feature(enable = "avx2,f16c,avxvnni")]
pub unsafe fn rows_q8_0<const NIBBLES: bool>(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8_0Block],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    BLOCKS.with_borrow_mut(|buf| {
        let flip = _mm256_set1_epi8(-128);
        buf.clear();
        buf.extend(x[..n_tok * per].iter().map(|xb| {
            let mut b = OffsetBlock {
                yu: [0; 32],
                dx: [xb.d; 8],
            };
            let yu = _mm256_xor_si256(load_i8(&xb.qs), flip);
            _mm256_storeu_si256(b.yu.as_mut_ptr().cast(), yu);
            b
        }));
        in_tiles!(q8_0_tile, NIBBLES; w, row_bytes, &buf[..], per, n_tok, out);
    });
}

/// One Q8_0/Q4_0 row against `T` consecutive tokens' [`OffsetBlock`]s: block `i` adds to
/// lane set `i mod 2`. The integer lanes are `Σ (y + 128) · q − 128 · Σ q`: `vpdpbusd` from a
/// start of `−128 · Σ q`, exact.
#[inline(always)]
unsafe fn q8_0_tile<const T: usize, const NIBBLES: bool>(
    wr: &[u8],
    x: &[OffsetBlock],
    per: usize,
    out: &mut [f32],
) {
    #[inline(always)]
    unsafe fn block<const T: usize, const NIBBLES: bool>(
        b: &[u8],
        x: &[OffsetBlock],
        per: usize,
        i: usize,
        acc: &mut [__m256; T],
    ) {
        let qx = q8_0_values::<NIBBLES>(b);
        let start = _mm256_sub_epi32(_mm256_setzero_si256(), dot4(_mm256_set1_epi8(-128), qx));
        let d = _mm256_set1_ps(f16_one(b, 0));
        for (t, a) in acc.iter_mut().enumerate() {
            let xb = &x[t * per + i];
            let yu = _mm256_load_si256(xb.yu.as_ptr().cast());
            let lanes = _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(start, yu, qx));
            let scale = _mm256_mul_ps(d, _mm256_load_ps(xb.dx.as_ptr()));
            *a = _mm256_add_ps(*a, _mm256_mul_ps(scale, lanes));
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
