//! What the dashboard shows, as plain data: built from the coverage reports, the links this
//! node has, and the router's dispatch and batch counts. Pure: no I/O, tested directly.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::Serialize;

use crate::api::LatencySummary;
use crate::dataplane::DispatchSummary;
use crate::ops::CoverageReport;

/// Everything `GET /api/dashboard` answers.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// This node's PeerId, when it is a swarm node.
    pub node: Option<String>,
    /// When this was made, in milliseconds since the Unix epoch.
    pub updated_unix_ms: u64,
    /// One line: every slab covered to target, or what is missing.
    pub health: String,
    /// Every model this node knows of, with its coverage.
    pub models: Vec<ModelView>,
    /// Every node with a live record for any of them.
    pub peers: Vec<PeerView>,
    /// What the router's API does, when this node serves one.
    pub throughput: Option<Throughput>,
}

/// One model's coverage: `moeswarm coverage --json`'s report, and its counts in brief.
#[derive(Debug, Clone, Serialize)]
pub struct ModelView {
    /// The report, exactly as `moeswarm coverage --json` gives it.
    #[serde(flatten)]
    pub report: CoverageReport,
    /// Slabs in the model (layers × experts).
    pub slabs: usize,
    /// Slabs with at least one replica.
    pub covered: usize,
    /// Slabs with at least `target` replicas.
    pub at_target: usize,
    /// The model's health line.
    pub health: String,
}

/// One node, over every model it holds slabs of.
#[derive(Debug, Clone, Serialize)]
pub struct PeerView {
    /// Its PeerId.
    pub id: String,
    /// This node itself.
    pub is_self: bool,
    /// This node has a libp2p connection to it now (always true of itself).
    pub connected: bool,
    /// The relay it is reached through, or `None` when reached directly (as its record says).
    pub relay: Option<String>,
    /// How this router reaches it now, and why (a worker behind a relay may be hole punched).
    pub path: Option<String>,
    /// Slabs held, over every model.
    pub slabs: usize,
    /// Bytes held (as its latest record says).
    pub used_bytes: u64,
    /// Bytes it would still take.
    pub free_bytes: u64,
    /// Dispatch round trips to it from this router, in milliseconds: median.
    pub latency_p50_ms: Option<f64>,
    /// The same, 99th percentile.
    pub latency_p99_ms: Option<f64>,
    /// Its answers this router checked and found right.
    pub checks_passed: u64,
    /// Its answers this router checked and found wrong.
    pub checks_failed: u64,
    /// Caught answering wrong, and so quarantined by this router.
    pub quarantined: bool,
}

/// The API's and the data plane's numbers (the same as `/metrics`).
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// The model's name in the API.
    pub model: String,
    /// Tokens generated so far.
    pub tokens_generated: u64,
    /// Tokens per second over the last seconds.
    pub tokens_per_second: f64,
    /// Sequences in the running batch.
    pub sequences_active: u64,
    /// Requests waiting to join it.
    pub sequences_queued: u64,
    /// Time to first token.
    pub time_to_first_token: LatencySummary,
    /// Dispatches sent to workers.
    pub dispatches_sent: u64,
    /// Dispatch answers re-computed and compared.
    pub dispatches_checked: u64,
    /// Workers quarantined.
    pub workers_quarantined: usize,
}

impl ModelView {
    /// The view of `report`.
    pub fn of(report: CoverageReport) -> Self {
        let counts = || {
            report
                .layers
                .iter()
                .flat_map(|l| l.replicas.iter().copied())
        };
        let slabs = counts().count();
        let covered = counts().filter(|&r| r > 0).count();
        let at_target = counts().filter(|&r| r >= report.target).count();
        let health = model_health(&report, slabs, covered, at_target);
        Self {
            report,
            slabs,
            covered,
            at_target,
            health,
        }
    }
}

/// `12288` → `12,288`.
fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn model_health(r: &CoverageReport, slabs: usize, covered: usize, at_target: usize) -> String {
    let target = r.target;
    if slabs == 0 {
        return "no slabs known".into();
    }
    if at_target == slabs {
        return format!("all {} slabs covered ≥ {target}×", grouped(slabs));
    }
    let mut s = String::new();
    let missing = slabs - covered;
    if missing > 0 {
        let first = r
            .layers
            .iter()
            .find_map(|l| l.missing.first().map(|e| (l.layer, *e)));
        let _ = write!(
            s,
            "{} of {} slabs have no replica",
            grouped(missing),
            grouped(slabs)
        );
        if let Some((l, e)) = first {
            let _ = write!(s, " (first: layer {l} expert {e})");
        }
    }
    let below = covered - at_target;
    if below > 0 {
        if !s.is_empty() {
            s += "; ";
        }
        let _ = write!(
            s,
            "{} of {} slabs below {target}×",
            grouped(below),
            grouped(slabs)
        );
    }
    s
}

/// The health line of every model together.
fn health(models: &[ModelView]) -> String {
    match models {
        [] => "no model known yet".into(),
        [one] => one.health.clone(),
        many => many
            .iter()
            .map(|m| format!("{}: {}", short(&m.report.model.to_string()), m.health))
            .collect::<Vec<_>>()
            .join(" · "),
    }
}

/// The first 12 characters of an id.
fn short(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

/// What goes into a [`Snapshot`] besides the coverage reports.
#[derive(Debug, Clone, Default)]
pub struct Links {
    /// This node's PeerId.
    pub node: Option<String>,
    /// The PeerIds this node is connected to.
    pub connected: BTreeSet<String>,
}

impl Snapshot {
    /// The snapshot of `reports`, with what this node knows of each peer from `links` and
    /// (as a router) `dispatch`.
    pub fn build(
        reports: Vec<CoverageReport>,
        links: &Links,
        dispatch: Option<&DispatchSummary>,
        throughput: Option<Throughput>,
        updated_unix_ms: u64,
    ) -> Self {
        let models: Vec<ModelView> = reports.into_iter().map(ModelView::of).collect();
        let mut peers: BTreeMap<String, PeerView> = BTreeMap::new();
        for m in &models {
            for (id, n) in &m.report.nodes {
                let p = peers.entry(id.clone()).or_insert_with(|| PeerView {
                    id: id.clone(),
                    is_self: links.node.as_deref() == Some(id.as_str()),
                    connected: links.node.as_deref() == Some(id.as_str())
                        || links.connected.contains(id),
                    relay: None,
                    path: None,
                    slabs: 0,
                    used_bytes: 0,
                    free_bytes: 0,
                    latency_p50_ms: None,
                    latency_p99_ms: None,
                    checks_passed: 0,
                    checks_failed: 0,
                    quarantined: false,
                });
                p.slabs += n.slabs;
                // Every model's record says the node's bytes over all models.
                p.used_bytes = p.used_bytes.max(n.used_bytes);
                p.free_bytes = p.free_bytes.max(n.free_bytes);
                if p.relay.is_none() {
                    p.relay.clone_from(&n.relay);
                }
            }
        }
        if let Some(d) = dispatch {
            for p in peers.values_mut() {
                if let Some(q) = d.worker_latency_ms.get(&p.id) {
                    p.latency_p50_ms = Some(q[0]);
                    p.latency_p99_ms = Some(q[2]);
                }
                if let Some([passed, failed]) = d.worker_checks.get(&p.id) {
                    p.checks_passed = *passed;
                    p.checks_failed = *failed;
                }
                p.quarantined = d.quarantined.contains_key(&p.id);
                p.path = d.worker_paths.get(&p.id).cloned();
            }
        }
        Self {
            node: links.node.clone(),
            updated_unix_ms,
            health: health(&models),
            models,
            peers: peers.into_values().collect(),
            throughput,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{LayerCoverage, NodeCoverage};
    use moeswarm_protocol::ModelId;

    fn report(replicas: Vec<Vec<usize>>) -> CoverageReport {
        let mut nodes = BTreeMap::new();
        nodes.insert(
            "a".to_string(),
            NodeCoverage {
                slabs: 3,
                used_bytes: 30,
                free_bytes: 5,
                relay: None,
            },
        );
        nodes.insert(
            "b".to_string(),
            NodeCoverage {
                slabs: 2,
                used_bytes: 20,
                free_bytes: 9,
                relay: Some("r".into()),
            },
        );
        CoverageReport {
            model: ModelId::of_manifest_bytes(b"a model"),
            target: 2,
            nodes,
            routers: 0,
            layers: replicas
                .into_iter()
                .enumerate()
                .map(|(l, r)| LayerCoverage {
                    layer: l as u32,
                    missing: (0..r.len() as u32)
                        .filter(|&e| r[e as usize] == 0)
                        .collect(),
                    demand: vec![0.0; r.len()],
                    replicas: r,
                })
                .collect(),
        }
    }

    #[test]
    fn a_fully_covered_model_says_so_with_its_slab_count() {
        let r = report(vec![vec![2; 256]; 48]);
        let m = ModelView::of(r);
        assert_eq!((m.slabs, m.covered, m.at_target), (12_288, 12_288, 12_288));
        assert_eq!(m.health, "all 12,288 slabs covered ≥ 2×");
    }

    #[test]
    fn missing_and_thin_slabs_are_counted_and_the_first_missing_named() {
        let r = report(vec![vec![2, 1, 3], vec![0, 2, 0]]);
        let m = ModelView::of(r);
        assert_eq!((m.slabs, m.covered, m.at_target), (6, 4, 3));
        assert_eq!(
            m.health,
            "2 of 6 slabs have no replica (first: layer 1 expert 0); 1 of 6 slabs below 2×"
        );
    }

    #[test]
    fn peers_carry_links_paths_dispatch_times_checks_and_quarantine() {
        let links = Links {
            node: Some("a".into()),
            connected: ["b".to_string()].into(),
        };
        let mut d = DispatchSummary::default();
        d.worker_latency_ms.insert("b".into(), [1.5, 2.0, 9.0]);
        d.worker_checks.insert("b".into(), [7, 1]);
        d.quarantined.insert("b".into(), 1);
        let punched = "direct 10.0.0.2:5 (hole punched, introduced by relay r)";
        d.worker_paths.insert("b".into(), punched.into());
        let s = Snapshot::build(vec![report(vec![vec![1, 2]])], &links, Some(&d), None, 5);
        assert_eq!(s.peers.len(), 2);
        let (a, b) = (&s.peers[0], &s.peers[1]);
        assert!(a.is_self && a.connected && a.relay.is_none() && !a.quarantined);
        assert_eq!((a.slabs, a.used_bytes, a.free_bytes), (3, 30, 5));
        assert!(!b.is_self && b.connected);
        assert_eq!(b.relay.as_deref(), Some("r"));
        assert_eq!(
            (a.path.as_deref(), b.path.as_deref()),
            (None, Some(punched))
        );
        assert_eq!((b.latency_p50_ms, b.latency_p99_ms), (Some(1.5), Some(9.0)));
        assert_eq!(
            (b.checks_passed, b.checks_failed, b.quarantined),
            (7, 1, true)
        );
        assert_eq!(s.health, "1 of 2 slabs below 2×");
    }

    #[test]
    fn no_model_and_many_models_have_their_own_health_lines() {
        let s = Snapshot::build(Vec::new(), &Links::default(), None, None, 0);
        assert_eq!(s.health, "no model known yet");
        let two = vec![report(vec![vec![2]]), report(vec![vec![0]])];
        let s = Snapshot::build(two, &Links::default(), None, None, 0);
        assert_eq!(s.health.matches(" · ").count(), 1);
        assert!(s.health.contains("all 1 slabs covered ≥ 2×"));
        assert!(s.health.contains("1 of 1 slabs have no replica"));
    }
}
