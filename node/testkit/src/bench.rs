//! What the benchmarks share: the benchmark model, synthesized once.

use std::path::PathBuf;

use moeswarm_engine::synth::{synth, Preset, SynthOptions};
use moeswarm_model::gguf::GgmlType;

/// `target/bench-data/<arch>-<preset>-q4_k.gguf`, synthesized on first use. The architecture comes from `MOESWARM_BENCH_ARCH`
/// (default `qwen3moe`), the preset from `MOESWARM_BENCH_PRESET` (default the architecture's
/// benchmark shape: `qwen3-30b-a3b-4l` or `qwen35-122b-a10b-4l`), the experts' type from
/// `MOESWARM_BENCH_EXPERT_TYPE` (default `q4_k`; any of the kernels' types).
pub fn bench_model() -> anyhow::Result<PathBuf> {
    let arch = std::env::var("MOESWARM_BENCH_ARCH").unwrap_or_else(|_| "qwen3moe".into());
    let default_preset = if arch == "qwen3moe" {
        "qwen3-30b-a3b-4l"
    } else {
        "qwen35-122b-a10b-4l"
    };
    let preset = std::env::var("MOESWARM_BENCH_PRESET").unwrap_or_else(|_| default_preset.into());
    let preset = Preset::named(&arch, &preset)?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-data");
    std::fs::create_dir_all(&dir)?;
    let ty = std::env::var("MOESWARM_BENCH_EXPERT_TYPE").unwrap_or_else(|_| "q4_k".into());
    let Some(expert_type) = GgmlType::from_name(&ty) else {
        anyhow::bail!("MOESWARM_BENCH_EXPERT_TYPE={ty} is not a GGUF type name");
    };
    let name = match preset.architecture() {
        // The name earlier runs used, kept so their synthesized files are reused.
        "qwen3moe" => format!("{}-{ty}.gguf", preset.name),
        a => format!("{a}-{}-{ty}.gguf", preset.name),
    };
    let path = dir.join(name);
    if !path.exists() {
        eprintln!("synthesizing {} ...", path.display());
        synth(&path, &preset, SynthOptions::new(expert_type, 0))?;
    }
    Ok(path)
}

/// Whether python3 can import llama.cpp's bindings (`llama-cpp-python`), installing them with
/// pip first when missing (a few minutes when pip has to build llama.cpp).
pub fn llama_cpp_available() -> bool {
    use std::process::Command;
    let has = || {
        Command::new("python3")
            .args(["-c", "import llama_cpp"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if has() {
        return true;
    }
    eprintln!("llama-cpp-python is missing: pip install llama-cpp-python ...");
    let _ = Command::new("python3")
        .args(["-m", "pip", "install", "llama-cpp-python"])
        .status();
    has()
}
