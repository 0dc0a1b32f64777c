//! Prefill and decode tokens/s of the whole model on the benchmark model, with time per layer
//! split into attention, Gated DeltaNet, gating, the shared expert and the routed experts, and
//! peak RSS beside the model's bytes. The
//! reference, measured in the same run, is a plain copy of the weight bytes one decode step
//! must read (trunk + the routed experts' share): the memory-bandwidth floor of a decode step.
//!
//! `cargo bench -p moeswarm-engine --bench trunk`; `MOESWARM_BENCH_ARCH=qwen35moe` for the
//! hybrid architecture (`qwen35-122b-a10b-4l`), `MOESWARM_BENCH_PRESET` for another shape
//! (Q4_K experts; synthesized once into `target/bench-data`).

use moeswarm_testkit as common;

use std::hint::black_box;
use std::time::Instant;

use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::trunk::ForwardTiming;
use moeswarm_model::gguf::Gguf;
use moeswarm_model::plan::ModelSizes;

fn main() -> anyhow::Result<()> {
    let path = common::bench::bench_model()?;
    let g = Gguf::open(&path)?;
    let sizes = ModelSizes::of(&g)?;
    let model = LocalModel::load(&ModelSource::Gguf(path.clone()))?;
    let h = model.trunk.hyper().clone();
    let rt = tokio::runtime::Builder::new_current_thread().build()?;

    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 37 + 11) % h.n_vocab).collect();
    let decode_steps = 32;
    let mut cache = model.trunk.new_cache();
    let mut pre = ForwardTiming::default();
    let t = Instant::now();
    let logits = rt.block_on(
        model
            .trunk
            .forward(&mut cache, &prompt, &model.experts, &mut pre),
    )?;
    let prefill_s = t.elapsed().as_secs_f64();
    let vocab = h.n_vocab as usize;
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32
    };
    let mut next = argmax(&logits[logits.len() - vocab..]);
    let mut dec = ForwardTiming::default();
    let t = Instant::now();
    for _ in 0..decode_steps {
        let l = rt.block_on(
            model
                .trunk
                .forward(&mut cache, &[next], &model.experts, &mut dec),
        )?;
        next = argmax(&l);
    }
    let decode_s = t.elapsed().as_secs_f64();
    // Before the reference below allocates its buffers.
    let peak_rss = moeswarm_engine::bench::peak_rss_bytes();

    // Reference: copy the bytes one decode step reads, from a pool larger than the caches.
    let per_expert = sizes.expert_bytes() / (sizes.expert_layers.len() as u64 * sizes.n_expert);
    let step_bytes = (sizes.trunk_bytes
        + per_expert * h.n_expert_used as u64 * sizes.expert_layers.len() as u64)
        as usize;
    let pool = vec![1u8; step_bytes * 4];
    let mut sink = vec![0u8; step_bytes];
    let t = Instant::now();
    for i in 0..decode_steps {
        let s = (i % 4) * step_bytes;
        sink.copy_from_slice(&pool[s..s + step_bytes]);
        black_box(&sink);
    }
    let copy_s = t.elapsed().as_secs_f64() / decode_steps as f64;

    let per_layer = |d: std::time::Duration, tokens: usize| {
        d.as_secs_f64() * 1e3 / h.n_layer as f64 / tokens as f64
    };
    println!(
        "model {} ({:.2} GB, {} layers)",
        path.display(),
        g.file_size as f64 / 1e9,
        h.n_layer
    );
    println!(
        "prefill {} tokens: {:.1} tokens/s",
        prompt.len(),
        prompt.len() as f64 / prefill_s
    );
    println!(
        "decode  {} tokens: {:.2} tokens/s ({:.2} ms/token)",
        decode_steps,
        decode_steps as f64 / decode_s,
        decode_s * 1e3 / decode_steps as f64
    );
    for (name, t, n) in [
        ("prefill", &pre, prompt.len()),
        ("decode", &dec, decode_steps),
    ] {
        println!(
            "  {name:<7} per layer per token: attention {:.3} ms, deltanet {:.3} ms, gating {:.3} ms, shared expert {:.3} ms, routed experts {:.3} ms; head {:.3} ms/token",
            per_layer(t.attention, n), per_layer(t.deltanet, n), per_layer(t.gating, n),
            per_layer(t.shared_expert, n), per_layer(t.experts, n),
            t.head.as_secs_f64() * 1e3 / n as f64
        );
    }
    println!(
        "reference: copying the {:.1} MB one decode step reads: {:.2} ms",
        step_bytes as f64 / 1e6,
        copy_s * 1e3
    );
    println!(
        "ratio decode step / copy: {:.2}",
        decode_s / decode_steps as f64 / copy_s
    );
    println!(
        "peak RSS {:.2} GB beside model file {:.2} GB: ratio {:.2}",
        peak_rss as f64 / 1e9,
        g.file_size as f64 / 1e9,
        peak_rss as f64 / g.file_size as f64
    );
    Ok(())
}
