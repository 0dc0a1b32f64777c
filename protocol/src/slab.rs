//! What makes a GGUF file a slab: one routed expert of one layer, as a mini-GGUF.
//!
//! A slab holds three 2-D tensors whose bytes are a byte copy of expert `e`'s range along
//! `ne[2]` of the source's `blk.L.ffn_{gate,up,down}_exps.weight`, and metadata naming where
//! it came from. The slab cannot name its model id (the manifest, which lists the slab ids, is
//! hashed after the slabs), so it names the source header's blake3 instead, which the manifest
//! repeats.

/// Metadata key: slab format version (u32).
pub const KEY_VERSION: &str = "moeswarm.slab.version";
/// Metadata key: `general.name` of the source model (string).
pub const KEY_MODEL_NAME: &str = "moeswarm.slab.model_name";
/// Metadata key: hex blake3 of the source GGUF's header bytes (string).
pub const KEY_SOURCE: &str = "moeswarm.slab.source_header";
/// Metadata key: layer index (u32).
pub const KEY_LAYER: &str = "moeswarm.slab.layer";
/// Metadata key: expert index within the layer (u32).
pub const KEY_EXPERT: &str = "moeswarm.slab.expert";

/// Current slab format version.
pub const VERSION: u32 = 1;

/// The three matrices of a SwiGLU expert, in the order a slab stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertMatrix {
    /// `gate`: `[n_embd] -> [expert_ff]`.
    Gate,
    /// `up`: `[n_embd] -> [expert_ff]`.
    Up,
    /// `down`: `[expert_ff] -> [n_embd]`.
    Down,
}

impl ExpertMatrix {
    /// All three, in slab order.
    pub const ALL: [ExpertMatrix; 3] = [Self::Gate, Self::Up, Self::Down];

    /// The tensor's name inside a slab.
    pub fn slab_tensor_name(self) -> &'static str {
        match self {
            Self::Gate => "ffn_gate.weight",
            Self::Up => "ffn_up.weight",
            Self::Down => "ffn_down.weight",
        }
    }

    /// The 3-D tensor's name in a llama.cpp MoE GGUF.
    pub fn source_tensor_name(self, layer: u32) -> String {
        match self {
            Self::Gate => format!("blk.{layer}.ffn_gate_exps.weight"),
            Self::Up => format!("blk.{layer}.ffn_up_exps.weight"),
            Self::Down => format!("blk.{layer}.ffn_down_exps.weight"),
        }
    }
}
