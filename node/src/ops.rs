//! What `moeswarm fetch` and `coverage` do: join a swarm for one task, do it, leave; and the
//! coverage report.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use crate::error::{bail, Context, Result};
use libp2p::{Multiaddr, PeerId};
use moeswarm_market::coverage::CoverageMap;
use moeswarm_protocol::{ModelId, NodeKey, Reach};
use serde::Serialize;

use crate::net::identity::{peer_id_of, NodeIdentity};
use crate::net::{collect_demand, collect_records, FetchReport, Selection};
use crate::net::{NodeConfig, SwarmNode};
use crate::node::{NodeOptions, RunningNode};
use moeswarm_market::choice::Policy;
use moeswarm_market::demand::DemandBook;

/// How long a one-shot command waits to join.
pub const JOIN_DEADLINE: Duration = Duration::from_secs(15);

/// Parses `a..b` (layers `a` to `b - 1`).
pub fn parse_layer_range(s: &str) -> Result<std::ops::Range<u32>> {
    let (a, b) = s
        .split_once("..")
        .with_context(|| format!("layers {s:?}: want a..b"))?;
    let (a, b): (u32, u32) = (
        a.trim()
            .parse()
            .ok()
            .with_context(|| format!("layers {s:?}"))?,
        b.trim()
            .parse()
            .ok()
            .with_context(|| format!("layers {s:?}"))?,
    );
    if a >= b {
        bail!("layers {s:?}: empty range");
    }
    Ok(a..b)
}

/// Parses a list of experts: `1,2,5..8`.
pub fn parse_experts(s: &str) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part.contains("..") {
            out.extend(parse_layer_range(part).with_context(|| format!("experts {s:?}"))?);
        } else {
            out.push(
                part.parse()
                    .ok()
                    .with_context(|| format!("experts {s:?}: {part:?} is not a number"))?,
            );
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Joins a swarm for one job, as every one-shot command does: a node with the identity and
/// store in `data_dir` starts (listening on an ephemeral port, advertising nothing unless
/// `advertise`: a process that leaves when its job is done must not be named as a holder),
/// reaches its bootstrap nodes and learns the peers they know (the DHT bootstrap), or stops
/// and says why.
pub async fn join(
    data_dir: &Path,
    bootstrap: Vec<Multiaddr>,
    advertise: bool,
) -> Result<RunningNode> {
    if bootstrap.is_empty() {
        bail!("give at least one --bootstrap address");
    }
    let mut opts = NodeOptions::local(data_dir.to_path_buf(), bootstrap);
    opts.listen = vec!["/ip4/0.0.0.0/tcp/0".parse()?];
    opts.advertise = advertise;
    let node = RunningNode::start(opts).await?;
    match node.handle.wait_joined(JOIN_DEADLINE).await {
        Ok(()) => Ok(node),
        Err(e) => {
            node.shutdown().await;
            Err(e)
        }
    }
}

/// Joins through `bootstrap` with the store's identity, fetches the selection of `model` into
/// the store, and leaves.
pub async fn fetch(
    store_dir: &Path,
    bootstrap: Vec<Multiaddr>,
    model: ModelId,
    selection: &Selection,
) -> Result<FetchReport> {
    let node = join(store_dir, bootstrap, false).await?;
    let bar = moeswarm_model::progress::bytes_bar(0);
    let began = std::time::Instant::now();
    let r = node.fetch(model, selection, &bar).await.map(|mut r| {
        r.seconds = began.elapsed().as_secs_f64();
        r
    });
    bar.finish_and_clear();
    node.shutdown().await;
    r
}

/// Every layer's replica counts, holders and demand, as `moeswarm coverage` prints them.
#[derive(Debug, Clone, Serialize)]
pub struct CoverageReport {
    /// The model.
    pub model: ModelId,
    /// The replicas every slab should have (the market's target).
    pub target: usize,
    /// Nodes with a live record (by PeerId): what each holds and has room for.
    pub nodes: BTreeMap<String, NodeCoverage>,
    /// Routers whose demand is counted.
    pub routers: usize,
    /// Per layer.
    pub layers: Vec<LayerCoverage>,
}

/// One node of a [`CoverageReport`].
#[derive(Debug, Clone, Serialize)]
pub struct NodeCoverage {
    /// Slabs of the model it holds.
    pub slabs: usize,
    /// Bytes it holds (of every model).
    pub used_bytes: u64,
    /// Bytes it could still take.
    pub free_bytes: u64,
    /// The relay it is reached through (its PeerId), or `None` when reached directly.
    pub relay: Option<String>,
}

/// One layer of a [`CoverageReport`].
#[derive(Debug, Clone, Serialize)]
pub struct LayerCoverage {
    /// Layer index.
    pub layer: u32,
    /// Replicas of each expert.
    pub replicas: Vec<usize>,
    /// Experts nobody holds.
    pub missing: Vec<u32>,
    /// Holders of each expert (PeerIds).
    pub holders: Vec<Vec<String>>,
    /// Merged demand of each expert: rows per window, over every router.
    pub demand: Vec<f64>,
}

impl CoverageReport {
    /// The report of a coverage map and the routers' demand.
    pub fn of(map: &CoverageMap, demand: &DemandBook, now: u64) -> Self {
        fn name(k: &NodeKey) -> String {
            peer_id_of(k).map_or_else(|| "?".into(), |p: PeerId| p.to_string())
        }
        let nodes = map
            .nodes()
            .map(|h| {
                let n = NodeCoverage {
                    slabs: h.slabs().count(),
                    used_bytes: h.used_bytes,
                    free_bytes: h.free_bytes,
                    relay: match &h.reach {
                        Reach::Direct => None,
                        Reach::ViaRelay(k) => Some(name(k)),
                    },
                };
                (name(&h.node), n)
            })
            .collect();
        let merged = demand.merged(now);
        let layers = map
            .replicas()
            .iter()
            .enumerate()
            .map(|(l, counts)| LayerCoverage {
                layer: l as u32,
                replicas: counts.clone(),
                missing: (0..counts.len() as u32)
                    .filter(|&e| counts[e as usize] == 0)
                    .collect(),
                holders: (0..counts.len() as u32)
                    .map(|e| map.holders(l as u32, e).iter().map(name).collect())
                    .collect(),
                demand: merged
                    .get(l)
                    .cloned()
                    .unwrap_or_else(|| vec![0.0; counts.len()]),
            })
            .collect();
        Self {
            model: map.model(),
            target: Policy::default().target,
            nodes,
            routers: demand.records().count(),
            layers,
        }
    }

    /// Human-readable form: the nodes (numbered), then per layer the replica counts, the
    /// experts nobody holds, and which nodes hold each expert.
    pub fn render(&self) -> String {
        let mut s = format!("model {}\n", self.model);
        let number: BTreeMap<&str, usize> = self
            .nodes
            .keys()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        for (i, (n, c)) in self.nodes.iter().enumerate() {
            let _ = writeln!(
                s,
                "n{i} {n}: {} slabs, {} bytes used, {} free",
                c.slabs, c.used_bytes, c.free_bytes
            );
        }
        let _ = writeln!(
            s,
            "replica target {}; demand of {} routers",
            self.target, self.routers
        );
        for l in &self.layers {
            let min = l.replicas.iter().min().copied().unwrap_or(0);
            let max = l.replicas.iter().max().copied().unwrap_or(0);
            let below = l.replicas.iter().filter(|&&r| r < self.target).count();
            let hottest = l
                .demand
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .filter(|(_, d)| **d > 0.0)
                .map_or(String::new(), |(e, d)| {
                    format!("; hottest e{e} ({d:.0} rows)")
                });
            let _ = writeln!(
                s,
                "layer {:>3}: replicas min {min} max {max}; {} experts with none{}; {below} below target{hottest}",
                l.layer,
                l.missing.len(),
                if l.missing.is_empty() {
                    String::new()
                } else {
                    format!(" {:?}", l.missing)
                }
            );
            let holders: Vec<String> = l
                .holders
                .iter()
                .enumerate()
                .map(|(e, hs)| {
                    let ns: Vec<String> = hs
                        .iter()
                        .filter_map(|h| number.get(h.as_str()))
                        .map(|i| format!("n{i}"))
                        .collect();
                    format!(
                        "e{e}:{}",
                        if ns.is_empty() {
                            "-".into()
                        } else {
                            ns.join(",")
                        }
                    )
                })
                .collect();
            let _ = writeln!(s, "  {}", holders.join(" "));
        }
        s
    }
}

/// Joins through `bootstrap` with a throwaway identity and builds `model`'s coverage from the
/// records the peers hand over (each verified here).
pub async fn coverage(bootstrap: Vec<Multiaddr>, model: ModelId) -> Result<CoverageReport> {
    if bootstrap.is_empty() {
        bail!("give at least one --bootstrap address");
    }
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    let node = SwarmNode::spawn(
        NodeIdentity::from_seed(seed)?,
        None,
        NodeConfig {
            listen: vec!["/ip4/0.0.0.0/tcp/0".parse()?],
            bootstrap,
            ..NodeConfig::default()
        },
    )
    .await?;
    if let Err(e) = node.wait_joined(JOIN_DEADLINE).await {
        node.shutdown().await;
        return Err(e);
    }
    let records = collect_records(&node, model).await;
    let demand = collect_demand(&node, model).await;
    node.shutdown().await;
    let (records, demand) = (records?, demand?);
    let Some(first) = records.first() else {
        bail!("no peer knows of model {model}");
    };
    let (n_layer, n_expert) = (first.layers.len() as u32, first.n_expert);
    let now = crate::net::records::now_secs();
    let mut map = CoverageMap::new(model, n_layer, n_expert);
    map.merge(records, now);
    let mut book = DemandBook::new(model, n_layer, n_expert);
    for d in demand {
        // Misshapen or stale ones are counted in the book and left out.
        let _ = book.apply(d, now);
    }
    Ok(CoverageReport::of(&map, &book, now))
}
