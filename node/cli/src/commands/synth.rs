//! `moeswarm synth`: a random-weight qwen3moe or qwen35moe model of a named shape.

use std::path::PathBuf;

use anyhow::Result;
use moeswarm_engine::synth::{synth, Preset, SynthOptions};
use moeswarm_model::gguf::{GgmlType, Gguf};

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// Architecture: qwen3moe or qwen35moe.
    #[arg(long, default_value = "qwen3moe")]
    arch: String,
    /// Model shape. qwen3moe: tiny, small or qwen3-30b-a3b-4l; qwen35moe: tiny, small,
    /// qwen35-122b-a10b-4l or qwen35-122b-a10b (the whole model, with --header-only).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Type of the routed experts: f32, f16, bf16, q8_0, q4_k, q5_k, q6_k.
    #[arg(long, default_value = "f32")]
    expert_type: GgmlType,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the header only, with a sparse data region of the right length (for `inspect`
    /// and `plan` on the full-size shape).
    #[arg(long)]
    header_only: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let preset = Preset::named(&a.arch, &a.preset)?;
    let opts = SynthOptions {
        expert_type: a.expert_type,
        seed: a.seed,
        header_only: a.header_only,
    };
    synth(&a.out, &preset, opts)?;
    let g = Gguf::open(&a.out)?;
    output::line(&format!(
        "wrote {} ({} bytes, {} tensors{})",
        a.out.display(),
        g.file_size,
        g.tensors.len(),
        if a.header_only { ", header only" } else { "" }
    ))?;
    Ok(true)
}
