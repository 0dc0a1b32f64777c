//! The trunk's logits against llama.cpp's on the reference models, and its own consistency:
//! monolithic GGUF vs sliced store, prefill vs token-by-token decode.

mod common;

use common::{cosine, data, index, read_f32};
use moeswarm_node::engine::trunk::{ForwardTiming, Trunk};
use moeswarm_node::engine::LocalExecutor;
use moeswarm_node::gguf::MappedGguf;
use moeswarm_node::model::hyper_params;
use moeswarm_node::slice::{slice, SliceOptions};
use moeswarm_node::store::Store;

fn tokens() -> Vec<u32> {
    index()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn load(model: &str) -> (Trunk, LocalExecutor) {
    let g = MappedGguf::open(&data(model)).unwrap();
    let h = hyper_params(&g.header).unwrap();
    (
        Trunk::from_gguf(&g, &h).unwrap(),
        LocalExecutor::from_gguf(&g).unwrap(),
    )
}

async fn prefill(trunk: &Trunk, exec: &LocalExecutor, toks: &[u32]) -> Vec<f32> {
    let mut cache = trunk.new_cache();
    trunk
        .forward(&mut cache, toks, exec, &mut ForwardTiming::default())
        .await
        .unwrap()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

#[tokio::test]
async fn f32_model_matches_llama_cpp_to_1e_4() {
    let (trunk, exec) = load("tiny-f32.gguf");
    let got = prefill(&trunk, &exec, &tokens()).await;
    let want = read_f32("tiny-f32.logits.bin");
    assert_eq!(got.len(), want.len());
    let max = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(max <= 1e-4, "max |Δ| {max}");
}

async fn quantized_matches(model: &str) {
    let (trunk, exec) = load(model);
    let got = prefill(&trunk, &exec, &tokens()).await;
    let stem = model.trim_end_matches(".gguf");
    let want = read_f32(&format!("{stem}.logits.bin"));
    let vocab = trunk.hyper().n_vocab as usize;
    for (t, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let c = cosine(g, w);
        assert!(c >= 0.9999, "{model} position {t}: cosine {c}");
        assert_eq!(argmax(g), argmax(w), "{model} position {t}: argmax");
    }
}

#[tokio::test]
async fn q8_0_model_matches_llama_cpp() {
    quantized_matches("tiny-q8_0.gguf").await;
}

#[tokio::test]
async fn q4_k_model_matches_llama_cpp() {
    quantized_matches("small-q4_k.gguf").await;
}

#[test]
fn kernels_are_pinned_for_tests() {
    // Without the pin, VNNI machines compute Q8_0 with other rounding (see `pin_kernels`).
    assert!(moeswarm_node::engine::quant::kernels_pinned());
}
