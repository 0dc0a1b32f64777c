//! The qwen35moe trunk (Gated DeltaNet, gated attention, shared expert) against llama.cpp's
//! logits on the reference models (`node/testkit/data/qwen35moe/`, written and run by
//! llama.cpp's own tools), in one batch and token by token.

use moeswarm_testkit as common;

use common::{cosine, data, read_f32};
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::trunk::ForwardTiming;

const DIR: &str = "qwen35moe";

fn tokens() -> Vec<u32> {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data(&format!("{DIR}/index.json"))).unwrap())
            .unwrap();
    index["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

fn model(name: &str) -> LocalModel {
    LocalModel::load(&ModelSource::Gguf(data(&format!("{DIR}/{name}.gguf")))).unwrap()
}

/// Logits of the reference tokens: one batch, or one token at a time through the same state.
async fn logits(m: &LocalModel, one_by_one: bool) -> Vec<f32> {
    let toks = tokens();
    let mut cache = m.trunk.new_cache();
    let mut timing = ForwardTiming::default();
    if !one_by_one {
        return m
            .trunk
            .forward(&mut cache, &toks, &m.experts, &mut timing)
            .await
            .unwrap();
    }
    let mut out = Vec::new();
    for t in toks {
        out.extend(
            m.trunk
                .forward(&mut cache, &[t], &m.experts, &mut timing)
                .await
                .unwrap(),
        );
    }
    out
}

/// Per position: cosine against the better of the references, and whether the argmax agrees
/// with it; then the thresholds (median ≥ 0.99995, 90 % ≥ 0.9999, argmax ≥ 95 %).
fn assert_matches(got: &[f32], refs: &[Vec<f32>], n_vocab: usize, what: &str) {
    let mut cos = Vec::new();
    let mut same_argmax = 0;
    for (p, row) in got.chunks_exact(n_vocab).enumerate() {
        let (c, r) = refs
            .iter()
            .map(|r| {
                let want = &r[p * n_vocab..(p + 1) * n_vocab];
                (cosine(row, want), want)
            })
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap();
        cos.push(c);
        same_argmax += usize::from(argmax(row) == argmax(r));
    }
    let n = cos.len();
    let mut sorted = cos.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[n / 2];
    let good = cos.iter().filter(|&&c| c >= 0.9999).count();
    assert!(median >= 0.99995, "{what}: median cosine {median}: {cos:?}");
    assert!(
        good * 10 >= n * 9,
        "{what}: {good} of {n} positions ≥ 0.9999: {cos:?}"
    );
    assert!(
        same_argmax * 100 >= n * 95,
        "{what}: argmax equal at {same_argmax} of {n}"
    );
}

async fn check(name: &str, twin: bool) {
    let m = model(name);
    let n_vocab = m.trunk.hyper().n_vocab as usize;
    let mut refs = vec![read_f32(&format!("{DIR}/{name}.logits.bin"))];
    if twin {
        refs.push(read_f32(&format!("{DIR}/{name}.twin-f32.logits.bin")));
    }
    let batch = logits(&m, false).await;
    assert_eq!(batch.len(), refs[0].len());
    assert_matches(&batch, &refs, n_vocab, &format!("{name} batch"));
    let mut seq_refs = vec![read_f32(&format!("{DIR}/{name}.seq.logits.bin"))];
    seq_refs.extend(refs.iter().skip(1).cloned());
    let seq = logits(&m, true).await;
    assert_matches(&seq, &seq_refs, n_vocab, &format!("{name} token by token"));
}

#[tokio::test]
async fn f32_model_matches_llama_cpp_in_a_batch_and_token_by_token() {
    check("tiny-f32", false).await;
}

#[tokio::test]
async fn quantized_model_matches_llama_cpp_in_a_batch_and_token_by_token() {
    check("small-q4_k", true).await;
}

#[tokio::test]
async fn the_f32_model_is_exact_to_1e_4() {
    let m = model("tiny-f32");
    let got = logits(&m, false).await;
    let want = read_f32(&format!("{DIR}/tiny-f32.logits.bin"));
    let max = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(max <= 1e-4, "max |Δ| {max}");
}
