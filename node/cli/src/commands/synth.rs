//! `moeswarm synth`: a random-weight qwen3moe model of a named shape.

use std::path::PathBuf;

use anyhow::Result;
use moeswarm_engine::synth::{synth, Preset};
use moeswarm_model::gguf::{GgmlType, Gguf};

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// Model shape: tiny, small or qwen3-30b-a3b-4l.
    #[arg(long, default_value = "tiny", value_parser = Preset::named)]
    preset: Preset,
    /// Type of the routed experts: f32, f16, bf16, q8_0, q4_k, q5_k, q6_k.
    #[arg(long, default_value = "f32")]
    expert_type: GgmlType,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(a: Args) -> Result<bool> {
    synth(&a.out, &a.preset, a.expert_type, a.seed)?;
    let g = Gguf::open(&a.out)?;
    output::line(&format!(
        "wrote {} ({} bytes, {} tensors)",
        a.out.display(),
        g.file_size,
        g.tensors.len()
    ))?;
    Ok(true)
}
