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

/// Where one expert matrix lies in a 3-D expert tensor: `rows` rows from `first_row` of each
/// expert's `[ne0, ne1]` block (all of it, or one half of a fused gate/up tensor).
#[derive(Debug, Clone, Copy)]
pub struct ExpertSource<'a> {
    /// The 3-D tensor `[ne0, ne1, n_expert]`.
    pub tensor: &'a TensorInfo,
    /// First row of this matrix inside one expert's block.
    pub first_row: u64,
    /// Rows of this matrix.
    pub rows: u64,
}

impl ExpertSource<'_> {
    fn whole(tensor: &TensorInfo) -> ExpertSource<'_> {
        ExpertSource {
            tensor,
            first_row: 0,
            rows: tensor.dims[1],
        }
    }

    fn row_bytes(&self) -> u64 {
        self.tensor.n_bytes() / self.tensor.dims[2] / self.tensor.dims[1]
    }

    /// Bytes of one expert's matrix.
    pub fn expert_bytes(&self) -> u64 {
        self.rows * self.row_bytes()
    }

    /// The matrix's shape `[ne0, rows]`.
    pub fn dims(&self) -> [u64; 2] {
        [self.tensor.dims[0], self.rows]
    }
}

/// The routed-expert tensors of one layer: gate, up and down, gate and up possibly fused in
/// one `ffn_gate_up_exps` tensor.
#[derive(Debug, Clone)]
pub struct ExpertTensors<'a> {
    /// Layer index.
    pub layer: u32,
    /// Experts in the layer.
    pub n_expert: u64,
    /// `[gate, up, down]`, in [`ExpertMatrix::ALL`] order.
    pub matrices: [ExpertSource<'a>; 3],
}

impl ExpertTensors<'_> {
    /// Bytes of one expert's slice of matrix `m`.
    pub fn matrix_bytes(&self, m: usize) -> u64 {
        self.matrices[m].expert_bytes()
    }

    /// Bytes of one expert: its three matrices.
    pub fn expert_bytes(&self) -> u64 {
        (0..3).map(|m| self.matrix_bytes(m)).sum()
    }

    /// Bytes of every expert of the layer.
    pub fn bytes(&self) -> u64 {
        self.expert_bytes() * self.n_expert
    }

    /// The distinct source tensors (two when gate and up are fused, else three).
    pub fn tensors(&self) -> Vec<&TensorInfo> {
        let mut out: Vec<&TensorInfo> = Vec::with_capacity(3);
        for m in &self.matrices {
            if !out.iter().any(|t| t.name == m.tensor.name) {
                out.push(m.tensor);
            }
        }
        out
    }

    /// Expert `e`'s three matrices: byte ranges of the 3-D tensors in the mapped source.
    pub fn expert<'m>(&self, src: &'m MappedGguf, e: u64) -> [SlabMatrix<'m>; 3] {
        self.matrices.map(|m| {
            let t = m.tensor;
            let block = (t.n_bytes() / t.dims[2]) as usize;
            let s = e as usize * block + (m.first_row * m.row_bytes()) as usize;
            SlabMatrix {
                dims: m.dims(),
                dtype: t.dtype,
                data: &src.bytes_of(t)[s..s + m.expert_bytes() as usize],
            }
        })
    }
}

/// The name of layer `layer`'s fused gate-and-up expert tensor.
pub fn fused_gate_up_name(layer: u32) -> String {
    format!("blk.{layer}.ffn_gate_up_exps.weight")
}

/// Blocks that run: `block_count` less the trailing multi-token-prediction blocks
/// (`nextn_predict_layers`), whose tensors are neither slabs nor trunk.
pub fn layers_run(g: &Gguf) -> Result<u32> {
    let arch = g
        .architecture()
        .context("metadata general.architecture is missing")?;
    let blocks = u32_key(g, arch, "block_count")?;
    let max = moeswarm_protocol::limits::MAX_LAYERS;
    if blocks == 0 || blocks > max {
        bail!("metadata {arch}.block_count = {blocks} is outside 1..={max}");
    }
    let nextn = u32_key(g, arch, "nextn_predict_layers").unwrap_or_default();
    if nextn >= blocks {
        bail!("metadata {arch}.nextn_predict_layers = {nextn} leaves no layer of {blocks}");
    }
    Ok(blocks - nextn)
}

/// Whether tensor `name` belongs to a block past the ones that run (an MTP block).
pub fn is_unrun_block(name: &str, layers_run: u32) -> bool {
    name.strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|l| l.parse::<u32>().ok())
        .is_some_and(|l| l >= layers_run)
}

/// Bytes of the tensors of blocks that are not run (see [`is_unrun_block`]).
pub fn unrun_bytes(g: &Gguf) -> Result<u64> {
    let n = layers_run(g)?;
    Ok(g.tensors
        .iter()
        .filter(|t| is_unrun_block(&t.name, n))
        .map(|t| t.n_bytes())
        .sum())
}

fn three_d<'a>(g: &'a Gguf, name: &str) -> Result<Option<&'a TensorInfo>> {
    match g.tensor(name) {
        Some(t) if t.dims.len() != 3 || t.dims.contains(&0) => {
            bail!("{name} has shape {:?}, want 3 non-zero dimensions", t.dims)
        }
        other => Ok(other),
    }
}

/// The layers that run and hold routed experts, with their tensors, checked for consistent
/// shapes (the MTP blocks' experts left out: see [`slab_layers`]).
pub fn expert_layers(g: &Gguf) -> Result<Vec<ExpertTensors<'_>>> {
    expert_layers_below(g, layers_run(g)?)
}

/// Every block with routed experts, the MTP blocks' included: what becomes slabs.
pub fn slab_layers(g: &Gguf) -> Result<Vec<ExpertTensors<'_>>> {
    layers_run(g)?;
    let arch = g.architecture().unwrap_or_default();
    expert_layers_below(g, u32_key(g, arch, "block_count")?)
}

/// The trailing multi-token-prediction blocks (`nextn_predict_layers`, 0 when absent).
pub fn mtp_blocks(g: &Gguf) -> Result<u32> {
    let arch = g.architecture().unwrap_or_default();
    Ok(u32_key(g, arch, "block_count")? - layers_run(g)?)
}

fn expert_layers_below(g: &Gguf, n_layer: u32) -> Result<Vec<ExpertTensors<'_>>> {
    let mut layers = Vec::new();
    for layer in 0..n_layer {
        let [gate_name, up_name, down_name] =
            ExpertMatrix::ALL.map(|m| m.source_tensor_name(layer));
        let fused_name = fused_gate_up_name(layer);
        let (gate, up, down, fused) = (
            three_d(g, &gate_name)?,
            three_d(g, &up_name)?,
            three_d(g, &down_name)?,
            three_d(g, &fused_name)?,
        );
        if [gate, up, down, fused].iter().all(Option::is_none) {
            continue;
        }
        let down =
            down.with_context(|| format!("layer {layer} has expert tensors but not {down_name}"))?;
        let (embd, ff, n) = (down.dims[1], down.dims[0], down.dims[2]);
        let [gate, up] = match (gate, up, fused) {
            (Some(gate), Some(up), None) => {
                if gate.dims != [embd, ff, n] || up.dims != gate.dims {
                    bail!(
                        "layer {layer} expert shapes disagree: gate {:?}, up {:?}, down {:?}",
                        gate.dims,
                        up.dims,
                        down.dims
                    );
                }
                [ExpertSource::whole(gate), ExpertSource::whole(up)]
            }
            (None, None, Some(f)) => {
                if f.dims != [embd, 2 * ff, n] {
                    bail!(
                        "{fused_name} has shape {:?}, want [{embd}, {}, {n}] for down {:?}",
                        f.dims,
                        2 * ff,
                        down.dims
                    );
                }
                [0, ff].map(|first_row| ExpertSource {
                    tensor: f,
                    first_row,
                    rows: ff,
                })
            }
            (_, _, Some(_)) => {
                bail!("layer {layer} has {fused_name} and also a separate gate or up tensor")
            }
            (None, _, None) => bail!("layer {layer} has expert tensors but not {gate_name}"),
            (_, None, None) => bail!("layer {layer} has expert tensors but not {up_name}"),
        };
        layers.push(ExpertTensors {
            layer,
            n_expert: n,
            matrices: [gate, up, ExpertSource::whole(down)],
        });
    }
    if layers.is_empty() {
        bail!("not a MoE model: no layer has blk.N.ffn_gate_exps.weight or ffn_gate_up_exps");
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
        Err(_) => expert_layers(g)?[0].matrices[0].rows as u32,
    };
    let n_expert = u32_key(g, arch, "expert_count").context("not a MoE model (no expert count)")?;
    let max = moeswarm_protocol::limits::MAX_EXPERTS;
    if n_expert == 0 || n_expert > max {
        bail!("metadata {arch}.expert_count = {n_expert} is outside 1..={max}");
    }
    let n_expert_used = u32_key(g, arch, "expert_used_count")?;
    if n_expert_used == 0 || n_expert_used > n_expert {
        bail!("metadata {arch}.expert_used_count = {n_expert_used} is outside 1..={n_expert}");
    }
    Ok(HyperParams {
        n_layer: layers_run(g)?,
        n_embd,
        n_head,
        n_head_kv: u32_key(g, arch, "attention.head_count_kv").unwrap_or(n_head),
        head_dim,
        n_expert,
        n_expert_used,
        expert_ff,
        n_vocab,
        context_length: u32_key(g, arch, "context_length")?,
        rope_freq_base: f32_key(g, arch, "rope.freq_base").unwrap_or(10_000.0),
        rms_eps: f32_key(g, arch, "attention.layer_norm_rms_epsilon")?,
    })
}
