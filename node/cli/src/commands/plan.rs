//! `moeswarm plan`: whether a model fits, on one coordinator or on a swarm, from its header.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use moeswarm_model::gguf::ModelFiles;
use moeswarm_model::plan;
use moeswarm_model::ByteSize;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file (only its header is read).
    file: PathBuf,
    /// GPU memory of the coordinator, e.g. 24GiB.
    #[arg(long, requires = "ram", conflicts_with = "nodes")]
    vram: Option<ByteSize>,
    /// System memory of the coordinator for experts, e.g. 64GiB.
    #[arg(long, requires = "vram")]
    ram: Option<ByteSize>,
    /// Context length the KV cache is sized for.
    #[arg(long, default_value_t = 32768)]
    ctx: u64,
    /// Devices of a swarm: a TOML file of [[node]] name, ram, phone.
    #[arg(long)]
    nodes: Option<PathBuf>,
    /// Replicas of every slab in a swarm.
    #[arg(long, default_value_t = 2)]
    replicas: u32,
    /// Routing statistics: JSON array [layer][expert] of expected load (default uniform).
    #[arg(long, requires = "nodes")]
    stats: Option<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// Reads the routing statistics file: `[layer][expert]` expected loads.
fn read_loads(f: &std::path::Path) -> Result<Vec<Vec<f64>>> {
    let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
    serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "{} is not a JSON array [layer][expert] of numbers",
            f.display()
        )
    })
}

pub fn run(a: Args) -> Result<bool> {
    let g = ModelFiles::open(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?
        .header;
    let sizes = plan::ModelSizes::of(&g)?;
    match (a.vram, a.ram, a.nodes) {
        (Some(vram), Some(ram), None) => {
            let p = plan::plan_coordinator(&sizes, vram.0, ram.0, a.ctx)?;
            if a.json {
                output::json(&p)?;
            } else {
                output::emit(&plan::render_coordinator(&p))?;
            }
            Ok(p.fits)
        }
        (None, None, Some(nodes)) => {
            let devices = plan::read_nodes(&nodes)?;
            let loads = a.stats.as_deref().map(read_loads).transpose()?;
            let p = plan::plan_swarm(&sizes, devices, a.replicas, loads.as_deref())?;
            if a.json {
                output::json(&p)?;
            } else {
                output::emit(&plan::render_swarm(&p))?;
            }
            Ok(true)
        }
        _ => bail!("give either --vram and --ram, or --nodes"),
    }
}
