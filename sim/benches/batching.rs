//! Continuous batching: aggregate decode tokens/s at 1, 4 and 16 concurrent sequences, in one
//! process and through a local swarm, each beside 1 sequence measured in the same run; the
//! dispatches per step through the swarm (one per worker per layer, whatever the batch);
//! the time to first token under load.
//!
//! The reference: llama.cpp (`llama-cpp-python`, installed if missing) decoding the same
//! numbers of sequences on the same file and threads, one batch a step
//! (`llamacpp_batched.py`), with its own ratio to 1 sequence and ours against it.
//!
//! `cargo bench -p moeswarm-sim --bench batching` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`; `MOESWARM_BENCH_SWARM=0`: the local part only). Requests go to the
//! batcher directly (no HTTP), greedy, 32 tokens each, short distinct prompts.

use moeswarm_testkit as common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moeswarm_engine::executor::ExpertExecutor;
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::text::{SamplingConfig, TextTokenizer};
use moeswarm_engine::trunk::Trunk;
use moeswarm_node::api::batcher::{self, BatchOptions, Batcher, Event, Request};
use moeswarm_sim::local::{start_local_swarm, SimOptions};

const TOKENS: usize = 32;
/// The numbers of concurrent sequences measured.
const COUNTS: [usize; 3] = [1, 4, 16];
const LLAMA_CPP_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/llamacpp_batched.py");

/// Runs `n` sequences at once; returns (tokens generated, seconds, mean time to first token).
async fn run(b: &Batcher, tok: &TextTokenizer, n: usize) -> anyhow::Result<(usize, f64, f64)> {
    let t = Instant::now();
    let mut rxs = Vec::new();
    for i in 0..n {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        b.submit(Request {
            prompt: tok.encode(&format!("Sequence {i} begins"))?,
            max_tokens: TOKENS,
            sampling: SamplingConfig {
                temperature: 0.0,
                ..SamplingConfig::default()
            },
            stop: vec![],
            speculation: moeswarm_engine::speculative::SpeculationConfig::OFF,
            events: tx,
        })
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        rxs.push(rx);
    }
    // Every receiver read at once, so each first token is timed when it comes.
    let each = rxs.into_iter().map(|mut rx| async move {
        let (mut first, mut tokens) = (None, 0);
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Text(_) if first.is_none() => first = Some(t.elapsed().as_secs_f64()),
                Event::Done {
                    completion_tokens, ..
                } => tokens = completion_tokens,
                Event::Failed(e) => anyhow::bail!("{e}"),
                _ => {}
            }
        }
        anyhow::Ok((tokens, first.unwrap_or(0.0)))
    });
    let mut tokens = 0;
    let mut ttft = 0.0;
    for r in futures::future::join_all(each).await {
        let (n, f) = r?;
        tokens += n;
        ttft += f;
    }
    Ok((tokens, t.elapsed().as_secs_f64(), ttft / n as f64))
}

async fn measure<E: ExpertExecutor + Send + Sync + 'static>(
    label: &str,
    trunk: Arc<Trunk>,
    exec: Arc<E>,
    tok: Arc<TextTokenizer>,
    dispatches: impl Fn() -> u64,
) -> anyhow::Result<Vec<f64>> {
    let b = batcher::spawn(trunk, exec, tok.clone(), BatchOptions::default());
    // Warm: every expert loaded once.
    run(&b, &tok, 4).await?;
    let mut one = 0.0;
    let mut all = Vec::new();
    for n in COUNTS {
        let (s0, d0) = (b.stats.steps.load(Ordering::Relaxed), dispatches());
        let (tokens, secs, ttft) = run(&b, &tok, n).await?;
        let steps = b.stats.steps.load(Ordering::Relaxed) - s0;
        let tps = tokens as f64 / secs;
        if n == 1 {
            one = tps;
        }
        println!(
            "{label}: {n:>2} sequences: {tokens} tokens in {secs:.2} s = {tps:.1} tokens/s (×{:.2} of 1 sequence); time to first token {:.0} ms; {:.1} dispatches a step",
            tps / one,
            ttft * 1e3,
            (dispatches() - d0) as f64 / steps.max(1) as f64
        );
        all.push(tps);
    }
    Ok(all)
}

/// llama.cpp's aggregate tokens/s at each of [`COUNTS`] on `model`, or why there are none.
fn llama_cpp(model: &std::path::Path) -> anyhow::Result<Vec<f64>> {
    if !common::bench::llama_cpp_available() {
        anyhow::bail!("llama.cpp is not available: run `python3 -m pip install llama-cpp-python`");
    }
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .to_string();
    let out = std::process::Command::new("python3")
        .arg(LLAMA_CPP_SCRIPT)
        .arg(model)
        .arg(&threads)
        .arg(TOKENS.to_string())
        .args(COUNTS.map(|n| n.to_string()))
        .output()?;
    if !out.status.success() {
        anyhow::bail!(
            "{LLAMA_CPP_SCRIPT}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    println!(
        "llama.cpp (llama-cpp-python {}, {threads} threads, one batch a step):",
        v["llama_cpp_python"].as_str().unwrap_or("?")
    );
    let tps: Vec<f64> = v["tps"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    if tps.len() != COUNTS.len() {
        anyhow::bail!("llama.cpp gave {} figures, not {}", tps.len(), COUNTS.len());
    }
    Ok(tps)
}

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let m = LocalModel::load(&ModelSource::Gguf(model.clone()))?;
        println!("model {}", model.display());
        let ours = measure(
            "local",
            Arc::new(m.trunk),
            Arc::new(m.experts),
            Arc::new(m.tokenizer),
            || 0,
        )
        .await?;
        match llama_cpp(&model) {
            Ok(theirs) => {
                for ((n, t), o) in COUNTS.iter().zip(&theirs).zip(&ours) {
                    println!(
                        "llama.cpp: {n:>2} sequences: {t:.1} tokens/s (×{:.2} of 1 sequence); moeswarm local / llama.cpp = {:.2}",
                        t / theirs[0],
                        o / t
                    );
                }
            }
            Err(e) => println!("llama.cpp reference not measured: {e:#}"),
        }
        if std::env::var("MOESWARM_BENCH_SWARM").as_deref() == Ok("0") {
            return Ok(());
        }
        let work = tempfile::tempdir_in(model.parent().expect("in bench-data"))?;
        let mut o = SimOptions::new(work.path().to_path_buf());
        o.model = Some(model.clone());
        o.relayed = 0;
        let s = start_local_swarm(&o).await?;
        let layers = s.manifest.hyper.n_layer;
        println!(
            "swarm: router and {} workers on 127.0.0.1 ({} MoE layers: at most {} dispatches a step)",
            s.workers.len(),
            layers,
            layers as usize * s.workers.len()
        );
        let stats = s.remote.stats.clone();
        let remote = Arc::new(s.remote);
        measure(
            "swarm",
            Arc::new(s.trunk),
            remote,
            Arc::new(s.tokenizer),
            move || stats.summary().sent,
        )
        .await?;
        for (w, _) in s.workers {
            w.shutdown().await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.router.shutdown().await;
        anyhow::Ok(())
    })
}
