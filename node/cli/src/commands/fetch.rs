//! `moeswarm fetch`: slabs of a model from a swarm into a store, verified as they stream.

use std::ops::Range;
use std::path::PathBuf;

use anyhow::Result;
use moeswarm_node::net::Selection;
use moeswarm_node::ops::{fetch, parse_experts, parse_layer_range};

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    join: super::JoinArgs,
    /// Store directory (the node's data dir).
    #[arg(long)]
    store: PathBuf,
    /// Layers a..b (default all).
    #[arg(long, value_parser = parse_layer_range)]
    layers: Option<Range<u32>>,
    /// Experts, e.g. 0,5,8..16 (default all).
    #[arg(long, value_parser = |s: &str| parse_experts(s).map(ExpertList))]
    experts: Option<ExpertList>,
    /// Fetch the trunk too.
    #[arg(long)]
    trunk: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// Expert indices as one value (clap would take a bare `Vec` for a repeated flag).
#[derive(Debug, Clone)]
struct ExpertList(Vec<u32>);

pub fn run(a: Args) -> Result<bool> {
    let selection = Selection {
        layers: a.layers,
        experts: a.experts.map(|e| e.0),
        trunk: a.trunk,
        only: None,
    };
    let report = super::runtime(true)?.block_on(fetch(
        &a.store,
        a.join.bootstrap,
        a.join.model,
        &selection,
    ))?;
    if a.json {
        output::json(&report)?;
    } else {
        output::line(&format!(
            "fetched {} blobs ({} bytes), {} already stored; {} bad answers",
            report.fetched,
            report.bytes,
            report.already,
            report.rejected.values().sum::<u64>()
        ))?;
    }
    Ok(true)
}
