//! What moeswarm's tests and benchmarks share: the reference files written by llama.cpp's
//! tools (`data/`, see its README), readers and comparisons for them, and the benchmark model.
//! It is not part of any shipped crate.

use std::path::PathBuf;

/// Slices the small reference model (`small-q4_k.gguf`) into a store in `dir`; its manifest.
pub fn sliced_small(dir: &std::path::Path) -> moeswarm_protocol::Manifest {
    sliced(&data("small-q4_k.gguf"), dir).expect("slicing the small model")
}

/// Slices the GGUF `model` into a store in `dir` (made if need be); its manifest.
pub fn sliced(
    model: &std::path::Path,
    dir: &std::path::Path,
) -> anyhow::Result<moeswarm_protocol::Manifest> {
    use moeswarm_model::slice::{slice, SliceOptions};
    let (store, _) = moeswarm_model::store::Store::open(dir)?;
    let (_, manifest, _) = slice(model, &store, SliceOptions::default())?;
    store.flush()?;
    Ok(manifest)
}

/// The reference files copied from llama.cpp's tools (see `data/README.md`).
pub fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
}

/// The index of the largest value (the greedy token of a row of logits).
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0
}

/// A model trained here (`sim/train/`), with what llama.cpp said of it: under `sim/models/`.
pub fn trained(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../sim/models")
        .join(name)
}

/// The qwen35moe trained here, `moeswarm sim`'s default model.
pub fn trained_model() -> PathBuf {
    trained("fortunes-qwen35moe-q8_0.gguf")
}

/// The words of `text` (lower-cased runs of ASCII letters), and the share of them found in
/// the trained models' corpus (`words.txt`, every word of the training text).
pub fn corpus_word_share(text: &str) -> (usize, f64) {
    let known = std::fs::read_to_string(trained("words.txt")).expect("the corpus's words");
    let known: std::collections::HashSet<&str> = known.lines().collect();
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_ascii_lowercase())
        .filter(|w| !w.is_empty())
        .collect();
    let found = words.iter().filter(|w| known.contains(**w)).count();
    (words.len(), found as f64 / words.len().max(1) as f64)
}

/// The held-out passage llama.cpp scored for the trained qwen35moe (its tokens).
pub fn held_out_passage() -> Vec<u32> {
    let path = trained("fortunes-qwen35moe-q8_0.reference.json");
    let text = std::fs::read_to_string(&path).expect("the trained model's reference");
    let r: serde_json::Value = serde_json::from_str(&text).expect("reference JSON");
    r["passage"]
        .as_array()
        .expect("a passage")
        .iter()
        .map(|t| t.as_u64().expect("token ids") as u32)
        .collect()
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

/// The token ids llama.cpp's reference outputs were computed for, from `dir/index.json`
/// (`""`: the qwen3moe references, `"qwen35moe"`: the qwen35moe ones).
pub fn reference_tokens(dir: &str) -> Vec<u32> {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data(dir).join("index.json")).unwrap()).unwrap();
    index["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
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
pub mod drafters;
pub mod faulty;

/// Asks `check` again and again (every 50 ms) until it gives a value (`Some`, or `Ok`), and
/// returns that; panics naming `what` and the last complaint (an `Err`'s) after `within`. The
/// one way tests wait for a swarm to get somewhere.
pub async fn eventually<T, C, F, Fut>(within: std::time::Duration, what: &str, mut check: F) -> T
where
    C: Check<T>,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = C>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let why = match check().await.outcome() {
            Ok(v) => return v,
            Err(why) => why,
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}{why}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// What a check given to [`eventually`] says: a value, or not yet (with why, for the failure
/// message).
pub trait Check<T> {
    /// The value, or why not yet (empty, or `": "` and the complaint).
    fn outcome(self) -> Result<T, String>;
}

impl<T> Check<T> for Option<T> {
    fn outcome(self) -> Result<T, String> {
        self.ok_or_else(String::new)
    }
}

impl<T, E: std::fmt::Display> Check<T> for Result<T, E> {
    fn outcome(self) -> Result<T, String> {
        self.map_err(|e| format!(": {e}"))
    }
}

/// A GGUF's metadata and tensors (with their bytes), to edit and write back.
pub struct EditableGguf {
    pub metadata: Vec<(String, moeswarm_model::gguf::Value)>,
    pub tensors: Vec<(moeswarm_model::gguf::TensorLayout, Vec<u8>)>,
}

impl EditableGguf {
    /// Reads a reference model (a path under `data/`).
    pub fn open(name: &str) -> Self {
        let src = moeswarm_model::gguf::MappedGguf::open(&data(name)).unwrap();
        Self {
            metadata: src.header.metadata.clone(),
            tensors: src
                .header
                .tensors
                .iter()
                .map(|t| (t.into(), src.bytes_of(t).to_vec()))
                .collect(),
        }
    }

    /// Replaces the value of metadata `key` (which must exist).
    pub fn set(&mut self, key: &str, value: moeswarm_model::gguf::Value) {
        let slot = self.metadata.iter_mut().find(|(k, _)| k == key).unwrap();
        slot.1 = value;
    }

    /// Drops tensor `name` (which must exist).
    pub fn remove_tensor(&mut self, name: &str) {
        let before = self.tensors.len();
        self.tensors.retain(|(t, _)| t.name != name);
        assert_eq!(self.tensors.len() + 1, before, "no tensor {name}");
    }

    /// Replaces every layer's `ffn_gate_exps` and `ffn_up_exps` by one `ffn_gate_up_exps`
    /// `[E, 2F, N]` whose expert `e` is gate `e`'s rows, then up `e`'s rows (as current
    /// converters write it).
    pub fn fuse_gate_up(&mut self) {
        let mut out = Vec::with_capacity(self.tensors.len());
        let mut pending_gate: Option<(moeswarm_model::gguf::TensorLayout, Vec<u8>)> = None;
        for (t, bytes) in std::mem::take(&mut self.tensors) {
            if t.name.ends_with(".ffn_gate_exps.weight") {
                pending_gate = Some((t, bytes));
            } else if t.name.ends_with(".ffn_up_exps.weight") {
                let (g, gate) = pending_gate.take().expect("gate before up");
                assert_eq!(g.dims, t.dims);
                let n = t.dims[2] as usize;
                let per = bytes.len() / n;
                let mut fused = Vec::with_capacity(2 * bytes.len());
                for e in 0..n {
                    fused.extend_from_slice(&gate[e * per..(e + 1) * per]);
                    fused.extend_from_slice(&bytes[e * per..(e + 1) * per]);
                }
                let layout = moeswarm_model::gguf::TensorLayout {
                    name: t.name.replace(".ffn_up_exps.", ".ffn_gate_up_exps."),
                    dims: vec![t.dims[0], 2 * t.dims[1], t.dims[2]],
                    dtype: t.dtype,
                };
                out.push((layout, fused));
            } else {
                out.push((t, bytes));
            }
        }
        assert!(pending_gate.is_none());
        self.tensors = out;
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &std::path::Path) {
        let layouts: Vec<_> = self.tensors.iter().map(|(t, _)| t.clone()).collect();
        let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
        let mut w = moeswarm_model::gguf::GgufWriter::new(file, &self.metadata, &layouts).unwrap();
        for (_, bytes) in &self.tensors {
            w.write_tensor(bytes).unwrap();
        }
        use std::io::Write;
        w.finish().unwrap().flush().unwrap();
    }
}
