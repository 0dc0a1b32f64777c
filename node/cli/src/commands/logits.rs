//! `moeswarm logits`: every position's logits as raw little-endian f32 `[tokens][vocab]`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use moeswarm_engine::generate::logits;
use moeswarm_node::router::{OpenModel, Place};

use super::model::ModelArgs;
use crate::output;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: Args) -> Result<bool> {
    let place = a.model.place()?;
    let (values, n_vocab) = super::block_on(matches!(place, Place::Swarm(_)), async {
        let m = OpenModel::open(&place).await?;
        let r = logits(&m.trunk, &m.experts, &a.tokens).await;
        let n_vocab = m.trunk.hyper().n_vocab;
        if let Some(d) = m.dispatch_summary() {
            tracing::info!("dispatch: {}", serde_json::to_string(&d)?);
        }
        m.close().await;
        anyhow::Ok((r?, n_vocab))
    })??;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&a.out, bytes).with_context(|| format!("writing {}", a.out.display()))?;
    output::line(&format!(
        "wrote {} ({} tokens x {} logits)",
        a.out.display(),
        a.tokens.len(),
        n_vocab
    ))?;
    Ok(true)
}
