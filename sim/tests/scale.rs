//! The scale simulator: one seed, one history; the market's invariants hold over many seeds;
//! a thousand nodes cover the model from cold within a bound.

use moeswarm_sim::scale::report::ScaleReport;
use moeswarm_sim::scale::scenario::Scenario;
use moeswarm_sim::scale::{run, run_until};
use proptest::prelude::*;

/// The default scenario's classes and knobs over a smaller model (48 × `experts` slabs of the
/// real size), so that a test runs in seconds.
fn scenario(experts: u32) -> Scenario {
    let mut s = Scenario::default_scenario();
    s.model.experts = experts;
    s
}

fn json(r: &ScaleReport) -> String {
    serde_json::to_string(r).unwrap()
}

#[test]
fn one_seed_gives_one_history_byte_for_byte_and_another_seed_another() {
    let sc = scenario(16);
    let a = run(&sc, 40, 1.0, 7);
    let b = run(&sc, 40, 1.0, 7);
    assert_eq!(json(&a), json(&b), "the same seed, the same report");
    let c = run(&sc, 40, 1.0, 8);
    assert_ne!(json(&a), json(&c), "another seed, another history");
    // Something happened in that hour: nodes came and went, slabs moved, coverage was full.
    assert!(
        a.churn.joins > 40 && a.churn.crashes + a.churn.clean_leaves > 0,
        "{a:#?}"
    );
    assert!(a.rounds.fetched > 0 && a.bytes_moved > 0, "{a:#?}");
    assert!(a.full_at_target_secs.is_some(), "{}", a.render());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    #[test]
    fn no_node_is_ever_over_capacity_or_advertises_a_slab_it_does_not_hold(seed in any::<u64>()) {
        // Short sessions, so that nodes crash and leave while they fetch and drop.
        let mut sc = scenario(8);
        for c in &mut sc.classes {
            c.session_hours = 0.2;
            c.offline_hours = 0.1;
        }
        let r = run(&sc, 30, 1.5, seed);
        prop_assert!(r.violations.is_empty(), "{:?}", r.violations);
        prop_assert!(r.churn.crashes + r.churn.clean_leaves > 10, "{}", r.render());
        for s in &r.samples {
            prop_assert!(s.at_target <= s.at_least_one && s.at_least_one <= r.slabs);
            prop_assert!(s.swarm_at_target <= s.at_target);
        }
    }
}

#[test]
fn a_thousand_nodes_cover_the_model_at_target_from_cold_within_ten_minutes() {
    // 1,536 slabs (48 × 32 of the real size, 8.2 GB), one seeder on a 1 Gbit/s line: the
    // seeder alone needs 65 s to send each slab once. Nodes join over the first five minutes.
    let sc = scenario(32);
    let r = run_until(&sc, 1000, 1.0, 1, true);
    let full = r.full_at_target_secs.expect("never full at target");
    assert!(
        full < 600.0,
        "full at target only after {full} s: {}",
        r.render()
    );
    assert!(r.violations.is_empty(), "{:?}", r.violations);
}

#[test]
fn the_quick_choice_changes_no_decision_a_whole_history_long() {
    // Small stores and short sessions: nodes fill up, swap, crash and come back while their
    // old records are still counted, so every case of the quick choice comes up.
    let mut sc = scenario(8);
    // Records slow to arrive: a node decides again while its old one is still counted.
    sc.market.gossip_delay_secs = [5.0, 60.0];
    for c in &mut sc.classes {
        c.capacity_gb /= 8.0;
        c.session_hours = 0.3;
        c.offline_hours = 0.2;
    }
    let quick = run(&sc, 60, 2.0, 11);
    sc.market.quick_choice = false;
    let full = run(&sc, 60, 2.0, 11);
    assert!(
        quick.rounds.quick > quick.rounds.decided / 2,
        "{:?}",
        quick.rounds
    );
    assert!(
        quick.rounds.dropped > 0 && quick.churn.crashes > 0,
        "{:?}",
        quick.rounds
    );
    assert_eq!(full.rounds.quick, 0);
    let mut quick = quick;
    quick.rounds.quick = 0;
    assert_eq!(json(&quick), json(&full), "the same history either way");
}
