//! `moeswarm slice`: a MoE GGUF into trunk + slabs + manifest in a store.

use std::path::PathBuf;

use anyhow::Result;
use moeswarm_model::slice::{slice, SliceOptions};

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    file: PathBuf,
    /// Store directory.
    #[arg(long)]
    store: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let store = super::open_store(&a.store)?;
    let (_, _, report) = slice(&a.file, &store, SliceOptions { progress: true })?;
    if a.json {
        output::json(&report)?;
    } else if report.already_sliced {
        output::line(&format!(
            "model {} is already in the store: nothing to do",
            report.model_id
        ))?;
    } else {
        output::line(&format!(
            "model {}\ntrunk {} ({} bytes)\n{} slabs ({} bytes)\n{:.2} s, {:.2} GB/s",
            report.model_id,
            report.trunk_id,
            report.trunk_bytes,
            report.slabs,
            report.slab_bytes,
            report.seconds,
            report.gb_per_s
        ))?;
    }
    Ok(true)
}
