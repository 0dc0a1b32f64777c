//! The engine's matmul kernels: every path this CPU has gives the same bits as the baseline
//! path on random blocks of every type, on a whole expert and over any thread count; and each
//! type agrees with the float64 dot of the dequantized weights and the activations rounded as
//! the kernels round them.

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use moeswarm_engine::kernels::act::prepare;
use moeswarm_engine::kernels::{force_path, Matrix, Path, WeightBytes, DEQUANTIZED, TYPES};
use moeswarm_engine::quant::{candle_type, dequantize};
use moeswarm_model::gguf::GgmlType;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// The kernel path is process-wide: tests that force it run one at a time.
static PATH_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn normal(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let z: f32 = StandardNormal.sample(&mut rng);
            z * scale
        })
        .collect()
}

/// A random `[n_in, n_out]` weight of type `t`, quantized by candle (ggml's layouts).
fn weight(t: GgmlType, n_in: usize, n_out: usize, seed: u64) -> Vec<u8> {
    let v = normal(n_in * n_out, seed, 1.0 / (n_in as f32).sqrt());
    let x = Tensor::from_vec(v, (n_out, n_in), &Device::Cpu).unwrap();
    QTensor::quantize(&x, candle_type(t).unwrap())
        .unwrap()
        .data()
        .unwrap()
        .to_vec()
}

fn matrix(t: GgmlType, n_in: usize, n_out: usize, seed: u64) -> (Matrix, Vec<u8>) {
    let bytes = weight(t, n_in, n_out, seed);
    let m = Matrix::new(
        WeightBytes::owned(bytes.clone()),
        t,
        n_in as u64,
        n_out as u64,
    )
    .unwrap();
    (m, bytes)
}

/// Every type computed: on blocks, then on dequantized values.
fn every_type() -> impl Iterator<Item = GgmlType> {
    TYPES.into_iter().chain(DEQUANTIZED)
}

fn on(path: Path, m: &Matrix, x: &[f32]) -> Vec<u32> {
    force_path(Some(path)).unwrap();
    let y = m.apply(x).unwrap();
    force_path(None).unwrap();
    y.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn every_path_gives_the_baseline_bits_for_every_type() {
    let _g = PATH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let paths = Path::available_paths();
    eprintln!("paths on this CPU: {paths:?}");
    for p in Path::ALL {
        if let Some(flag) = p.missing() {
            eprintln!("skipped the {} path: this CPU lacks {flag}", p.name());
        }
    }
    for t in every_type() {
        // 800 values: an odd number of 32-value blocks (not whole K-quant superblocks).
        for (n_in, n_out, rows, seed) in [
            (256, 8, 1, 1),
            (512, 96, 3, 2),
            (1024, 130, 16, 3),
            (800, 5, 1, 4),
            (800, 7, 2, 5),
            // Float rows whose length is not a multiple of the 16 lanes; a tile of 4 and 3.
            (808, 6, 7, 6),
            // Tiles of 8, then 4, then 1 (the AVX-512 path's widest tiles and their rest).
            (1024, 40, 13, 7),
        ] {
            if !(n_in as u64).is_multiple_of(t.block_size()) {
                continue;
            }
            let (m, _) = matrix(t, n_in, n_out, seed);
            // Wide activations with outliers, so blocks use their whole range.
            let mut x = normal(rows * n_in, seed + 100, 1.0);
            x[3] = 40.0;
            let want = on(Path::Baseline, &m, &x);
            for &p in &paths {
                assert_eq!(on(p, &m, &x), want, "{t} {n_in}x{n_out}x{rows} on {p:?}");
            }
        }
    }
}

#[test]
fn a_path_the_cpu_lacks_is_refused_naming_the_flag_and_names_round_trip() {
    let _g = PATH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    for p in Path::ALL {
        assert_eq!(Path::named(p.name()), Some(p));
        assert_eq!(Path::named(&p.name().to_uppercase()), Some(p));
        match p.missing() {
            Some(flag) => {
                let err = force_path(Some(p)).expect_err("a missing flag refuses the path");
                assert!(err.to_string().contains(flag), "{err}");
                assert!(!Path::available_paths().contains(&p));
            }
            None => {
                force_path(Some(p)).unwrap();
                assert_eq!(moeswarm_engine::kernels::current_path(), p);
            }
        }
    }
    force_path(None).unwrap();
    assert_eq!(Path::named("sse9"), None);
    assert!(Path::Baseline.available());
}

#[test]
fn thread_count_does_not_change_the_bits_on_any_path() {
    let _g = PATH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let x = normal(5 * 2048, 10, 1.0);
    for t in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::F16,
    ] {
        let (m, _) = matrix(t, 2048, 200, 9);
        let want = on(Path::Baseline, &m, &x);
        for p in Path::available_paths() {
            for threads in [1, 3] {
                let got = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap()
                    .install(|| on(p, &m, &x));
                assert_eq!(got, want, "{t} on {p:?} with {threads} threads");
            }
        }
    }
}

#[test]
fn each_type_matches_the_f64_dot_of_its_dequantized_weights() {
    // Relative to the row's Σ|w·x|: only f32 rounding of sums of up to 1024 terms remains.
    let tolerance = 2e-6;
    for t in every_type() {
        let (n_in, n_out, rows) = (1024, 64, 3);
        let (m, bytes) = matrix(t, n_in, n_out, 4);
        let w = dequantize(&bytes, t, &[n_in as u64, n_out as u64]).unwrap();
        let x = normal(rows * n_in, 5, 1.0);
        let xr = prepare(t, &x, n_in).widened();
        let y = m.apply(&x).unwrap();
        for r in 0..rows {
            for o in 0..n_out {
                let (mut exact, mut mag) = (0f64, 0f64);
                for i in 0..n_in {
                    let p = w[o * n_in + i] as f64 * xr[r * n_in + i];
                    exact += p;
                    mag += p.abs();
                }
                let got = y[r * n_out + o] as f64;
                assert!(
                    (got - exact).abs() <= tolerance * mag,
                    "{t} row {r} out {o}: {got} vs {exact} (Σ|wx| {mag})"
                );
            }
        }
    }
}

#[test]
fn activation_rounding_is_ggml_s() {
    use moeswarm_engine::kernels::act::{quantize_q8_0, quantize_q8k};
    // Q8_K: iscale = -127 / (the value of largest magnitude), so that value maps to -127;
    // ties round to even.
    let mut x = vec![0f32; 256];
    x[0] = -2.0;
    x[1] = 1.0; // 1 × 63.5: to even, 64
    x[2] = 3.0 / 63.5; // exactly 3
    let b = quantize_q8k(&x);
    assert_eq!((b.qs[0], b.qs[1], b.qs[2]), (-127, 64, 3));
    assert_eq!(b.bsums[0], -127 + 64 + 3);
    assert_eq!(b.d, 1.0 / 63.5);
    // Q8_0: scale amax / 127 as f16, values x × 127 / amax rounded half to even.
    let mut y = vec![0f32; 32];
    y[0] = 127.0;
    y[1] = 2.5;
    y[2] = -3.5;
    let q = quantize_q8_0(&y);
    assert_eq!((q.qs[0], q.qs[1], q.qs[2]), (127, 2, -4));
    assert_eq!(q.d, 1.0);
    assert!(quantize_q8k(&[0.0; 256]).qs.iter().all(|&v| v == 0));
}

#[test]
fn bad_shapes_are_refused() {
    let bytes = weight(GgmlType::Q4_K, 256, 2, 1);
    let short = WeightBytes::owned(bytes[..100].to_vec());
    assert!(Matrix::new(short, GgmlType::Q4_K, 256, 2).is_err());
    let ok = Matrix::new(WeightBytes::owned(bytes), GgmlType::Q4_K, 256, 2).unwrap();
    assert!(ok.apply(&[0.0; 100]).is_err());
    assert!(Matrix::new(WeightBytes::owned(vec![0; 18]), GgmlType::Q4_0, 64, 1).is_err());
    let unknown = Matrix::new(WeightBytes::owned(vec![0; 136]), GgmlType::IQ4_XS, 256, 1);
    let err = unknown.err().expect("IQ4_XS has no kernel").to_string();
    assert!(err.contains("iq4_xs"), "{err}");
}
