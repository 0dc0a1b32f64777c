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

/// [`fixed`] over 48 × 8 slabs with nodes that hold about `slabs` slabs each.
fn small_holders(slabs: f64) -> Scenario {
    let mut sc = fixed(8);
    sc.classes[0].capacity_gb = slabs * sc.model.slab_bytes as f64 / 1e9;
    sc
}

/// The fewest slabs at target in the samples from `from` (s, included) to `to` (excluded).
fn fewest_at_target(r: &ScaleReport, from: f64, to: f64) -> usize {
    r.samples
        .iter()
        .filter(|s| s.secs >= from && s.secs < to)
        .map(|s| s.at_target)
        .min()
        .expect("no sample in that stretch")
}

/// The first sample time at or after `from` (s) at which every slab is at target.
fn back_at_target(r: &ScaleReport, from: f64) -> Option<f64> {
    r.samples
        .iter()
        .find(|s| s.secs >= from && s.at_target == r.slabs)
        .map(|s| s.secs)
}

#[test]
fn thirty_percent_leaving_within_a_minute_is_repaired_within_ten_minutes() {
    use moeswarm_sim::scale::scenario::Fault;
    let mut sc = small_holders(12.0);
    sc.serving = None;
    sc.faults = vec![Fault::MassLeave {
        at_secs: 1200.0,
        share: 0.3,
        within_secs: 60.0,
        crash: true,
    }];
    let r = run(&sc, 100, 1.0, 4);
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert_eq!(r.churn.mass_leaves, 1);
    assert!(r.churn.crashes >= 25, "{}", r.render());
    let before = r.samples.iter().rfind(|s| s.secs < 1200.0).unwrap();
    assert_eq!(before.at_target, r.slabs, "full before: {}", r.render());
    let low = fewest_at_target(&r, 1200.0 + 1e-9, f64::INFINITY);
    assert!(
        low < r.slabs,
        "the fault knocked slabs short: {}",
        r.render()
    );
    let back = back_at_target(&r, 1260.0).expect("never back at target");
    assert!(
        back - 1260.0 <= 600.0,
        "back at target at {back} s: {}",
        r.render()
    );
}

#[test]
fn liars_are_caught_before_any_wrong_answer_reaches_a_user() {
    let mut sc = small_holders(40.0);
    sc.liars.share = 0.2;
    sc.liars.lie_rate = 1.0;
    sc.serving.as_mut().unwrap().requests_per_min = 6.0;
    sc.serving.as_mut().unwrap().max_batch = 4;
    let r = run(&sc, 60, 1.0, 8);
    let c = &r.serving.as_ref().unwrap().checks;
    assert!(c.liars >= 5 && c.liars_dispatched > 0, "{}", r.render());
    // New workers are on probation (every answer checked), so a liar that always lies is
    // caught by its first answer, whose outputs are not used.
    assert_eq!(c.wrong_answers_used, 0, "{}", r.render());
    assert_eq!(c.requests_answered_wrong, 0, "{}", r.render());
    assert_eq!(c.liars_caught, c.liars_dispatched, "{}", r.render());
    assert_eq!(c.honest_caught, 0, "{}", r.render());
    assert!(c.worst_time_to_catch_ms < 1000.0, "{}", r.render());
    assert!(r.serving.as_ref().unwrap().completed > 0, "{}", r.render());
}

#[test]
fn liars_that_lie_now_and_then_are_caught_at_the_sampling_rate_and_no_honest_one_is() {
    let mut sc = small_holders(40.0);
    sc.liars.share = 0.2;
    sc.liars.lie_rate = 0.05;
    let sv = sc.serving.as_mut().unwrap();
    sv.requests_per_min = 6.0;
    sv.max_batch = 4;
    sv.check_rate = 0.1;
    let r = run(&sc, 60, 1.0, 8);
    let c = &r.serving.as_ref().unwrap().checks;
    assert_eq!(c.honest_caught, 0, "{}", r.render());
    // Each answer of a liar is wrong 1 time in 20: on probation (16 answers, all checked)
    // about half are caught, the rest at the rate of 1 in 10 afterwards; once caught, every
    // answer is checked. Within ten minutes of its first dispatch every liar sent work is
    // caught.
    assert_eq!(c.liars_caught, c.liars_dispatched, "{}", r.render());
    assert!(c.worst_time_to_catch_ms < 600_000.0, "{}", r.render());
    // A lie through an unchecked answer is possible (1 in 10 checked once proven); every one
    // is counted.
    assert!(c.wrong_answers_used <= c.caught * 20, "{}", r.render());
}

#[test]
fn a_region_cut_off_for_ten_minutes_is_repaired_around_and_serving_goes_on() {
    use moeswarm_sim::scale::scenario::Fault;
    let mut sc = small_holders(12.0);
    sc.network.regions = vec!["near".into(), "far".into()];
    sc.network.inter_region_ms = 0.0;
    sc.faults = vec![Fault::Partition {
        at_secs: 1200.0,
        for_secs: 600.0,
        regions: vec!["far".into()],
    }];
    sc.serving.as_mut().unwrap().requests_per_min = 4.0;
    let r = run(&sc, 100, 1.0, 6);
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    let low = fewest_at_target(&r, 1200.0, 1800.0);
    assert!(low < r.slabs, "the cut knocked slabs short: {}", r.render());
    let back = back_at_target(&r, 1230.0).expect("never back at target");
    assert!(
        back <= 1800.0,
        "repaired around the cut at {back} s: {}",
        r.render()
    );
    let v = r.serving.as_ref().unwrap();
    assert!(
        v.dispatch_gone > 0,
        "dispatches across the cut: {}",
        r.render()
    );
    assert!(v.completed > 0, "{}", r.render());
    assert_eq!(v.failed_no_holder, 0, "{}", r.render());
}

#[test]
fn a_class_slowing_down_is_routed_around_once_measured() {
    use moeswarm_sim::scale::scenario::Fault;
    // Two classes alike, every node holding the whole model; from 1,200 s for 20 minutes one
    // class computes 100 times slower (1 ms an expert becomes 100 ms).
    let mut sc = fixed(8);
    let mut slow = sc.classes[0].clone();
    slow.name = "heated".into();
    sc.classes.push(slow);
    sc.faults = vec![Fault::Slow {
        at_secs: 1200.0,
        for_secs: 1200.0,
        class: "heated".into(),
        factor: 100.0,
    }];
    sc.serving.as_mut().unwrap().requests_per_min = 3.0;
    let r = run(&sc, 40, 1.0, 3);
    let p50 = |from: f64, to: f64| {
        let mut v: Vec<f64> = r
            .samples
            .iter()
            .filter(|s| s.secs > from && s.secs <= to)
            .filter_map(|s| s.serving.as_ref())
            .filter(|s| s.token_ms.count > 0)
            .map(|s| s.token_ms.p50)
            .collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let before = p50(300.0, 1200.0);
    let during = p50(1500.0, 2400.0);
    // Sent to a slowed holder, a layer waits 100 ms more than its 33: a router that ignored
    // what it measured took four times as long (6.3 s against 1.6 s, tried); this one pays
    // only for the dispatches that measure the slowed holders again now and then (1.8 s).
    assert!(
        during < 1.3 * before,
        "time between tokens {before:.0} ms before, {during:.0} ms while slowed: {}",
        r.render()
    );
    assert!(r.serving.as_ref().unwrap().failed_dispatch == 0);
}
