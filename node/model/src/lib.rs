//! What a MoE model is on disk: GGUF files, their hyper-parameters, slabs, and the store.
//!
//! It reads and writes GGUF ([`gguf`]), says what a MoE GGUF means ([`hparams`]: the
//! architecture's hyper-parameters and which tensors are routed experts), writes the slab
//! format ([`slab`]), slices a model into trunk + slabs + manifest ([`slice`]) into the
//! content-addressed [`store`] (with verified transfer by byte ranges), and plans from a header
//! alone whether a model fits ([`plan`], [`inspect`]). It is not compute (no candle: that is
//! `moeswarm-engine`) and not the network (no libp2p, no QUIC: `moeswarm-node`).

pub mod error;
pub mod gguf;
pub mod hparams;
pub mod inspect;
pub mod plan;
pub mod progress;
pub mod qwen35;
pub mod size;
pub mod slab;
pub mod slice;
pub mod store;

pub use error::{Error, Result};
pub use hparams::{
    expert_layers, fused_gate_up_name, hyper_params, is_unrun_block, layers_run, mtp_blocks,
    slab_layers, unrun_bytes, ExpertSource, ExpertTensors,
};
pub use size::ByteSize;
pub use slab::{SlabMatrix, SlabView};
