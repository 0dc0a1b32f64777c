//! What speculative decoding costs and gives, in this process.
//!
//! Part 1, a verification pass: one pass over k + 1 positions of one sequence against a
//! single-token decode step at the same position, on the benchmark model (the reference is the
//! single-token step measured in the same run; target ≤ 1.3× for k + 1 ≤ 5). Part 2, the
//! trained qwen35moe (`sim/models/`): tokens/s and expert requests per token (the round trips
//! a swarm makes) greedy, drafting off, by prompt lookup and by the MTP block.
//!
//! `cargo bench -p moeswarm-engine --bench speculation` (`MOESWARM_BENCH_ARCH=qwen35moe` for
//! the hybrid benchmark model).

use moeswarm_testkit as common;

use std::time::Instant;

use moeswarm_engine::generate::{generate, GenerateOptions, LocalModel, ModelSource};
use moeswarm_engine::speculative::{Speculation, SpeculationConfig};
use moeswarm_engine::text::SamplingConfig;
use moeswarm_engine::trunk::ForwardTiming;

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    verification_pass(&rt)?;
    trained_model(&rt)
}

fn verification_pass(rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let path = common::bench::bench_model()?;
    let model = LocalModel::load(&ModelSource::Gguf(path.clone()))?;
    let h = model.trunk.hyper().clone();
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 37 + 11) % h.n_vocab).collect();
    let mut cache = model.trunk.new_cache();
    let t = &mut ForwardTiming::default();
    rt.block_on(model.trunk.forward(&mut cache, &prompt, &model.experts, t))?;
    let reps = 8;
    // Each pass from the same position: checkpoint, run, roll back to it.
    let mut time_rows = |rows: usize| -> anyhow::Result<f64> {
        let tokens: Vec<u32> = (0..rows as u32)
            .map(|i| (i * 101 + 7) % h.n_vocab)
            .collect();
        let mut best = f64::MAX;
        for _ in 0..reps {
            let at = cache.len();
            model.trunk.checkpoint(&mut cache);
            let s = Instant::now();
            rt.block_on(model.trunk.forward(&mut cache, &tokens, &model.experts, t))?;
            best = best.min(s.elapsed().as_secs_f64());
            model.trunk.rollback(&mut cache, at)?;
        }
        Ok(best)
    };
    let one = time_rows(1)?;
    println!(
        "verification pass on {} (best of {reps}): 1 position {:.2} ms (the reference)",
        path.display(),
        one * 1e3
    );
    for rows in 2..=5 {
        let t = time_rows(rows)?;
        println!(
            "  {rows} positions: {:.2} ms, {:.2}x the single-token step",
            t * 1e3,
            t / one
        );
    }
    Ok(())
}

fn trained_model(rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let m = LocalModel::load(&ModelSource::Gguf(common::trained_model()))?;
    println!("trained qwen35moe, greedy, 64 tokens, local (after one warm-up run of each):");
    for warm in [true, false] {
        for (mode, k) in [
            (Speculation::Off, None),
            (Speculation::Ngram, Some(4)),
            (Speculation::Mtp, Some(1)),
            (Speculation::Mtp, Some(3)),
        ] {
            let opts = GenerateOptions {
                prompt: "The best thing about a good friend is".into(),
                max_tokens: 64,
                raw: true,
                sampling: SamplingConfig::default(),
                speculation: SpeculationConfig::new(mode, k, &m.trunk)?,
            };
            let s = Instant::now();
            let r = rt.block_on(generate(&m.trunk, &m.experts, &m.tokenizer, &opts, |_| {}))?;
            let secs = s.elapsed().as_secs_f64();
            let sp = r.speculation;
            if warm {
                continue;
            }
            println!(
            "  {mode:?} k={}: {:.0} tokens/s, {:.2} tokens a pass, {:.2} expert round trips a token ({} of {} drafts kept)",
            k.unwrap_or(0),
            r.tokens.len() as f64 / secs,
            r.tokens.len() as f64 / (sp.passes.max(1)) as f64,
            sp.expert_rounds as f64 / r.tokens.len() as f64,
            sp.accepted,
            sp.drafted
        );
        }
    }
    Ok(())
}
