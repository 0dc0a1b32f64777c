//! The trunk's logits against llama.cpp's on the reference models, and its own consistency:
//! monolithic GGUF vs sliced store, prefill vs token-by-token decode.

use moeswarm_testkit as common;

use common::{argmax, cosine, data, read_f32};
use moeswarm_engine::generate::{generate, GenerateOptions, LocalModel, ModelSource};
use moeswarm_engine::text::SamplingConfig;
use moeswarm_engine::trunk::{ForwardTiming, Trunk};
use moeswarm_engine::LocalExecutor;
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::hyper_params;
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;

fn tokens() -> Vec<u32> {
    common::reference_tokens("")
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

#[tokio::test]
async fn sliced_store_gives_bit_identical_logits_and_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (model, _, _) = slice(&data("small-q4_k.gguf"), &store, SliceOptions::default()).unwrap();
    drop(store);
    let mono = LocalModel::load(&ModelSource::Gguf(data("small-q4_k.gguf"))).unwrap();
    let sliced = LocalModel::load(&ModelSource::Store {
        dir: dir.path().to_path_buf(),
        model,
    })
    .unwrap();
    let a = prefill(&mono.trunk, &mono.experts, &tokens()).await;
    let b = prefill(&sliced.trunk, &sliced.experts, &tokens()).await;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&a) == bits(&b), "logits differ between GGUF and store");
    let opts = GenerateOptions {
        prompt: "The swarm".into(),
        max_tokens: 12,
        raw: true,
        speculation: moeswarm_engine::speculative::SpeculationConfig::OFF,
        keep_logits: false,
        sampling: SamplingConfig {
            temperature: 0.7,
            seed: 9,
            ..Default::default()
        },
    };
    let ga = generate(&mono.trunk, &mono.experts, &mono.tokenizer, &opts, |_| {})
        .await
        .unwrap();
    let gb = generate(
        &sliced.trunk,
        &sliced.experts,
        &sliced.tokenizer,
        &opts,
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(ga.tokens, gb.tokens);
    assert_eq!(ga.tokens.len(), 12);
}

#[tokio::test]
async fn prefill_then_decode_equals_one_batch() {
    for model in ["tiny-f32.gguf", "small-q4_k.gguf"] {
        let (trunk, exec) = load(model);
        let toks = tokens();
        let whole = prefill(&trunk, &exec, &toks).await;
        let vocab = trunk.hyper().n_vocab as usize;
        let mut cache = trunk.new_cache();
        let mut timing = ForwardTiming::default();
        let mut stepped = trunk
            .forward(&mut cache, &toks[..10], &exec, &mut timing)
            .await
            .unwrap();
        for &t in &toks[10..] {
            stepped.extend(
                trunk
                    .forward(&mut cache, &[t], &exec, &mut timing)
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(cache.len(), toks.len());
        assert_eq!(stepped.len(), toks.len() * vocab);
        let max = whole
            .iter()
            .zip(&stepped)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(max <= 1e-5, "{model}: prefill vs decode max |Δ| {max}");
    }
}

#[test]
fn tokenizer_from_gguf_round_trips_bytes() {
    let g = MappedGguf::open(&data("small-q4_k.gguf")).unwrap();
    let tok = moeswarm_engine::text::TextTokenizer::from_gguf(&g.header).unwrap();
    for text in [
        "hello world",
        "  two  spaces\nand a newline",
        "ünïcödé ✓ 42",
    ] {
        let ids = tok.encode(text).unwrap();
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    // Byte tokens: "A" is byte 65, which is token 65 in this vocabulary.
    assert_eq!(tok.encode("A").unwrap(), vec![65]);
    assert_eq!(tok.eos, Some(511));
    assert!(!tok.chatml && tok.prompt("hi").unwrap() == "hi");
}

#[tokio::test]
async fn a_token_outside_the_vocabulary_is_an_error() {
    let (trunk, exec) = load("tiny-f32.gguf");
    let mut cache = trunk.new_cache();
    let err = trunk
        .forward(&mut cache, &[3, 999], &exec, &mut ForwardTiming::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

#[test]
fn shapes_that_contradict_the_metadata_are_refused_not_panicked_on() {
    let mut bytes = std::fs::read(data("tiny-f32.gguf")).unwrap();
    let key = b"qwen3moe.attention.head_count";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // After the key: the u32 type tag, then the value (4 heads): claim 8.
    assert_eq!(&bytes[at + 4..at + 8], &4u32.to_le_bytes());
    bytes[at + 4..at + 8].copy_from_slice(&8u32.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lying.gguf");
    std::fs::write(&file, bytes).unwrap();
    let err = LocalModel::load(&ModelSource::Gguf(file))
        .err()
        .expect("refused");
    assert!(
        format!("{err:#}").contains("blk.0.attn_q.weight has shape"),
        "{err:#}"
    );
}

#[test]
fn chat_models_get_chatml_and_stop_at_the_end_of_the_turn() {
    use moeswarm_engine::synth::{synth, Preset, SynthOptions};
    use moeswarm_model::gguf::{GgmlType, Gguf};
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.gguf");
    synth(
        &file,
        &Preset::named("qwen3moe", "small").unwrap(),
        SynthOptions::new(GgmlType::Q8_0, 1),
    )
    .unwrap();
    let tok = moeswarm_engine::text::TextTokenizer::from_gguf(&Gguf::open(&file).unwrap()).unwrap();
    assert!(tok.chatml);
    let prompt = tok.prompt("hi").unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&prompt).unwrap();
    // Control tokens are single ids (510 = <|im_start|>, 511 = <|im_end|>), not their bytes.
    assert_eq!(&ids[..1], &[510]);
    assert!(ids.contains(&511));
    // <s>user \n hi <e> \n <s>assistant \n, one byte token per character (no merges).
    assert_eq!(ids.len(), 1 + 4 + 1 + 2 + 1 + 1 + 1 + 9 + 1);
    assert!(tok.is_stop(511) && tok.eos == Some(511));
    // Decoding leaves the control tokens out.
    assert_eq!(tok.decode(&ids).unwrap(), "user\nhi\nassistant\n");
}
