//! The router's remote expert executor: a layer's expert work sent to workers over QUIC.
//!
//! Per MoE layer the trunk hands over the rows and the dispatch plan. Each group (one expert,
//! its token rows) goes to one replica of its slab, chosen by the market crate's rule from what
//! the router has measured; groups bound for the same worker travel in one dispatch; all
//! dispatches go out at once and are awaited with a deadline.
//!
//! The router keeps authority: every dispatch carries a ticket (model, epoch, step, layer,
//! sequence) and its slabs with their row counts, and a reply counts only if it answers that
//! ticket exactly, on the stream it was sent on, from the node it was sent to (the TLS
//! certificate pins the node on a direct connection; through a relay the worker signs its
//! reply). Late, duplicate, mismatched, unsigned or malformed replies are dropped and counted.
//! A group whose worker fails is retried on another replica, then computed locally if the
//! router holds the weights; otherwise the layer fails with an error naming the expert. The
//! outputs are unweighted; combine stays in the trunk, so the result is the local result bit
//! for bit.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use moeswarm_market::replica::{choose, smooth_latency, ReplicaView};
use moeswarm_protocol::dispatch::MAX_PAYLOAD_BYTES;
use moeswarm_protocol::relay::from_hex;
use moeswarm_protocol::{
    DispatchReply, DispatchRequest, DispatchTicket, Manifest, ModelId, ReplyStatus, SlabRows,
    WireType,
};
use moeswarm_relay::framing::{read_frame, write_frame};
use moeswarm_relay::{DataEndpoint, PeerId, RelayClient};

use super::replicas::{ReplicaTable, Route};
use super::stats::DispatchStats;
use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest};
use moeswarm_engine::expert::ExpertWeights;
use moeswarm_engine::layer::read_slab;
use moeswarm_model::store::Store;

/// How long a dispatch may take by default.
pub const DISPATCH_DEADLINE: Duration = Duration::from_secs(10);
/// How long a reply that missed its deadline is still watched for (to count it as late).
pub const LATE_WATCH: Duration = Duration::from_secs(30);
/// Rounds of retries before the local fallback.
pub const MAX_ROUNDS: usize = 4;

#[derive(Debug, Clone, Default)]
struct Health {
    latency_ms: Option<f64>,
    in_flight: u32,
    failures: u32,
}

/// Weights the router can compute itself when no replica answers.
struct Fallback {
    store: Arc<Store>,
    loaded: Mutex<HashMap<(u32, u32), Arc<ExpertWeights>>>,
}

/// The remote executor. See the module docs.
pub struct RemoteExecutor {
    model: ModelId,
    manifest: Arc<Manifest>,
    epoch: u64,
    seq: AtomicU64,
    endpoint: DataEndpoint,
    table: std::sync::RwLock<ReplicaTable>,
    health: Mutex<HashMap<PeerId, Health>>,
    conns: Mutex<HashMap<PeerId, quinn::Connection>>,
    relays: Mutex<HashMap<PeerId, RelayClient>>,
    fallback: Option<Fallback>,
    deadline: Duration,
    wire: WireType,
    /// What it did.
    pub stats: Arc<DispatchStats>,
}

struct Outbound {
    peer: PeerId,
    route: Route,
    groups: Vec<usize>,
}

fn verify_signature(peer: &PeerId, reply: &DispatchReply, payload: &[u8]) -> bool {
    let Some(sig) = reply.signature.as_deref().and_then(from_hex) else {
        return false;
    };
    moeswarm_relay::identity::verify(peer, &reply.signed_bytes(payload), &sig)
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
        Self {
            model: manifest.id(),
            manifest: Arc::new(manifest),
            epoch: u64::from_le_bytes(epoch),
            seq: AtomicU64::new(0),
            endpoint,
            table: std::sync::RwLock::new(table),
            health: Mutex::default(),
            conns: Mutex::default(),
            relays: Mutex::default(),
            fallback: fallback.map(|store| Fallback {
                store,
                loaded: Mutex::default(),
            }),
            deadline,
            wire: WireType::F32,
            stats: Arc::default(),
        }
    }

    /// Sends rows as `wire` (f16/bf16 halve the bytes but round the activations: the result is
    /// then close to, not bit-identical with, a local run).
    pub fn with_wire(mut self, wire: WireType) -> Self {
        self.wire = wire;
        self
    }

    /// Replaces the replica table (after coverage changed).
    pub fn set_replicas(&self, table: ReplicaTable) {
        if let Ok(mut t) = self.table.write() {
            *t = table;
        }
    }

    fn health_of(&self, peer: &PeerId) -> Health {
        self.health
            .lock()
            .ok()
            .and_then(|h| h.get(peer).cloned())
            .unwrap_or_default()
    }

    fn update_health(&self, peer: PeerId, f: impl FnOnce(&mut Health)) {
        if let Ok(mut h) = self.health.lock() {
            f(h.entry(peer).or_default());
        }
    }

    /// Picks a replica for each group not yet answered; groups bound for one worker share a
    /// dispatch.
    fn assign(
        &self,
        layer: u32,
        req: &ExpertRequest<'_>,
        done: &[Option<Vec<f32>>],
        excluded: &[HashSet<PeerId>],
    ) -> Vec<Outbound> {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        let mut planned: HashMap<PeerId, u32> = HashMap::new();
        let mut by_peer: BTreeMap<PeerId, Outbound> = BTreeMap::new();
        for (i, g) in req.plan.groups.iter().enumerate() {
            if done[i].is_some() {
                continue;
            }
            let replicas = table.replicas(layer, g.expert);
            let views: Vec<ReplicaView> = replicas
                .iter()
                .map(|r| {
                    let h = self.health_of(&r.peer);
                    ReplicaView {
                        node: r.key,
                        direct: matches!(r.route, Route::Direct(_)),
                        latency_ms: h.latency_ms,
                        in_flight: h.in_flight + planned.get(&r.peer).copied().unwrap_or(0),
                        failures: h.failures,
                        excluded: excluded[i].contains(&r.peer),
                    }
                })
                .collect();
            let Some(k) = choose(&views) else { continue };
            let r = &replicas[k];
            *planned.entry(r.peer).or_default() += 1;
            by_peer
                .entry(r.peer)
                .or_insert_with(|| Outbound {
                    peer: r.peer,
                    route: r.route.clone(),
                    groups: Vec::new(),
                })
                .groups
                .push(i);
        }
        // Long prompts: no dispatch over half the payload limit; one worker may get several.
        let budget = MAX_PAYLOAD_BYTES / 2;
        let row_bytes = req.n_embd as u64 * self.wire.size();
        let mut out = Vec::new();
        for o in by_peer.into_values() {
            let mut part = Vec::new();
            let mut bytes = 0u64;
            for i in o.groups {
                let b = req.plan.groups[i].tokens.len() as u64 * row_bytes;
                if !part.is_empty() && bytes + b > budget {
                    out.push(Outbound {
                        peer: o.peer,
                        route: o.route.clone(),
                        groups: std::mem::take(&mut part),
                    });
                    bytes = 0;
                }
                part.push(i);
                bytes += b;
            }
            out.push(Outbound {
                peer: o.peer,
                route: o.route,
                groups: part,
            });
        }
        out
    }

    async fn open_stream(
        &self,
        peer: PeerId,
        route: &Route,
    ) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        // No lock is held while dialing: a dead peer must not hold up dispatches to others.
        match route {
            Route::Direct(addr) => {
                let known = self.conns.lock().ok().and_then(|c| c.get(&peer).cloned());
                if let Some(c) = known {
                    if let Ok(s) = c.open_bi().await {
                        return Ok(s);
                    }
                    if let Ok(mut conns) = self.conns.lock() {
                        conns.remove(&peer);
                    }
                }
                let c = self
                    .endpoint
                    .connect(*addr, peer, moeswarm_protocol::dispatch::DISPATCH_ALPN)
                    .await?;
                let s = c.open_bi().await?;
                if let Ok(mut conns) = self.conns.lock() {
                    conns.insert(peer, c);
                }
                Ok(s)
            }
            Route::ViaRelay { relay, addr } => {
                let known = self
                    .relays
                    .lock()
                    .ok()
                    .and_then(|r| r.get(relay).filter(|c| c.is_open()).cloned());
                let client = match known {
                    Some(c) => c,
                    None => {
                        let c = RelayClient::register(&self.endpoint, *addr, *relay).await?;
                        if let Ok(mut r) = self.relays.lock() {
                            r.insert(*relay, c.clone());
                        }
                        c
                    }
                };
                client.open(peer).await
            }
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
        let mut rows = Vec::new();
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
            rows.extend(req.plan.gather(g, req.x, n_embd));
        }
        let header = DispatchRequest {
            ticket,
            n_embd: n_embd as u32,
            slabs,
            wire: self.wire,
        };
        header.validate()?;
        let payload = self.wire.encode(&rows);
        let t0 = Instant::now();
        self.update_health(out.peer, |h| h.in_flight += 1);
        let result = self.exchange(out, &header, &payload).await;
        self.update_health(out.peer, |h| {
            h.in_flight = h.in_flight.saturating_sub(1);
            match &result {
                Ok(_) => {
                    h.latency_ms = Some(smooth_latency(
                        h.latency_ms,
                        t0.elapsed().as_secs_f64() * 1e3,
                    ));
                    h.failures = h.failures.saturating_sub(1);
                }
                Err(_) => h.failures += 1,
            }
        });
        let body = result?;
        self.stats.accepted.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_in
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        if let Ok(mut l) = self.stats.latency_ms.lock() {
            let v = l.entry(req.layer).or_default();
            if v.len() < 100_000 {
                v.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        let values = self.wire.decode(&body);
        let mut at = 0;
        Ok(header
            .slabs
            .iter()
            .map(|s| {
                let n = s.rows as usize * n_embd;
                let v = values[at..at + n].to_vec();
                at += n;
                v
            })
            .collect())
    }

    async fn exchange(
        &self,
        out: &Outbound,
        header: &DispatchRequest,
        payload: &[u8],
    ) -> Result<Vec<u8>> {
        let stats = &self.stats;
        let via_relay = matches!(out.route, Route::ViaRelay { .. });
        let (mut send, mut recv) =
            tokio::time::timeout(self.deadline, self.open_stream(out.peer, &out.route))
                .await
                .map_err(|_| {
                    stats.drop_reply("failed");
                    anyhow!("no stream to {} in time", out.peer)
                })?
                .inspect_err(|_| stats.drop_reply("failed"))?;
        stats.sent.fetch_add(1, Ordering::Relaxed);
        stats
            .bytes_out
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        write_frame(&mut send, header, payload).await?;
        let _ = send.finish();
        let expected = |h: &DispatchReply| -> Result<u64> {
            h.validate()?;
            Ok(if h.status == ReplyStatus::Ok {
                h.payload_len()
            } else {
                0
            })
        };
        let frame = tokio::time::timeout(
            self.deadline,
            read_frame::<DispatchReply>(&mut recv, expected),
        )
        .await;
        let (reply, body) = match frame {
            Err(_) => {
                // Watch for the reply a while, to count it when it comes late.
                let st = stats.clone();
                tokio::spawn(async move {
                    let late = tokio::time::timeout(
                        LATE_WATCH,
                        read_frame::<DispatchReply>(&mut recv, expected),
                    )
                    .await;
                    if let Ok(Ok(Some(_))) = late {
                        st.drop_reply("late");
                    }
                });
                stats.drop_reply("failed");
                bail!("{} did not answer within {:?}", out.peer, self.deadline);
            }
            Ok(Err(e)) => {
                // A frame that breaks the protocol is malformed; a stream or connection that
                // broke (a worker that went away) is a failure.
                let broke_rules = e
                    .downcast_ref::<moeswarm_protocol::dispatch::DispatchError>()
                    .is_some();
                stats.drop_reply(if broke_rules { "malformed" } else { "failed" });
                return Err(e.context(format!("reply from {}", out.peer)));
            }
            Ok(Ok(None)) => {
                stats.drop_reply("failed");
                bail!("{} closed the stream without answering", out.peer);
            }
            Ok(Ok(Some(f))) => f,
        };
        if let Err(e) = reply.check_answers(header) {
            stats.drop_reply("mismatched");
            bail!("reply from {}: {e}", out.peer);
        }
        if via_relay && !verify_signature(&out.peer, &reply, &body) {
            stats.drop_reply("bad_signature");
            bail!("reply through the relay is not signed by {}", out.peer);
        }
        match reply.status {
            ReplyStatus::Ok => {}
            ReplyStatus::Busy => {
                stats.drop_reply("busy");
                bail!("{} is busy", out.peer);
            }
            ReplyStatus::Refused { reason } => {
                stats.drop_reply("refused");
                bail!("{} refused: {reason}", out.peer);
            }
        }
        // Anything more on this stream is a second answer: dropped and counted.
        let st = stats.clone();
        tokio::spawn(async move {
            let more =
                tokio::time::timeout(LATE_WATCH, read_frame::<DispatchReply>(&mut recv, expected))
                    .await;
            if let Ok(Ok(Some(_))) = more {
                st.drop_reply("duplicate");
            }
        });
        Ok(body)
    }

    fn local_weights(&self, layer: u32, expert: u32) -> Result<Arc<ExpertWeights>> {
        let fb = self
            .fallback
            .as_ref()
            .context("the router holds no expert weights")?;
        if let Some(w) = fb
            .loaded
            .lock()
            .ok()
            .and_then(|m| m.get(&(layer, expert)).cloned())
        {
            return Ok(w);
        }
        let bytes = read_slab(&fb.store, &self.manifest, layer, expert)?;
        let w = Arc::new(ExpertWeights::from_slab_bytes(&bytes)?);
        if let Ok(mut m) = fb.loaded.lock() {
            m.insert((layer, expert), w.clone());
        }
        Ok(w)
    }

    async fn compute_layer(&self, req: ExpertRequest<'_>) -> Result<Vec<Vec<f32>>> {
        let step = req.step;
        let n = req.plan.groups.len();
        let mut outputs: Vec<Option<Vec<f32>>> = vec![None; n];
        let mut excluded: Vec<HashSet<PeerId>> = vec![HashSet::new(); n];
        let mut why: Vec<Vec<String>> = vec![Vec::new(); n];
        for round in 0..MAX_ROUNDS {
            let plan = self.assign(req.layer, &req, &outputs, &excluded);
            if plan.is_empty() {
                break;
            }
            if round > 0 {
                let groups: usize = plan.iter().map(|o| o.groups.len()).sum();
                self.stats
                    .retried
                    .fetch_add(groups as u64, Ordering::Relaxed);
            }
            let sends = plan.iter().map(|o| {
                let ticket = DispatchTicket {
                    model: self.model,
                    epoch: self.epoch,
                    step,
                    layer: req.layer,
                    seq: self.seq.fetch_add(1, Ordering::Relaxed),
                };
                self.dispatch(o, ticket, &req)
            });
            let results = futures::future::join_all(sends).await;
            for (o, r) in plan.iter().zip(results) {
                match r {
                    Ok(outs) => {
                        for (&i, v) in o.groups.iter().zip(outs) {
                            outputs[i] = Some(v);
                        }
                    }
                    Err(e) => {
                        for &i in &o.groups {
                            excluded[i].insert(o.peer);
                            why[i].push(format!("{e:#}"));
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
            let rows = req.plan.gather(g, req.x, req.n_embd);
            let out = tokio::task::spawn_blocking(move || w.forward_rows(&rows))
                .await
                .map_err(|e| anyhow!("local expert: {e}"))??;
            self.stats.local.fetch_add(1, Ordering::Relaxed);
            *slot = Some(out);
        }
        Ok(outputs.into_iter().map(Option::unwrap_or_default).collect())
    }
}

impl ExpertExecutor for RemoteExecutor {
    fn compute(
        &self,
        req: ExpertRequest<'_>,
    ) -> impl std::future::Future<Output = Result<Vec<Vec<f32>>>> + Send {
        self.compute_layer(req)
    }
}
