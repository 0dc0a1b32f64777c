//! `moeswarm tokenize` on Qwen3.5's real vocabulary, and `--chat-template` in `generate`.

use moeswarm_testkit::{data, run_program};

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

fn vocab() -> String {
    data("vocab/ggml-vocab-qwen35.gguf")
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn tokenize_prints_llama_cpps_ids_and_the_pieces() {
    // llama.cpp's own case: "Hello world" is 9707 1879 in Qwen3.5's vocabulary.
    let (code, out, err) = moeswarm(&["tokenize", "--model", &vocab(), "--json", "Hello world"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ids"], serde_json::json!([9707, 1879]));
    assert_eq!(v["tokens"][1]["piece"], " world");
    let (code, text, _) = moeswarm(&["tokenize", "--model", &vocab(), "Hello world"]);
    assert_eq!(code, 0);
    assert!(
        text.contains("9707 \"Hello\"") && text.contains("2 tokens"),
        "{text}"
    );

    // From standard input; control tokens parsed unless told not to.
    let vocab = vocab();
    let run = |extra: &[&str]| {
        let mut args = vec!["tokenize", "--model", &vocab, "--json", "-"];
        args.splice(1..1, extra.iter().copied());
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_moeswarm"))
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"<|im_start|>hi")
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["ids"].as_array().unwrap().len()
    };
    assert_eq!(run(&[]), 2);
    assert!(run(&["--no-parse-special"]) > 2);
}

#[test]
fn generate_uses_a_given_chat_template() {
    let model = data("small-q4_k.gguf");
    let model = model.to_str().unwrap();
    let template = data("templates/Qwen-Qwen3-0.6B.jinja");
    let gen = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", model, "--max-tokens", "1", "--json"];
        args.extend_from_slice(extra);
        let (code, out, err) = moeswarm(&args);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["prompt_tokens"].as_array().unwrap().len()
    };
    // The model has no template: the prompt is the text; with Qwen3's, the rendered turn.
    let rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(gen(&["--prompt", "hi"]), 2);
    assert_eq!(
        gen(&[
            "--prompt",
            "hi",
            "--chat-template",
            template.to_str().unwrap()
        ]),
        gen(&["--prompt", rendered, "--raw"])
    );
    let (code, _, err) = moeswarm(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--chat-template",
        "/nonexistent.jinja",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent.jinja"), "{err}");
}
