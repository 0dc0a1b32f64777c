//! The router role: join a swarm, get a model's manifest and trunk, and run the trunk with its
//! experts answered by the workers that hold them.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use libp2p::Multiaddr;
use moeswarm_protocol::{Manifest, ModelId};

use crate::dataplane::{RemoteExecutor, ReplicaTable};
use crate::engine::trunk::Trunk;
use crate::gguf::MappedGguf;
use crate::net::fetch::gather_coverage;
use crate::net::{NodeOptions, RunningNode, Selection};
use crate::text::TextTokenizer;

/// A model run through a swarm.
pub struct SwarmModel {
    /// The router's node (keep it running while the model is used).
    pub node: RunningNode,
    /// The manifest.
    pub manifest: Manifest,
    /// The trunk, from the router's store.
    pub trunk: Trunk,
    /// The tokenizer from the trunk's metadata.
    pub tokenizer: TextTokenizer,
    /// Experts answered by the workers (and by the router's own slabs, if any, as fallback).
    pub experts: RemoteExecutor,
}

impl SwarmModel {
    /// Stops the router's node.
    pub async fn shutdown(self) {
        self.node.shutdown().await;
    }
}

/// Joins through `bootstrap` with the identity in `store_dir`, fetches `model`'s manifest and
/// trunk if the store lacks them, learns who holds which slab, and readies the remote
/// executor. Fails, naming them, if some slab has no replica the router can reach and the
/// router cannot compute it itself.
pub async fn join_swarm_model(
    store_dir: &Path,
    bootstrap: Vec<Multiaddr>,
    model: ModelId,
    deadline: Duration,
) -> Result<SwarmModel> {
    if bootstrap.is_empty() {
        bail!("--swarm needs at least one --bootstrap address");
    }
    let mut opts = NodeOptions::local(store_dir.to_path_buf(), bootstrap);
    opts.listen = vec!["/ip4/0.0.0.0/tcp/0".parse()?];
    let mut node = RunningNode::start(opts).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let trunk_only = Selection {
        trunk: true,
        only: Some(Default::default()),
        ..Selection::default()
    };
    node.fetch(model, &trunk_only, &ProgressBar::hidden())
        .await
        .context("fetching the manifest and the trunk")?;
    let manifest = node.store.manifest(&model)?;
    let h = &manifest.hyper;
    let map = gather_coverage(&node.handle, model, h.n_layer, h.n_expert).await?;
    let table = ReplicaTable::from_records(&manifest, map.nodes(), Some(&node.handle.identity.key));
    let mut unreachable = Vec::new();
    for (l, e, r) in manifest.all_slabs() {
        if table.replicas(l, e).is_empty() && !node.store.contains(&r.id)? {
            unreachable.push(format!("{l}/{e}"));
        }
    }
    if !unreachable.is_empty() {
        bail!(
            "{} slabs (layer/expert) have no worker serving them and are not in the router's store: {}",
            unreachable.len(),
            unreachable.iter().take(16).cloned().collect::<Vec<_>>().join(" ")
        );
    }
    let trunk_file = MappedGguf::open(&node.store.blob_path(&manifest.trunk.id))?;
    let trunk = Trunk::from_gguf(&trunk_file, &manifest.hyper)?;
    let tokenizer = TextTokenizer::from_gguf(&trunk_file.header)?;
    let experts = RemoteExecutor::new(
        manifest.clone(),
        node.data_endpoint()?,
        table,
        Some(node.store.clone()),
        deadline,
    );
    Ok(SwarmModel {
        node,
        manifest,
        trunk,
        tokenizer,
        experts,
    })
}
