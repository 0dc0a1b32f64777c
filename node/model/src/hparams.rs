//! Hyper-parameters and expert tensors of a llama.cpp MoE GGUF.

use crate::error::{bail, Context, Result};
use moeswarm_protocol::slab::ExpertMatrix;
use moeswarm_protocol::HyperParams;

use super::SlabMatrix;
use crate::gguf::{Gguf, MappedGguf, TensorInfo, Value};

/// Architectures whose routed experts and hyper-parameters this node understands.
pub const KNOWN_ARCHITECTURES: &[&str] = &["qwen3moe", crate::qwen35::ARCH];

fn u32_key(g: &Gguf, arch: &str, key: &str) -> Result<u32> {
    let full = format!("{arch}.{key}");
    let v = g
        .get(&full)
        .with_context(|| format!("metadata {full:?} is missing"))?;
    let n = v
        .as_u64()
        .with_context(|| format!("metadata {full:?} is {v}, want an integer"))?;
    u32::try_from(n)
        .ok()
        .with_context(|| format!("metadata {full:?} = {n} does not fit u32"))
}

fn f32_key(g: &Gguf, arch: &str, key: &str) -> Result<f32> {
    let full = format!("{arch}.{key}");
    let v = g
        .get(&full)
        .with_context(|| format!("metadata {full:?} is missing"))?;
    v.as_f64()
        .map(|x| x as f32)
        .with_context(|| format!("metadata {full:?} is {v}, want a float"))
}

/// The three 3-D expert tensors of one layer.
#[derive(Debug, Clone)]
pub struct ExpertTensors<'a> {
    /// Layer index.
    pub layer: u32,
    /// `[gate, up, down]`, in [`ExpertMatrix::ALL`] order.
    pub matrices: [&'a TensorInfo; 3],
}

impl ExpertTensors<'_> {
    /// Bytes of one expert's slice of matrix `m` (the tensor's bytes over `ne[2]`).
    pub fn expert_bytes(&self, m: usize) -> u64 {
        let t = self.matrices[m];
        t.n_bytes() / t.dims[2]
    }

    /// Expert `e`'s three matrices: byte ranges of the 3-D tensors in the mapped source.
    pub fn expert<'m>(&self, src: &'m MappedGguf, e: u64) -> [SlabMatrix<'m>; 3] {
        [0, 1, 2].map(|m| {
            let t = self.matrices[m];
            let per = self.expert_bytes(m) as usize;
            let s = e as usize * per;
            SlabMatrix {
                dims: [t.dims[0], t.dims[1]],
                dtype: t.dtype,
                data: &src.bytes_of(t)[s..s + per],
            }
        })
    }
}

/// The layers that hold routed experts, with their tensors, checked for consistent shapes.
pub fn expert_layers(g: &Gguf) -> Result<Vec<ExpertTensors<'_>>> {
    let arch = g
        .architecture()
        .context("metadata general.architecture is missing")?;
    let n_layer = u32_key(g, arch, "block_count")?;
    let mut layers = Vec::new();
    for layer in 0..n_layer {
        let found: Vec<Option<&TensorInfo>> = ExpertMatrix::ALL
            .iter()
            .map(|m| g.tensor(&m.source_tensor_name(layer)))
            .collect();
        if found.iter().all(Option::is_none) {
            continue;
        }
        let mut matrices = Vec::with_capacity(3);
        for (m, t) in ExpertMatrix::ALL.iter().zip(&found) {
            let name = m.source_tensor_name(layer);
            let t =
                t.with_context(|| format!("layer {layer} has expert tensors but not {name}"))?;
            if t.dims.len() != 3 {
                bail!("{name} has shape {:?}, want 3 dimensions", t.dims);
            }
            matrices.push(t);
        }
        let [gate, up, down]: [&TensorInfo; 3] = matrices.try_into().expect("three matrices");
        let (embd, ff, n) = (gate.dims[0], gate.dims[1], gate.dims[2]);
        if up.dims != gate.dims || down.dims != [ff, embd, n] {
            bail!(
                "layer {layer} expert shapes disagree: gate {:?}, up {:?}, down {:?}",
                gate.dims,
                up.dims,
                down.dims
            );
        }
        layers.push(ExpertTensors {
            layer,
            matrices: [gate, up, down],
        });
    }
    if layers.is_empty() {
        bail!("not a MoE model: no layer has blk.N.ffn_gate_exps.weight");
    }
    Ok(layers)
}

/// The hyper-parameters a manifest records, from the GGUF's metadata.
pub fn hyper_params(g: &Gguf) -> Result<HyperParams> {
    let arch = g
        .architecture()
        .context("metadata general.architecture is missing")?;
    let n_embd = u32_key(g, arch, "embedding_length")?;
    let n_head = u32_key(g, arch, "attention.head_count")?;
    let head_dim = match u32_key(g, arch, "attention.key_length") {
        Ok(d) => d,
        Err(_) if n_head > 0 => n_embd / n_head,
        Err(e) => return Err(e),
    };
    let n_vocab = match g.get("tokenizer.ggml.tokens") {
        Some(Value::Array { items, .. }) => items.len() as u32,
        _ => g
            .tensor("token_embd.weight")
            .map(|t| *t.dims.last().unwrap_or(&0) as u32)
            .context("neither tokenizer.ggml.tokens nor token_embd.weight gives the vocabulary")?,
    };
    let expert_ff = match u32_key(g, arch, "expert_feed_forward_length") {
        Ok(v) => v,
        Err(_) => expert_layers(g)?[0].matrices[0].dims[1] as u32,
    };
    // Multi-token-prediction blocks at the end of a qwen35moe file are not run.
    let nextn = u32_key(g, arch, "nextn_predict_layers").unwrap_or_default();
    Ok(HyperParams {
        n_layer: u32_key(g, arch, "block_count")?.saturating_sub(nextn),
        n_embd,
        n_head,
        n_head_kv: u32_key(g, arch, "attention.head_count_kv").unwrap_or(n_head),
        head_dim,
        n_expert: u32_key(g, arch, "expert_count").context("not a MoE model (no expert count)")?,
        n_expert_used: u32_key(g, arch, "expert_used_count")?,
        expert_ff,
        n_vocab,
        context_length: u32_key(g, arch, "context_length")?,
        rope_freq_base: f32_key(g, arch, "rope.freq_base").unwrap_or(10_000.0),
        rms_eps: f32_key(g, arch, "attention.layer_norm_rms_epsilon")?,
    })
}
