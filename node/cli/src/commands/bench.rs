//! `moeswarm bench`: prompt-processing and text-generation speed of a model, like
//! `llama-bench`, plus the cold first run and peak memory.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use moeswarm_engine::bench::{bench, BenchOptions};
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::kernels::{force_path, Path};
use moeswarm_model::gguf::ModelFiles;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF model.
    model: PathBuf,
    /// Compute threads (default: the CPU's cores).
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// Prompt tokens, processed in one batch.
    #[arg(short = 'p', long = "prompt", default_value_t = 64)]
    prompt: usize,
    /// Tokens generated one at a time.
    #[arg(short = 'n', long = "generate", default_value_t = 32)]
    generate: usize,
    /// Measured repetitions, after a warm-up run.
    #[arg(long, short = 'r', default_value_t = 3)]
    repetitions: usize,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// The kernels' instruction-set path: baseline, avx2, avx-vnni or avx512 (default: the
    /// fastest this CPU has). The bits are the same on every path; only the speed differs.
    #[arg(long, value_parser = parse_path)]
    kernels: Option<Path>,
}

fn parse_path(s: &str) -> Result<Path, String> {
    Path::named(s).ok_or_else(|| {
        let names: Vec<&str> = Path::ALL.iter().map(|p| p.name()).collect();
        format!("no kernel path {s:?}: one of {}", names.join(", "))
    })
}

pub fn run(a: Args) -> Result<bool> {
    force_path(a.kernels)?;
    if let Some(n) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("setting the thread count")?;
    }
    let weights_bytes = ModelFiles::open(&a.model)?.header.tensor_bytes();
    let t = Instant::now();
    let m = LocalModel::load(&ModelSource::Gguf(a.model.clone()))?;
    let load_s = t.elapsed().as_secs_f64();
    let opts = BenchOptions {
        prompt: a.prompt,
        generate: a.generate,
        repetitions: a.repetitions,
    };
    let r = super::block_on(
        false,
        bench(&m.trunk, &m.experts, opts, load_s, weights_bytes),
    )??;
    if a.json {
        output::json(&r)?;
    } else {
        let gb = |b: u64| b as f64 / 1e9;
        output::line(&format!(
            "model {} ({:.2} GB of weights), {} threads, kernels {} (CPU flags: {})\n\
             pp{:<4} {:>8.1} ± {:.1} tokens/s\n\
             tg{:<4} {:>8.2} ± {:.2} tokens/s\n\
             load {:.2} s; first run {:.2} s cold, {:.2} s warm\n\
             peak RSS {:.2} GB ({:.2} × the weights)",
            a.model.display(),
            gb(r.weights_bytes),
            rayon::current_num_threads(),
            r.kernels,
            r.cpu_flags.join(" "),
            a.prompt,
            r.pp_tps,
            r.pp_sd,
            a.generate,
            r.tg_tps,
            r.tg_sd,
            r.load_s,
            r.cold_first_generation_s,
            r.warm_generation_s,
            gb(r.peak_rss_bytes),
            r.peak_rss_bytes as f64 / r.weights_bytes as f64
        ))?;
    }
    Ok(true)
}
