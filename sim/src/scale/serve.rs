//! Routers serving requests over the simulated swarm.
//!
//! Requests reach each router as a Poisson process. A router steps its sequences together
//! (continuous batching: up to `max_batch`, the rest wait; a new sequence's first step is its
//! whole prompt). In a step, every MoE layer routes each row to its experts ([`routing`]),
//! sends each expert's rows to one of its holders chosen by the market's own replica choice
//! ([`moeswarm_market::replica::choose`]: what the router measured of each, what it has in
//! flight there this layer, relay and failures), and waits for the slowest answer
//! ([`dispatch`]: latency, bytes, the worker's compute and its queue). A holder that has gone
//! (the router still counts it live until its heartbeats are missed) costs the deadline; one
//! that no longer holds the slab refuses at once; either way the experts are asked of another
//! holder, up to `tries` holders, after which the sequences routed there fail, as do those
//! routed to a slab nobody holds. The router counts the rows it sent per slab and publishes the
//! market's demand records ([`moeswarm_node::dataplane::DemandCounter`]), which every node's
//! rounds then weigh.
//!
//! A step is worked out in one event when it begins and takes effect when it ends (the next
//! step's event).
//!
//! [`routing`]: super::routing
//! [`dispatch`]: super::dispatch

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use moeswarm_market::replica::{choose, smooth_latency, ReplicaView};
use moeswarm_market::trust::CheckRecord;
use moeswarm_node::dataplane::DemandCounter;
use moeswarm_protocol::{BlobId, NodeKey};
use rand::Rng;

use super::dispatch::{self, End, Net};
use super::queue::Millis;
use super::report::Failed;
use super::scenario::{Nat, Serving};
use super::world::{bytes_per_ms, Event, World};

/// One router.
pub struct Router {
    pub key: NodeKey,
    pub(super) end: End,
    waiting: VecDeque<Millis>,
    active: Vec<Sequence>,
    /// The step under way: when it ends, which of its sequences failed (and why) and which
    /// got a wrong answer.
    step: Option<(f64, Vec<Option<Failed>>, Vec<bool>)>,
    /// What it knows of each node as a replica, by node index.
    pub(super) seen: Vec<Seen>,
    counter: DemandCounter,
    seq: u64,
    /// Tokens generated, and since the last sample.
    pub tokens: u64,
    pub tokens_since_sample: u64,
}

struct Sequence {
    arrived: Millis,
    /// The prompt is still to be stepped.
    prompt: bool,
    left: u32,
    last_token: f64,
    /// A wrong answer went into it.
    wrong: bool,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Seen {
    latency_ms: Option<f64>,
    at: f64,
    failures: u32,
    /// Its answers' checks at this router.
    pub(super) checks: CheckRecord,
    /// Its place among equals ([`moeswarm_market::replica::tie_break`]).
    tie_break: u64,
}

/// One expert of a layer to be computed: its rows, the sequences they belong to, and where it
/// was tried.
struct Want {
    expert: u32,
    rows: u32,
    seqs: Vec<usize>,
    start: f64,
    tried: Vec<usize>,
}

impl Router {
    /// Router `k` of a run from `seed`, reached as `end`, among the nodes `keys`.
    pub fn new(
        seed: u64,
        k: usize,
        end: End,
        keys: &[NodeKey],
        shape: (u32, u32),
        sv: &Serving,
    ) -> Self {
        let key = NodeKey(BlobId::of(format!("moeswarm sim router {seed} {k}").as_bytes()).0);
        let window = Duration::from_secs(sv.demand_period_secs * 12);
        // Its secret, and each node's place among equals at this router (drawn once: a
        // keyed hash of the node's key, as the node's router draws it).
        let secret = BlobId::of(format!("router secret {seed} {k}").as_bytes()).0;
        let seen = keys
            .iter()
            .map(|key| Seen {
                tie_break: moeswarm_market::replica::tie_break(&secret, key),
                ..Seen::default()
            })
            .collect();
        Self {
            key,
            end,
            waiting: VecDeque::new(),
            active: Vec::new(),
            step: None,
            seen,
            counter: DemandCounter::of_shape(shape.0, shape.1, window),
            seq: 0,
            tokens: 0,
            tokens_since_sample: 0,
        }
    }
}

/// A router's end of the network, drawn for router `k`.
pub fn router_end(sv: &Serving, rng: &mut impl Rng) -> End {
    let [lo, hi] = sv.latency_ms;
    End {
        latency_ms: lo + (hi - lo) * rng.random::<f64>(),
        region: 0,
        up: bytes_per_ms(sv.up_mbps),
        down: bytes_per_ms(sv.down_mbps),
        nat: Nat::None,
    }
}

impl World {
    fn sv(&self) -> &Serving {
        self.sc
            .serving
            .as_ref()
            .expect("serving events need a [serving] section")
    }

    /// The routers' first requests and demand records, from the scenario's start time.
    pub(super) fn start_serving(&mut self) {
        let Some(sv) = self.sc.serving.clone() else {
            return;
        };
        let start = self.secs(sv.start_secs);
        for r in 0..self.routers.len() {
            let first = start + self.arrival_gap(&sv);
            self.queue.at(first, Event::Request(r));
            let publish = start + self.secs(sv.demand_period_secs as f64);
            self.queue.at(publish, Event::PublishDemand(r));
        }
    }

    /// The time to a router's next request (exponential; never when none come).
    fn arrival_gap(&mut self, sv: &Serving) -> Millis {
        if sv.requests_per_min <= 0.0 {
            return Millis::MAX / 2;
        }
        let u: f64 = self.rng.random();
        self.secs(-60.0 / sv.requests_per_min * (1.0 - u).ln())
    }

    /// A request reaches router `r`.
    pub fn request(&mut self, r: usize) {
        let sv = self.sv().clone();
        let now = self.queue.now();
        self.serving.arrived += 1;
        self.routers[r].waiting.push_back(now);
        let gap = self.arrival_gap(&sv);
        self.queue.after(gap, Event::Request(r));
        let rt = &self.routers[r];
        if rt.step.is_none() && rt.active.is_empty() {
            self.step(r);
        }
    }

    /// Router `r` publishes its demand; the nodes get it after the gossip delay.
    pub fn publish_demand(&mut self, r: usize) {
        let sv = self.sv().clone();
        let now = self.now_secs();
        let rt = &mut self.routers[r];
        rt.seq += 1;
        let ttl = Duration::from_secs(sv.demand_ttl_secs);
        if let Some(d) = rt.counter.record_of(self.model, rt.key, rt.seq, now, ttl) {
            let delay = self.gossip_delay();
            self.queue.after(delay, Event::DemandArrives(Box::new(d)));
        }
        let period = self.secs(sv.demand_period_secs as f64);
        self.queue.after(period, Event::PublishDemand(r));
    }

    /// Router `r`'s step: the one under way ends (its tokens out, its failures counted), and
    /// the next begins if there is anything to step.
    pub fn step(&mut self, r: usize) {
        let sv = self.sv().clone();
        if let Some((end, failed, wrong)) = self.routers[r].step.take() {
            self.finish_step(r, end, failed, wrong);
        }
        let now = self.queue.now();
        let rt = &mut self.routers[r];
        while rt.active.len() < sv.max_batch {
            let Some(arrived) = rt.waiting.pop_front() else {
                break;
            };
            rt.active.push(Sequence {
                arrived,
                prompt: true,
                left: sv.output_tokens,
                last_token: 0.0,
                wrong: false,
            });
        }
        if rt.active.is_empty() {
            return;
        }
        let rows: Vec<u32> = rt
            .active
            .iter()
            .map(|s| if s.prompt { sv.prompt_tokens } else { 1 })
            .collect();
        let mut failed = vec![None; rows.len()];
        let mut wrong = vec![false; rows.len()];
        let mut t = now as f64;
        for layer in 0..self.sc.model.layers {
            t = self.layer(r, layer, &rows, (&mut failed, &mut wrong), t, &sv);
        }
        self.routers[r].step = Some((t, failed, wrong));
        self.queue.at(t.ceil() as Millis, Event::Step(r));
    }

    /// A step of router `r` that ended at `end`: tokens to its sequences, failures counted.
    fn finish_step(&mut self, r: usize, end: f64, failed: Vec<Option<Failed>>, wrong: Vec<bool>) {
        let stats = &mut self.serving;
        let rt = &mut self.routers[r];
        let mut k = 0;
        rt.active.retain_mut(|s| {
            let why = failed.get(k).copied().flatten();
            s.wrong |= wrong.get(k).copied().unwrap_or(false);
            k += 1;
            if let Some(why) = why {
                stats.failed(why);
                return false;
            }
            if s.prompt {
                s.prompt = false;
                stats.first_token_ms.push((end - s.arrived as f64) as f32);
            } else {
                stats.token_ms.push((end - s.last_token) as f32);
            }
            s.last_token = end;
            s.left -= 1;
            stats.tokens += 1;
            rt.tokens += 1;
            rt.tokens_since_sample += 1;
            if s.left == 0 {
                stats.completed += 1;
                if s.wrong {
                    stats.completed_wrong += 1;
                }
            }
            s.left > 0
        });
    }

    /// One MoE layer of router `r`'s step beginning at `t` (ms): routes `rows` of each
    /// sequence (those not `failed`), dispatches them and returns when the last answer is in.
    fn layer(
        &mut self,
        r: usize,
        layer: u32,
        rows: &[u32],
        (failed, wrong): (&mut [Option<Failed>], &mut [bool]),
        t: f64,
        sv: &Serving,
    ) -> f64 {
        let Some(routing) = self.routing.as_ref() else {
            return t;
        };
        let live_rows: u32 = (0..rows.len())
            .filter(|&s| failed[s].is_none())
            .map(|s| rows[s])
            .sum();
        let start = t + sv.trunk_ms + sv.trunk_row_ms * live_rows as f64;
        let mut by_expert: BTreeMap<u32, (u32, Vec<usize>)> = BTreeMap::new();
        let mut picked = Vec::new();
        for (s, &n) in rows.iter().enumerate() {
            if failed[s].is_some() {
                continue;
            }
            for _ in 0..n {
                picked.clear();
                routing.pick(
                    layer as usize,
                    sv.experts_per_token,
                    &mut self.rng,
                    &mut picked,
                );
                for &e in &picked {
                    let w = by_expert.entry(e).or_default();
                    w.0 += 1;
                    if w.1.last() != Some(&s) {
                        w.1.push(s);
                    }
                }
            }
        }
        let now = self.now_secs();
        let mut todo: Vec<Want> = by_expert
            .into_iter()
            .map(|(expert, (n, seqs))| {
                self.routers[r].counter.add(layer, expert, n as u64, now);
                Want {
                    expert,
                    rows: n,
                    seqs,
                    start,
                    tried: Vec::new(),
                }
            })
            .collect();
        let mut end = start;
        while !todo.is_empty() {
            todo = self.dispatch_wave(r, layer, todo, (&mut *failed, &mut *wrong), &mut end, sv);
        }
        end
    }

    /// Sends each of `todo` to a holder, grouped by holder; what failed comes back to be
    /// asked elsewhere. `end` grows to the last answer.
    fn dispatch_wave(
        &mut self,
        r: usize,
        layer: u32,
        todo: Vec<Want>,
        (failed, wrong): (&mut [Option<Failed>], &mut [bool]),
        end: &mut f64,
        sv: &Serving,
    ) -> Vec<Want> {
        let experts = self.sc.model.experts;
        let mut in_flight: BTreeMap<usize, u32> = BTreeMap::new();
        let mut by_worker: BTreeMap<usize, Vec<Want>> = BTreeMap::new();
        for w in todo {
            let slab = (layer * experts + w.expert) as usize;
            match self.choose(r, slab, &w.tried, &in_flight) {
                Some(j) => {
                    *in_flight.entry(j).or_default() += 1;
                    by_worker.entry(j).or_default().push(w);
                }
                None => {
                    let why = if w.tried.is_empty() {
                        Failed::NoHolder
                    } else {
                        Failed::Dispatch
                    };
                    for &s in &w.seqs {
                        failed[s].get_or_insert(why);
                    }
                    *end = end.max(w.start);
                }
            }
        }
        let mut again = Vec::new();
        for (j, mut ws) in by_worker {
            let start = ws.iter().map(|w| w.start).fold(0.0, f64::max);
            let slabs: Vec<u32> = ws.iter().map(|w| layer * experts + w.expert).collect();
            let each: Vec<u32> = ws.iter().map(|w| w.rows).collect();
            let rows: u32 = each.iter().sum();
            self.serving.dispatches += 1;
            // A caught answer is not used: its experts go elsewhere, as a failed dispatch's.
            let outcome = self
                .dispatch(r, j, &slabs, rows, start, sv)
                .and_then(|done| {
                    let judged = self.judge(r, j, (&slabs, &each), (start, done), sv);
                    if judged.used {
                        Ok((judged.at, judged.wrong))
                    } else {
                        Err(judged.at)
                    }
                });
            match outcome {
                Ok((done, lie)) => {
                    *end = end.max(done);
                    if lie {
                        for s in ws.iter().flat_map(|w| &w.seqs) {
                            wrong[*s] = true;
                        }
                    }
                }
                Err(at) => {
                    for mut w in ws.drain(..) {
                        w.tried.push(j);
                        w.start = at;
                        if w.tried.len() as u32 >= sv.tries {
                            for &s in &w.seqs {
                                failed[s].get_or_insert(Failed::Dispatch);
                            }
                            *end = end.max(at);
                        } else {
                            again.push(w);
                        }
                    }
                }
            }
        }
        again
    }

    /// The holder of `slab` router `r` sends to, by the market's replica choice over the
    /// holders it counts live (`tried` excluded; `in_flight` its dispatches this layer).
    pub(super) fn choose(
        &self,
        r: usize,
        slab: usize,
        tried: &[usize],
        in_flight: &BTreeMap<usize, u32>,
    ) -> Option<usize> {
        let rt = &self.routers[r];
        let now = self.queue.now() as f64;
        let policy = super::checks::policy(self.sv());
        let holders = self.view.holders(slab);
        let views: Vec<ReplicaView> = holders
            .iter()
            .map(|&j| {
                let j = j as usize;
                let seen = &rt.seen[j];
                ReplicaView {
                    node: self.nodes[j].key,
                    direct: !dispatch::via_relay(self.nodes[j].nat),
                    latency_ms: seen.latency_ms,
                    latency_age_ms: (now - seen.at).max(0.0) as u64,
                    in_flight: in_flight.get(&j).copied().unwrap_or(0),
                    failures: seen.failures,
                    excluded: tried.contains(&j) || seen.checks.quarantined(now as u64),
                    proven: seen.checks.proven(&policy),
                    tie_break: seen.tie_break,
                }
            })
            .collect();
        choose(&views).map(|k| holders[k] as usize)
    }

    /// Router `r` sends `slabs` (`rows` rows in all) to node `j` at `start`: when the answer
    /// is in, or (`Err`) when the router gives up on it: the deadline for a holder gone or too
    /// slow, a round trip for one that no longer holds a slab (each counted by why). What the
    /// router learns is noted.
    pub(super) fn dispatch(
        &mut self,
        r: usize,
        j: usize,
        slabs: &[u32],
        rows: u32,
        start: f64,
        sv: &Serving,
    ) -> Result<f64, f64> {
        let net = Net {
            relay_ms: self.sc.network.relay_ms,
            relay_rate: bytes_per_ms(self.sc.network.relay_mbps),
            inter_region_ms: self.sc.network.inter_region_ms,
        };
        let router = self.routers[r].end;
        let node = &mut self.nodes[j];
        node.first_dispatch_ms.get_or_insert(start);
        let node = &self.nodes[j];
        let worker = node.end();
        let rtt = dispatch::round_trip(&net, &router, &worker);
        let outcome = if !node.online || node.cut {
            self.serving.gone += 1;
            Err(start + sv.deadline_ms)
        } else if slabs.iter().any(|s| !node.held.contains_key(s)) {
            self.serving.not_held += 1;
            Err(start + rtt)
        } else {
            let relay = dispatch::via_relay(worker.nat);
            let bytes = dispatch::row_bytes(rows, self.sc.model.hidden);
            let there = dispatch::carry(&net, bytes, &router, &worker, relay);
            let back = dispatch::carry(&net, bytes, &worker, &router, relay);
            let ready = start + rtt / 2.0 + there;
            let work = dispatch::compute_ms(&node.compute, slabs.len() as u32, rows) * node.slow;
            let now = self.queue.now() as f64;
            let began = self.nodes[j].calendar.book(now, ready, work);
            let done = began + work + rtt / 2.0 + back;
            if done - start > sv.deadline_ms {
                self.serving.late += 1;
                Err(start + sv.deadline_ms)
            } else {
                Ok(done)
            }
        };
        let seen = &mut self.routers[r].seen[j];
        match outcome {
            Ok(done) => {
                seen.latency_ms = Some(smooth_latency(seen.latency_ms, done - start));
                seen.at = done;
                seen.failures = 0;
            }
            Err(_) => seen.failures = seen.failures.saturating_add(1),
        }
        outcome
    }
}
