//! `moeswarm coverage`: how many replicas every slab of a model has in a swarm, and who holds
//! them.

use anyhow::Result;
use moeswarm_node::ops::coverage;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    join: super::JoinArgs,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let report = super::runtime(true)?.block_on(coverage(a.join.bootstrap, a.join.model))?;
    if a.json {
        output::json(&report)?;
    } else {
        output::emit(&report.render())?;
    }
    Ok(true)
}
