//! The models trained here (`sim/train/`, `sim/models/`) against what llama.cpp said of them
//! (`sim/train/reference.py`): the engine's logits on a held-out passage, and that the model
//! learned (cross-entropy well under the corpus's unigram, greedy text of real words, skewed
//! routing).

use moeswarm_testkit as common;

use common::{argmax, corpus_word_share, cosine, trained};
use moeswarm_engine::generate::{generate, GenerateOptions};
use moeswarm_engine::moe::Routing;
use moeswarm_engine::text::{SamplingConfig, TextTokenizer};
use moeswarm_engine::trunk::{ForwardTiming, Probe, Tap, Trunk};
use moeswarm_engine::LocalExecutor;
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::hyper_params;

const QWEN3MOE: &str = "fortunes-qwen3moe-q8_0";
const QWEN35MOE: &str = "fortunes-qwen35moe-q8_0";

struct Model {
    trunk: Trunk,
    exec: LocalExecutor,
    tokenizer: TextTokenizer,
    reference: serde_json::Value,
    llama_logits: Vec<f32>,
}

fn load(stem: &str) -> Model {
    let g = MappedGguf::open(&trained(&format!("{stem}.gguf"))).unwrap();
    let h = hyper_params(&g.header).unwrap();
    let reference = std::fs::read_to_string(trained(&format!("{stem}.reference.json"))).unwrap();
    let llama_logits = read_f32(&trained(&format!("{stem}.logits.bin")));
    Model {
        trunk: Trunk::from_gguf(&g, &h).unwrap(),
        exec: LocalExecutor::from_gguf(&g).unwrap(),
        tokenizer: TextTokenizer::from_gguf(&g.header).unwrap(),
        reference: serde_json::from_str(&reference).unwrap(),
        llama_logits,
    }
}

/// Rows each expert took, per layer.
#[derive(Default)]
struct RowsPerExpert(Vec<Vec<u64>>);

impl Probe for RowsPerExpert {
    fn tensor(&mut self, _: usize, _: Tap, _: &[f32]) {}
    fn routing(&mut self, layer: usize, r: &Routing<f32>) {
        let n_expert = r.probs.len() / r.n_tokens.max(1);
        if self.0.len() <= layer {
            self.0.resize(layer + 1, Vec::new());
        }
        let row = &mut self.0[layer];
        row.resize(n_expert, 0);
        for &e in &r.experts {
            row[e as usize] += 1;
        }
    }
}

fn passage(m: &Model) -> Vec<u32> {
    m.reference["passage"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

#[tokio::test]
async fn the_trained_qwen3moe_gives_llama_cpps_logits_and_has_learned() {
    gives_llama_cpps_logits_and_has_learned(QWEN3MOE).await;
}

#[tokio::test]
async fn the_trained_qwen35moe_gives_llama_cpps_logits_and_has_learned() {
    gives_llama_cpps_logits_and_has_learned(QWEN35MOE).await;
}

#[tokio::test]
async fn the_trained_qwen3moe_writes_real_words_as_llama_cpp_does() {
    writes_real_words_as_llama_cpp_does(QWEN3MOE).await;
}

#[tokio::test]
async fn the_trained_qwen35moe_writes_real_words_as_llama_cpp_does() {
    writes_real_words_as_llama_cpp_does(QWEN35MOE).await;
}

async fn gives_llama_cpps_logits_and_has_learned(stem: &str) {
    let m = load(stem);
    let toks = passage(&m);
    let mut cache = m.trunk.new_cache();
    let mut rows = RowsPerExpert::default();
    let got = m
        .trunk
        .forward_probed(
            &mut cache,
            &toks,
            &m.exec,
            &mut ForwardTiming::default(),
            &mut rows,
        )
        .await
        .unwrap();
    let vocab = m.trunk.hyper().n_vocab as usize;
    assert_eq!(got.len(), m.llama_logits.len());

    // The engine against llama.cpp, position by position.
    let mut cos: Vec<f64> = Vec::new();
    let mut same_argmax = 0;
    for (g, w) in got.chunks(vocab).zip(m.llama_logits.chunks(vocab)) {
        cos.push(cosine(g, w));
        same_argmax += usize::from(argmax(g) == argmax(w));
    }
    cos.sort_by(f64::total_cmp);
    let median = cos[cos.len() / 2];
    let agree = same_argmax as f64 / cos.len() as f64;
    eprintln!("median cosine {median}, argmax agreement {agree}");
    assert!(median >= 0.99999, "median cosine {median}");
    assert!(agree >= 0.97, "argmax agreement {agree}");

    // Learned: its cross-entropy on the passage well under the corpus's unigram distribution's.
    let neglog: Vec<f64> = m.reference["unigram_neglog"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let (mut ce, mut unigram) = (0.0, 0.0);
    for (t, row) in got.chunks(vocab).enumerate().take(toks.len() - 1) {
        let next = toks[t + 1] as usize;
        let max = row.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
        let lse = row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        ce += lse - row[next] as f64;
        unigram += neglog[next];
    }
    let ratio = ce / unigram;
    eprintln!(
        "cross-entropy {:.3} against unigram {:.3}: {ratio:.3}",
        ce / (toks.len() - 1) as f64,
        unigram / (toks.len() - 1) as f64
    );
    assert!(ratio <= 0.6, "cross-entropy {ratio} of the unigram's");

    // Routing is skewed: the busiest quarter of the experts takes more than a quarter of rows.
    for (l, counts) in rows.0.iter().enumerate() {
        let mut c = counts.clone();
        c.sort_unstable_by(|a, b| b.cmp(a));
        let top: u64 = c[..c.len() / 4].iter().sum();
        let share = top as f64 / c.iter().sum::<u64>() as f64;
        eprintln!("layer {l}: the busiest quarter of the experts takes {share:.2} of the rows");
        assert!(share > 0.25, "layer {l}: {share}");
    }
}

async fn writes_real_words_as_llama_cpp_does(stem: &str) {
    let m = load(stem);
    let prompt = m.reference["prompt"].as_str().unwrap();
    let gen = GenerateOptions {
        prompt: prompt.into(),
        max_tokens: 48,
        raw: true,
        speculation: moeswarm_engine::speculative::SpeculationConfig::OFF,
        keep_logits: false,
        sampling: SamplingConfig {
            temperature: 0.0,
            ..SamplingConfig::default()
        },
    };
    let r = generate(&m.trunk, &m.exec, &m.tokenizer, &gen, |_| {})
        .await
        .unwrap();
    let (n_words, share) = corpus_word_share(&r.text);
    eprintln!(
        "{prompt}{}\n{share:.2} of its words are the corpus's",
        r.text
    );
    assert!(n_words >= 5, "{}", r.text);
    assert!(share >= 0.8, "{share}: {}", r.text);
    // The same text as llama.cpp's greedy run, but where a near tie breaks the other way.
    let want = m.reference["greedy_text"].as_str().unwrap();
    let common_prefix = r
        .text
        .chars()
        .zip(want.chars())
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        common_prefix >= 20,
        "engine {:?}, llama.cpp {want:?}",
        r.text
    );
}

#[tokio::test]
async fn the_trained_qwen35moes_mtp_block_gives_the_reference_logits_and_drafts_the_models_next_token(
) {
    let m = load(QWEN35MOE);
    assert!(m.trunk.has_mtp());
    let toks = passage(&m);
    let vocab = m.trunk.hyper().n_vocab as usize;
    let n_embd = m.trunk.hyper().n_embd as usize;
    let mut cache = m.trunk.new_cache();
    let mut timing = ForwardTiming::default();
    let (logits, hidden) = m
        .trunk
        .forward_batch_hidden(&mut [(&mut cache, &toks[..])], &m.exec, &mut timing)
        .await
        .unwrap();
    let (logits, hidden) = (&logits[0], hidden.of(0));
    // Row t: the stream at t and token t + 1 predict token t + 2.
    let n = toks.len() - 1;
    let mtp = m
        .trunk
        .mtp_forward(
            &mut cache,
            &hidden[..n * n_embd],
            &toks[1..],
            &m.exec,
            &mut timing,
        )
        .await
        .unwrap();
    assert_eq!(cache.mtp_len(), n);
    // Against the block's definition run in f32 on the file's weights (`mtp_reference.py`).
    let want = read_f32(&trained(&format!("{QWEN35MOE}.mtp.logits.bin")));
    assert_eq!(want.len(), mtp.logits.len());
    let mut cos: Vec<f64> = Vec::new();
    let mut same = 0;
    for (g, w) in mtp.logits.chunks(vocab).zip(want.chunks(vocab)) {
        cos.push(cosine(g, w));
        same += usize::from(argmax(g) == argmax(w));
    }
    cos.sort_by(f64::total_cmp);
    let (median, agree) = (cos[cos.len() / 2], same as f64 / n as f64);
    eprintln!("MTP: median cosine {median}, argmax agreement {agree}");
    assert!(median >= 0.9999, "median cosine {median}");
    assert!(agree >= 0.95, "argmax agreement {agree}");
    // As a drafter: its top-1 for t + 2 against the model's own greedy token at t + 1.
    let drafted = (0..n - 1)
        .filter(|&t| {
            argmax(&mtp.logits[t * vocab..(t + 1) * vocab])
                == argmax(&logits[(t + 1) * vocab..(t + 2) * vocab])
        })
        .count();
    let rate = drafted as f64 / (n - 1) as f64;
    eprintln!("MTP drafts agree with the model's next greedy token at {rate:.2}");
    assert!(rate >= 0.4, "{rate}");
}

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
