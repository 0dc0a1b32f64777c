//! Measuring a model the way `llama-bench` does: prompt processing (one batch of `p` tokens)
//! and text generation (`n` tokens one at a time) in tokens/s over repetitions after a
//! warm-up, the cold first run, and the process's peak resident memory.

use std::time::Instant;

use serde::Serialize;

use crate::error::{bail, Result};
use crate::executor::ExpertExecutor;
use crate::trunk::{ForwardTiming, Trunk};

/// What to measure.
#[derive(Debug, Clone, Copy)]
pub struct BenchOptions {
    /// Prompt tokens processed in one batch.
    pub prompt: usize,
    /// Tokens generated one at a time.
    pub generate: usize,
    /// Measured repetitions (after one warm-up).
    pub repetitions: usize,
}

/// What was measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Prompt processing, tokens/s (mean over repetitions).
    pub pp_tps: f64,
    /// Its standard deviation.
    pub pp_sd: f64,
    /// Text generation, tokens/s (mean over repetitions).
    pub tg_tps: f64,
    /// Its standard deviation.
    pub tg_sd: f64,
    /// Seconds of the first run, prompt and generation, right after loading (cold).
    pub cold_first_generation_s: f64,
    /// Seconds of a warm run of the same, for comparison.
    pub warm_generation_s: f64,
    /// Seconds loading took (given by the caller).
    pub load_s: f64,
    /// Peak resident memory of the process.
    pub peak_rss_bytes: u64,
    /// Bytes of weights the model holds.
    pub weights_bytes: u64,
    /// The kernels' instruction-set path that ran ([`crate::kernels::Path::name`]).
    pub kernels: &'static str,
    /// The CPU flags the kernels look for that this CPU has.
    pub cpu_flags: Vec<&'static str>,
}

/// The process's peak resident set (Linux `VmHWM`; 0 where unknown).
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, var.sqrt())
}

/// One run: the prompt in a batch, then `n` greedy tokens; the two durations in seconds.
async fn run_once(
    trunk: &Trunk,
    exec: &impl ExpertExecutor,
    prompt: &[u32],
    n: usize,
) -> Result<(f64, f64)> {
    let vocab = trunk.hyper().n_vocab as usize;
    let mut cache = trunk.new_cache();
    let mut timing = ForwardTiming::default();
    let t = Instant::now();
    let logits = trunk.forward(&mut cache, prompt, exec, &mut timing).await?;
    let pp = t.elapsed().as_secs_f64();
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as u32)
    };
    let mut next = argmax(&logits[logits.len() - vocab..]);
    let t = Instant::now();
    for _ in 0..n {
        let l = trunk
            .forward(&mut cache, &[next], exec, &mut timing)
            .await?;
        next = argmax(&l);
    }
    Ok((pp, t.elapsed().as_secs_f64()))
}

/// Measures `trunk` with `exec` (see the module docs); `load_s` and `weights_bytes` are the
/// caller's.
pub async fn bench(
    trunk: &Trunk,
    exec: &impl ExpertExecutor,
    opts: BenchOptions,
    load_s: f64,
    weights_bytes: u64,
) -> Result<BenchReport> {
    if opts.prompt == 0 || opts.generate == 0 || opts.repetitions == 0 {
        bail!("prompt, generated tokens and repetitions must each be at least 1");
    }
    let n_vocab = trunk.hyper().n_vocab;
    let prompt: Vec<u32> = (0..opts.prompt as u32)
        .map(|i| (i * 37 + 11) % n_vocab)
        .collect();
    let (pp, tg) = run_once(trunk, exec, &prompt, opts.generate).await?;
    let cold = pp + tg;
    let (mut pps, mut tgs) = (Vec::new(), Vec::new());
    let mut warm = 0.0;
    for _ in 0..opts.repetitions {
        let (pp, tg) = run_once(trunk, exec, &prompt, opts.generate).await?;
        warm = pp + tg;
        pps.push(opts.prompt as f64 / pp);
        tgs.push(opts.generate as f64 / tg);
    }
    let (pp_tps, pp_sd) = mean_sd(&pps);
    let (tg_tps, tg_sd) = mean_sd(&tgs);
    Ok(BenchReport {
        pp_tps,
        pp_sd,
        tg_tps,
        tg_sd,
        cold_first_generation_s: cold,
        warm_generation_s: warm,
        load_s,
        peak_rss_bytes: peak_rss_bytes(),
        weights_bytes,
        kernels: crate::kernels::current_path().name(),
        cpu_flags: crate::kernels::cpu_flags(),
    })
}
