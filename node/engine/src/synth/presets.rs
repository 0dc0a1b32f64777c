//! The shapes `synth` writes: named presets of both architectures, from a tiny test model to
//! the target's full shape (header only), and the expert types the engine computes.

use crate::error::{bail, Context, Result};
use moeswarm_model::gguf::GgmlType;

/// What a `qwen35moe` shape adds: the hybrid layer pattern, the DeltaNet sizes, the partial
/// rotary and the shared expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HybridShape {
    /// Every this-many-th layer is full attention, the others Gated DeltaNet.
    pub full_attention_interval: u64,
    /// Rotary dims of an attention head.
    pub rope_dims: u64,
    /// DeltaNet head dim (q, k and v).
    pub ssm_head_dim: u64,
    /// DeltaNet q/k heads.
    pub ssm_qk_heads: u64,
    /// DeltaNet v heads.
    pub ssm_v_heads: u64,
    /// Conv window.
    pub conv_kernel: u64,
    /// Shared expert inner size.
    pub shared_ff: u64,
}

impl HybridShape {
    pub(super) fn conv_channels(&self) -> u64 {
        (2 * self.ssm_qk_heads + self.ssm_v_heads) * self.ssm_head_dim
    }

    pub(super) fn is_full(&self, layer: u64) -> bool {
        (layer + 1).is_multiple_of(self.full_attention_interval)
    }
}

/// A model shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    /// Name on the command line.
    pub name: &'static str,
    /// The qwen35moe part of the shape; `None` for qwen3moe.
    pub hybrid: Option<HybridShape>,
    /// Transformer blocks.
    pub n_layer: u64,
    /// Hidden size.
    pub n_embd: u64,
    /// Query heads.
    pub n_head: u64,
    /// Key/value heads.
    pub n_head_kv: u64,
    /// Head size.
    pub head_dim: u64,
    /// Routed experts per layer.
    pub n_expert: u64,
    /// Experts per token.
    pub n_expert_used: u64,
    /// Expert inner size.
    pub expert_ff: u64,
    /// Vocabulary (the first 256 are byte tokens).
    pub n_vocab: u64,
    /// Type of the attention, DeltaNet and shared-expert projections.
    pub attn_type: GgmlType,
    /// Type of the token embedding and the output head.
    pub embd_type: GgmlType,
}

/// The qwen3moe presets: `tiny` and `small` have the reference models' shapes;
/// `qwen3-30b-a3b-4l` has Qwen3-30B-A3B's layer shapes with 4 layers and a small vocabulary
/// (the benchmark model).
pub const PRESETS: [Preset; 3] = [
    Preset {
        name: "tiny",
        hybrid: None,
        n_layer: 2,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        n_expert: 8,
        n_expert_used: 2,
        expert_ff: 32,
        n_vocab: 256,
        attn_type: GgmlType::F32,
        embd_type: GgmlType::F32,
    },
    Preset {
        name: "small",
        hybrid: None,
        n_layer: 3,
        n_embd: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        n_expert: 16,
        n_expert_used: 4,
        expert_ff: 256,
        n_vocab: 512,
        attn_type: GgmlType::Q8_0,
        embd_type: GgmlType::F32,
    },
    Preset {
        name: "qwen3-30b-a3b-4l",
        hybrid: None,
        n_layer: 4,
        n_embd: 2048,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        n_expert: 128,
        n_expert_used: 8,
        expert_ff: 768,
        n_vocab: 512,
        attn_type: GgmlType::Q8_0,
        embd_type: GgmlType::F32,
    },
];

/// Qwen3.5-122B-A10B's layer shapes (its published config).
const QWEN35_122B: HybridShape = HybridShape {
    full_attention_interval: 4,
    rope_dims: 64,
    ssm_head_dim: 128,
    ssm_qk_heads: 16,
    ssm_v_heads: 64,
    conv_kernel: 4,
    shared_ff: 1024,
};

/// The qwen35moe presets: `tiny` and `small` have the reference models' shapes;
/// `qwen35-122b-a10b-4l` has Qwen3.5-122B-A10B's layer shapes with 4 layers (3 Gated DeltaNet,
/// 1 full attention) and a small vocabulary (the benchmark model); `qwen35-122b-a10b` is the
/// whole model's shape, for `--header-only`.
pub const QWEN35_PRESETS: [Preset; 4] = [
    Preset {
        name: "tiny",
        hybrid: Some(HybridShape {
            full_attention_interval: 4,
            rope_dims: 8,
            ssm_head_dim: 16,
            ssm_qk_heads: 2,
            ssm_v_heads: 4,
            conv_kernel: 4,
            shared_ff: 48,
        }),
        n_layer: 4,
        n_embd: 64,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        n_expert: 8,
        n_expert_used: 2,
        expert_ff: 32,
        n_vocab: 256,
        attn_type: GgmlType::F32,
        embd_type: GgmlType::F32,
    },
    Preset {
        name: "small",
        hybrid: Some(HybridShape {
            full_attention_interval: 4,
            rope_dims: 16,
            ssm_head_dim: 64,
            ssm_qk_heads: 2,
            ssm_v_heads: 4,
            conv_kernel: 4,
            shared_ff: 256,
        }),
        n_layer: 4,
        n_embd: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        n_expert: 16,
        n_expert_used: 4,
        expert_ff: 256,
        n_vocab: 512,
        attn_type: GgmlType::Q8_0,
        embd_type: GgmlType::F32,
    },
    Preset {
        name: "qwen35-122b-a10b-4l",
        hybrid: Some(QWEN35_122B),
        n_layer: 4,
        n_embd: 3072,
        n_head: 32,
        n_head_kv: 2,
        head_dim: 256,
        n_expert: 256,
        n_expert_used: 8,
        expert_ff: 1024,
        n_vocab: 512,
        attn_type: GgmlType::Q8_0,
        embd_type: GgmlType::Q6_K,
    },
    Preset {
        name: "qwen35-122b-a10b",
        hybrid: Some(QWEN35_122B),
        n_layer: 48,
        n_embd: 3072,
        n_head: 32,
        n_head_kv: 2,
        head_dim: 256,
        n_expert: 256,
        n_expert_used: 8,
        expert_ff: 1024,
        n_vocab: 248_320,
        attn_type: GgmlType::Q8_0,
        embd_type: GgmlType::Q6_K,
    },
];

/// Architectures `synth` writes.
pub const ARCHITECTURES: [&str; 2] = ["qwen3moe", moeswarm_model::qwen35::ARCH];

impl Preset {
    /// The preset called `name` of architecture `arch`.
    pub fn named(arch: &str, name: &str) -> Result<Self> {
        let presets: &[Preset] = match arch {
            "qwen3moe" => &PRESETS,
            a if a == moeswarm_model::qwen35::ARCH => &QWEN35_PRESETS,
            other => bail!(
                "synth writes no architecture {other:?} (known: {})",
                ARCHITECTURES.join(", ")
            ),
        };
        presets
            .iter()
            .copied()
            .find(|p| p.name == name)
            .with_context(|| {
                let names: Vec<_> = presets.iter().map(|p| p.name).collect();
                format!(
                    "unknown preset {name:?} of {arch} (known: {})",
                    names.join(", ")
                )
            })
    }

    /// The architecture name.
    pub fn architecture(&self) -> &'static str {
        match self.hybrid {
            None => "qwen3moe",
            Some(_) => moeswarm_model::qwen35::ARCH,
        }
    }
}

/// Expert types `synth` writes: those the engine's kernels compute.
pub const EXPERT_TYPES: [GgmlType; 8] = crate::kernels::TYPES;
