//! Taking part in the market by itself: what a node started with a capacity does.
//!
//! Every round (a round apart when there is nothing to do, a quarter of one while it fetches a
//! few slabs at a time; each wait jittered so that nodes do not decide in lockstep) the node looks at the models it takes part in (those it was told, or every model
//! its peers serve), at who holds what (its coverage maps, fed by gossip and, on joining a
//! model, by asking its peers) and at the routers' merged demand, and lets
//! [`moeswarm_market::choice::decide`] say what to fetch and what to drop under its capacity.
//! It then carries that out: drops first (deleted from the store, no longer served, a new
//! record published), then fetches (verified, stored, served, advertised). The node only feeds
//! the market and does what it says; routing and combine stay the router's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Context, Result};
use indicatif::ProgressBar;
use moeswarm_market::choice::{
    decide, views as slab_views, Decision, NodeClass, NodeView, Policy, SlabKey, SlabState,
};
use moeswarm_model::store::Store;
use moeswarm_protocol::{ExchangeRequest, Manifest, ModelId, NodeKey, ResponseHeader};
use serde::Serialize;

use crate::holdings::Advertiser;
use crate::net::records::now_secs;
use crate::net::NodeHandle;
use crate::net::{learn_records, Fetcher, Selection};

/// Most models one node takes part in at once.
pub const MAX_AUTO_MODELS: usize = 8;
/// How long a peer may take to say which models it serves, or to hand over its records.
const ASK_DEADLINE: Duration = Duration::from_secs(5);
/// Most announced models tried in one round.
const MAX_ANNOUNCED: usize = 4 * MAX_AUTO_MODELS;
/// Rounds between asking the peers again which models they serve.
const DISCOVER_EVERY: u64 = 6;

/// How a node takes part in the market.
#[derive(Debug, Clone)]
pub struct AutoOptions {
    /// The models to take part in; empty: the models the peers serve, up to `max_models`,
    /// those some router demands first (see `Participant::candidates`).
    pub models: Vec<ModelId>,
    /// Most models taken part in at once when `models` is empty.
    pub max_models: usize,
    /// The market's knobs.
    pub policy: Policy,
    /// Time between rounds.
    pub round: Duration,
}

impl Default for AutoOptions {
    fn default() -> Self {
        Self {
            models: Vec::new(),
            max_models: MAX_AUTO_MODELS,
            policy: Policy::default(),
            round: Duration::from_secs(10),
        }
    }
}

/// What the node's market rounds did.
#[derive(Debug, Default)]
pub struct AutoStats {
    /// Rounds decided.
    pub rounds: AtomicU64,
    /// Slabs fetched.
    pub fetched_slabs: AtomicU64,
    /// Verified bytes fetched.
    pub fetched_bytes: AtomicU64,
    /// Slabs dropped.
    pub dropped_slabs: AtomicU64,
    /// Rounds that failed (a fetch that did not finish, a store error); retried next round.
    pub failed_rounds: AtomicU64,
    /// Rounds in a row, up to now, that found nothing to do.
    pub idle_rounds: AtomicU64,
    /// The last decision that did something, and the last error.
    last: Mutex<(Option<Decision>, Option<String>)>,
    /// Woken when a round ends idle (see [`AutoStats::settled`]).
    idle: tokio::sync::Notify,
}

/// A copy of [`AutoStats`] at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AutoSummary {
    /// Rounds decided.
    pub rounds: u64,
    /// Slabs fetched.
    pub fetched_slabs: u64,
    /// Verified bytes fetched.
    pub fetched_bytes: u64,
    /// Slabs dropped.
    pub dropped_slabs: u64,
    /// Rounds that failed.
    pub failed_rounds: u64,
    /// Rounds in a row, up to now, that found nothing to do.
    pub idle_rounds: u64,
    /// The last error, if any.
    pub last_error: Option<String>,
}

impl AutoStats {
    /// Waits until a round found nothing left to do (after whatever it fetched), or `within`
    /// passes; returns whether it settled.
    pub async fn settled(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // Made before the check: a round that ends idle in between still wakes it.
            let woken = self.idle.notified();
            if self.idle_rounds.load(Ordering::Relaxed) > 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                return self.idle_rounds.load(Ordering::Relaxed) > 0;
            }
        }
    }

    /// The counts now.
    pub fn summary(&self) -> AutoSummary {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AutoSummary {
            rounds: get(&self.rounds),
            fetched_slabs: get(&self.fetched_slabs),
            fetched_bytes: get(&self.fetched_bytes),
            dropped_slabs: get(&self.dropped_slabs),
            failed_rounds: get(&self.failed_rounds),
            idle_rounds: get(&self.idle_rounds),
            last_error: self.last.lock().ok().and_then(|l| l.1.clone()),
        }
    }
}

/// A node's part in the market: what it needs to decide and to act.
pub(crate) struct Participant {
    pub(crate) handle: NodeHandle,
    pub(crate) store: Arc<Store>,
    pub(crate) fetcher: Fetcher,
    pub(crate) advertiser: Advertiser,
    pub(crate) class: NodeClass,
    pub(crate) opts: AutoOptions,
    pub(crate) stats: Arc<AutoStats>,
}

/// What a participant remembers between rounds.
#[derive(Default)]
struct Memory {
    manifests: BTreeMap<ModelId, Manifest>,
    /// When each held slab was fetched (or first seen held).
    held_since: HashMap<SlabKey, u64>,
    /// Models the peers announced when last asked.
    announced: BTreeSet<ModelId>,
}

impl Participant {
    /// Runs rounds until the node stops: a round apart while there is nothing to do, a
    /// quarter of one after a round that fetched or dropped (the market fetches a few slabs a
    /// round and decides again on a view that shows them). Each wait is jittered afresh, so
    /// nodes started together do not keep deciding in lockstep.
    pub(crate) async fn run(self) {
        let mut mem = Memory::default();
        let mut n = 0u64;
        loop {
            let busy = match self.round(&mut mem, n).await {
                Ok(acted) => acted,
                Err(e) => {
                    self.stats.failed_rounds.fetch_add(1, Ordering::Relaxed);
                    self.stats.idle_rounds.store(0, Ordering::Relaxed);
                    tracing::warn!("market round failed: {e:#}");
                    if let Ok(mut l) = self.stats.last.lock() {
                        l.1 = Some(format!("{e:#}"));
                    }
                    false
                }
            };
            n += 1;
            let wait = if busy {
                self.opts.round / 4
            } else {
                self.opts.round
            };
            tokio::time::sleep(wait.mul_f64(rand::random_range(0.5..1.5))).await;
        }
    }

    /// One round; whether it fetched or dropped anything.
    async fn round(&self, mem: &mut Memory, n: u64) -> Result<bool> {
        self.join_models(mem, n).await?;
        if mem.manifests.is_empty() {
            return Ok(false);
        }
        let now = now_secs();
        let me = self.handle.identity.key;
        let mut views = Vec::new();
        let mut model_slab_bytes = 0u64;
        let mut still_held = BTreeSet::new();
        for (&model, manifest) in &mem.manifests {
            let coverage = self.handle.coverage(model).await?;
            let demand = self
                .handle
                .demand(model)
                .await?
                .map(|b| b.merged(now))
                .unwrap_or_default();
            // What the store and the coverage say of each slab, read once.
            let states = manifest
                .all_slabs()
                .map(|(l, e, r)| {
                    Ok(StoredSlab {
                        layer: l,
                        expert: e,
                        held: self.store.contains(&r.id)?,
                        holders: coverage
                            .as_ref()
                            .map(|c| c.holders(l, e))
                            .unwrap_or_default(),
                        id: r.id,
                        bytes: r.bytes,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let mut slab_states = Vec::with_capacity(states.len());
            let mut seen_ids = BTreeSet::new();
            for st in &states {
                let slab = SlabKey {
                    model,
                    layer: st.layer,
                    expert: st.expert,
                };
                if st.held {
                    still_held.insert(slab);
                    if seen_ids.insert(st.id) {
                        model_slab_bytes += st.bytes;
                    }
                }
                slab_states.push(SlabState {
                    slab,
                    bytes: st.bytes,
                    holders: &st.holders,
                    held_since: st.held.then(|| *mem.held_since.entry(slab).or_insert(now)),
                    demand: demand
                        .get(st.layer as usize)
                        .and_then(|row| row.get(st.expert as usize))
                        .copied()
                        .unwrap_or(0.0),
                });
            }
            let known = coverage.iter().flat_map(|c| c.nodes().map(|h| h.node));
            views.extend(slab_views(
                &me,
                &slab_states,
                known,
                self.opts.policy.target,
            ));
        }
        mem.held_since.retain(|k, _| still_held.contains(k));
        // What the store holds besides these slabs (manifests, trunks, other models) is not
        // the market's to give away.
        let other_bytes = self
            .advertiser
            .held_bytes()?
            .saturating_sub(model_slab_bytes);
        let node = NodeView {
            node: me,
            class: self.class,
            budget: self.advertiser.ad.capacity.saturating_sub(other_bytes),
            now,
        };
        let decision = decide(&node, &views, &self.opts.policy);
        self.stats.rounds.fetch_add(1, Ordering::Relaxed);
        if decision.is_empty() {
            self.stats.idle_rounds.fetch_add(1, Ordering::Relaxed);
            self.stats.idle.notify_waiters();
            return Ok(false);
        }
        self.stats.idle_rounds.store(0, Ordering::Relaxed);
        tracing::info!(
            "market: fetching {} slabs, dropping {}",
            decision.fetch.len(),
            decision.drop.len()
        );
        if let Ok(mut l) = self.stats.last.lock() {
            l.0 = Some(decision.clone());
        }
        self.carry_out(mem, &decision).await.map(|()| true)
    }

    /// Drops, then fetches, then serves and advertises what is held now.
    async fn carry_out(&self, mem: &mut Memory, d: &Decision) -> Result<()> {
        if !d.drop.is_empty() {
            let keep: BTreeSet<SlabKey> = mem
                .held_since
                .keys()
                .filter(|k| !d.drop.contains(k))
                .copied()
                .collect();
            for k in &d.drop {
                let Some(m) = mem.manifests.get(&k.model) else {
                    continue;
                };
                let Some(id) = m.slab(k.layer, k.expert).map(|r| r.id) else {
                    continue;
                };
                // Two experts with the same bytes are one blob: kept while either is wanted.
                let shared = keep.iter().any(|o| {
                    o.model == k.model && m.slab(o.layer, o.expert).is_some_and(|r| r.id == id)
                });
                if !shared {
                    self.store.remove(&id)?;
                }
                mem.held_since.remove(k);
                self.stats.dropped_slabs.fetch_add(1, Ordering::Relaxed);
            }
            self.advertiser.reload_and_advertise().await?;
        }
        let mut by_model: BTreeMap<ModelId, BTreeSet<(u32, u32)>> = BTreeMap::new();
        for k in &d.fetch {
            by_model
                .entry(k.model)
                .or_default()
                .insert((k.layer, k.expert));
        }
        let mut result = Ok(());
        for (model, only) in by_model {
            let sel = Selection {
                only: Some(only.clone()),
                ..Selection::default()
            };
            let r = self
                .fetcher
                .fetch_model(model, &sel, &ProgressBar::hidden())
                .await;
            let now = now_secs();
            if let Some(m) = mem.manifests.get(&model) {
                for &(l, e) in &only {
                    if m.slab(l, e)
                        .is_some_and(|r| self.store.contains(&r.id).unwrap_or(false))
                    {
                        mem.held_since
                            .entry(SlabKey {
                                model,
                                layer: l,
                                expert: e,
                            })
                            .or_insert(now);
                        self.stats.fetched_slabs.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            match r {
                Ok(rep) => {
                    self.stats
                        .fetched_bytes
                        .fetch_add(rep.bytes, Ordering::Relaxed);
                }
                Err(e) => result = Err(e),
            }
        }
        if !d.fetch.is_empty() {
            self.advertiser.reload_and_advertise().await?;
        }
        result
    }

    /// Takes up the models to take part in that are new: their manifests (fetched if need
    /// be and indexed, so they are advertised), their topics, and the records the peers hold.
    async fn join_models(&self, mem: &mut Memory, n: u64) -> Result<()> {
        let most = if self.opts.models.is_empty() {
            self.opts.max_models.max(1)
        } else {
            self.opts.models.len()
        };
        let wanted: Vec<ModelId> = if self.opts.models.is_empty() {
            // Asked again now and then, not every round: a peer may announce models whose
            // manifests nobody serves, and each try costs requests.
            if !n.is_multiple_of(DISCOVER_EVERY) && !mem.manifests.is_empty() {
                return Ok(());
            }
            self.candidates(mem, most).await?
        } else {
            self.opts.models.clone()
        };
        for model in wanted {
            if mem.manifests.contains_key(&model) || mem.manifests.len() >= most {
                continue;
            }
            let manifest = match self.fetcher.manifest(model).await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!("market: no manifest for {model} yet: {e:#}");
                    continue;
                }
            };
            let (store, m) = (self.store.clone(), manifest.clone());
            tokio::task::spawn_blocking(move || store.add_partial_model(&m))
                .await
                .context("indexing a model")??;
            let h = &manifest.hyper;
            self.handle
                .subscribe(model, manifest.slab_layers(), h.n_expert)
                .await?;
            learn_records(&self.handle, model).await?;
            mem.manifests.insert(model, manifest);
        }
        Ok(())
    }

    /// The announced models to take up, most wanted first: those some router demands now (by
    /// how many routers do), then the rest in id order. A node with `most` models already
    /// lets go of one that no router demands for each demanded one waiting: models announced
    /// by anyone (their ids ground to sort first) hold a node only while nothing real is
    /// asked for.
    async fn candidates(&self, mem: &mut Memory, most: usize) -> Result<Vec<ModelId>> {
        mem.announced = self.announced_models().await?;
        let now = now_secs();
        let live = |d: &moeswarm_protocol::Demand| d.expires_at > now && d.total_rows > 0;
        let mut ranked = Vec::new();
        for &model in mem.announced.iter().take(MAX_ANNOUNCED) {
            if mem.manifests.contains_key(&model) {
                continue;
            }
            let routers = match crate::net::collect_demand(&self.handle, model).await {
                Ok(d) => d.iter().filter(|d| live(d)).count(),
                Err(_) => 0,
            };
            ranked.push((std::cmp::Reverse(routers), model));
        }
        ranked.sort();
        let demanded = ranked.iter().filter(|(r, _)| r.0 > 0).count();
        let free = most.saturating_sub(mem.manifests.len());
        let mut idle = Vec::new();
        for &m in mem.manifests.keys() {
            let book = self.handle.demand(m).await?;
            if book.is_none_or(|b| !b.records().any(&live)) {
                idle.push(m);
            }
        }
        for m in idle.into_iter().take(demanded.saturating_sub(free)) {
            tracing::info!("market: letting go of {m}, which no router demands, for one that is");
            mem.manifests.remove(&m);
        }
        Ok(ranked.into_iter().map(|(_, m)| m).collect())
    }

    /// The models the connected peers serve (each peer names at most 32).
    async fn announced_models(&self) -> Result<BTreeSet<ModelId>> {
        let mut out = BTreeSet::new();
        for peer in self.handle.peers().await? {
            let Ok(Ok(r)) = tokio::time::timeout(
                ASK_DEADLINE,
                self.handle.request(peer, ExchangeRequest::Models),
            )
            .await
            else {
                continue;
            };
            if let ResponseHeader::Models { models } = r.header {
                out.extend(models);
            }
        }
        Ok(out)
    }
}

/// One slab of a model as a round sees it.
struct StoredSlab {
    layer: u32,
    expert: u32,
    id: moeswarm_protocol::BlobId,
    bytes: u64,
    /// Whether this node's store holds it.
    held: bool,
    /// Its live holders in the coverage.
    holders: Vec<NodeKey>,
}
