//! What a MoE GGUF means: hyper-parameters, which tensors are routed experts, the slab format.

pub mod hparams;
pub mod slab;
pub mod synth;

pub use hparams::{expert_layers, hyper_params, ExpertTensors};
pub use slab::{SlabMatrix, SlabView};
