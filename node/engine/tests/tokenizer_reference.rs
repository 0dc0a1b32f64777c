//! The tokenizer against llama.cpp on Qwen3.5's real vocabulary (`data/vocab/`): llama.cpp's
//! own test cases for it (`ggml-vocab-qwen35.gguf.inp` / `.out`, and qwen2's), and a corpus of
//! our own tokenized by llama.cpp (llama-cpp-python, `scripts/tokenizer_reference.py`).

use moeswarm_engine::text::TextTokenizer;
use moeswarm_model::gguf::{Gguf, Value};
use moeswarm_testkit::{data, EditableGguf};

const VOCAB: &str = "vocab/ggml-vocab-qwen35.gguf";

fn qwen35() -> TextTokenizer {
    TextTokenizer::from_gguf(&Gguf::open(&data(VOCAB)).unwrap()).unwrap()
}

/// The same vocabulary with another `tokenizer.ggml.pre` (llama.cpp's qwen2 vocabulary file
/// differs from qwen35's in that key only).
fn with_pre(pre: &str) -> anyhow::Result<TextTokenizer> {
    let mut g = EditableGguf::open(VOCAB);
    g.set("tokenizer.ggml.pre", Value::String(pre.into()));
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("vocab.gguf");
    g.write(&path);
    Ok(TextTokenizer::from_gguf(&Gguf::open(&path)?)?)
}

/// llama.cpp's test cases: `(text, ids)`.
fn cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(data(&format!("vocab/{name}.inp"))).unwrap();
    let out = std::fs::read_to_string(data(&format!("vocab/{name}.out"))).unwrap();
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let ids: Vec<&str> = out.split('\n').collect();
    // Both end with a separator: one empty piece more than there are cases.
    assert_eq!(texts.last(), Some(&""));
    let n = texts.len() - 1;
    assert!(n >= 40 && ids.len() > n, "{n} cases, {} lines", ids.len());
    (0..n)
        .map(|i| {
            let want = ids[i]
                .split_whitespace()
                .map(|t| t.parse().unwrap())
                .collect();
            (texts[i].to_string(), want)
        })
        .collect()
}

fn check(tok: &TextTokenizer, cases: &[(String, Vec<u32>)]) {
    let mut wrong = Vec::new();
    for (text, want) in cases {
        let got = tok.tokenize(text, false, true).unwrap();
        if &got != want {
            wrong.push(format!("{text:?}: got {got:?}, llama.cpp {want:?}"));
        }
        assert_eq!(&tok.detokenize(&got).unwrap(), text, "round trip");
    }
    assert!(
        wrong.is_empty(),
        "{} of {} differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}

#[test]
fn qwen35_gives_llama_cpp_ids_on_its_own_test_cases() {
    check(&qwen35(), &cases("ggml-vocab-qwen35.gguf"));
}

#[test]
fn qwen2_gives_llama_cpp_ids_on_its_own_test_cases() {
    check(&with_pre("qwen2").unwrap(), &cases("ggml-vocab-qwen2.gguf"));
}

#[test]
fn a_corpus_of_our_own_gives_llama_cpps_ids_under_qwen35_and_qwen2() {
    let corpus: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data("vocab/corpus.json")).unwrap()).unwrap();
    let texts = corpus["cases"].as_array().unwrap();
    assert!(texts.len() >= 200);
    for (pre, tok) in [("qwen35", qwen35()), ("qwen2", with_pre("qwen2").unwrap())] {
        let cases: Vec<(String, Vec<u32>)> = texts
            .iter()
            .zip(corpus[pre].as_array().unwrap())
            .map(|(t, ids)| {
                let ids = ids
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap() as u32);
                (t.as_str().unwrap().to_string(), ids.collect())
            })
            .collect();
        check(&tok, &cases);
    }
}

#[test]
fn control_and_user_defined_tokens_follow_llama_cpp() {
    let tok = qwen35();
    let (endoftext, im_start, im_end, pad) = (151643, 151644, 151645, 151650);
    assert_eq!(
        tok.tokenize("<|im_start|>", false, true).unwrap(),
        [im_start]
    );
    // Not parsing specials, control tokens are text; user-defined ones are still tokens.
    let plain = tok
        .tokenize("<|im_start|>[PAD151650]", false, false)
        .unwrap();
    assert!(plain.len() > 2 && !plain.contains(&im_start), "{plain:?}");
    assert_eq!(plain.last(), Some(&pad));
    // Generation stops at every end-of-generation token; a user reads no control token.
    assert!(tok.is_stop(endoftext) && tok.is_stop(im_end) && !tok.is_stop(im_start));
    assert_eq!(tok.stop_tokens().collect::<Vec<_>>(), [endoftext, im_end]);
    let ids = tok.encode("<|im_start|>hi<|im_end|>").unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), "hi");
    assert_eq!(tok.detokenize(&ids).unwrap(), "<|im_start|>hi<|im_end|>");
    // Pieces are bytes: an emoji's first token is part of a character.
    let ids = tok.tokenize("🦙", false, true).unwrap();
    let bytes: Vec<u8> = ids.iter().flat_map(|&i| tok.piece(i).unwrap()).collect();
    assert_eq!(bytes, "🦙".as_bytes());
}

#[test]
fn an_unknown_pre_tokenizer_is_an_error_not_a_guess() {
    let e = with_pre("qwen9000").err().expect("refused");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("\"qwen9000\"") && msg.contains("refusing to guess"),
        "{msg}"
    );
}
