//! Routers serving over the scale simulator: a token costs what its layers' round trips,
//! compute and trunk add up to; requests fail with their reason when holders vanish; demand
//! pulls replicas to the hot experts; one seed, one history.

use moeswarm_sim::scale::report::ScaleReport;
use moeswarm_sim::scale::run;
use moeswarm_sim::scale::scenario::{Compute, Nat, Scenario, Serving};

/// A swarm where every number is fixed: one region, no NAT, 10 ms one way for every node,
/// 5 ms for the router, fast links, each expert 1 ms, nodes that never leave; one router
/// stepping one sequence at a time, a token's experts 8 of `experts` per layer.
fn fixed(experts: u32) -> Scenario {
    let mut s = Scenario::default_scenario();
    s.model.experts = experts;
    s.classes.truncate(1);
    let c = &mut s.classes[0];
    c.nat = Nat::None;
    c.latency_ms = [10.0, 10.0];
    c.compute = Compute {
        expert_ms: 1.0,
        row_ms: 0.0,
    };
    c.session_hours = 1e6;
    c.up_mbps = 10_000.0;
    c.down_mbps = 10_000.0;
    s.serving = Some(Serving {
        routers: 1,
        requests_per_min: 2.0,
        prompt_tokens: 1,
        output_tokens: 8,
        max_batch: 1,
        trunk_ms: 2.0,
        trunk_row_ms: 0.0,
        latency_ms: [5.0, 5.0],
        up_mbps: 10_000.0,
        down_mbps: 10_000.0,
        start_secs: 300.0,
        ..Serving::default()
    });
    s
}

fn json(r: &ScaleReport) -> String {
    serde_json::to_string(r).unwrap()
}

#[test]
fn a_token_costs_each_layers_trunk_round_trip_and_compute() {
    let sc = fixed(16);
    let r = run(&sc, 40, 0.5, 3);
    let v = r.serving.as_ref().expect("serving");
    assert!(v.tokens > 50, "{}", r.render());
    assert_eq!(v.failed_no_holder + v.failed_dispatch, 0, "{}", r.render());
    // Per layer: 2 ms of trunk, a 30 ms round trip (2 × (5 + 10)), one expert's 1 ms on each
    // of 8 holders (the replica choice spreads a layer's experts over holders of equal
    // latency); 3072 f16 values each way at 10 Gbit/s are 5 µs. A queue at a holder (one
    // router only) cannot arise.
    let layer = 2.0 + 30.0 + 1.0 + 2.0 * 3072.0 * 2.0 / 1.25e6;
    let want = 48.0 * layer;
    let p50 = v.token_ms.p50;
    assert!(
        (p50 - want).abs() < 0.01 * want,
        "time between tokens {p50} ms, expected {want}: {}",
        r.render()
    );
    // The first token is the prompt's step after the wait for the router (none here).
    assert!(v.first_token_ms.p50 >= want - 1.0, "{}", r.render());
}

#[test]
fn the_same_seed_gives_the_same_serving_history() {
    let mut sc = fixed(8);
    sc.classes[0].session_hours = 0.3;
    sc.classes[0].offline_hours = 0.1;
    sc.classes[0].crash = 0.5;
    let a = run(&sc, 30, 0.4, 11);
    let b = run(&sc, 30, 0.4, 11);
    assert_eq!(json(&a), json(&b));
    let c = run(&sc, 30, 0.4, 12);
    assert_ne!(json(&a), json(&c));
    assert!(a.serving.as_ref().unwrap().tokens > 0);
}

#[test]
fn holders_that_crash_cost_the_deadline_and_are_asked_elsewhere() {
    let mut sc = fixed(8);
    // Every session ends in a crash after six minutes on average; the router counts a node
    // live until 35 s after its last heartbeat, so some dispatches go to nodes gone.
    let c = &mut sc.classes[0];
    c.session_hours = 0.1;
    c.offline_hours = 0.05;
    c.crash = 1.0;
    let sv = sc.serving.as_mut().unwrap();
    sv.requests_per_min = 6.0;
    sv.deadline_ms = 500.0;
    let r = run(&sc, 60, 1.0, 5);
    let v = r.serving.as_ref().unwrap();
    assert!(v.dispatch_gone > 0, "{}", r.render());
    assert!(v.completed > 0, "{}", r.render());
    // A step that met a gone holder took the deadline: the slowest tokens show it.
    assert!(v.token_ms.max >= 500.0, "{}", r.render());
    assert!(r.violations.is_empty(), "{:?}", r.violations);
}

#[test]
fn once_the_only_holder_leaves_requests_fail_as_having_no_holder() {
    let mut sc = fixed(8);
    // Market nodes too small for a slab: the seeder is the only holder, and it leaves.
    sc.classes[0].capacity_gb = 0.001;
    sc.seeders.leave_after_hours = Some(0.25);
    let r = run(&sc, 10, 0.5, 2);
    let v = r.serving.as_ref().unwrap();
    assert!(
        v.completed > 0,
        "served while the seeder was there: {}",
        r.render()
    );
    assert!(v.failed_no_holder > 0, "{}", r.render());
    assert_eq!(v.failed_dispatch, 0, "{}", r.render());
}

#[test]
fn demand_draws_more_replicas_to_the_hot_experts() {
    // Skewed routing over 16 experts a layer; nodes that can hold a quarter of the model.
    let mut sc = fixed(16);
    sc.classes[0].capacity_gb = 0.25 * 768.0 * sc.model.slab_bytes as f64 / 1e9;
    let sv = sc.serving.as_mut().unwrap();
    sv.zipf = 1.5;
    sv.requests_per_min = 6.0;
    sv.max_batch = 4;
    sv.start_secs = 60.0;
    let r = run(&sc, 40, 1.0, 9);
    let q = &r.serving.as_ref().unwrap().replicas_by_rank;
    assert_eq!(q.len(), 4);
    assert!(
        q[0] > 1.5 * q[3],
        "hottest quarter {} vs coldest {}: {}",
        q[0],
        q[3],
        r.render()
    );
}
