//! The AVX2 path: the same row dot products as the generic code in `dot`, with the integer
//! block dots in AVX2 intrinsics (exact: no product or partial sum can overflow its lane) and
//! the float steps in the generic code's order.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::act::{Q8KBlock, Q8_0Block};
use super::dot::{f16_at, reduce_8, reduce_lanes, scale_min_k4, LANES};

/// Sum of the 8 i32 lanes (exact).
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

#[inline(always)]
unsafe fn load(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    _mm256_loadu_si256(p.as_ptr().cast())
}

#[inline(always)]
unsafe fn load_i8(p: &[i8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    _mm256_loadu_si256(p.as_ptr().cast())
}

/// The 8 float lanes summed in `dot::reduce_8`'s tree.
#[inline(always)]
unsafe fn reduce_8_ps(v: __m256) -> f32 {
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
    reduce_8(lanes)
}

/// The 8 six-bit scales and 8 mins of a K-quant superblock's 12 scale bytes, all at once
/// (the same integers as `dot::scale_min_k4` for each sub-block).
#[inline(always)]
fn scales_mins_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc_lo = u0 & M1;
    let sc_hi = (u2 & M2) | (((u0 >> 6) & M3) << 4);
    let mn_lo = u1 & M1;
    let mn_hi = ((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4);
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    sc[..4].copy_from_slice(&sc_lo.to_le_bytes());
    sc[4..].copy_from_slice(&sc_hi.to_le_bytes());
    mn[..4].copy_from_slice(&mn_lo.to_le_bytes());
    mn[4..].copy_from_slice(&mn_hi.to_le_bytes());
    (sc, mn)
}

/// `Σ_j mins[j] · (bsums[2j] + bsums[2j+1])`, exact.
#[inline(always)]
unsafe fn mins_dot(mins: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    let m = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr().cast()));
    let lo = _mm_loadu_si128(bsums.as_ptr().cast());
    let hi = _mm_loadu_si128(bsums.as_ptr().add(8).cast());
    let pairs = _mm_hadd_epi16(lo, hi);
    let p = _mm_madd_epi16(m, pairs);
    let p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0b01_00_11_10));
    let p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0b10_11_00_01));
    _mm_cvtsi128_si32(p)
}

/// Q5_K × Q8_K.
#[target_feature(enable = "avx2")]
pub unsafe fn row_q5_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let low = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut sum = 0f32;
    for (b, xb) in w.chunks_exact(176).zip(x) {
        let scales = &b[4..16];
        let qh = load(&b[16..]);
        let qs = &b[48..176];
        let mut acc = _mm256_setzero_si256();
        let mut msum = 0i32;
        for c in 0..4 {
            let bits = load(&qs[c * 32..]);
            let sh = _mm_cvtsi32_si128(2 * c as i32);
            let sh1 = _mm_cvtsi32_si128(2 * c as i32 + 1);
            let hl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, sh), one), 4);
            let hh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, sh1), one), 4);
            let lo = _mm256_or_si256(_mm256_and_si256(bits, low), hl);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), low), hh);
            let (s1, m1) = scale_min_k4(2 * c, scales);
            let (s2, m2) = scale_min_k4(2 * c + 1, scales);
            let pl = _mm256_maddubs_epi16(lo, load_i8(&xb.qs[c * 64..]));
            let ph = _mm256_maddubs_epi16(hi, load_i8(&xb.qs[c * 64 + 32..]));
            let pl = _mm256_madd_epi16(pl, _mm256_set1_epi16(s1 as i16));
            let ph = _mm256_madd_epi16(ph, _mm256_set1_epi16(s2 as i16));
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(pl, ph));
            let bs = &xb.bsums[4 * c..4 * c + 4];
            msum += m1 * (bs[0] as i32 + bs[1] as i32) + m2 * (bs[2] as i32 + bs[3] as i32);
        }
        let isum = hsum_i32(acc);
        sum += (f16_at(b, 0) * xb.d) * isum as f32;
        sum -= (f16_at(b, 2) * xb.d) * msum as f32;
    }
    sum
}

/// 16 lanes of `w · x` in two registers (`$w8(i)`: weights `i..i+8` as f32; `$w1(i)`: weight
/// `i`), then the generic code's tail and tree (see `dot`): the same order, so the same bits.
macro_rules! lanes_dot {
    ($w:expr, $x:expr, $w8:expr, $w1:expr) => {{
        let (w, x): (&[u8], &[f32]) = ($w, $x);
        let n = x.len();
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let full = n / LANES * LANES;
        let mut i = 0;
        while i < full {
            let x0 = _mm256_loadu_ps(x.as_ptr().add(i));
            let x1 = _mm256_loadu_ps(x.as_ptr().add(i + 8));
            a0 = _mm256_add_ps(a0, _mm256_mul_ps($w8(w, i), x0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps($w8(w, i + 8), x1));
            i += LANES;
        }
        let mut acc = [0f32; LANES];
        _mm256_storeu_ps(acc.as_mut_ptr(), a0);
        _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
        for (j, a) in acc.iter_mut().enumerate().take(n - full) {
            *a += $w1(w, full + j) * x[full + j];
        }
        reduce_lanes(acc)
    }};
}

/// f32 weights.
#[target_feature(enable = "avx2")]
pub unsafe fn row_f32(w: &[u8], x: &[f32]) -> f32 {
    lanes_dot!(
        w,
        x,
        |w: &[u8], i: usize| _mm256_loadu_ps(w.as_ptr().add(4 * i).cast()),
        |w: &[u8], i: usize| f32::from_le_bytes([
            w[4 * i],
            w[4 * i + 1],
            w[4 * i + 2],
            w[4 * i + 3]
        ])
    )
}

/// f16 weights (activations already rounded to f16).
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn row_f16(w: &[u8], x: &[f32]) -> f32 {
    lanes_dot!(
        w,
        x,
        |w: &[u8], i: usize| _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(2 * i).cast())),
        |w: &[u8], i: usize| f16_at(w, 2 * i)
    )
}

/// bf16 weights (activations already rounded to bf16).
#[target_feature(enable = "avx2")]
pub unsafe fn row_bf16(w: &[u8], x: &[f32]) -> f32 {
    lanes_dot!(
        w,
        x,
        |w: &[u8], i: usize| {
            let h = _mm_loadu_si128(w.as_ptr().add(2 * i).cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        },
        |w: &[u8], i: usize| f32::from_bits(
            (u16::from_le_bytes([w[2 * i], w[2 * i + 1]]) as u32) << 16
        )
    )
}

/// Q4_K rows against `n_tok` activation rows at once (`x`: `per` blocks per token):
/// `out[r × n_tok + t]`. Each superblock's weights are unpacked once for all tokens; each
/// token's sum takes the generic code's steps in its order, so the same bits.
#[target_feature(enable = "avx2")]
pub unsafe fn rows_q4_k(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8KBlock],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    let low = _mm256_set1_epi8(0x0F);
    for (wr, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n_tok)) {
        o.fill(0.0);
        for (i, b) in wr.chunks_exact(144).enumerate() {
            let scales = &b[4..16];
            let qs = &b[16..144];
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (scb, mn) = scales_mins_k4(scales);
            let mut nib = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let bits = load(&qs[c * 32..]);
                nib[2 * c] = _mm256_and_si256(bits, low);
                nib[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
            }
            for j in 0..8 {
                sc[j] = _mm256_set1_epi16(scb[j] as i16);
            }
            for (t, y) in o.iter_mut().enumerate() {
                let xb = &x[t * per + i];
                let mut acc = _mm256_setzero_si256();
                for j in 0..8 {
                    let p = _mm256_maddubs_epi16(nib[j], load_i8(&xb.qs[j * 32..]));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc[j]));
                }
                let msum = mins_dot(&mn, &xb.bsums);
                let isum = hsum_i32(acc);
                *y += (d * xb.d) * isum as f32;
                *y -= (dmin * xb.d) * msum as f32;
            }
        }
    }
}

/// Q6_K rows against `n_tok` activation rows at once, as [`rows_q4_k`].
#[target_feature(enable = "avx2")]
pub unsafe fn rows_q6_k(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8KBlock],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    let low = _mm256_set1_epi8(0x0F);
    let three = _mm256_set1_epi8(3);
    let m32 = _mm256_set1_epi8(32);
    for (wr, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n_tok)) {
        o.fill(0.0);
        for (i, b) in wr.chunks_exact(210).enumerate() {
            let d = f16_at(b, 208);
            let mut q = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let ql1 = load(&b[n * 64..]);
                let ql2 = load(&b[n * 64 + 32..]);
                let qh = load(&b[128 + n * 32..]);
                q[4 * n] = _mm256_or_si256(
                    _mm256_and_si256(ql1, low),
                    _mm256_slli_epi16(_mm256_and_si256(qh, three), 4),
                );
                q[4 * n + 1] = _mm256_or_si256(
                    _mm256_and_si256(ql2, low),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4),
                );
                q[4 * n + 2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4),
                );
                q[4 * n + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql2, 4), low),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4),
                );
                let s = &b[192 + n * 8..192 + n * 8 + 8];
                for k in 0..4 {
                    let (sa, sb) = (s[2 * k] as i8 as i16, s[2 * k + 1] as i8 as i16);
                    sc[4 * n + k] = _mm256_setr_epi16(
                        sa, sa, sa, sa, sa, sa, sa, sa, sb, sb, sb, sb, sb, sb, sb, sb,
                    );
                }
            }
            for (t, y) in o.iter_mut().enumerate() {
                let xb = &x[t * per + i];
                let mut acc = _mm256_setzero_si256();
                for j in 0..8 {
                    let yv = load_i8(&xb.qs[j * 32..]);
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(q[j], yv),
                        _mm256_maddubs_epi16(m32, yv),
                    );
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc[j]));
                }
                *y += (d * xb.d) * hsum_i32(acc) as f32;
            }
        }
    }
}

/// Q8_0 rows against `n_tok` activation rows at once, as [`rows_q4_k`], in the generic
/// code's 2 × 8 lanes.
#[target_feature(enable = "avx2")]
pub unsafe fn rows_q8_0(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8_0Block],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = vec![[_mm256_setzero_ps(); 2]; n_tok];
    for (wr, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(n_tok)) {
        acc.fill([_mm256_setzero_ps(); 2]);
        for (i, b) in wr.chunks_exact(34).enumerate() {
            let qx = load(&b[2..]);
            let ax = _mm256_sign_epi8(qx, qx);
            let d = f16_at(b, 0);
            for (t, a) in acc.iter_mut().enumerate() {
                let xb = &x[t * per + i];
                let p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(load_i8(&xb.qs), qx));
                let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                a[i % 2] = _mm256_add_ps(a[i % 2], _mm256_mul_ps(_mm256_set1_ps(d * xb.d), lanes));
            }
        }
        for (y, a) in o.iter_mut().zip(&acc) {
            *y = reduce_8_ps(_mm256_add_ps(a[0], a[1]));
        }
    }
}
