//! The engine's kernels beside candle's on the same weights: ms per matmul of a 2048 → 768
//! (Qwen3-30B-A3B expert gate) and 768 → 2048 (its down) matrix at batch 1, 5 (a speculative
//! verification pass) and 16, cycling 48 matrices so weights come from memory, not cache;
//! and a streaming read of the same bytes, the floor for batch 1. Ours runs on every kernel
//! path this CPU has, one column each (the last is the one a model runs on).
//!
//! `cargo bench -p moeswarm-engine --bench kernels` (`MOESWARM_KERNEL_TYPES=q4_k,q8_0` for
//! some types only)

use std::hint::black_box;
use std::time::Instant;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use moeswarm_engine::kernels::{cpu_flags, current_path, force_path, Matrix, Path, WeightBytes};
use moeswarm_engine::quant::candle_type;
use moeswarm_model::gguf::GgmlType;

const N: usize = 48;

fn main() -> anyhow::Result<()> {
    let paths = Path::available_paths();
    println!(
        "kernel path {:?} (CPU flags: {}), {} threads",
        current_path(),
        cpu_flags().join(" "),
        rayon::current_num_threads()
    );
    let cols: String = paths.iter().map(|p| format!(" {p:?} ms |")).collect();
    let bars: String = paths.iter().map(|_| " --- |").collect();
    println!("| type | shape | batch |{cols} candle ms | ours/candle | read ms | ours/read |");
    println!("| --- | --- | --- |{bars} --- | --- | --- | --- |");
    for t in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        if let Ok(only) = std::env::var("MOESWARM_KERNEL_TYPES") {
            if !only
                .split(',')
                .any(|o| o.eq_ignore_ascii_case(&t.to_string()))
            {
                continue;
            }
        }
        for (n_in, n_out) in [(2048usize, 768usize), (768, 2048)] {
            let mut ours = Vec::new();
            let mut theirs = Vec::new();
            let mut raw = Vec::new();
            for i in 0..N {
                let v: Vec<f32> = (0..n_in * n_out)
                    .map(|j| (((j * 7919 + i * 104_729) % 2003) as f32 / 1001.0 - 1.0) * 0.05)
                    .collect();
                let x = Tensor::from_vec(v, (n_out, n_in), &Device::Cpu)?;
                let q = QTensor::quantize(&x, candle_type(t)?)?;
                let bytes = q.data()?.to_vec();
                ours.push(Matrix::new(
                    WeightBytes::owned(bytes.clone()),
                    t,
                    n_in as u64,
                    n_out as u64,
                )?);
                theirs.push(QMatMul::from_qtensor(q)?);
                raw.push(bytes);
            }
            for batch in [1usize, 5, 16] {
                let x: Vec<f32> = (0..batch * n_in)
                    .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
                    .collect();
                let xt = Tensor::from_slice(&x, (batch, n_in), &Device::Cpu)?;
                // Warm both (candle repacks some types on first use).
                for i in 0..N {
                    black_box(ours[i].apply(&x)?);
                    black_box(theirs[i].forward(&xt)?);
                }
                let reps = 4;
                let mut per_path = Vec::new();
                for &p in &paths {
                    force_path(Some(p))?;
                    let t0 = Instant::now();
                    for _ in 0..reps {
                        for m in &ours {
                            black_box(m.apply(&x)?);
                        }
                    }
                    per_path.push(t0.elapsed().as_secs_f64() * 1e3 / (reps * N) as f64);
                }
                force_path(None)?;
                let ours_ms = *per_path.last().unwrap_or(&f64::NAN);
                let t0 = Instant::now();
                for _ in 0..reps {
                    for m in &theirs {
                        black_box(m.forward(&xt)?);
                    }
                }
                let theirs_ms = t0.elapsed().as_secs_f64() * 1e3 / (reps * N) as f64;
                let t0 = Instant::now();
                for _ in 0..reps {
                    for b in &raw {
                        let s: u64 = b
                            .chunks_exact(8)
                            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                            .fold(0, u64::wrapping_add);
                        black_box(s);
                    }
                }
                let read_ms = t0.elapsed().as_secs_f64() * 1e3 / (reps * N) as f64;
                let cols: String = per_path.iter().map(|ms| format!(" {ms:.3} |")).collect();
                println!(
                    "| {t} | {n_in}x{n_out} | {batch} |{cols} {theirs_ms:.3} | {:.2} | {read_ms:.3} | {:.2} |",
                    ours_ms / theirs_ms,
                    ours_ms / read_ms
                );
            }
        }
    }
    Ok(())
}
