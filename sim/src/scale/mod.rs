//! The scale simulator: thousands of nodes joining, fetching and leaving, as a deterministic
//! discrete-event simulation over the real market code.
//!
//! One seed gives one history: every draw comes from one ChaCha stream in the order events are
//! processed, and events come from one queue ([`queue`]: a binary heap of (time, sequence,
//! event); no async, no threads, no clock). Nodes are plain structs ([`world`]); what they know
//! of each other is the market's own coverage map fed by the protocol's holdings records
//! ([`view`]), and each round they decide with the market's own
//! [`views`](moeswarm_market::choice::views) and [`decide`](moeswarm_market::choice::decide).
//! Signatures are left out: a record here is never forged, so checking one would change no
//! decision. What the run measured comes back as a [`report::ScaleReport`].
//!
//! What it models: node classes (capacity, link rates, NAT, session and offline times, crash or
//! clean leave) from a [`scenario::Scenario`]; the model's real shape; transfers at the slower
//! end's rate, one at a time per link, through a relay (capped) where neither end can be
//! reached; records that reach everyone after a gossip delay and expire; heartbeats by their
//! effect (a crashed node is counted dead a fixed time after its last one). What it does not
//! (yet): routers and their demand (step 2 of the scale issue), who hears a record first (one
//! delay for all), links shared fairly between concurrent transfers (they queue instead).
//!
//! It is not the node and does no I/O; `moeswarm sim --scale N` runs it.

pub mod queue;
pub mod report;
pub mod scenario;
pub mod view;
pub mod world;

use report::{ClassSummary, Sample, ScaleReport};
use scenario::Scenario;
use world::{Event, World};

/// How often records are swept for expiry, ms.
const EXPIRY_SWEEP_MS: u64 = 60_000;

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
    // The seeders hold everything from the start.
    for i in nodes..w.nodes.len() {
        for s in 0..slabs as u32 {
            w.nodes[i].held.insert(s, world::START_SECS);
        }
        w.join(i);
    }
    let spread = scenario.market.join_spread_secs;
    for i in 0..nodes {
        let at = (spread * 1000.0 * rand::Rng::random::<f64>(&mut w.rng)) as u64;
        w.queue.at(at, Event::Join(i));
    }
    w.queue.at(0, Event::Sample);
    w.queue.at(EXPIRY_SWEEP_MS, Event::Expire);
    let mut samples = Vec::new();
    let mut events = 0u64;
    let mut full_at: Option<u64> = None;
    let mut at_99: Option<u64> = None;
    let mut swarm_full: Option<u64> = None;
    let mut swarm_full_target: Option<u64> = None;
    let mut short_ms = 0u64;
    let mut short_since: Option<u64> = None;
    let mut fewest: Option<usize> = None;
    while let Some(e) = w.queue.pop_until(horizon) {
        events += 1;
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
            }
            Event::Liveness {
                node,
                session,
                live,
            } => {
                let n = &w.nodes[node];
                // A dead word from an earlier session means nothing once it is back.
                if n.session == session && (live == n.online || !live) {
                    w.view.set_live(node, live);
                }
            }
            Event::Refresh { node, session } => w.refresh(node, session),
            Event::Expire => {
                let now = w.now_secs();
                w.view.expire(now);
                w.queue.after(EXPIRY_SWEEP_MS, Event::Expire);
            }
            Event::Sample => {
                samples.push(sample(&w));
                w.queue.after(sample_every, Event::Sample);
            }
        }
        let now = w.queue.now();
        if at_99.is_none() && w.all_ge_target * 100 >= slabs * 99 {
            at_99 = Some(now);
        }
        let full = w.all_ge_target == slabs;
        if full && full_at.is_none() {
            full_at = Some(now);
            if stop_when_full {
                break;
            }
        }
        if swarm_full.is_none() && w.swarm_ge1 == slabs {
            swarm_full = Some(now);
        }
        if swarm_full_target.is_none() && w.swarm_ge_target == slabs {
            swarm_full_target = Some(now);
        }
        if full_at.is_some() {
            fewest = Some(fewest.map_or(w.all_ge_target, |f| f.min(w.all_ge_target)));
            match (full, short_since) {
                (false, None) => short_since = Some(now),
                (true, Some(t)) => {
                    short_ms += now - t;
                    short_since = None;
                }
                _ => {}
            }
        }
    }
    let end = w.queue.now().max(if stop_when_full { 0 } else { horizon });
    if let Some(t) = short_since {
        short_ms += end - t;
    }
    samples.push(sample(&w));
    let secs = |ms: Option<u64>| ms.map(|m| m as f64 / 1000.0);
    ScaleReport {
        seed,
        nodes,
        seeders: scenario.seeders.count,
        hours,
        slabs,
        target: scenario.market.target,
        full_at_target_secs: secs(full_at),
        at_target_99_secs: secs(at_99),
        swarm_full_secs: secs(swarm_full),
        swarm_full_at_target_secs: secs(swarm_full_target),
        short_after_full_secs: short_ms as f64 / 1000.0,
        fewest_at_target_after_full: fewest,
        bytes_moved: w.bytes_moved,
        churn: w.churn.clone(),
        rounds: w.rounds.clone(),
        classes: classes(&w),
        samples,
        events,
        violations: w.violations.clone(),
    }
}

fn sample(w: &World) -> Sample {
    Sample {
        secs: w.queue.now() as f64 / 1000.0,
        online: w.nodes.iter().filter(|n| n.online).count(),
        at_least_one: w.all_ge1,
        at_target: w.all_ge_target,
        swarm_at_least_one: w.swarm_ge1,
        swarm_at_target: w.swarm_ge_target,
        bytes_moved: w.bytes_moved,
    }
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
