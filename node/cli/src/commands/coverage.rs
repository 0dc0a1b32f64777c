//! `moeswarm coverage`: how many replicas every slab of a model has in a swarm, and who holds
//! them.

use anyhow::Result;
use libp2p::Multiaddr;
use moeswarm_node::net::commands::coverage;
use moeswarm_protocol::ModelId;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// A node of the swarm, ending in /p2p/<peer id> (repeatable).
    #[arg(long, required = true)]
    bootstrap: Vec<Multiaddr>,
    /// The model id.
    #[arg(long)]
    model: ModelId,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let report = super::runtime(true)?.block_on(coverage(a.bootstrap, a.model))?;
    if a.json {
        output::json(&report)?;
    } else {
        output::emit(&report.render())?;
    }
    Ok(true)
}
