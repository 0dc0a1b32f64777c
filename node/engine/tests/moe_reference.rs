//! The MoE layer on llama.cpp's own layer-0 inputs reproduces its expert choices and output.

use moeswarm_testkit as common;

use common::{cosine, data, index, read_f32, read_i32};
use moeswarm_engine::layer::{load_experts, moe_forward, MoeGate};
use moeswarm_engine::moe::route;
use moeswarm_engine::oracle::{dequantize_f64, matvec_rows, moe_monolithic, ExpertF64, Rounding};
use moeswarm_model::expert_layers;
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;

fn check(model: &str) {
    let stem = model.trim_end_matches(".gguf");
    let idx = index();
    let n_embd = idx["models"][model]["n_embd"].as_u64().unwrap() as usize;
    let n_expert = idx["models"][model]["n_expert"].as_u64().unwrap() as usize;
    let k = idx["models"][model]["n_expert_used"].as_u64().unwrap() as usize;
    let x = read_f32(&format!("{stem}.layer0.ffn_norm.bin"));
    let want_topk = read_i32(&format!("{stem}.layer0.ffn_moe_topk.bin"));
    let want_probs = read_f32(&format!("{stem}.layer0.ffn_moe_probs.bin"));
    let want_out = read_f32(&format!("{stem}.layer0.ffn_moe_out.bin"));

    // The candle path over the sliced store: gate from the trunk, experts from slabs.
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (_, manifest, _) = slice(&data(model), &store, SliceOptions::default()).unwrap();
    let trunk = MappedGguf::open(&store.blob_path(&manifest.trunk.id)).unwrap();
    let gate = MoeGate::from_gguf(&trunk, 0, k).unwrap();
    let exec = load_experts(&store, &manifest, 0, 0..n_expert as u32).unwrap();
    let (routing, out) = moe_forward(&gate, &x, n_embd, &exec).unwrap();

    let got_topk: Vec<i32> = routing.experts.iter().map(|&e| e as i32).collect();
    assert_eq!(got_topk, want_topk, "{model}: top-k differs from llama.cpp");
    let dp = routing
        .probs
        .iter()
        .zip(&want_probs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(dp < 1e-5, "{model}: router probabilities differ by {dp}");
    let cos = cosine(&out, &want_out);
    eprintln!("{model}: candle moe vs llama cosine {cos:.8}");
    assert!(cos >= 0.9999, "{model}: MoE output cosine {cos}");
    for t in 0..x.len() / n_embd {
        let c = cosine(
            &out[t * n_embd..(t + 1) * n_embd],
            &want_out[t * n_embd..(t + 1) * n_embd],
        );
        assert!(c >= 0.9999, "{model}: token {t} cosine {c}");
    }

    // The f64 oracle from the monolithic file picks the same experts too.
    let src = MappedGguf::open(&data(model)).unwrap();
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let router = dequantize_f64(&src.tensor("blk.0.ffn_gate_inp.weight").unwrap()).unwrap();
    let r64 = route(&matvec_rows(&router, n_embd, &x64), n_expert, k);
    assert_eq!(r64.experts, routing.experts, "{model}: f64 gate disagrees");
    let layers = expert_layers(&src.header).unwrap();
    let l0 = &layers[0];
    let mono = moe_monolithic(&r64, &x64, n_embd, |e| {
        ExpertF64::new(&l0.expert(&src, e as u64), Rounding::LikeKernels)
    })
    .unwrap();
    let mono32: Vec<f32> = mono.iter().map(|&v| v as f32).collect();
    let cos = cosine(&mono32, &want_out);
    eprintln!("{model}: oracle(kernels) vs llama cosine {cos:.8}");
    assert!(
        cos >= 0.9999,
        "{model}: f64 oracle vs llama.cpp cosine {cos}"
    );
}

#[test]
fn tiny_f32_layer0_matches_llama_cpp() {
    check("tiny-f32.gguf");
}

#[test]
fn small_q4_k_layer0_matches_llama_cpp() {
    check("small-q4_k.gguf");
}
