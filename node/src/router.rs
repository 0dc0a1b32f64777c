//! The router role: run a model's trunk here with its experts answered in this process or by
//! the workers of a swarm that hold them.
//!
//! [`OpenModel::open`] is the one way a command gets a runnable model: from a GGUF or a store
//! ([`Place::Local`]), or by joining a swarm ([`Place::Swarm`]: fetch the manifest and trunk
//! if the store lacks them, learn who holds which slab, ready the remote executor).

use moeswarm_market::trust::CheckPolicy;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{bail, Context, Result};
use libp2p::Multiaddr;
use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest, LocalExecutor};
use moeswarm_engine::generate::{trunk_from_store, LocalModel, ModelSource};
use moeswarm_engine::text::TextTokenizer;
use moeswarm_engine::trunk::Trunk;
use moeswarm_protocol::{Manifest, ModelId, WireType};

use crate::dataplane::{
    DemandCounter, DispatchSummary, HealthTable, RemoteExecutor, ReplicaTable, SharedReplicas,
};
use crate::holdings::fresh_seq;
use crate::net::records::now_secs;
use crate::net::NodeHandle;
use crate::net::Selection;
use crate::net::{gather_coverage, learn_records};
use crate::node::RunningNode;
use moeswarm_protocol::RecordBody;
use std::sync::Arc;

/// Where a model's experts are computed.
#[derive(Debug, Clone)]
pub enum Place {
    /// In this process, from a GGUF or a store.
    Local(ModelSource),
    /// By the workers of a swarm.
    Swarm(SwarmPlace),
}

/// How to run a model through a swarm.
#[derive(Debug, Clone)]
pub struct SwarmPlace {
    /// The router's data dir (its store and key); it gets the manifest and trunk if it lacks
    /// them.
    pub store_dir: PathBuf,
    /// Nodes to join through.
    pub bootstrap: Vec<Multiaddr>,
    /// The model.
    pub model: ModelId,
    /// Deadline of one dispatch to a worker.
    pub deadline: Duration,
    /// How activations travel (f32: bit-identical to a local run).
    pub wire: WireType,
    /// How workers' answers are checked.
    pub checks: CheckPolicy,
    /// Whether workers reached through a relay are hole punched for a direct path.
    pub hole_punch: bool,
}

/// Experts answered here or by a swarm.
pub enum Experts {
    /// Every expert in this process.
    Local(LocalExecutor),
    /// Workers over QUIC, the router's own slabs as fallback.
    Swarm(Box<RemoteExecutor>),
}

impl ExpertExecutor for Experts {
    async fn compute(&self, req: ExpertRequest<'_>) -> moeswarm_engine::Result<Vec<Vec<f32>>> {
        match self {
            Experts::Local(e) => e.compute(req).await,
            Experts::Swarm(e) => e.compute(req).await,
        }
    }
}

/// A model ready to run: trunk, tokenizer, experts, and the router's node when in a swarm.
pub struct OpenModel {
    /// The trunk.
    pub trunk: Trunk,
    /// The tokenizer from the model's metadata.
    pub tokenizer: TextTokenizer,
    /// Who computes the experts.
    pub experts: Experts,
    node: Option<RunningNode>,
}

impl OpenModel {
    /// Opens the model at `place`.
    pub async fn open(place: &Place) -> Result<Self> {
        match place {
            Place::Local(source) => {
                let source = source.clone();
                let m = tokio::task::spawn_blocking(move || LocalModel::load(&source))
                    .await
                    .context("loading the model")??;
                Ok(Self {
                    trunk: m.trunk,
                    tokenizer: m.tokenizer,
                    experts: Experts::Local(m.experts),
                    node: None,
                })
            }
            Place::Swarm(s) => {
                let m = join_swarm_model(s).await?;
                Ok(Self {
                    trunk: m.trunk,
                    tokenizer: m.tokenizer,
                    experts: Experts::Swarm(Box::new(m.experts)),
                    node: Some(m.node),
                })
            }
        }
    }

    /// What the dispatches did, when the experts are the swarm's.
    pub fn dispatch_summary(&self) -> Option<DispatchSummary> {
        match &self.experts {
            Experts::Swarm(e) => Some(e.summary()),
            Experts::Local(_) => None,
        }
    }

    /// The parts: trunk, tokenizer, experts, and the router's node (keep it running while the
    /// experts are used; stop it after).
    pub fn into_parts(self) -> (Trunk, TextTokenizer, Experts, Option<RunningNode>) {
        (self.trunk, self.tokenizer, self.experts, self.node)
    }

    /// Stops the router's node, if any.
    pub async fn close(self) {
        if let Some(n) = self.node {
            n.shutdown().await;
        }
    }
}

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

/// Who serves each slab of `manifest`'s model, from the records the router's node gathers
/// (each verified; the router itself is left out).
pub async fn replica_table(node: &RunningNode, manifest: &Manifest) -> Result<ReplicaTable> {
    let h = &manifest.hyper;
    let map = gather_coverage(
        &node.handle,
        manifest.id(),
        manifest.slab_layers(),
        h.n_expert,
    )
    .await?;
    Ok(ReplicaTable::from_records(
        manifest,
        map.nodes(),
        Some(&node.handle.identity.key),
    ))
}

/// How a router keeps the swarm informed while it runs a model.
#[derive(Debug, Clone)]
pub struct RouterUpkeep {
    /// Time between demand records (and replica table refreshes).
    pub period: Duration,
    /// The window the demand counts cover.
    pub demand_window: Duration,
    /// Lifetime of a demand record.
    pub demand_ttl: Duration,
}

impl Default for RouterUpkeep {
    fn default() -> Self {
        Self {
            period: Duration::from_secs(10),
            demand_window: Duration::from_secs(120),
            demand_ttl: Duration::from_secs(300),
        }
    }
}

/// The remote executor of `manifest`'s model on the router's node: dispatches to `table`'s
/// replicas, the node's own store as fallback (and first, for the MTP block's slabs). While the node runs, the router publishes its
/// demand every `upkeep.period` and refreshes the executor's replicas from the node's
/// coverage map (the market moves slabs around).
pub fn remote_executor(
    node: &mut RunningNode,
    manifest: &Manifest,
    table: ReplicaTable,
    deadline: Duration,
    wire: WireType,
    upkeep: &RouterUpkeep,
) -> Result<RemoteExecutor> {
    let counter = Arc::new(DemandCounter::new(manifest, upkeep.demand_window));
    let executor = RemoteExecutor::new(
        manifest.clone(),
        node.data_endpoint()?,
        table,
        Some(node.store.clone()),
        deadline,
    )
    .with_wire(wire)
    .with_home_layers(manifest.mtp_slab_layers())
    .with_demand(counter.clone())
    .with_referee(node.fetcher.clone());
    let task = tokio::spawn(keep_routing(
        node.handle.clone(),
        manifest.clone(),
        counter,
        (executor.shared_replicas(), executor.standing()),
        upkeep.clone(),
    ));
    node.add_task(task);
    Ok(executor)
}

/// The router's upkeep: see [`remote_executor`].
async fn keep_routing(
    handle: NodeHandle,
    manifest: Manifest,
    counter: Arc<DemandCounter>,
    (replicas, standing): (SharedReplicas, Arc<HealthTable>),
    upkeep: RouterUpkeep,
) {
    let model = manifest.id();
    let me = handle.identity.key;
    // What the peers knew before this node followed the model, so the first refresh does not
    // forget replicas the table was built with.
    if let Err(e) = learn_records(&handle, model).await {
        tracing::warn!("learning the records of {model}: {e:#}");
    }
    loop {
        tokio::time::sleep(upkeep.period).await;
        let now = now_secs();
        if let Some(d) = counter.record(&manifest, me, fresh_seq(), now, upkeep.demand_ttl) {
            if let Err(e) = handle
                .publish_demand(model, d.sign(&handle.identity.signing))
                .await
            {
                tracing::warn!("publishing the demand of {model}: {e:#}");
            }
        }
        match handle.coverage(model).await {
            Ok(Some(map)) => {
                let table = ReplicaTable::from_records(&manifest, map.nodes(), Some(&me))
                    .capped(|r| standing.rank(r));
                if let Ok(mut t) = replicas.write() {
                    *t = table;
                }
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("refreshing the replicas of {model}: {e:#}"),
        }
    }
}

/// Joins through `place.bootstrap` with the identity in its store dir, fetches the model's
/// manifest and trunk if the store lacks them, learns who holds which slab, and readies the
/// remote executor. Fails, naming them, if some slab has no replica the router can reach and
/// the router cannot compute it itself.
pub async fn join_swarm_model(place: &SwarmPlace) -> Result<SwarmModel> {
    if place.bootstrap.is_empty() {
        bail!("--swarm needs at least one --bootstrap address");
    }
    let mut node = crate::ops::join(&place.store_dir, place.bootstrap.clone(), true).await?;
    match prepare(&mut node, place).await {
        Ok((manifest, trunk, tokenizer, experts)) => Ok(SwarmModel {
            node,
            manifest,
            trunk,
            tokenizer,
            experts,
        }),
        Err(e) => {
            node.shutdown().await;
            Err(e)
        }
    }
}

async fn prepare(
    node: &mut RunningNode,
    place: &SwarmPlace,
) -> Result<(Manifest, Trunk, TextTokenizer, RemoteExecutor)> {
    let trunk_only = Selection {
        trunk: true,
        only: Some(Default::default()),
        ..Selection::default()
    };
    node.fetch(place.model, &trunk_only, &indicatif::ProgressBar::hidden())
        .await
        .context("fetching the manifest and the trunk")?;
    let manifest = node.store.manifest(&place.model)?;
    if manifest.mtp_layers > 0 {
        // The MTP block drafts here only: its few slabs stay with the router, so a draft costs
        // no round trip. Workers still serve them to a router that could not fetch them.
        let mtp = Selection {
            layers: Some(manifest.mtp_slab_layers()),
            ..Selection::default()
        };
        if let Err(e) = node
            .fetch(place.model, &mtp, &indicatif::ProgressBar::hidden())
            .await
        {
            tracing::warn!("fetching the MTP block's slabs (drafts go to the workers): {e:#}");
        }
    }
    let table = replica_table(node, &manifest).await?;
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
    let (trunk, tokenizer) = trunk_from_store(&node.store, &manifest)?;
    let experts = remote_executor(
        node,
        &manifest,
        table,
        place.deadline,
        place.wire,
        &RouterUpkeep::default(),
    )?
    .with_checks(place.checks)
    .with_hole_punching(place.hole_punch);
    experts.prepare_paths(place.deadline).await;
    Ok((manifest, trunk, tokenizer, experts))
}
