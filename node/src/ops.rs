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

/// Every layer's replica counts and demand, and every node's holdings, as `moeswarm coverage`
/// prints them: counts per slab, never a list of holders per slab (thousands of made-up
/// records would make that millions of names); those are asked for one slab at a time, a
/// page at a time ([`HoldersPage`]).
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

    /// Human-readable form: the nodes (numbered), then per layer the replica counts and the
    /// experts nobody holds (who holds an expert: [`HoldersPage`]).
    pub fn render(&self) -> String {
        let mut s = format!("model {}\n", self.model);
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
        }
        s
    }
}

/// Holders shown in one page of [`HoldersPage`].
pub const HOLDERS_PER_PAGE: usize = 64;

/// One page of the holders of one slab (PeerIds, in order).
#[derive(Debug, Clone, Serialize)]
pub struct HoldersPage {
    /// The model.
    pub model: ModelId,
    /// Layer index.
    pub layer: u32,
    /// Expert index.
    pub expert: u32,
    /// Holders in all.
    pub total: usize,
    /// This page (from 0), of [`HOLDERS_PER_PAGE`] each.
    pub page: usize,
    /// The holders on it.
    pub holders: Vec<String>,
}

impl HoldersPage {
    /// Page `page` of the holders of `(layer, expert)` in `map`.
    pub fn of(map: &CoverageMap, layer: u32, expert: u32, page: usize) -> Self {
        let mut all: Vec<String> = map
            .holders(layer, expert)
            .iter()
            .map(|k| peer_id_of(k).map_or_else(|| "?".into(), |p: PeerId| p.to_string()))
            .collect();
        all.sort();
        let total = all.len();
        let holders = all
            .into_iter()
            .skip(page.saturating_mul(HOLDERS_PER_PAGE))
            .take(HOLDERS_PER_PAGE)
            .collect();
        Self {
            model: map.model(),
            layer,
            expert,
            total,
            page,
            holders,
        }
    }

    /// Human-readable form: one holder a line, after a line saying which of how many.
    pub fn render(&self) -> String {
        let first = self.page * HOLDERS_PER_PAGE;
        let mut s = format!(
            "layer {} expert {} of {}: {} holders{}\n",
            self.layer,
            self.expert,
            self.model,
            self.total,
            if self.total > HOLDERS_PER_PAGE {
                format!(
                    "; {}–{} shown (page {})",
                    (first + 1).min(self.total),
                    first + self.holders.len(),
                    self.page
                )
            } else {
                String::new()
            }
        );
        for h in &self.holders {
            let _ = writeln!(s, "{h}");
        }
        s
    }
}

/// Joins through `bootstrap` with a throwaway identity and builds `model`'s coverage from the
/// records the peers hand over (each verified here).
pub async fn coverage(bootstrap: Vec<Multiaddr>, model: ModelId) -> Result<CoverageReport> {
    let (map, book, now) = coverage_map(bootstrap, model).await?;
    Ok(CoverageReport::of(&map, &book, now))
}

/// Page `page` of the holders of `(layer, expert)` of `model`, as [`coverage`] gathers them.
pub async fn holders(
    bootstrap: Vec<Multiaddr>,
    model: ModelId,
    (layer, expert): (u32, u32),
    page: usize,
) -> Result<HoldersPage> {
    let (map, _, _) = coverage_map(bootstrap, model).await?;
    let shape = map.replicas();
    if shape
        .get(layer as usize)
        .is_none_or(|l| expert as usize >= l.len())
    {
        bail!(
            "model {model} has no expert {expert} in layer {layer} ({} layers of {} experts)",
            shape.len(),
            shape.first().map_or(0, Vec::len)
        );
    }
    Ok(HoldersPage::of(&map, layer, expert, page))
}

/// `model`'s coverage map and demand as the peers reached through `bootstrap` hand them over,
/// and the time they were merged at.
pub async fn coverage_map(
    bootstrap: Vec<Multiaddr>,
    model: ModelId,
) -> Result<(CoverageMap, DemandBook, u64)> {
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
    Ok((map, book, now))
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeswarm_protocol::holdings::LayerBits;
    use moeswarm_protocol::{BlobId, Holdings};

    #[test]
    fn holders_come_a_page_at_a_time_and_the_report_counts_without_naming_them() {
        let model = ModelId(BlobId::of(b"m"));
        let records: Vec<Holdings> = (0..150u16)
            .map(|i| {
                let mut seed = [9u8; 32];
                seed[..2].copy_from_slice(&i.to_le_bytes());
                let id = NodeIdentity::from_seed(seed).unwrap();
                let mut layers = vec![LayerBits::empty(4); 2];
                layers[1].set(3);
                Holdings {
                    model,
                    node: id.key,
                    n_expert: 4,
                    layers,
                    used_bytes: 0,
                    free_bytes: 0,
                    addrs: vec![],
                    reach: Reach::Direct,
                    seq: 1,
                    expires_at: u64::MAX,
                }
            })
            .collect();
        let mut map = CoverageMap::new(model, 2, 4);
        map.merge(records, 1);
        let pages: Vec<HoldersPage> = (0..4).map(|p| HoldersPage::of(&map, 1, 3, p)).collect();
        let sizes: Vec<usize> = pages.iter().map(|p| p.holders.len()).collect();
        assert_eq!(sizes, vec![64, 64, 22, 0]);
        assert!(pages.iter().all(|p| p.total == 150));
        let mut all: Vec<&String> = pages.iter().flat_map(|p| &p.holders).collect();
        all.dedup();
        assert_eq!(all.len(), 150, "every holder once, in order");
        assert!(pages[0]
            .render()
            .contains("150 holders; 1–64 shown (page 0)"));
        let report = CoverageReport::of(&map, &DemandBook::new(model, 2, 4), 1);
        assert_eq!(report.layers[1].replicas, vec![0, 0, 0, 150]);
        let json = serde_json::to_string(&report).unwrap();
        // Each node named once (with its holdings), never once per slab it holds.
        assert!(json.len() < 150 * 150, "{} bytes", json.len());
        assert_eq!(json.matches(&pages[0].holders[0]).count(), 1);
    }
}
