//! The qwen35moe trunk (Gated DeltaNet, gated attention, shared expert) against llama.cpp's
//! logits on the reference models (`node/testkit/data/qwen35moe/`, written and run by
//! llama.cpp's own tools), in one batch and token by token.

use moeswarm_testkit as common;

use common::{argmax, cosine, data, read_f32};
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::trunk::{ForwardTiming, Probe, Tap};

const DIR: &str = "qwen35moe";

fn tokens() -> Vec<u32> {
    common::reference_tokens(DIR)
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

/// Collects every tap of a forward pass, rows appended in the order they come.
#[derive(Default)]
struct Recorder {
    tensors: std::collections::HashMap<(usize, Tap), Vec<f32>>,
    topk: std::collections::HashMap<usize, Vec<u32>>,
}

impl Probe for Recorder {
    fn tensor(&mut self, layer: usize, tap: Tap, rows: &[f32]) {
        self.tensors
            .entry((layer, tap))
            .or_default()
            .extend_from_slice(rows);
    }

    fn routing(&mut self, layer: usize, routing: &moeswarm_engine::moe::Routing<f32>) {
        self.topk
            .entry(layer)
            .or_default()
            .extend_from_slice(&routing.experts);
    }
}

/// The reference's layer dumps, each matched to the tap that computes it.
const DUMPS: &[(usize, Tap, &str)] = &[
    (0, Tap::ConvSilu, "conv_silu"),
    (0, Tap::DeltaNetCore, "deltanet_core"),
    (0, Tap::MixerOut, "linear_attn_out"),
    (0, Tap::MoeInput, "attn_post_norm"),
    (0, Tap::MoeProbs, "ffn_moe_probs"),
    (0, Tap::MoeOut, "ffn_moe_out"),
    (0, Tap::FfnOut, "ffn_out"),
    (0, Tap::LayerOut, "l_out"),
    (1, Tap::LayerOut, "l_out"),
    (2, Tap::LayerOut, "l_out"),
    (3, Tap::MixerOut, "attn_output"),
    (3, Tap::LayerOut, "l_out"),
];

/// Runs the batch with a recorder and compares every dump, in forward order, per position:
/// cosine ≥ `min_cos` and max |Δ| ≤ `max_rel` × the row's largest magnitude. The first dump
/// that fails names the step that went wrong.
async fn check_dumps(name: &str, min_cos: f64, max_rel: f32) {
    let m = model(name);
    let mut rec = Recorder::default();
    m.trunk
        .forward_probed(
            &mut m.trunk.new_cache(),
            &tokens(),
            &m.experts,
            &mut ForwardTiming::default(),
            &mut rec,
        )
        .await
        .unwrap();
    let n_tok = tokens().len();
    for &(layer, tap, file) in DUMPS {
        let want = read_f32(&format!("{DIR}/{name}.layer{layer}.{file}.bin"));
        let got = rec
            .tensors
            .get(&(layer, tap))
            .unwrap_or_else(|| panic!("{name}: no {tap:?} in layer {layer}"));
        assert_eq!(got.len(), want.len(), "{name} layer {layer} {file}: length");
        let width = want.len() / n_tok;
        for (p, (g, w)) in got
            .chunks_exact(width)
            .zip(want.chunks_exact(width))
            .enumerate()
        {
            let cos = cosine(g, w);
            let scale = w.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-6);
            let max = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                cos >= min_cos && max <= max_rel * scale,
                "{name} layer {layer} {file} position {p}: cosine {cos}, max |Δ| {max} of {scale}"
            );
        }
    }
    let want: Vec<u32> = common::read_i32(&format!("{DIR}/{name}.layer0.ffn_moe_topk.bin"))
        .into_iter()
        .map(|e| e as u32)
        .collect();
    assert_eq!(rec.topk[&0], want, "{name}: layer 0's chosen experts");
}

#[tokio::test]
async fn f32_model_layer_dumps_match_llama_cpp_step_by_step() {
    check_dumps("tiny-f32", 0.999_999, 1e-4).await;
}

#[tokio::test]
async fn quantized_model_layer_dumps_match_llama_cpp_step_by_step() {
    check_dumps("small-q4_k", 0.99999, 1e-3).await;
}
