//! Speculative decoding on the model trained here: greedy text is the model's own, token for
//! token, whichever drafter guessed it, in fewer forward passes.

use moeswarm_testkit as common;

use common::drafters::KnowingDrafter;
use common::trained_model;
use moeswarm_engine::generate::{generate, generate_drafted, GenerateOptions, GenerateReport};
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
    load_file(&trained_model())
}

fn load_file(path: &std::path::Path) -> Model {
    let g = MappedGguf::open(path).unwrap();
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
        keep_logits: true,
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
            assert!(same_logits(&r, &plain), "{mode:?} k={k}");
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

/// Whether two generations chose every token from the same logits, bit for bit.
fn same_logits(a: &GenerateReport, b: &GenerateReport) -> bool {
    !a.logits.is_empty() && moeswarm_engine::ops::same_bits(&a.logits, &b.logits)
}

/// A greedy run of `prompt` without drafts, then the same with an always-right and an
/// always-wrong drafter at k = 4.
async fn plain_right_and_wrong(
    m: &Model,
    prompt: &str,
    max_tokens: usize,
) -> (GenerateReport, [GenerateReport; 2]) {
    let opts = GenerateOptions {
        prompt: prompt.into(),
        max_tokens,
        raw: true,
        sampling: SamplingConfig::default(),
        speculation: SpeculationConfig::OFF,
        keep_logits: true,
    };
    let plain = generate(&m.trunk, &m.exec, &m.tokenizer, &opts, |_| {})
        .await
        .unwrap();
    let mut text = plain.prompt_tokens.clone();
    text.extend(&plain.tokens);
    let mut drafted = Vec::new();
    for wrong in [false, true] {
        let mut d = KnowingDrafter {
            text: text.clone(),
            wrong,
        };
        let r = generate_drafted(
            &m.trunk,
            &m.exec,
            &m.tokenizer,
            &opts,
            Some(&mut d),
            4,
            |_| {},
        )
        .await
        .unwrap();
        drafted.push(r);
    }
    let [right, wrong] = drafted.try_into().unwrap();
    (plain, [right, wrong])
}

#[tokio::test]
async fn an_always_right_drafter_gives_five_tokens_a_pass_and_an_always_wrong_one_changes_nothing()
{
    let m = load();
    let (plain, drafted) = plain_right_and_wrong(&m, PROMPTS[0], 41).await;
    let n = plain.tokens.len();
    assert_eq!(n, 41, "{:?}", plain.text);
    for (r, wrong) in drafted.iter().zip([false, true]) {
        assert_eq!(r.tokens, plain.tokens, "wrong: {wrong}");
        assert!(same_logits(r, &plain), "wrong: {wrong}");
        let s = r.speculation;
        if wrong {
            // One token a pass, as without drafts; every draft refused.
            assert_eq!(s.passes, plain.speculation.passes, "{s:?}");
            assert_eq!(s.accepted, 0, "{s:?}");
            assert!(s.drafted >= s.passes, "{s:?}");
        } else {
            // The first token comes from the prompt's pass; each pass then gives 4 drafts and
            // the model's own token: 40 tokens in 8 passes.
            assert_eq!(s.passes, (n - 1) / 5, "{s:?}");
            assert_eq!(s.accepted, 4 * s.passes, "{s:?}");
        }
        // The model's layers are the round trips: 4 a pass.
        assert_eq!(s.expert_rounds, 4 * s.passes as u64, "{s:?}");
    }
}

#[tokio::test]
async fn on_every_reference_model_drafts_change_no_greedy_token() {
    for name in [
        "tiny-f32.gguf",
        "small-q4_k.gguf",
        "qwen35moe/tiny-f32.gguf",
        "qwen35moe/small-q4_k.gguf",
    ] {
        let m = load_file(&common::data(name));
        let (plain, drafted) = plain_right_and_wrong(&m, "The swarm", 24).await;
        assert!(!plain.logits.is_empty());
        for (r, wrong) in drafted.iter().zip([false, true]) {
            assert_eq!(r.tokens, plain.tokens, "{name}, wrong drafts: {wrong}");
            assert!(same_logits(r, &plain), "{name}, wrong drafts: {wrong}");
        }
        let ngram = SpeculationConfig::new(Speculation::Ngram, Some(4), &m.trunk).unwrap();
        let r = run(&m, "The swarm", SamplingConfig::default(), ngram).await;
        let want = run(
            &m,
            "The swarm",
            SamplingConfig::default(),
            SpeculationConfig::OFF,
        )
        .await;
        assert_eq!(r.tokens, want.tokens, "{name}, prompt lookup");
        assert!(same_logits(&r, &want), "{name}, prompt lookup");
    }
}
