//! `moeswarm inspect`: a GGUF's architecture, hyper-parameters and tensors, from its header.

use std::path::PathBuf;

use anyhow::{Context, Result};
use moeswarm_model::gguf::ModelFiles;
use moeswarm_model::inspect;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file (of a split model: any part).
    file: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let files =
        ModelFiles::open(&a.file).with_context(|| format!("inspecting {}", a.file.display()))?;
    if a.json {
        output::json(&inspect::describe_files(&files))?;
    } else {
        output::emit(&inspect::render_files(&files))?;
    }
    Ok(true)
}
