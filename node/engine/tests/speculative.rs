//! Speculative decoding on the model trained here: greedy text is the model's own, token for
//! token, whichever drafter guessed it, in fewer forward passes.

use moeswarm_testkit as common;

use common::trained_model;
use moeswarm_engine::generate::{generate, GenerateOptions, GenerateReport};
use moeswarm_engine::speculative::{Speculation, SpeculationConfig};
use moeswarm_engine::text::{SamplingConfig, TextTokenizer};
use moeswarm_engine::trunk::Trunk;
use moeswarm_engine::LocalExecutor;
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::hyper_params;

struct Model {
    trunk: Trunk,
    exec: LocalExecutor,
    tokenizer: TextTokenizer,
}

fn load() -> Model {
    let g = MappedGguf::open(&trained_model()).unwrap();
    let h = hyper_params(&g.header).unwrap();
    Model {
        trunk: Trunk::from_gguf(&g, &h).unwrap(),
        exec: LocalExecutor::from_gguf(&g).unwrap(),
        tokenizer: TextTokenizer::from_gguf(&g.header).unwrap(),
    }
}

async fn run(
    m: &Model,
    prompt: &str,
    sampling: SamplingConfig,
    spec: SpeculationConfig,
) -> GenerateReport {
    let opts = GenerateOptions {
        prompt: prompt.into(),
        max_tokens: 64,
        raw: true,
        sampling,
        speculation: spec,
    };
    generate(&m.trunk, &m.exec, &m.tokenizer, &opts, |_| {})
        .await
        .unwrap()
}

const PROMPTS: [&str; 2] = [
    "The best thing about a good friend is",
    "A list in Python is written as a sequence of values. A list",
];

#[tokio::test]
async fn greedy_text_with_drafts_is_the_models_own_in_fewer_passes() {
    let m = load();
    for prompt in PROMPTS {
        let greedy = SamplingConfig::default();
        let plain = run(&m, prompt, greedy.clone(), SpeculationConfig::OFF).await;
        for (mode, k) in [
            (Speculation::Mtp, 1),
            (Speculation::Mtp, 3),
            (Speculation::Ngram, 4),
        ] {
            let spec = SpeculationConfig::new(mode, Some(k), &m.trunk).unwrap();
            let r = run(&m, prompt, greedy.clone(), spec).await;
            assert_eq!(r.tokens, plain.tokens, "{mode:?} k={k}: {:?}", r.text);
            let s = r.speculation;
            eprintln!(
                "{prompt:?} {mode:?} k={k}: {} tokens in {} passes, {} of {} drafts kept",
                r.tokens.len(),
                s.passes,
                s.accepted,
                s.drafted
            );
            assert!(
                s.passes + s.accepted >= plain.speculation.passes,
                "{mode:?} {s:?}"
            );
            if mode == Speculation::Mtp {
                assert!(s.passes < plain.speculation.passes, "{s:?}");
            }
            if mode == Speculation::Mtp && k == 1 {
                // The block's next-token guess, kept at the rate stated in docs/training.md.
                assert!(s.accepted * 10 >= s.drafted * 4, "{s:?}");
            }
        }
    }
}

#[tokio::test]
async fn sampled_text_with_drafts_stays_within_the_samplers_choices() {
    let m = load();
    let sampling = SamplingConfig {
        temperature: 0.8,
        top_k: 1,
        seed: 3,
        ..SamplingConfig::default()
    };
    // top-k 1 leaves one choice a position: sampling is then greedy, drafts or not.
    let plain = run(&m, PROMPTS[0], sampling.clone(), SpeculationConfig::OFF).await;
    let spec = SpeculationConfig::new(Speculation::Mtp, Some(3), &m.trunk).unwrap();
    let r = run(&m, PROMPTS[0], sampling, spec).await;
    assert_eq!(r.tokens, plain.tokens);
    assert!(r.speculation.passes < plain.speculation.passes);
}

#[test]
fn a_model_without_an_mtp_block_refuses_mtp_speculation() {
    let g = MappedGguf::open(&common::data("small-q4_k.gguf")).unwrap();
    let trunk = Trunk::from_gguf(&g, &hyper_params(&g.header).unwrap()).unwrap();
    let e = SpeculationConfig::new(Speculation::Mtp, None, &trunk).unwrap_err();
    assert!(e.to_string().contains("no MTP block"), "{e}");
    assert_eq!(
        SpeculationConfig::default_for(&trunk),
        SpeculationConfig::OFF
    );
    assert!(SpeculationConfig::new(Speculation::Ngram, Some(0), &trunk).is_err());
}
