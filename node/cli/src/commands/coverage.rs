//! `moeswarm coverage`: how many replicas every slab of a model has in a swarm, and (one slab
//! at a time, a page at a time) who holds them.

use anyhow::{bail, Result};
use moeswarm_node::ops::{coverage, holders};

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    join: super::JoinArgs,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// List the holders of one slab, `LAYER:EXPERT`, instead of the counts of all.
    #[arg(long, value_name = "LAYER:EXPERT")]
    holders: Option<String>,
    /// Which page of holders (64 a page, from 0), with --holders.
    #[arg(long, default_value_t = 0, requires = "holders")]
    page: usize,
}

/// `LAYER:EXPERT` as numbers, or what is wrong with it.
fn slab(s: &str) -> Result<(u32, u32)> {
    let parsed = s
        .split_once(':')
        .and_then(|(l, e)| Some((l.trim().parse().ok()?, e.trim().parse().ok()?)));
    match parsed {
        Some(p) => Ok(p),
        None => bail!("--holders {s:?}: give LAYER:EXPERT, two numbers (e.g. 0:3)"),
    }
}

pub fn run(a: Args) -> Result<bool> {
    let rt = super::runtime(true)?;
    if let Some(s) = &a.holders {
        let page = rt.block_on(holders(a.join.bootstrap, a.join.model, slab(s)?, a.page))?;
        if a.json {
            output::json(&page)?;
        } else {
            output::emit(&page.render())?;
        }
        return Ok(true);
    }
    let report = rt.block_on(coverage(a.join.bootstrap, a.join.model))?;
    if a.json {
        output::json(&report)?;
    } else {
        output::emit(&report.render())?;
    }
    Ok(true)
}
