//! Which replica computes each group of a layer, and how the groups travel: the health the
//! router has measured of each worker, the market's choice over it, and the dispatches that
//! result (one per worker, split where a long prompt would pass half the payload limit).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use moeswarm_engine::executor::ExpertRequest;
use moeswarm_market::replica::{choose, smooth_latency, tie_break, ReplicaView};
use moeswarm_market::trust::{CheckPolicy, CheckRecord};
use moeswarm_protocol::dispatch::MAX_PAYLOAD_BYTES;
use moeswarm_protocol::{NodeKey, WireType};
use moeswarm_relay::PeerId;

use super::replicas::{Replica, ReplicaTable, Route};

/// How hard the router tries before computing a group itself.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Rounds of sending (the first and the retries, each to replicas not yet tried).
    pub rounds: usize,
    /// How long one dispatch may take.
    pub deadline: Duration,
}

/// What the router knows of one worker.
#[derive(Debug, Clone, Default)]
struct Health {
    latency_ms: Option<f64>,
    /// When the latency was last measured (ms since the table started).
    measured_ms: u64,
    in_flight: u32,
    failures: u32,
    checks: CheckRecord,
    /// Until when (ms since the table started) it is taken for gone: no stream, no answer.
    down_until_ms: u64,
}

/// How long a worker that could not be reached or did not answer at all is passed over while
/// another replica can serve (dispatches and second opinions alike): longer than it takes a
/// dead holder to leave the coverage (its heartbeats' window and the router's refresh).
pub const DOWN_FOR: Duration = Duration::from_secs(45);

/// What the router knows of every worker it sent to: speed, failures, and its check record;
/// and the router's secret that orders equals among them ([`tie_break`]).
pub struct HealthTable {
    peers: Mutex<HashMap<PeerId, Health>>,
    /// How answers are checked.
    policy: Mutex<CheckPolicy>,
    secret: [u8; 32],
    start: Instant,
}

impl Default for HealthTable {
    fn default() -> Self {
        Self::new(CheckPolicy::default())
    }
}

impl HealthTable {
    /// An empty table checking answers by `policy`.
    pub fn new(policy: CheckPolicy) -> Self {
        let mut secret = [0u8; 32];
        rand::fill(&mut secret);
        Self {
            peers: Mutex::default(),
            policy: Mutex::new(policy),
            secret,
            start: Instant::now(),
        }
    }

    /// How answers are checked.
    pub fn policy(&self) -> CheckPolicy {
        *self.policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks answers by `policy` from now on, every worker starting afresh (on probation).
    pub fn reset(&self, policy: CheckPolicy) {
        *self.policy.lock().unwrap_or_else(|p| p.into_inner()) = policy;
        if let Ok(mut h) = self.peers.lock() {
            h.clear();
        }
    }

    /// `node`'s place among equals at this router.
    pub fn tie_break(&self, node: &NodeKey) -> u64 {
        tie_break(&self.secret, node)
    }

    /// Where replica `r` stands at this router, best first: not quarantined, proven,
    /// measured (faster first), fewer failures, then the router's secret order. What the
    /// replica table keeps the best [`super::replicas::MAX_REPLICAS`] of.
    pub fn rank(&self, r: &Replica) -> (bool, bool, u64, u32, u64) {
        let (h, now) = (self.of(&r.peer), self.now_ms());
        let unmeasured = u64::MAX;
        let latency_us = h
            .latency_ms
            .map_or(unmeasured, |l| (l.max(0.0) * 1e3) as u64);
        (
            h.checks.quarantined(now),
            !h.checks.proven(&self.policy()),
            latency_us,
            h.failures,
            self.tie_break(&r.key),
        )
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The fraction of `peer`'s answers to check.
    pub fn check_rate(&self, peer: &PeerId) -> f64 {
        self.of(peer).checks.check_rate(&self.policy())
    }

    /// `peer`'s answer passed a check.
    pub fn check_passed(&self, peer: PeerId) {
        self.update(peer, |h| h.checks.pass());
    }

    /// `peer`'s answer failed a check: it is quarantined.
    pub fn check_failed(&self, peer: PeerId) {
        let (policy, now) = (self.policy(), self.now_ms());
        self.update(peer, |h| h.checks.fail(&policy, now));
    }

    fn of(&self, peer: &PeerId) -> Health {
        self.peers
            .lock()
            .ok()
            .and_then(|h| h.get(peer).cloned())
            .unwrap_or_default()
    }

    fn update(&self, peer: PeerId, f: impl FnOnce(&mut Health)) {
        if let Ok(mut h) = self.peers.lock() {
            f(h.entry(peer).or_default());
        }
    }

    /// A dispatch to `peer` is on its way.
    pub fn started(&self, peer: PeerId) {
        self.update(peer, |h| h.in_flight += 1);
    }

    /// A dispatch to `peer` ended: answered after a round trip, or failed (and how).
    pub fn finished(&self, peer: PeerId, outcome: Result<Duration, super::DropReason>) {
        let now = self.now_ms();
        self.update(peer, |h| {
            h.in_flight = h.in_flight.saturating_sub(1);
            match outcome {
                Ok(rt) => {
                    h.latency_ms = Some(smooth_latency(h.latency_ms, rt.as_secs_f64() * 1e3));
                    h.measured_ms = now;
                    h.failures = h.failures.saturating_sub(1);
                    h.down_until_ms = 0;
                }
                // Unreachable or silent: taken for gone for a while, at once.
                Err(super::DropReason::Failed) => {
                    h.failures += 1;
                    h.down_until_ms = now + DOWN_FOR.as_millis() as u64;
                }
                // Busy, refused or a bad answer: alive, but counted against its choice.
                Err(_) => h.failures += 1,
            }
        });
    }
}

/// One dispatch to send: to whom, how, and which of the layer's groups it carries.
pub struct Outbound {
    /// The worker.
    pub peer: PeerId,
    /// Directly or through a relay.
    pub route: Route,
    /// Indices into the request's dispatch plan.
    pub groups: Vec<usize>,
}

/// Picks a replica for each group still `wanted`, never one in its `excluded` set nor a
/// quarantined one; groups bound for one worker share a dispatch. Groups with no replica left
/// are not sent.
pub fn assign(
    table: &ReplicaTable,
    health: &HealthTable,
    req: &ExpertRequest<'_>,
    wire: WireType,
    wanted: &[bool],
    excluded: &[HashSet<PeerId>],
) -> Vec<Outbound> {
    let mut planned: HashMap<PeerId, u32> = HashMap::new();
    let mut by_peer: BTreeMap<PeerId, Outbound> = BTreeMap::new();
    let now = health.now_ms();
    let policy = health.policy();
    for (i, g) in req.plan.groups.iter().enumerate() {
        if !wanted[i] {
            continue;
        }
        let replicas = table.replicas(req.layer, g.expert);
        let mut down = Vec::with_capacity(replicas.len());
        let mut views: Vec<ReplicaView> = replicas
            .iter()
            .map(|r| {
                let h = health.of(&r.peer);
                down.push(h.down_until_ms > now);
                ReplicaView {
                    node: r.key,
                    direct: matches!(r.route, Route::Direct(_)),
                    latency_ms: h.latency_ms,
                    latency_age_ms: now.saturating_sub(h.measured_ms),
                    in_flight: h.in_flight + planned.get(&r.peer).copied().unwrap_or(0),
                    failures: h.failures,
                    excluded: excluded[i].contains(&r.peer) || h.checks.quarantined(now),
                    proven: h.checks.proven(&policy),
                    tie_break: health.tie_break(&r.key),
                }
            })
            .collect();
        // A replica taken for gone is passed over while another can serve.
        if views.iter().zip(&down).any(|(v, d)| !v.excluded && !d) {
            for (v, d) in views.iter_mut().zip(&down) {
                v.excluded |= d;
            }
        }
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
    let row_bytes = req.n_embd as u64 * wire.size();
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
