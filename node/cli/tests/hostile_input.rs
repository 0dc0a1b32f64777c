//! Input a careless user or a hostile file gives: each a named error (exit status 2), found
//! before any work, with nothing created or left behind.

use moeswarm_testkit as common;

use common::{data, EditableGguf};
use moeswarm_model::gguf::Value;

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    common::run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

/// `tiny-q8_0.gguf` with metadata `key` set to `value`, written to `dir/name`.
fn edited(dir: &std::path::Path, name: &str, key: &str, value: Value) -> String {
    let mut g = EditableGguf::open("tiny-q8_0.gguf");
    g.set(key, value);
    let path = dir.join(name);
    g.write(&path);
    path.to_str().unwrap().to_string()
}

/// The GGUF bytes of `tiny-q8_0.gguf` with the u64 at `offset` (8: tensor count, 16: metadata
/// count) replaced by `value`.
fn patched_count(dir: &std::path::Path, offset: usize, value: i64) -> String {
    let mut bytes = std::fs::read(data("tiny-q8_0.gguf")).unwrap();
    bytes[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
    let path = dir.join(format!("count-{offset}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn a_block_count_past_the_limit_is_refused_at_once_by_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let f = edited(
        dir.path(),
        "blocks.gguf",
        "qwen3moe.block_count",
        Value::U32(u32::MAX),
    );
    let store = dir.path().join("store");
    for args in [
        vec!["plan", f.as_str(), "--vram", "1GiB", "--ram", "8GiB"],
        vec!["slice", f.as_str(), "--store", store.to_str().unwrap()],
    ] {
        let (code, _, err) = moeswarm(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("block_count = 4294967295 is outside 1..=1024"),
            "{args:?}: {err}"
        );
    }
    // The refused slice stored nothing.
    let blobs = std::fs::read_dir(store.join("blobs")).map_or(0, |d| d.count());
    assert_eq!(blobs, 0);
}

#[test]
fn negative_counts_are_named_as_negative() {
    let dir = tempfile::tempdir().unwrap();
    for (offset, what) in [(8, "tensor count"), (16, "metadata count")] {
        let f = patched_count(dir.path(), offset, -1);
        let (code, _, err) = moeswarm(&["inspect", &f]);
        assert_eq!(code, 2, "{what}: {err}");
        assert!(err.contains(&format!("{what} is negative (-1)")), "{err}");
    }
}

#[test]
fn an_architecture_the_engine_does_not_run_is_not_sliced() {
    let dir = tempfile::tempdir().unwrap();
    let f = edited(
        dir.path(),
        "llama.gguf",
        "general.architecture",
        Value::String("llama".into()),
    );
    let store = dir.path().join("store");
    let (code, _, err) = moeswarm(&["slice", &f, "--store", store.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("\"llama\" is not one the engine runs (qwen3moe, qwen35moe)"),
        "{err}"
    );
}

#[test]
fn sampling_parameters_are_checked_before_anything_runs() {
    let f = data("tiny-q8_0.gguf");
    let f = f.to_str().unwrap();
    for (flag, value, says) in [
        ("--temperature", "NaN", "temperature NaN"),
        ("--temperature", "-1", "temperature -1"),
        ("--repeat-penalty", "0", "repetition penalty 0"),
        ("--top-p", "0", "top-p 0"),
    ] {
        let (code, _, err) = moeswarm(&[
            "generate",
            "--model",
            f,
            "--prompt",
            "x",
            "--max-tokens",
            "1",
            &format!("{flag}={value}"),
        ]);
        assert_eq!(code, 2, "{flag} {value}: {err}");
        assert!(err.contains(says), "{flag} {value}: {err}");
    }
}

#[test]
fn a_command_that_reads_a_store_does_not_create_one() {
    let dir = tempfile::tempdir().unwrap();
    let typo = dir.path().join("stroe");
    let (code, _, err) = moeswarm(&[
        "generate",
        "--store",
        typo.to_str().unwrap(),
        "--model-id",
        &"ab".repeat(32),
        "--prompt",
        "x",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no store at"), "{err}");
    assert!(!typo.exists());
    let (code, _, err) = moeswarm(&["scrub", "--store", typo.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(!typo.exists());
}

#[test]
fn sim_runs_the_tiny_preset() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = moeswarm(&[
        "sim",
        "--preset",
        "tiny",
        "--max-tokens",
        "2",
        "--work-dir",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["tokens_identical"], true);
}
