//! What moeswarm's tests and benchmarks share: the reference files written by llama.cpp's
//! tools (`data/`, see its README), readers and comparisons for them, and the benchmark model.
//! It is not part of any shipped crate.

use std::path::PathBuf;

/// The reference files copied from llama.cpp's tools (see `data/README.md`).
pub fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
}

/// The reference models.
pub const MODELS: [&str; 3] = ["tiny-f32.gguf", "tiny-q8_0.gguf", "small-q4_k.gguf"];

pub fn read_f32(name: &str) -> Vec<f32> {
    std::fs::read(data(name))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn read_i32(name: &str) -> Vec<i32> {
    std::fs::read(data(name))
        .unwrap()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn index() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(data("index.json")).unwrap()).unwrap()
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// tiny-f32.gguf with every expert tensor renamed (`_exps.` → `_dens.`): not a MoE model.
pub fn dense_model_bytes() -> Vec<u8> {
    let mut bytes = std::fs::read(data("tiny-f32.gguf")).unwrap();
    let mut i = 0;
    while let Some(p) = bytes[i..].windows(6).position(|w| w == b"_exps.") {
        bytes[i + p..i + p + 6].copy_from_slice(b"_dens.");
        i += p + 6;
    }
    bytes
}

/// Runs a program (the `moeswarm` binary in CLI tests): exit code, stdout, stderr.
pub fn run_program(program: &str, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub mod bench;
