//! The engine's own matmul kernels: `y = W · x` on GGUF weight bytes as stored (no repacking,
//! no copy), with the same output bits on every CPU.
//!
//! Each weight type is computed as llama.cpp computes it: the activations are first rounded to
//! the weight's "vec-dot" type ([`act`]: f32 stays, f16/bf16 round, Q8_0 weights take Q8_0
//! activations, K-quants take Q8_K), then each row's dot product is the sum over blocks of
//! `scale × (integer block dot)`. The integer block dots are exact, whatever SIMD computes
//! them; the floating-point steps run in one fixed order ([`dot`]), never reassociated or
//! fused, so the generic and the AVX2 paths ([`Path`]) give identical bits. Float weights
//! (f32, f16, bf16) are summed in 16 fixed lanes and a fixed tree. Rows are split over threads
//! ([`Matrix`]), each output element computed by one thread in that same order, so the thread
//! count does not change the bits either.
//!
//! The other types candle knows ([`DEQUANTIZED`]: Q4_1, Q5_0, Q5_1, Q8_1, Q2_K, Q3_K, Q8_K)
//! are computed on their dequantized values: each task's rows are dequantized by candle's
//! (scalar, so CPU-independent) block code and dotted with the f32 activations like f32
//! weights. Slower, and not llama.cpp's rounding for those types, but the same on every CPU.

/// Rows of `w` against `n_tok` tokens, each row in tiles of tokens, each tile
/// `$tile::<T, ...>(row, x from the tile's first token, per, out of the tile)`: the x86
/// paths' shared loop (each weight row unpacked once per tile). `in_tiles!(tile, ...; ...)`
/// runs tiles of 4 and a remainder tile of 1–3; `in_tiles!(8; tile, ...; ...)` tiles of 8
/// first, for kernels with the registers for them.
#[cfg(target_arch = "x86_64")]
macro_rules! in_tiles {
    (@row $tile:ident $(, $g:tt)*; $wr:expr, $x:expr, $per:expr, $o:expr) => {{
        let (wr, x, per, o) = ($wr, $x, $per, $o);
        let n = o.len();
        let mut t = 0;
        while t + 4 <= n {
            $tile::<4 $(, $g)*>(wr, &x[t * per..], per, &mut o[t..t + 4]);
            t += 4;
        }
        let x = &x[t * per..];
        match n - t {
            3 => $tile::<3 $(, $g)*>(wr, x, per, &mut o[t..]),
            2 => $tile::<2 $(, $g)*>(wr, x, per, &mut o[t..]),
            1 => $tile::<1 $(, $g)*>(wr, x, per, &mut o[t..]),
            _ => {}
        }
    }};
    (8; $tile:ident $(, $g:tt)*; $w:expr, $row_bytes:expr, $x:expr, $per:expr, $n_tok:expr, $out:expr) => {{
        let (x, per, n_tok) = ($x, $per, $n_tok);
        for (wr, o) in $w.chunks_exact($row_bytes).zip($out.chunks_exact_mut(n_tok)) {
            let mut t = 0;
            while t + 8 <= n_tok {
                $tile::<8 $(, $g)*>(wr, &x[t * per..], per, &mut o[t..t + 8]);
                t += 8;
            }
            in_tiles!(@row $tile $(, $g)*; wr, &x[t * per..], per, &mut o[t..]);
        }
    }};
    ($tile:ident $(, $g:tt)*; $w:expr, $row_bytes:expr, $x:expr, $per:expr, $n_tok:expr, $out:expr) => {{
        let (x, per, n_tok) = ($x, $per, $n_tok);
        for (wr, o) in $w.chunks_exact($row_bytes).zip($out.chunks_exact_mut(n_tok)) {
            in_tiles!(@row $tile $(, $g)*; wr, x, per, o);
        }
    }};
}

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod dot;
mod matrix;
#[cfg(target_arch = "x86_64")]
mod vnni;

pub use matrix::{Matrix, WeightBytes};

/// Runs `f` on a worker of the kernels' thread pool (in place when already on one), so that
/// the parallel parts inside it start at once on that worker, instead of each waking the pool
/// from outside and waiting for it. Wrap a stretch of serial and parallel compute in it.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// Runs `f` on a worker of the kernels' thread pool and returns at once: how an async caller
/// hands compute to the pool without parking a thread of its own to wait for it. A panic in
/// `f` is caught and handed to `done` as an error, never unwound through the pool.
pub fn spawn_on_pool<R: Send + 'static>(
    f: impl FnOnce() -> R + Send + 'static,
    done: impl FnOnce(std::thread::Result<R>) + Send + 'static,
) {
    rayon::spawn(move || done(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))));
}

use std::sync::atomic::{AtomicU8, Ordering};

use moeswarm_model::gguf::GgmlType;

/// An instruction-set path the kernels can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Path {
    /// The generic code, vectorized by the compiler for what the build targets everywhere
    /// (SSE2 on x86_64, NEON on aarch64).
    Baseline,
    /// x86_64 AVX2 + F16C intrinsics.
    Avx2,
    /// AVX2 with AVX-VNNI's 256-bit int8 and int16 dot products (`vpdpbusd`, `vpdpwssd`) for
    /// the quantized types: CPUs with VNNI but without AVX-512.
    AvxVnni,
    /// AVX-512 (F, BW, VL) with its VNNI, and FMA (every such CPU has it): the quantized
    /// types two 32-value groups (or two blocks) to a 512-bit register, the float types 16
    /// lanes to one.
    Avx512,
}

impl Path {
    /// Every path, in order of preference (fastest last).
    pub const ALL: [Path; 4] = [Path::Baseline, Path::Avx2, Path::AvxVnni, Path::Avx512];

    /// The path's name on the command line: `baseline`, `avx2`, `avx-vnni`, `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            Path::Baseline => "baseline",
            Path::Avx2 => "avx2",
            Path::AvxVnni => "avx-vnni",
            Path::Avx512 => "avx512",
        }
    }

    /// The path of that [`name`](Self::name) (any case).
    pub fn named(name: &str) -> Option<Path> {
        Self::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(name))
    }

    /// The CPU flags (as Linux's `/proc/cpuinfo` and Rust's feature detection name them)
    /// the path needs.
    pub fn flags(self) -> &'static [&'static str] {
        match self {
            Path::Baseline => &[],
            Path::Avx2 => &["avx2", "f16c"],
            Path::AvxVnni => &["avx2", "f16c", "avxvnni"],
            Path::Avx512 => &[
                "avx2",
                "f16c",
                "fma",
                "avx512f",
                "avx512bw",
                "avx512vl",
                "avx512vnni",
            ],
        }
    }

    /// The first flag the path needs that this CPU lacks; `None` when it can run the path.
    pub fn missing(self) -> Option<&'static str> {
        self.flags().iter().copied().find(|f| !has_flag(f))
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        self.missing().is_none()
    }

    /// The paths this CPU can run.
    pub fn available_paths() -> Vec<Path> {
        Self::ALL.into_iter().filter(|p| p.available()).collect()
    }
}

/// The CPU flags the kernels' paths look for that this CPU has (for benchmarks to print).
pub fn cpu_flags() -> Vec<&'static str> {
    let mut flags: Vec<&'static str> = Vec::new();
    for p in Path::ALL {
        for &f in p.flags().iter().chain(&["fma"]) {
            if has_flag(f) && !flags.contains(&f) {
                flags.push(f);
            }
        }
    }
    flags
}

/// Whether this CPU has the named flag (one of those [`Path::flags`] lists).
fn has_flag(flag: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match flag {
            "avx2" => std::is_x86_feature_detected!("avx2"),
            "f16c" => std::is_x86_feature_detected!("f16c"),
            "fma" => std::is_x86_feature_detected!("fma"),
            "avxvnni" => std::is_x86_feature_detected!("avxvnni"),
            "avx512f" => std::is_x86_feature_detected!("avx512f"),
            "avx512bw" => std::is_x86_feature_detected!("avx512bw"),
            "avx512vl" => std::is_x86_feature_detected!("avx512vl"),
            "avx512vnni" => std::is_x86_feature_detected!("avx512vnni"),
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = flag;
        false
    }
}

/// 0: detect; otherwise `1 + index` into [`Path::ALL`].
static FORCED: AtomicU8 = AtomicU8::new(0);

/// Runs every later kernel call on `path` (tests compare paths this way); `None` returns to
/// the fastest available one. A path this CPU lacks is refused.
pub fn force_path(path: Option<Path>) -> crate::Result<()> {
    let v = match path {
        None => 0,
        Some(p) if p.available() => 1 + Path::ALL.iter().position(|&q| q == p).unwrap_or(0) as u8,
        Some(p) => crate::error::bail!(
            "this CPU cannot run the {p:?} kernels: it lacks {}",
            p.missing().unwrap_or("a flag they need")
        ),
    };
    FORCED.store(v, Ordering::Relaxed);
    Ok(())
}

/// The path kernel calls run on now.
pub fn current_path() -> Path {
    match FORCED.load(Ordering::Relaxed) {
        0 => *BEST.get_or_init(|| {
            Path::ALL
                .into_iter()
                .rev()
                .find(|p| p.available())
                .unwrap_or(Path::Baseline)
        }),
        v => Path::ALL[(v - 1) as usize],
    }
}

static BEST: std::sync::OnceLock<Path> = std::sync::OnceLock::new();

/// Weight types these kernels compute on their blocks as stored, with llama.cpp's
/// activation rounding.
pub const TYPES: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Weight types computed on their dequantized values (see the module docs).
pub const DEQUANTIZED: [GgmlType; 7] = [
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q8_K,
];

/// Whether these kernels compute weights of type `t` (on its blocks or dequantized).
pub fn supports(t: GgmlType) -> bool {
    TYPES.contains(&t) || DEQUANTIZED.contains(&t)
}
