//! The AVX-512 path: 512-bit registers and AVX-512 VNNI, in the lanes of the generic code.
//!
//! - K-quants: a 512-bit register holds two 32-value groups that sit side by side in the
//!   activations (Q4_K/Q5_K: a byte's low and high nibbles; Q6_K: a half's first 64 values),
//!   one group per 256-bit half; `vpdpbusd` sums each lane's four products and `vpdpwssd`
//!   applies that half's scale (the lane sums fit i16: see `vnni`). The halves are added at
//!   the end of the superblock, which gives each of the 8 integer lanes the same exact sum as
//!   the other paths; the float steps are then the AVX2 path's.
//! - Q8_0/Q4_0: two consecutive blocks to a register, block `2m` in the low half and `2m + 1`
//!   in the high one: exactly the generic code's two lane sets, so the float adds are the
//!   same adds in the same order.
//! - Float weights: the generic code's 16 lanes are one register.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use super::act::{Q8KBlock, Q8_0Block};
use super::avx2::float1;
use super::avx2::{
    add_lanes, add_mins, f16_one, f16_pair, load, load_i8, mins_i16, mins_lanes, prefetch,
    q8_0_values, reduce_4_ps, reduce_8_ps, scales_mins_k4,
};
use super::dot::{reduce_lanes, LANES, Q4_0_BYTES, Q8_0_BYTES};

/// Lane `k` = Σ of the four products `q[4k..4k+4] · y[4k..4k+4]` (`q` unsigned).
#[inline(always)]
unsafe fn dot4(q: __m512i, y: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y)
}

/// The 32 bytes at `p` in both halves.
#[inline(always)]
unsafe fn both_halves(p: &[u8]) -> __m512i {
    _mm512_broadcast_i64x4(load(p))
}

/// 64 activation bytes.
#[inline(always)]
unsafe fn load64(p: &[i8]) -> __m512i {
    debug_assert!(p.len() >= 64);
    _mm512_loadu_si512(p.as_ptr().cast())
}

/// Lanes 0–7 plus lanes 8–15: the 8 integer lanes of the other paths.
#[inline(always)]
unsafe fn fold_halves(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
}

/// A register whose lanes 0–7 are lane `a` of `v` and lanes 8–15 lane `b`.
#[inline(always)]
unsafe fn pick2(v: __m512i, a: i32, b: i32) -> __m512i {
    let idx = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set1_epi32(a)),
        _mm256_set1_epi32(b),
        1,
    );
    _mm512_permutexvar_epi32(idx, v)
}

/// Q4_K (`HIGH = false`) or Q5_K (`HIGH = true`) rows against `n_tok` activation rows, as
/// `avx2::rows_q4_q5_k`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q4_q5_k<const HIGH: bool>(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8KBlock],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    in_tiles!(8; q4_q5_k_tile, HIGH; w, row_bytes, x, per, n_tok, out);
}

/// One Q4_K/Q5_K row against `T` consecutive tokens' blocks (`x[t × per + i]`). Register
/// `c` holds group `2c` (low nibbles of `qs[32c..32c+32]`) and group `2c + 1` (their high
/// nibbles): activations `64c..64c+64`, one load.
#[inline(always)]
unsafe fn q4_q5_k_tile<const T: usize, const HIGH: bool>(
    wr: &[u8],
    x: &[Q8KBlock],
    per: usize,
    out: &mut [f32],
) {
    let (block, qs_at) = if HIGH { (176, 48) } else { (144, 16) };
    let low = _mm512_set1_epi8(0x0F);
    let fifth = _mm512_set1_epi8(0x10);
    // Tokens in pairs, one per 256-bit half of the float lanes (lane-wise, so the same adds);
    // an odd last token alone.
    let mut pairs = [_mm512_setzero_ps(); 4];
    let mut pair_mins = [_mm256_setzero_ps(); 4];
    let (mut last, mut last_mins) = (_mm256_setzero_ps(), _mm_setzero_ps());
    for (i, b) in wr.chunks_exact(block).enumerate() {
        prefetch(b);
        let sm = scales_mins_k4(&b[4..16]);
        let mn = mins_i16(sm);
        // Lane j: scale j as an i32, that is the pair (scale, 0).
        let sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(sm));
        let qh = if HIGH {
            both_halves(&b[16..])
        } else {
            _mm512_setzero_si512()
        };
        let mut acc = [_mm512_setzero_si512(); T];
        for c in 0..4 {
            let bits = both_halves(&b[qs_at + c * 32..]);
            // The high half's 16-bit lanes shifted by 4: its bytes' high nibbles.
            let mut q = _mm512_and_si512(_mm512_mask_srli_epi16::<4>(bits, 0xFFFF_0000, bits), low);
            if HIGH {
                // Bit 2c of qh for group 2c, bit 2c + 1 for group 2c + 1, moved to bit 4.
                let (s0, s1) = (2 * c as i16, 2 * c as i16 + 1);
                let shift = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set1_epi16(s0)),
                    _mm256_set1_epi16(s1),
                    1,
                );
                let h = _mm512_slli_epi16::<4>(_mm512_srlv_epi16(qh, shift));
                q = _mm512_or_si512(q, _mm512_and_si512(h, fifth));
            }
            let s = pick2(sc, 2 * c as i32, 2 * c as i32 + 1);
            for (t, a) in acc.iter_mut().enumerate() {
                let y = load64(&x[t * per + i].qs[c * 64..]);
                *a = _mm512_dpwssd_epi32(*a, dot4(q, y), s);
            }
        }
        let (d, dmin) = f16_pair(b, 0);
        let mn2 = _mm256_broadcastsi128_si256(mn);
        for t in (0..T - T % 2).step_by(2) {
            let (x0, x1) = (&x[t * per + i], &x[(t + 1) * per + i]);
            let xd = join_ps(_mm256_set1_ps(x0.d), _mm256_set1_ps(x1.d));
            pairs[t / 2] = add_pair_lanes(pairs[t / 2], d, xd, fold_pair(acc[t], acc[t + 1]));
            let p = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(x0.sums32.as_ptr().cast())),
                _mm_loadu_si128(x1.sums32.as_ptr().cast()),
                1,
            );
            let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(mn2, p));
            let dm = _mm256_mul_ps(_mm256_set1_ps(dmin), four_and_four(x0.d, x1.d));
            pair_mins[t / 2] = _mm256_add_ps(pair_mins[t / 2], _mm256_mul_ps(dm, m));
        }
        if T % 2 == 1 {
            let t = T - 1;
            let xb = &x[t * per + i];
            last = add_lanes(last, d * xb.d, fold_halves(acc[t]));
            last_mins = add_mins(last_mins, dmin * xb.d, mins_lanes(mn, &xb.sums32));
        }
    }
    for t in (0..T - T % 2).step_by(2) {
        let (l0, l1) = halves_ps(pairs[t / 2]);
        let (m0, m1) = (
            _mm256_castps256_ps128(pair_mins[t / 2]),
            _mm256_extractf128_ps(pair_mins[t / 2], 1),
        );
        out[t] = reduce_8_ps(l0) - reduce_4_ps(m0);
        out[t + 1] = reduce_8_ps(l1) - reduce_4_ps(m1);
    }
    if T % 2 == 1 {
        out[T - 1] = reduce_8_ps(last) - reduce_4_ps(last_mins);
    }
}

/// Two tokens' 8 integer lanes in one register, `a`'s in lanes 0–7 and `b`'s in 8–15: each
/// token's halves added (as [`fold_halves`] adds them).
#[inline(always)]
unsafe fn fold_pair(a: __m512i, b: __m512i) -> __m512i {
    let lo = _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b);
    let hi = _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b);
    _mm512_add_epi32(lo, hi)
}

/// `dot::KLanes::add`'s lane update for two tokens at once (float lanes 0–7 and 8–15):
/// `acc + (d × x.d) × isum`, lane by lane, the same operations as for one.
#[inline(always)]
unsafe fn add_pair_lanes(acc: __m512, d: f32, xd: __m512, isum: __m512i) -> __m512 {
    let scale = _mm512_mul_ps(_mm512_set1_ps(d), xd);
    _mm512_add_ps(acc, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(isum)))
}

/// `a` in lanes 0–3, `b` in lanes 4–7.
#[inline(always)]
unsafe fn four_and_four(a: f32, b: f32) -> __m256 {
    _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a))
}

/// Lanes 0–7 and 8–15.
#[inline(always)]
unsafe fn halves_ps(v: __m512) -> (__m256, __m256) {
    (
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
    )
}

/// Q6_K rows against `n_tok` activation rows, as `avx2::rows_q6_k`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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

/// A Q6_K superblock as 4 registers of two 32-value groups each (values `64m..64m+64`, as
/// u8 `q + 32`), with their scale registers (lane `L` of register `m`: scale `4m + L / 4`
/// as the pair (scale, 0)).
#[inline(always)]
unsafe fn q6_k_unpack(b: &[u8]) -> ([__m512i; 4], [__m512i; 4]) {
    let low = _mm512_set1_epi8(0x0F);
    let three = _mm512_set1_epi8(3);
    let shifts = |a: i16, b: i16| {
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set1_epi16(a)),
            _mm256_set1_epi16(b),
            1,
        )
    };
    let (s01, s23) = (shifts(0, 2), shifts(4, 6));
    let sc = _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128(
        b[192..].as_ptr().cast(),
    )));
    let mut q = [_mm512_setzero_si512(); 4];
    let mut s = [_mm512_setzero_si512(); 4];
    for n in 0..2 {
        // Half n: groups 0 and 1 are ql[0..64]'s low nibbles with qh bits 0–1 and 2–3;
        // groups 2 and 3 their high nibbles with bits 4–5 and 6–7.
        let ql = _mm512_loadu_si512(b[n * 64..].as_ptr().cast());
        let qh = both_halves(&b[128 + n * 32..]);
        let hi = |sh: __m512i| {
            _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srlv_epi16(qh, sh), three))
        };
        q[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, low), hi(s01));
        q[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), low), hi(s23));
        for h in 0..2 {
            let m = 2 * n + h;
            let k = 4 * m as i32;
            let idx = _mm512_setr_epi32(
                k,
                k,
                k,
                k,
                k + 1,
                k + 1,
                k + 1,
                k + 1,
                k + 2,
                k + 2,
                k + 2,
                k + 2,
                k + 3,
                k + 3,
                k + 3,
                k + 3,
            );
            s[m] = _mm512_permutexvar_epi32(idx, sc);
        }
    }
    (q, s)
}

/// One Q6_K row against `T` consecutive tokens' blocks.
#[inline(always)]
unsafe fn q6_k_tile<const T: usize>(wr: &[u8], x: &[Q8KBlock], per: usize, out: &mut [f32]) {
    let m32 = _mm512_set1_epi8(32);
    let mut lanes = [_mm256_setzero_ps(); T];
    for (i, b) in wr.chunks_exact(210).enumerate() {
        prefetch(b);
        let d = f16_one(b, 208);
        let (q, s) = q6_k_unpack(b);
        for (t, l) in lanes.iter_mut().enumerate() {
            let xb = &x[t * per + i];
            let mut acc = _mm512_setzero_si512();
            for m in 0..4 {
                let y = load64(&xb.qs[m * 64..]);
                let p = _mm512_sub_epi32(dot4(q[m], y), dot4(m32, y));
                acc = _mm512_dpwssd_epi32(acc, p, s[m]);
            }
            *l = add_lanes(*l, d * xb.d, fold_halves(acc));
        }
    }
    for t in 0..T {
        out[t] = reduce_8_ps(lanes[t]);
    }
}

/// Two consecutive Q8_0 activation blocks of one token laid out for [`q8_0_tile`]: their
/// values offset to unsigned (`y + 128`, the operand `vpdpbusd` takes unsigned) and their
/// scales spread over the lanes each block's products land in. Built once per call for every
/// row of it, so the tiles' inner loop is a load, a dot and the float steps.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct PairBlock {
    yu: [u8; 64],
    dx: [f32; 16],
}

const EMPTY_PAIR: PairBlock = PairBlock {
    yu: [0x80; 64],
    dx: [0.0; 16],
};

thread_local! {
    /// Each thread's [`PairBlock`]s, reused from call to call.
    static PAIRS: std::cell::RefCell<Vec<PairBlock>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Q8_0 (`NIBBLES = false`) or Q4_0 (`NIBBLES = true`) rows against `n_tok` activation
/// rows, as `avx2::rows_q8_0`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q8_0<const NIBBLES: bool>(
    w: &[u8],
    row_bytes: usize,
    x: &[Q8_0Block],
    per: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    let pairs = per.div_ceil(2);
    PAIRS.with_borrow_mut(|buf| {
        buf.clear();
        buf.resize(n_tok * pairs, EMPTY_PAIR);
        let flip = _mm256_set1_epi8(-128);
        for t in 0..n_tok {
            for (j, xb) in x[t * per..(t + 1) * per].iter().enumerate() {
                let p = &mut buf[t * pairs + j / 2];
                let half = 32 * (j % 2);
                let yu = _mm256_xor_si256(load_i8(&xb.qs), flip);
                _mm256_storeu_si256(p.yu[half..].as_mut_ptr().cast(), yu);
                p.dx[half / 4..half / 4 + 8].fill(xb.d);
            }
        }
        in_tiles!(8; q8_0_tile, NIBBLES; w, row_bytes, &buf[..], pairs, n_tok, out);
    });
}

/// Two 256-bit registers as one: `lo` in lanes 0–7, `hi` in 8–15.
#[inline(always)]
unsafe fn join_ps(lo: __m256, hi: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
        _mm256_castps_pd(hi),
        1,
    ))
}

/// One Q8_0/Q4_0 row against `T` consecutive tokens' [`PairBlock`]s. Blocks go in pairs,
/// `2m` in the low half (the generic code's lane set 0) and `2m + 1` in the high half (set 1);
/// an odd last block is paired with nothing (zero weights, zero values, zero scales: it adds
/// `+0.0` to set 1's lanes, which changes no lane, as no lane is ever `-0.0`). The integer
/// lanes are `Σ (y + 128) · q − 128 · Σ q`: `vpdpbusd` from a start of `−128 · Σ q`, exact.
#[inline(always)]
unsafe fn q8_0_tile<const T: usize, const NIBBLES: bool>(
    wr: &[u8],
    x: &[PairBlock],
    pairs: usize,
    out: &mut [f32],
) {
    let bytes = if NIBBLES { Q4_0_BYTES } else { Q8_0_BYTES };
    let n = wr.len() / bytes;
    let offset = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); T];
    for m in 0..pairs {
        let b0 = &wr[2 * m * bytes..];
        prefetch(b0);
        let (q1, d1) = if 2 * m + 1 < n {
            let b1 = &wr[(2 * m + 1) * bytes..];
            (q8_0_values::<NIBBLES>(b1), f16_one(b1, 0))
        } else {
            (_mm256_setzero_si256(), 0.0)
        };
        let qx = _mm512_inserti64x4(_mm512_castsi256_si512(q8_0_values::<NIBBLES>(b0)), q1, 1);
        let start = _mm512_sub_epi32(_mm512_setzero_si512(), dot4(offset, qx));
        let dw = join_ps(_mm256_set1_ps(f16_one(b0, 0)), _mm256_set1_ps(d1));
        for (t, a) in acc.iter_mut().enumerate() {
            let p = &x[t * pairs + m];
            let yu = _mm512_load_si512(p.yu.as_ptr().cast());
            let lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, yu, qx));
            let scale = _mm512_mul_ps(dw, _mm512_load_ps(p.dx.as_ptr()));
            *a = _mm512_add_ps(*a, _mm512_mul_ps(scale, lanes));
        }
    }
    for t in 0..T {
        let (set0, set1) = halves_ps(acc[t]);
        out[t] = reduce_8_ps(_mm256_add_ps(set0, set1));
    }
}

/// Float weight kinds, as `avx2`'s.
pub use super::avx2::{BF16, F16, F32};

/// Weights `i..i + 16` of a float row as singles (all three conversions are exact).
#[inline(always)]
unsafe fn float16<const KIND: u8>(w: &[u8], i: usize) -> __m512 {
    match KIND {
        F32 => _mm512_loadu_ps(w.as_ptr().add(4 * i).cast()),
        F16 => _mm512_cvtph_ps(_mm256_loadu_si256(w.as_ptr().add(2 * i).cast())),
        _ => {
            let h = _mm256_loadu_si256(w.as_ptr().add(2 * i).cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

/// Float rows against `n_tok` activation rows, as `avx2::rows_float`: the generic code's 16
/// lanes in one register. f16 weights use fused multiply-adds (exact there: see
/// `avx2::rows_f16_fused`).
#[target_feature(enable = "avx2,f16c,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_float<const KIND: u8>(
    w: &[u8],
    row_bytes: usize,
    x: &[f32],
    n_in: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    in_tiles!(8; float_tile, KIND; w, row_bytes, x, n_in, n_tok, out);
}

/// One float row against `T` consecutive tokens (`x[t × n + i]`).
#[inline(always)]
unsafe fn float_tile<const T: usize, const KIND: u8>(
    wr: &[u8],
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let full = n / LANES * LANES;
    let x = &x[..T * n];
    let mut acc = [_mm512_setzero_ps(); T];
    let mut i = 0;
    while i < full {
        prefetch(&wr[i * (if KIND == F32 { 4 } else { 2 })..]);
        let wv = float16::<KIND>(wr, i);
        for (t, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_loadu_ps(x.as_ptr().add(t * n + i));
            *a = if KIND == F16 {
                _mm512_fmadd_ps(wv, xv, *a)
            } else {
                _mm512_add_ps(*a, _mm512_mul_ps(wv, xv))
            };
        }
        i += LANES;
    }
    for t in 0..T {
        let mut lanes = [0f32; LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc[t]);
        let xt = &x[t * n..(t + 1) * n];
        for (j, a) in lanes.iter_mut().enumerate().take(n - full) {
            *a += float1::<KIND>(wr, full + j) * xt[full + j];
        }
        out[t] = reduce_lanes(lanes);
    }
}
