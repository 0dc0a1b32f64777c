//! `moeswarm node`: run a swarm node until Ctrl-C, printing the addresses others join with.
//! With `--capacity` it takes part in the market by itself (`--no-auto`: only serve the store).

use anyhow::Result;
use moeswarm_node::config::NodeSettings;
use moeswarm_node::{NodeOptions, RunningNode};

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    settings: NodeSettings,
}

pub fn run(a: Args) -> Result<bool> {
    let opts = a.settings.resolve()?;
    super::runtime(true)?.block_on(serve(opts))?;
    Ok(true)
}

/// Starts the node, says where it can be reached, and runs until Ctrl-C.
async fn serve(opts: NodeOptions) -> Result<()> {
    let capacity = opts.capacity;
    let auto_models = opts
        .auto
        .as_ref()
        .map(|a| a.models.clone())
        .unwrap_or_default();
    let mut node = RunningNode::start(opts).await?;
    node.keep_advertising();
    let mut text = format!("peer id {}\n", node.handle.peer_id);
    for a in node.addrs().await? {
        text += &format!("listening on {a}\n");
    }
    if let Some(h) = node.http_addr {
        text += &format!("http on http://{h}\ndashboard on http://{h}/\n");
    }
    if let Some(r) = &node.relay {
        text += &format!("data-plane relay on {}@{}\n", r.peer_id(), r.local_addr()?);
    }
    if let (Some(_), Some(ep)) = (&node.worker, &node.endpoint) {
        text += &format!("serving dispatches on quic://{}\n", ep.local_addr()?);
    }
    for m in node.store.models()? {
        let held = node.store.held_slabs(&node.store.manifest(&m)?)?.len();
        text += &format!("serving model {m} ({held} slabs)\n");
    }
    if node.market.is_some() {
        let models = if auto_models.is_empty() {
            "every model the peers serve".to_string()
        } else {
            auto_models
                .iter()
                .map(|m| m.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        text += &format!("taking part in the market with {capacity} bytes: {models}\n");
    }
    text += "ready\n";
    // Whoever reads the addresses may go away; the node keeps running.
    if let Err(e) = output::emit(&text) {
        tracing::warn!("could not print the node's addresses: {e}");
    }
    super::until_stopped().await;
    node.shutdown().await;
    Ok(())
}
