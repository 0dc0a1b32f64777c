//! What a `qwen35moe` GGUF adds to a MoE model's shape: which layers are Gated DeltaNet and
//! which full attention, the DeltaNet sizes, the partial rotary, the shared expert, and the
//! multi-token-prediction blocks that are not run.

use crate::error::{bail, Context, Result};
use crate::gguf::{Gguf, Value};

/// The architecture name.
pub const ARCH: &str = "qwen35moe";

pub use moeswarm_protocol::LayerKind;

/// The qwen35moe-specific shape, from the metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Shape {
    /// Kind of each layer that runs (MTP blocks excluded).
    pub kinds: Vec<LayerKind>,
    /// Trailing multi-token-prediction blocks in the file, not run.
    pub nextn_layers: u32,
    /// Rotary dims of an attention head (the first this-many of each head).
    pub rope_dims: u32,
    /// DeltaNet head dim of q, k and v (`ssm.state_size`).
    pub ssm_head_dim: u32,
    /// DeltaNet q/k heads (`ssm.group_count`).
    pub ssm_qk_heads: u32,
    /// DeltaNet v heads (`ssm.time_step_rank`).
    pub ssm_v_heads: u32,
    /// Causal conv window (`ssm.conv_kernel`).
    pub conv_kernel: u32,
    /// Hidden size of the shared expert.
    pub shared_ff: u32,
}

fn key<'a>(g: &'a Gguf, k: &str) -> Option<&'a Value> {
    g.get(&format!("{ARCH}.{k}"))
}

fn u32_of(g: &Gguf, k: &str) -> Result<Option<u32>> {
    match key(g, k) {
        None => Ok(None),
        Some(v) => {
            let n = v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| format!("metadata {ARCH}.{k} is {v}, want a u32"))?;
            Ok(Some(n))
        }
    }
}

fn required(g: &Gguf, k: &str) -> Result<u32> {
    u32_of(g, k)?.with_context(|| format!("metadata {ARCH}.{k} is missing"))
}

impl Qwen35Shape {
    /// Reads and checks the shape of a qwen35moe GGUF.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let blocks = required(g, "block_count")?;
        let nextn_layers = u32_of(g, "nextn_predict_layers")?.unwrap_or(0);
        if nextn_layers >= blocks {
            bail!(
                "metadata {ARCH}.nextn_predict_layers = {nextn_layers} leaves no layer of {blocks}"
            );
        }
        let n_layer = blocks - nextn_layers;
        let kinds: Vec<LayerKind> = match key(g, "attention.recurrent_layers") {
            Some(v) => {
                let items = v.as_array().with_context(|| {
                    format!("metadata {ARCH}.attention.recurrent_layers is {v}, want an array")
                })?;
                if items.len() != blocks as usize {
                    bail!(
                        "metadata {ARCH}.attention.recurrent_layers has {} entries for {blocks} blocks",
                        items.len()
                    );
                }
                items[..n_layer as usize]
                    .iter()
                    .map(|i| match i {
                        Value::Bool(true) => Ok(LayerKind::Linear),
                        Value::Bool(false) => Ok(LayerKind::Full),
                        other => match other.as_u64() {
                            Some(0) => Ok(LayerKind::Full),
                            Some(_) => Ok(LayerKind::Linear),
                            None => {
                                bail!("metadata {ARCH}.attention.recurrent_layers holds {other}")
                            }
                        },
                    })
                    .collect::<Result<_>>()?
            }
            None => {
                let every = u32_of(g, "full_attention_interval")?.unwrap_or(4);
                if every == 0 {
                    bail!("metadata {ARCH}.full_attention_interval is 0");
                }
                (0..n_layer)
                    .map(|l| {
                        if (l + 1) % every == 0 {
                            LayerKind::Full
                        } else {
                            LayerKind::Linear
                        }
                    })
                    .collect()
            }
        };
        let head_dim = required(g, "attention.key_length")?;
        if let Some(v) = u32_of(g, "attention.value_length")? {
            if v != head_dim {
                bail!("metadata {ARCH}.attention.value_length = {v}, key_length = {head_dim}: they must agree");
            }
        }
        let rope_dims = u32_of(g, "rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            bail!("metadata {ARCH}.rope.dimension_count = {rope_dims}: want an even number ≤ the head dim {head_dim}");
        }
        let ssm_head_dim = required(g, "ssm.state_size")?;
        let ssm_qk_heads = required(g, "ssm.group_count")?;
        let ssm_v_heads = required(g, "ssm.time_step_rank")?;
        if ssm_qk_heads == 0 || ssm_v_heads % ssm_qk_heads != 0 {
            bail!("metadata {ARCH}.ssm.time_step_rank = {ssm_v_heads} is not a multiple of ssm.group_count = {ssm_qk_heads}");
        }
        if let Some(inner) = u32_of(g, "ssm.inner_size")? {
            if inner != ssm_v_heads * ssm_head_dim {
                bail!("metadata {ARCH}.ssm.inner_size = {inner}, want time_step_rank × state_size = {}", ssm_v_heads * ssm_head_dim);
            }
        }
        let conv_kernel = required(g, "ssm.conv_kernel")?;
        if conv_kernel == 0 {
            bail!("metadata {ARCH}.ssm.conv_kernel is 0");
        }
        let shared_ff = match u32_of(g, "expert_shared_feed_forward_length")? {
            Some(f) => f,
            None => required(g, "feed_forward_length")?,
        };
        Ok(Self {
            kinds,
            nextn_layers,
            rope_dims,
            ssm_head_dim,
            ssm_qk_heads,
            ssm_v_heads,
            conv_kernel,
            shared_ff,
        })
    }

    /// The tensors layer `layer` must have besides its norms, router and experts.
    pub fn mixer_tensors(&self, layer: u32) -> Vec<String> {
        let names: &[&str] = match self.kinds.get(layer as usize) {
            Some(LayerKind::Linear) => &[
                "attn_qkv.weight",
                "attn_gate.weight",
                "ssm_conv1d.weight",
                "ssm_beta.weight",
                "ssm_alpha.weight",
                "ssm_dt.bias",
                "ssm_a",
                "ssm_norm.weight",
                "ssm_out.weight",
            ],
            Some(LayerKind::Full) => &[
                "attn_q.weight",
                "attn_k.weight",
                "attn_v.weight",
                "attn_output.weight",
                "attn_q_norm.weight",
                "attn_k_norm.weight",
            ],
            None => &[],
        };
        names.iter().map(|n| format!("blk.{layer}.{n}")).collect()
    }

    /// Refuses a file lacking a tensor some layer's mixer or norms need, naming it.
    pub fn check_tensors(&self, g: &Gguf) -> Result<()> {
        for (l, kind) in self.kinds.iter().enumerate() {
            let l = l as u32;
            let common = [
                "attn_norm.weight",
                "post_attention_norm.weight",
                "ffn_gate_inp.weight",
            ]
            .map(|n| format!("blk.{l}.{n}"));
            for name in common.into_iter().chain(self.mixer_tensors(l)) {
                if g.tensor(&name).is_none() {
                    let kind = match kind {
                        LayerKind::Linear => "a Gated DeltaNet",
                        LayerKind::Full => "a full-attention",
                    };
                    bail!("tensor {name} is missing: layer {l} is {kind} layer and needs it");
                }
            }
        }
        Ok(())
    }

    /// Channels of the DeltaNet in-projection and conv: q, k and v heads.
    pub fn conv_channels(&self) -> u32 {
        (2 * self.ssm_qk_heads + self.ssm_v_heads) * self.ssm_head_dim
    }
}
