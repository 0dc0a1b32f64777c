//! What the benchmarks share: the benchmark model, synthesized once.

use std::path::PathBuf;

use moeswarm_engine::synth::{synth, Preset, SynthOptions};
use moeswarm_model::gguf::GgmlType;

/// `target/bench-data/<preset>-q4_k.gguf` (preset from `MOESWARM_BENCH_PRESET`, default
/// `qwen3-30b-a3b-4l`), synthesized on first use, with kernels pinned as the binary pins them.
pub fn bench_model() -> anyhow::Result<PathBuf> {
    moeswarm_engine::quant::pin_kernels();
    let preset =
        std::env::var("MOESWARM_BENCH_PRESET").unwrap_or_else(|_| "qwen3-30b-a3b-4l".into());
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-data");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{preset}-q4_k.gguf"));
    if !path.exists() {
        eprintln!("synthesizing {} ...", path.display());
        synth(
            &path,
            &Preset::named("qwen3moe", &preset)?,
            SynthOptions::new(GgmlType::Q4_K, 0),
        )?;
    }
    Ok(path)
}
