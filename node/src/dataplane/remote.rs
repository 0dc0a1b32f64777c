//! The router's remote expert executor: a layer's expert work sent to workers over QUIC.
//!
//! Per MoE layer the trunk hands over the rows and the dispatch plan. Each group (one expert,
//! its token rows) goes to one replica of its slab, chosen by the market crate's rule from what
//! the router has measured; groups bound for the same worker travel in one dispatch; all
//! dispatches go out at once and are awaited with a deadline. Each travels on a fresh stream of
//! a pooled connection ([`exchange`]); a pooled connection found gone (its worker restarted and
//! said so with a stateless reset) is dialed afresh once, within the same deadline.
//!
//! The router keeps authority: every dispatch carries a ticket (model, epoch, step, layer,
//! sequence) and its slabs with their row counts, and a reply counts only if it answers that
//! ticket exactly, on the stream it was sent on, from the node it was sent to (the TLS
//! certificate pins the node on a direct connection; through a relay the worker signs its
//! reply). Late, duplicate, mismatched, unsigned or malformed replies are dropped and counted.
//! Accepted answers are checked by sampling ([`check`]): a worker caught answering wrong is
//! quarantined and its answers are not used.
//! A group whose worker fails is retried on another replica, then computed locally if the
//! router holds the weights; otherwise the layer fails with an error naming the expert.
//! Layers the router keeps at home ([`RemoteExecutor::with_home_layers`]: the MTP block it
//! drafts with) are computed from its own store first and sent out only for slabs it lacks. The
//! outputs are unweighted; combine stays in the trunk, so the result is the local result bit
//! for bit.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Context, Error, Result};
use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest};
use moeswarm_engine::layer::ExpertCache;
use moeswarm_model::store::Store;
use moeswarm_protocol::{
    rows, DispatchRequest, DispatchTicket, Manifest, ModelId, SlabRows, WireType,
};
use moeswarm_relay::{DataEndpoint, PeerId};

use super::assign::{assign, HealthTable, Outbound, RetryPolicy};
use moeswarm_market::trust::CheckPolicy;

mod check;
mod exchange;
mod referee;
mod reply;
use super::connections::Connections;
use super::demand::DemandCounter;
use super::replicas::ReplicaTable;
use super::stats::{DispatchStats, DispatchSummary};
use super::timeline::{mark, Mark};
pub use referee::{RefereeBudget, REFEREE_BURST, REFEREE_RENEWAL};

/// How long a router reads for a worker's refusal after the worker stopped taking the payload.
const REFUSAL_WAIT: Duration = Duration::from_secs(1);

/// How long a dispatch may take by default.
pub const DISPATCH_DEADLINE: Duration = Duration::from_secs(10);
/// How long a reply that missed its deadline is still watched for (to count it as late).
pub const LATE_WATCH: Duration = Duration::from_secs(30);
/// A replica table several tasks share: the executor reads it, the router's upkeep replaces it.
pub type SharedReplicas = Arc<std::sync::RwLock<ReplicaTable>>;

/// Rounds of retries before the local fallback.
pub const MAX_ROUNDS: usize = 4;

/// The remote executor. See the module docs.
pub struct RemoteExecutor {
    model: ModelId,
    manifest: Arc<Manifest>,
    epoch: u64,
    seq: AtomicU64,
    connections: Connections,
    table: SharedReplicas,
    demand: Option<Arc<DemandCounter>>,
    health: Arc<HealthTable>,
    fallback: Option<ExpertCache>,
    /// Layers computed from the fallback store first, dispatched only for slabs it lacks.
    home_layers: Vec<u32>,
    /// Fetches a slab into the router's store to settle a dispute (see `check`).
    referee: Option<referee::Referee>,
    retry: RetryPolicy,
    wire: WireType,
    /// What it did.
    pub stats: Arc<DispatchStats>,
}

impl RemoteExecutor {
    /// An executor for `manifest`'s model sending from `endpoint` to the replicas in `table`;
    /// with `fallback`, the router computes from its own store what no replica answers.
    pub fn new(
        manifest: Manifest,
        endpoint: DataEndpoint,
        table: ReplicaTable,
        fallback: Option<Arc<Store>>,
        deadline: Duration,
    ) -> Self {
        let mut epoch = [0u8; 8];
        rand::fill(&mut epoch);
        let manifest = Arc::new(manifest);
        let health = Arc::new(HealthTable::default());
        let table = table.capped(|r| health.rank(r));
        Self {
            model: manifest.id(),
            epoch: u64::from_le_bytes(epoch),
            seq: AtomicU64::new(0),
            connections: Connections::new(endpoint),
            table: Arc::new(std::sync::RwLock::new(table)),
            demand: None,
            health,
            fallback: fallback.map(|store| ExpertCache::new(store, manifest.clone())),
            home_layers: Vec::new(),
            referee: None,
            manifest,
            retry: RetryPolicy {
                rounds: MAX_ROUNDS,
                deadline,
            },
            wire: WireType::F32,
            stats: Arc::default(),
        }
    }

    /// The model this executor computes experts of.
    pub fn model(&self) -> ModelId {
        self.model
    }

    /// Checks answers no one else can give an opinion on (a slab's only holder), and settles
    /// disputes between two workers, by fetching the slab through `fetcher` (into the
    /// fallback store, verified by its hash) and computing it here, within a budget that
    /// renews over time (see `referee`).
    pub fn with_referee(mut self, fetcher: crate::net::fetch::Fetcher) -> Self {
        self.referee = Some(referee::Referee {
            fetcher,
            budget: std::sync::Mutex::new(referee::RefereeBudget::new(std::time::Instant::now())),
        });
        self
    }

    /// Computes `layers` here, from the router's own store, wherever it holds their slabs
    /// (the rest still go to the workers): no round trip for them. A router keeps the MTP
    /// block's few slabs so, since it alone drafts with them.
    pub fn with_home_layers(mut self, layers: impl IntoIterator<Item = u32>) -> Self {
        self.home_layers = layers.into_iter().collect();
        self
    }

    /// Whether workers reached through a relay are hole punched for a direct path (on by
    /// default).
    pub fn with_hole_punching(mut self, on: bool) -> Self {
        self.connections.set_hole_punching(on);
        self
    }

    /// Sends rows as `wire` (f16/bf16 halve the bytes but round the activations: the result is
    /// then close to, not bit-identical with, a local run).
    pub fn with_wire(mut self, wire: WireType) -> Self {
        self.wire = wire;
        self
    }

    /// Checks workers' answers by `policy` (default: [`CheckPolicy::default`]).
    pub fn with_checks(mut self, policy: CheckPolicy) -> Self {
        self.set_checks(policy);
        self
    }

    /// Checks answers by `policy` from now on, every worker starting afresh (on probation).
    pub fn set_checks(&mut self, policy: CheckPolicy) {
        self.health.reset(policy);
    }

    /// What the executor knows of each worker: how whoever refreshes its replica table ranks
    /// (and caps) the holders of each slab (see [`ReplicaTable::capped`]).
    pub fn standing(&self) -> Arc<HealthTable> {
        self.health.clone()
    }

    /// Counts every row it sends (or computes itself) in `counter`: the router's demand.
    pub fn with_demand(mut self, counter: Arc<DemandCounter>) -> Self {
        self.demand = Some(counter);
        self
    }

    /// Replaces the replica table (after coverage changed).
    pub fn set_replicas(&self, table: ReplicaTable) {
        if let Ok(mut t) = self.table.write() {
            *t = table;
        }
    }

    /// Gets the paths to the table's workers ready before the first dispatch: registers at
    /// the relays they use and hole punches the workers behind them, waiting for the punches'
    /// outcomes (at most `deadline` in all; what is not ready then is made on first use, and
    /// a punch still in flight goes on in the background), so that the first tokens already
    /// take the direct paths that can be had.
    pub async fn prepare_paths(&self, deadline: Duration) {
        let until = tokio::time::Instant::now() + deadline;
        let workers = self.table.read().map(|t| t.workers()).unwrap_or_default();
        let all = futures::future::join_all(
            workers
                .iter()
                .map(|(peer, route)| self.connections.prepare(*peer, route)),
        );
        if tokio::time::timeout_at(until, all).await.is_err() {
            tracing::debug!("the paths to the workers were not all ready within {deadline:?}");
        }
        self.connections.punches_settled(until).await;
    }

    /// What the dispatches did, with how each known worker is reached.
    pub fn summary(&self) -> DispatchSummary {
        let mut s = self.stats.summary();
        s.worker_paths = self.table.read().map(|t| t.paths()).unwrap_or_default();
        for (peer, path) in self.connections.punched_paths() {
            if let Some(p) = s.worker_paths.get_mut(&peer) {
                *p = path;
            }
        }
        s
    }

    /// The replica table, shared: whoever holds it can replace it while the executor runs.
    pub fn shared_replicas(&self) -> SharedReplicas {
        self.table.clone()
    }

    /// A fresh ticket for a dispatch of `layer` in forward pass `step`.
    fn ticket(&self, step: u64, layer: u32) -> DispatchTicket {
        DispatchTicket {
            model: self.model,
            epoch: self.epoch,
            step,
            layer,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Sends one dispatch and returns each slab's outputs, or why it failed.
    async fn dispatch(
        &self,
        out: &Outbound,
        ticket: DispatchTicket,
        req: &ExpertRequest<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let n_embd = req.n_embd;
        let mut slabs = Vec::new();
        // Every slab row named by its token: a token routed to several of these slabs travels
        // once, each row copied once from the layer's input straight into the payload.
        let mut tokens = Vec::new();
        for &i in &out.groups {
            let g = &req.plan.groups[i];
            let slab = self.manifest.slab(req.layer, g.expert).with_context(|| {
                format!(
                    "the model has no expert {} in layer {}",
                    g.expert, req.layer
                )
            })?;
            slabs.push(SlabRows {
                slab: slab.id,
                expert: g.expert,
                rows: g.tokens.len() as u32,
            });
            tokens.extend_from_slice(&g.tokens);
        }
        let row = |t: u32| &req.x[t as usize * n_embd..(t as usize + 1) * n_embd];
        let (layout, payload) = rows::pack(self.wire, &tokens, row);
        let header = DispatchRequest {
            ticket,
            n_embd: n_embd as u32,
            slabs,
            wire: self.wire,
            distinct_rows: layout.distinct_rows(),
        };
        header.validate()?;
        mark(header.ticket.seq, Mark::RowsGathered);
        let payload = bytes::Bytes::from(payload);
        let t0 = Instant::now();
        self.health.started(out.peer);
        let result = self.exchange(out, &header, &payload).await;
        self.health.finished(
            out.peer,
            result.as_ref().map(|_| t0.elapsed()).map_err(|f| f.reason),
        );
        let body = result?;
        self.stats.accepted.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_in
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        self.stats.round_trip(
            req.layer,
            &out.peer.to_string(),
            t0.elapsed().as_secs_f64() * 1e3,
        );
        // Each slab's outputs decoded straight from the pieces the reply came in: one copy.
        let lens: Vec<usize> = header
            .slabs
            .iter()
            .map(|s| s.rows as usize * n_embd)
            .collect();
        let outputs = self.wire.decode_parts(body.parts(), &lens);
        if outputs.iter().zip(&lens).any(|(o, &n)| o.len() != n) {
            return Err(Error::invalid("the reply is shorter than its slabs"));
        }
        mark(header.ticket.seq, Mark::OutputsDecoded);
        Ok(outputs)
    }

    fn local_weights(
        &self,
        layer: u32,
        expert: u32,
    ) -> Result<Arc<moeswarm_engine::ExpertWeights>> {
        Ok(self
            .fallback
            .as_ref()
            .context("the router holds no expert weights")?
            .get(layer, expert)?)
    }

    async fn compute_layer(&self, req: ExpertRequest<'_>) -> Result<Vec<Vec<f32>>> {
        let step = req.step;
        if let Some(d) = &self.demand {
            let now = crate::net::records::now_secs();
            for g in &req.plan.groups {
                d.add(req.layer, g.expert, g.tokens.len() as u64, now);
            }
        }
        let n = req.plan.groups.len();
        let mut outputs: Vec<Option<Vec<f32>>> = vec![None; n];
        let mut excluded: Vec<HashSet<PeerId>> = vec![HashSet::new(); n];
        let mut why: Vec<Vec<String>> = vec![Vec::new(); n];
        if self.home_layers.contains(&req.layer) {
            for (i, slot) in outputs.iter_mut().enumerate() {
                if let Ok(w) = self.local_weights(req.layer, req.plan.groups[i].expert) {
                    *slot = Some(self.compute_here(&req, i, w).await?);
                }
            }
        }
        for round in 0..self.retry.rounds {
            let plan = {
                let table = self.table.read().unwrap_or_else(|e| e.into_inner());
                let wanted: Vec<bool> = outputs.iter().map(Option::is_none).collect();
                assign(&table, &self.health, &req, self.wire, &wanted, &excluded)
            };
            if plan.is_empty() {
                break;
            }
            if round > 0 {
                let groups: usize = plan.iter().map(|o| o.groups.len()).sum();
                self.stats
                    .retried
                    .fetch_add(groups as u64, Ordering::Relaxed);
            }
            let req = &req;
            // Each worker's answer is checked as soon as it is in, while slower workers of the
            // same layer are still computing.
            let sends = plan.iter().map(|o| async move {
                let dispatch = self.dispatch(o, self.ticket(step, req.layer), req);
                let (r, ahead) = if self.check_ahead(&o.peer) {
                    let (r, second) = futures::join!(dispatch, self.opinion_ahead(req, o));
                    (r, Some(second))
                } else {
                    (dispatch.await, None)
                };
                match r {
                    Ok(outs) => Ok(self.check(req, o, outs, ahead).await),
                    Err(e) => Err(e),
                }
            });
            let results = futures::future::join_all(sends).await;
            for (o, r) in plan.iter().zip(results) {
                let checked = match r {
                    Ok(checked) => checked,
                    Err(e) => {
                        for &i in &o.groups {
                            excluded[i].insert(o.peer);
                            why[i].push(format!("{e:#}"));
                        }
                        continue;
                    }
                };
                for (&i, v) in o.groups.iter().zip(checked.outputs) {
                    match v {
                        Some(v) => outputs[i] = Some(v),
                        None => {
                            excluded[i].extend(checked.exclude.iter().copied());
                            why[i].push(checked.why.clone());
                        }
                    }
                }
            }
        }
        for (i, slot) in outputs.iter_mut().enumerate() {
            if slot.is_some() {
                continue;
            }
            let g = &req.plan.groups[i];
            let w = self.local_weights(req.layer, g.expert).with_context(|| {
                format!(
                    "expert {} of layer {}: no replica answered ({}) and it cannot be computed here",
                    g.expert,
                    req.layer,
                    if why[i].is_empty() { "none known".into() } else { why[i].join("; ") }
                )
            })?;
            *slot = Some(self.compute_here(&req, i, w).await?);
        }
        Ok(outputs.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Group `i` of `req` computed here with `w` (counted as local).
    async fn compute_here(
        &self,
        req: &ExpertRequest<'_>,
        i: usize,
        w: Arc<moeswarm_engine::ExpertWeights>,
    ) -> Result<Vec<f32>> {
        let rows = req.plan.gather(&req.plan.groups[i], req.x, req.n_embd);
        let out = tokio::task::spawn_blocking(move || w.forward_rows(&rows))
            .await
            .map_err(|e| Error::invalid(format!("local expert: {e}")))??;
        self.stats.local.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }
}

impl ExpertExecutor for RemoteExecutor {
    async fn compute(&self, req: ExpertRequest<'_>) -> moeswarm_engine::Result<Vec<Vec<f32>>> {
        Ok(self.compute_layer(req).await?)
    }
}
