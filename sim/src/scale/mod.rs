//! The scale simulator: thousands of nodes joining, fetching and leaving, as a deterministic
//! discrete-event simulation over the real market code.
//!
//! One seed gives one history: every draw comes from one ChaCha stream in the order events are
//! processed, and events come from one queue ([`queue`]: a binary heap of (time, sequence,
//! event); no async, no threads, no clock). Nodes are plain structs ([`world`]); what they know
//! of each other is the market's own coverage map fed by the protocol's holdings records
//! ([`view`]), and each round they decide with the market's own
//! [`views`](moeswarm_market::choice::views) and [`decide`](moeswarm_market::choice::decide),
//! or, where it tells the same decision without a look at every slab, with `quick` (slabs
//! sorted by their count of holders; proven equal to `decide` by its tests).
//! Signatures are left out: a record here is never forged, so checking one would change no
//! decision. What the run measured comes back as a [`report::ScaleReport`].
//!
//! What it models: node classes (capacity, link rates, NAT, session and offline times, crash or
//! clean leave) from a [`scenario::Scenario`]; the model's real shape; transfers at the slower
//! end's rate, one at a time per link, through a relay (capped) where neither end can be
//! reached; records that reach everyone after a gossip delay and expire; heartbeats by their
//! effect (a crashed node is counted dead a fixed time after its last one); routers serving
//! requests ([`serve`]: skewed routing per layer ([`routing`]), the market's replica choice,
//! each layer waiting for its slowest holder ([`dispatch`]: latency, regions, relays, links,
//! the holder's compute and queue), failures and retries) and publishing the demand the
//! nodes' rounds weigh. What it does not (yet): who hears a record first (one delay for all),
//! links shared fairly between concurrent transfers (they queue instead), dispatch bytes on
//! the links that fetches use.
//!
//! [`fixed`] tells a given swarm (keys, budgets, joins one by one, one seeder) to compare the
//! simulator with real nodes started by [`crate::local`].
//!
//! It is not the node and does no I/O; `moeswarm sim --scale N` runs it.

mod checks;
pub mod dispatch;
mod faults;
pub mod fixed;
pub mod node;
pub mod queue;
mod quick;
pub mod report;
mod round;
pub mod routing;
pub mod scenario;
pub mod serve;
pub mod view;
pub mod world;

use queue::Millis;
use report::{
    CheckSummary, ClassSummary, Percentiles, Sample, ScaleReport, ServingReport, ServingSample,
};
use scenario::Scenario;
use world::{Event, World};

/// How often records are swept for expiry, ms.
pub(crate) const EXPIRY_SWEEP_MS: u64 = 60_000;

/// Runs `scenario` with `nodes` market nodes for `hours` simulated hours from `seed`.
pub fn run(scenario: &Scenario, nodes: usize, hours: f64, seed: u64) -> ScaleReport {
    run_until(scenario, nodes, hours, seed, false)
}

/// As [`run`], stopping early (when `stop_when_full`) once every slab is at target.
pub fn run_until(
    scenario: &Scenario,
    nodes: usize,
    hours: f64,
    seed: u64,
    stop_when_full: bool,
) -> ScaleReport {
    let mut w = World::new(scenario.clone(), nodes, seed);
    let horizon = (hours.max(0.0) * 3600.0 * 1000.0) as u64;
    // Samples: every minute, or 240 in all for long runs.
    let sample_every = (horizon / 240).max(60_000);
    let slabs = scenario.slabs();
    w.start_seeders(nodes);
    let spread = scenario.market.join_spread_secs;
    for i in 0..nodes {
        let at = (spread * 1000.0 * rand::Rng::random::<f64>(&mut w.rng)) as u64;
        w.queue.at(at, Event::Join(i));
    }
    w.start_serving();
    w.schedule_faults();
    w.queue.at(0, Event::Sample);
    w.queue.at(EXPIRY_SWEEP_MS, Event::Expire);
    let mut samples = Vec::new();
    let mut events = 0u64;
    let mut m = Milestones::default();
    while let Some(e) = w.queue.pop_until(horizon) {
        events += 1;
        if let Some(s) = handle(&mut w, e, sample_every) {
            samples.push(s);
        }
        let full = m.observe(&w, w.queue.now());
        if full && stop_when_full {
            break;
        }
    }
    m.finish(w.queue.now().max(if stop_when_full { 0 } else { horizon }));
    samples.push(sample(&mut w));
    let end = w.queue.now().max(if stop_when_full { 0 } else { horizon });
    let secs = |ms: Option<u64>| ms.map(|m| m as f64 / 1000.0);
    ScaleReport {
        seed,
        nodes,
        seeders: scenario.seeders.count,
        hours,
        slabs,
        target: scenario.market.target,
        full_at_target_secs: secs(m.full_at),
        at_target_99_secs: secs(m.at_99),
        swarm_full_secs: secs(m.swarm_full),
        swarm_full_at_target_secs: secs(m.swarm_full_target),
        short_after_full_secs: m.short_ms as f64 / 1000.0,
        fewest_at_target_after_full: m.fewest,
        bytes_moved: w.bytes_moved,
        churn: w.churn.clone(),
        rounds: w.rounds.clone(),
        classes: classes(&w),
        samples,
        events,
        serving: serving_report(&w, end),
        violations: w.violations.clone(),
    }
}

/// Carries out one event; a coverage sample when it was the sampling event.
pub(crate) fn handle(w: &mut World, e: Event, sample_every: u64) -> Option<Sample> {
    match e {
        Event::Join(i) => w.join(i),
        Event::Leave {
            node,
            session,
            crash,
        } => w.leave(node, session, crash),
        Event::Round { node, session } => w.round(node, session),
        Event::Transfer {
            node,
            session,
            slab,
            from,
            from_session,
        } => w.transfer_done(node, session, slab, from, from_session),
        Event::Arrive(record) => {
            let now = w.now_secs();
            w.view.arrive(*record, now);
            w.sync_ghosts();
        }
        Event::Liveness {
            node,
            session,
            live,
        } => {
            let n = &w.nodes[node];
            // A dead word from an earlier session means nothing once it is back, nor one
            // from behind a partition once it has healed; nothing comes from behind one.
            let applies = if live {
                n.online && !n.cut
            } else {
                !n.online || n.cut
            };
            if n.session == session && applies {
                w.view.set_live(node, live);
                w.sync_ghosts();
            }
        }
        Event::Refresh { node, session } => w.refresh(node, session),
        Event::Expire => {
            let now = w.now_secs();
            w.view.expire(now);
            w.sync_ghosts();
            w.queue.after(EXPIRY_SWEEP_MS, Event::Expire);
        }
        Event::Sample => {
            w.queue.after(sample_every, Event::Sample);
            return Some(sample(w));
        }
        Event::Request(r) => w.request(r),
        Event::Step(r) => w.step(r),
        Event::PublishDemand(r) => w.publish_demand(r),
        Event::Fault(k) => w.fault(k),
        Event::Heal(k) => w.heal(k),
        Event::DemandArrives(d) => {
            let now = w.now_secs();
            // A record the book refuses (older, expired) changes nothing.
            let _ = w.demand.apply(*d, now);
        }
    }
    None
}

/// When coverage first reached what the report names (ms), and how it fared once full.
#[derive(Default)]
struct Milestones {
    full_at: Option<u64>,
    at_99: Option<u64>,
    swarm_full: Option<u64>,
    swarm_full_target: Option<u64>,
    short_ms: u64,
    short_since: Option<u64>,
    fewest: Option<usize>,
}

impl Milestones {
    /// Notes the coverage at `now`; whether every slab is at target.
    fn observe(&mut self, w: &World, now: u64) -> bool {
        let slabs = w.sc.slabs();
        let first = |at: &mut Option<u64>, reached: bool| {
            if at.is_none() && reached {
                *at = Some(now);
            }
        };
        let full = w.all_ge_target == slabs;
        first(&mut self.at_99, w.all_ge_target * 100 >= slabs * 99);
        first(&mut self.full_at, full);
        first(&mut self.swarm_full, w.swarm_ge1 == slabs);
        first(&mut self.swarm_full_target, w.swarm_ge_target == slabs);
        if self.full_at.is_some() {
            let fewest = self
                .fewest
                .map_or(w.all_ge_target, |f| f.min(w.all_ge_target));
            self.fewest = Some(fewest);
            match (full, self.short_since) {
                (false, None) => self.short_since = Some(now),
                (true, Some(t)) => {
                    self.short_ms += now - t;
                    self.short_since = None;
                }
                _ => {}
            }
        }
        full
    }

    /// Closes a stretch short of target still open at `end`.
    fn finish(&mut self, end: u64) {
        if let Some(t) = self.short_since.take() {
            self.short_ms += end.saturating_sub(t);
        }
    }
}

fn sample(w: &mut World) -> Sample {
    let serving = w.sc.serving.is_some().then(|| serving_sample(w));
    Sample {
        secs: w.queue.now() as f64 / 1000.0,
        online: w.nodes.iter().filter(|n| n.online).count(),
        at_least_one: w.all_ge1,
        at_target: w.all_ge_target,
        swarm_at_least_one: w.swarm_ge1,
        swarm_at_target: w.swarm_ge_target,
        bytes_moved: w.bytes_moved,
        serving,
    }
}

/// Serving since the last sample; starts the next interval.
fn serving_sample(w: &mut World) -> ServingSample {
    let now = w.queue.now();
    let secs = now.saturating_sub(w.last_sample) as f64 / 1000.0;
    w.last_sample = now;
    let tokens_per_sec = w
        .routers
        .iter_mut()
        .map(|r| {
            let n = std::mem::take(&mut r.tokens_since_sample);
            if secs > 0.0 {
                n as f64 / secs
            } else {
                0.0
            }
        })
        .collect();
    let s = &mut w.serving;
    let token_ms = Percentiles::of(&s.token_ms[s.sampled_tokens..]);
    s.sampled_tokens = s.token_ms.len();
    ServingSample {
        tokens_per_sec,
        token_ms,
    }
}

/// The run's serving, over the time from the routers' start to `end` (ms).
fn serving_report(w: &World, end: Millis) -> Option<ServingReport> {
    let sv = w.sc.serving.as_ref()?;
    let s = &w.serving;
    let secs = end.saturating_sub(w.secs(sv.start_secs)) as f64 / 1000.0;
    Some(ServingReport {
        routers: w.routers.len(),
        requests: s.arrived,
        completed: s.completed,
        failed_no_holder: s.failed_no_holder,
        failed_dispatch: s.failed_dispatch,
        tokens: s.tokens,
        tokens_per_sec: w
            .routers
            .iter()
            .map(|r| {
                if secs > 0.0 {
                    r.tokens as f64 / secs
                } else {
                    0.0
                }
            })
            .collect(),
        token_ms: Percentiles::of(&s.token_ms),
        first_token_ms: Percentiles::of(&s.first_token_ms),
        dispatches: s.dispatches,
        dispatch_gone: s.gone,
        dispatch_not_held: s.not_held,
        dispatch_late: s.late,
        replicas_by_rank: replicas_by_rank(w),
        checks: check_summary(w),
    })
}

/// See [`CheckSummary`].
fn check_summary(w: &World) -> CheckSummary {
    let s = &w.serving;
    let liars: Vec<_> = w.nodes.iter().filter(|n| n.liar).collect();
    CheckSummary {
        checked: s.checked,
        caught: s.caught,
        honest_caught: s.honest_convicted,
        wrong_answers_used: s.wrong_used,
        requests_answered_wrong: s.completed_wrong,
        liars: liars.len(),
        liars_dispatched: liars
            .iter()
            .filter(|n| n.first_dispatch_ms.is_some())
            .count(),
        liars_caught: liars.iter().filter(|n| n.caught_ms.is_some()).count(),
        worst_time_to_catch_ms: liars
            .iter()
            .filter_map(|n| Some(n.caught_ms? - n.first_dispatch_ms?))
            .fold(0.0, f64::max),
    }
}

/// See [`ServingReport::replicas_by_rank`].
fn replicas_by_rank(w: &World) -> Vec<f64> {
    let Some(routing) = &w.routing else {
        return Vec::new();
    };
    let (layers, experts) = (w.sc.model.layers as usize, w.sc.model.experts as usize);
    let quarters = experts.min(4);
    let mut sum = vec![0u64; quarters];
    let mut n = vec![0u64; quarters];
    for l in 0..layers {
        for rank in 0..experts {
            let q = rank * quarters / experts;
            let e = routing.expert_of_rank(l, rank) as usize;
            sum[q] += w.count_all[l * experts + e] as u64;
            n[q] += 1;
        }
    }
    sum.iter()
        .zip(&n)
        .map(|(&s, &n)| s as f64 / n.max(1) as f64)
        .collect()
}

fn classes(w: &World) -> Vec<ClassSummary> {
    w.sc.classes
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let of: Vec<_> = w.nodes.iter().filter(|n| n.class == Some(k)).collect();
            let offered: u64 = of.iter().map(|n| n.capacity).sum();
            let held: u64 = of
                .iter()
                .map(|n| n.held.len() as u64 * w.sc.model.slab_bytes)
                .sum();
            ClassSummary {
                name: c.name.clone(),
                nodes: of.len(),
                online: of.iter().filter(|n| n.online).count(),
                fill: if offered == 0 {
                    0.0
                } else {
                    held as f64 / offered as f64
                },
            }
        })
        .collect()
}
