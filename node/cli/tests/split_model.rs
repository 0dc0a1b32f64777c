//! A model split into parts (llama.cpp's gguf-split layout, parts written by gguf-py) works in
//! every command that takes a model file, as the file it was split from does.

use moeswarm_testkit::{data, run_program};

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

fn part(no: u64) -> String {
    data("split")
        .join(format!("tiny-f32-by-count-{no:05}-of-00003.gguf"))
        .to_str()
        .unwrap()
        .to_string()
}

fn json(args: &[&str]) -> serde_json::Value {
    let (code, out, err) = moeswarm(args);
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

#[test]
fn every_command_reads_a_split_model_as_the_merged_file() {
    let merged = data("tiny-f32.gguf");
    let merged = merged.to_str().unwrap();
    let (first, middle) = (part(1), part(2));

    // inspect: the model's header, with its parts.
    let one = json(&["inspect", merged, "--json"]);
    let split = json(&["inspect", &middle, "--json"]);
    assert_eq!(split["parts"].as_array().unwrap().len(), 3);
    for key in [
        "hyper_params",
        "metadata",
        "header_id",
        "tensor_bytes",
        "expert_bytes",
    ] {
        assert_eq!(split[key], one[key], "{key}");
    }
    let (code, text, _) = moeswarm(&["inspect", &first]);
    assert_eq!(code, 0);
    assert!(text.contains("split into 3 parts"), "{text}");

    // plan: the same sizes.
    let plan = |f: &str| json(&["plan", f, "--vram", "1GiB", "--ram", "1GiB", "--json"]);
    assert_eq!(plan(&first), plan(merged));

    // slice and verify: the same model id.
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let sliced_one = json(&["slice", merged, "--store", a.to_str().unwrap(), "--json"]);
    let sliced = json(&["slice", &first, "--store", b.to_str().unwrap(), "--json"]);
    assert_eq!(sliced["model_id"], sliced_one["model_id"]);
    let v = json(&[
        "verify",
        &middle,
        "--store",
        b.to_str().unwrap(),
        "--tokens",
        "4",
        "--json",
    ]);
    assert_eq!(v["passed"], true);

    // generate: the same tokens.
    let gen = |f: &str| {
        json(&[
            "generate",
            "--model",
            f,
            "--prompt",
            "hi",
            "--max-tokens",
            "6",
            "--json",
        ])["tokens"]
            .clone()
    };
    assert_eq!(gen(&first), gen(merged));

    // bench runs on it.
    let v = json(&["bench", &first, "-p", "4", "-n", "2", "-r", "1", "--json"]);
    assert!(v["tg_tps"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_split_model_with_a_part_missing_is_a_clear_error_in_every_command() {
    let dir = tempfile::tempdir().unwrap();
    for no in [1, 3] {
        std::fs::copy(
            part(no),
            dir.path().join(format!("m-{no:05}-of-00003.gguf")),
        )
        .unwrap();
    }
    let first = dir.path().join("m-00001-of-00003.gguf");
    let first = first.to_str().unwrap();
    let store = dir.path().join("store");
    for args in [
        vec!["inspect", first],
        vec!["slice", first, "--store", store.to_str().unwrap()],
        vec!["generate", "--model", first, "--prompt", "hi"],
        vec!["plan", first, "--vram", "1GiB", "--ram", "1GiB"],
    ] {
        let (code, _, err) = moeswarm(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("part 2 of 3 is missing") && err.contains("m-00002-of-00003.gguf"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}
