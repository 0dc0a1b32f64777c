//! A whole model gives the same logits bits on every kernel path this CPU has: the reference
//! models (Q4_K experts, Q8_0 and f32 trunks, both architectures) prefilled and decoded on
//! each path in turn, against the baseline path.

use moeswarm_testkit as common;

use common::data;
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::kernels::{force_path, Path};
use moeswarm_engine::trunk::ForwardTiming;

/// Prefill logits, then three decode steps' logits, as bits, on `path`.
async fn logits_on(model: &str, path: Path) -> Vec<u32> {
    force_path(Some(path)).unwrap();
    let m = LocalModel::load(&ModelSource::Gguf(data(model))).unwrap();
    let mut cache = m.trunk.new_cache();
    let mut t = ForwardTiming::default();
    let mut bits = Vec::new();
    let mut step: Vec<u32> = common::reference_tokens("");
    for _ in 0..4 {
        let logits = m
            .trunk
            .forward(&mut cache, &step, &m.experts, &mut t)
            .await
            .unwrap();
        bits.extend(logits.iter().map(|v| v.to_bits()));
        let n_vocab = m.trunk.hyper().n_vocab as usize;
        let last = &logits[logits.len() - n_vocab..];
        let next = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap();
        step = vec![next as u32];
    }
    force_path(None).unwrap();
    bits
}

/// Tests here run one at a time: the path is process-wide.
static PATH_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn same_bits_on_every_path(model: &str) {
    let _g = PATH_LOCK.lock().await;
    let want = logits_on(model, Path::Baseline).await;
    for p in Path::ALL {
        if let Some(flag) = p.missing() {
            eprintln!(
                "{model}: skipped the {} path: this CPU lacks {flag}",
                p.name()
            );
        }
    }
    for p in Path::available_paths() {
        let got = logits_on(model, p).await;
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ, 0,
            "{model} on {p:?}: {differ} logits differ from the baseline"
        );
        assert_eq!(got.len(), want.len());
    }
}

#[tokio::test]
async fn qwen3moe_q4_k_model_gives_the_same_logits_on_every_path() {
    same_bits_on_every_path("small-q4_k.gguf").await;
}

#[tokio::test]
async fn qwen3moe_q8_0_model_gives_the_same_logits_on_every_path() {
    same_bits_on_every_path("tiny-q8_0.gguf").await;
}

#[tokio::test]
async fn qwen35moe_q4_k_model_gives_the_same_logits_on_every_path() {
    same_bits_on_every_path("qwen35moe/small-q4_k.gguf").await;
}
