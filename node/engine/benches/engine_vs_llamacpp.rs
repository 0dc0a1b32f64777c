//! The engine beside llama.cpp on the same GGUF with the same threads, in the same run:
//! prompt processing (64 tokens in a batch) and generation (32 tokens one at a time),
//! tokens/s and the ratio ours / llama.cpp; plus the engine's cold first run and peak RSS.
//!
//! `cargo bench -p moeswarm-engine --bench engine_vs_llamacpp` (the benchmark model;
//! `MOESWARM_BENCH_ARCH=qwen35moe` for the hybrid one, `MOESWARM_BENCH_THREADS` for the
//! thread count, default 2; `MOESWARM_BENCH_KERNELS=avx2` for a kernel path other than the
//! fastest this CPU has). llama.cpp comes from the `llama-cpp-python` package: if it is
//! missing, this installs it with `pip install llama-cpp-python` (a few minutes when pip has
//! to build it), or says how when that fails.

use moeswarm_testkit as common;

use std::process::Command;
use std::time::Instant;

use moeswarm_engine::bench::{bench, BenchOptions};
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_model::gguf::Gguf;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/llamacpp_bench.py");

fn main() -> anyhow::Result<()> {
    let threads: usize = std::env::var("MOESWARM_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()?;
    if let Ok(name) = std::env::var("MOESWARM_BENCH_KERNELS") {
        let Some(p) = moeswarm_engine::kernels::Path::named(&name) else {
            anyhow::bail!("MOESWARM_BENCH_KERNELS={name} names no kernel path");
        };
        moeswarm_engine::kernels::force_path(Some(p))?;
    }
    let path = common::bench::bench_model()?;
    let (p, n, reps) = (64, 32, 3);

    let weights = Gguf::open(&path)?.tensor_bytes();
    let t = Instant::now();
    let m = LocalModel::load(&ModelSource::Gguf(path.clone()))?;
    let load_s = t.elapsed().as_secs_f64();
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let opts = BenchOptions {
        prompt: p,
        generate: n,
        repetitions: reps,
    };
    // On the thread pool, as `moeswarm bench` runs it.
    let ours = moeswarm_engine::kernels::on_pool(|| {
        rt.block_on(bench(&m.trunk, &m.experts, opts, load_s, weights))
    })?;
    drop(m);

    if !common::bench::llama_cpp_available() {
        anyhow::bail!("llama.cpp is not available: run `python3 -m pip install llama-cpp-python`");
    }
    let out = Command::new("python3")
        .arg(SCRIPT)
        .arg(&path)
        .args([threads, p, n, reps].map(|v| v.to_string()))
        .output()?;
    if !out.status.success() {
        use std::os::unix::process::ExitStatusExt;
        let hint = if out.status.signal().is_some() {
            // Seen on an Intel Xeon with AMX: llama.cpp built for the native CPU crashes in
            // ggml_backend_amx_mul_mat.
            "\nllama.cpp crashed; if this CPU has AMX, rebuild it without: CMAKE_ARGS=\"-DGGML_NATIVE=OFF \
             -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \
             -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON\" pip install --force-reinstall --no-deps \
             --no-cache-dir llama-cpp-python"
        } else {
            ""
        };
        anyhow::bail!(
            "llama.cpp run failed ({}): {}{hint}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let theirs: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let f = |k: &str| theirs[k].as_f64().unwrap_or(f64::NAN);

    println!(
        "model {} ({:.2} GB of weights), {threads} threads, kernels {} (CPU flags: {}), llama-cpp-python {}",
        path.display(),
        weights as f64 / 1e9,
        ours.kernels,
        ours.cpu_flags.join(" "),
        theirs["llama_cpp_python"].as_str().unwrap_or("?")
    );
    println!("| | moeswarm | llama.cpp | ratio |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| pp{p} tokens/s | {:.1} ± {:.1} | {:.1} ± {:.1} | {:.2} |",
        ours.pp_tps,
        ours.pp_sd,
        f("pp_tps"),
        f("pp_sd"),
        ours.pp_tps / f("pp_tps")
    );
    println!(
        "| tg{n} tokens/s | {:.2} ± {:.2} | {:.2} ± {:.2} | {:.2} |",
        ours.tg_tps,
        ours.tg_sd,
        f("tg_tps"),
        f("tg_sd"),
        ours.tg_tps / f("tg_tps")
    );
    println!(
        "cold first run {:.2} s, warm {:.2} s (ratio {:.2}); load {:.2} s; peak RSS {:.2} GB = {:.2} × the weights",
        ours.cold_first_generation_s,
        ours.warm_generation_s,
        ours.cold_first_generation_s / ours.warm_generation_s,
        ours.load_s,
        ours.peak_rss_bytes as f64 / 1e9,
        ours.peak_rss_bytes as f64 / weights as f64
    );
    Ok(())
}
