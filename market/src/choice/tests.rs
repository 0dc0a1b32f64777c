use super::*;
use moeswarm_protocol::BlobId;
use proptest::prelude::*;

fn model() -> ModelId {
    ModelId(BlobId::of(b"m"))
}

fn key(l: u32, e: u32) -> SlabKey {
    SlabKey {
        model: model(),
        layer: l,
        expert: e,
    }
}

fn node(k: u8, class: NodeClass, budget: u64) -> NodeView {
    NodeView {
        node: NodeKey([k; 32]),
        class,
        budget,
        now: 10_000,
    }
}

fn view(e: u32, others: usize, demand: f64, held_since: Option<u64>) -> SlabView {
    SlabView {
        slab: key(0, e),
        bytes: 10,
        others,
        demand,
        held_since,
        excess: true,
    }
}

fn experts(keys: &[SlabKey]) -> Vec<u32> {
    keys.iter().map(|k| k.expert).collect()
}

#[test]
fn an_empty_node_takes_the_uncovered_then_the_short_then_the_hot() {
    let slabs = vec![
        view(0, 3, 100.0, None),
        view(1, 1, 5.0, None),
        view(2, 0, 1.0, None),
        view(3, 2, 900.0, None),
        view(4, 1, 50.0, None),
        view(5, 0, 2.0, None),
    ];
    let p = Policy {
        max_fetches: usize::MAX,
        ..Policy::default()
    };
    let take = |budget| experts(&decide(&node(1, NodeClass::Computer, budget), &slabs, &p).fetch);
    assert_eq!(take(20), vec![2, 5], "nobody holds 2 and 5");
    assert_eq!(take(30), vec![2, 4, 5], "then the hotter of the short ones");
    assert_eq!(take(40), vec![1, 2, 4, 5]);
    // Past the target: 900 rows over 3 replicas beats 100 over 4.
    assert_eq!(take(50), vec![1, 2, 3, 4, 5]);
    let phone = decide(&node(1, NodeClass::Phone, 30), &slabs, &p);
    assert_eq!(
        experts(&phone.fetch),
        vec![1, 2, 5],
        "a phone takes the colder short one"
    );
}

#[test]
fn a_round_fetches_at_most_max_fetches_the_most_wanted_first() {
    let slabs: Vec<SlabView> = (0..6).map(|e| view(e, e as usize, 0.0, None)).collect();
    let p = Policy::default();
    let d = decide(&node(1, NodeClass::Computer, 1_000), &slabs, &p);
    assert_eq!(
        experts(&d.fetch),
        vec![0, 1],
        "the uncovered, then the short"
    );
    // The next round, with those held, goes on where it stopped.
    let mut held = slabs.clone();
    held[0].held_since = Some(10_000);
    held[1].held_since = Some(10_000);
    let d = decide(&node(1, NodeClass::Computer, 1_000), &held, &p);
    assert_eq!(experts(&d.fetch), vec![2, 3]);
    assert!(d.drop.is_empty());
}

#[test]
fn phones_past_the_target_take_the_fewest_replicas_computers_the_most_demand() {
    let slabs = vec![view(0, 2, 1000.0, None), view(1, 3, 1.0, None)];
    let p = Policy::default();
    let c = decide(&node(1, NodeClass::Computer, 10), &slabs, &p);
    assert_eq!(experts(&c.fetch), vec![0]);
    let slabs = vec![view(0, 3, 1000.0, None), view(1, 2, 1.0, None)];
    let ph = decide(&node(1, NodeClass::Phone, 10), &slabs, &p);
    assert_eq!(experts(&ph.fetch), vec![1]);
    let c = decide(&node(1, NodeClass::Computer, 10), &slabs, &p);
    assert_eq!(experts(&c.fetch), vec![0], "1000/4 per replica beats 1/3");
}

#[test]
fn a_swap_needs_the_gain_the_hold_time_and_replicas_to_spare() {
    let p = Policy::default();
    let n = node(1, NodeClass::Computer, 10);
    let old = Some(n.now - p.min_hold_secs);
    // Held: 100 rows over 3+1 replicas = 25 a replica. Candidate: 60 over 1+1 = 30: not 1.5×.
    let slabs = vec![view(0, 3, 100.0, old), view(1, 2, 60.0 - 1.0, None)];
    assert!(decide(&n, &slabs, &p).is_empty());
    // 120 over 3 = 40 > 1.5 × 25.5: swap.
    let slabs = vec![view(0, 3, 100.0, old), view(1, 2, 119.0, None)];
    let d = decide(&n, &slabs, &p);
    assert_eq!((experts(&d.fetch), experts(&d.drop)), (vec![1], vec![0]));
    // Not while it is freshly fetched.
    let fresh = Some(n.now - p.min_hold_secs + 1);
    let slabs = vec![view(0, 3, 100.0, fresh), view(1, 2, 119.0, None)];
    assert!(decide(&n, &slabs, &p).is_empty());
    // Not when the others hold it fewer than target times: even for an uncovered slab.
    let slabs = vec![view(0, 1, 1.0, old), view(1, 0, 1e6, None)];
    assert!(decide(&n, &slabs, &p).is_empty());
    // An uncovered slab displaces a spare replica whatever its demand.
    let slabs = vec![view(0, 2, 1e6, old), view(1, 0, 0.0, None)];
    let d = decide(&n, &slabs, &p);
    assert_eq!((experts(&d.fetch), experts(&d.drop)), (vec![1], vec![0]));
}

#[test]
fn a_node_over_its_budget_drops_its_least_wanted_first() {
    let p = Policy::default();
    let n = node(1, NodeClass::Computer, 20);
    let t = Some(n.now);
    let slabs = vec![
        view(0, 0, 1.0, t),
        view(1, 5, 1.0, t),
        view(2, 1, 1.0, t),
        view(3, 4, 1.0, t),
    ];
    let d = decide(&n, &slabs, &p);
    assert_eq!(experts(&d.drop), vec![1, 3]);
    assert!(d.fetch.is_empty());
}

fn arb_slabs() -> impl Strategy<Value = Vec<SlabView>> {
    proptest::collection::vec(
        (
            1u64..40,
            0usize..5,
            0.0f64..500.0,
            proptest::option::of(9_000u64..10_001),
            any::<bool>(),
        ),
        0..40,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (bytes, others, demand, held, excess))| SlabView {
                slab: key(i as u32 / 8, i as u32 % 8),
                bytes,
                others,
                demand,
                held_since: held,
                excess,
            })
            .collect()
    })
}

/// What node `i` sees of slab `j` when node `o` holds it where `holds[o][j]`, holding its own
/// since 0.
fn view_of(
    nodes: &[NodeView],
    holds: &[Vec<bool>],
    i: usize,
    j: usize,
    demand: f64,
    p: &Policy,
) -> SlabView {
    let slab = key(j as u32 / 8, j as u32 % 8);
    let others: Vec<NodeKey> = (0..nodes.len())
        .filter(|&o| o != i && holds[o][j])
        .map(|o| nodes[o].node)
        .collect();
    // Whether node `o` lacks some slab short of its target: could use room for a repair.
    let short: Vec<usize> = (0..holds[0].len())
        .filter(|&x| holds.iter().filter(|h| h[x]).count() < p.target)
        .collect();
    let can_repair = |k: &NodeKey| {
        let o = nodes.iter().position(|n| n.node == *k).unwrap();
        short.iter().any(|&x| !holds[o][x])
    };
    SlabView {
        slab,
        bytes: 10,
        others: others.len(),
        demand,
        held_since: holds[i][j].then_some(0),
        excess: is_excess(&nodes[i].node, &others, &slab, p.target, can_repair),
    }
}

#[test]
fn a_slab_short_of_its_target_displaces_a_fresh_spare_replica_its_holder_lets_go_first() {
    let p = Policy::default();
    let n = node(1, NodeClass::Computer, 10);
    let fresh = Some(n.now - 1);
    // Held a second ago, two others hold it too; a slab with one replica needs room.
    let slabs = vec![view(0, 2, 50.0, fresh), view(1, 1, 0.0, None)];
    let d = decide(&n, &slabs, &p);
    assert_eq!((experts(&d.fetch), experts(&d.drop)), (vec![1], vec![0]));
    // Not by a holder the others keep it after: one of them lets it go.
    let mut kept = slabs.clone();
    kept[0].excess = false;
    assert!(decide(&n, &kept, &p).is_empty());
    // And no fresh replica goes for a slab already at its target.
    let slabs = vec![view(0, 2, 1.0, fresh), view(1, 2, 1e6, None)];
    assert!(decide(&n, &slabs, &p).is_empty());
}

#[test]
fn of_a_slabs_holders_as_many_as_it_has_to_spare_may_drop_it_and_only_those_that_can_repair() {
    let slab = key(0, 3);
    let keys: Vec<NodeKey> = (0..6u8).map(|k| NodeKey([k; 32])).collect();
    let excess = |target: usize, can: &dyn Fn(&NodeKey) -> bool| -> Vec<NodeKey> {
        keys.iter()
            .copied()
            .filter(|k| is_excess(k, &keys, &slab, target, can))
            .collect()
    };
    for target in 0..7 {
        assert_eq!(
            excess(target, &|_| true).len(),
            keys.len().saturating_sub(target)
        );
    }
    // Two holders have nothing to repair: of the four others, two may drop it (6 - 4 spare
    // is 2), and neither of the two that could not use the room.
    let idle = [keys[1], keys[4]];
    let can = |k: &NodeKey| !idle.contains(k);
    let chosen = excess(4, &can);
    assert_eq!(chosen.len(), 2);
    assert!(chosen.iter().all(|k| !idle.contains(k)));
    // With more to spare than holders that could use it: all of those.
    assert_eq!(excess(1, &can).len(), 4);
}

proptest! {
    #[test]
    fn a_decision_keeps_the_budget_and_the_target_and_ignores_order(
        slabs in arb_slabs(), budget in 0u64..600, phone in any::<bool>(), k in any::<u8>(),
        rot in 0usize..40, hold in 0u64..2_000,
    ) {
        let class = if phone { NodeClass::Phone } else { NodeClass::Computer };
        let n = node(k, class, budget);
        let p = Policy { min_hold_secs: hold, ..Policy::default() };
        let d = decide(&n, &slabs, &p);
        let by_key = |k: &SlabKey| slabs.iter().find(|s| s.slab == *k).unwrap();
        let held: u64 = slabs.iter().filter(|s| s.held_since.is_some()).map(|s| s.bytes).sum();
        let after = held - d.drop.iter().map(|k| by_key(k).bytes).sum::<u64>()
            + d.fetch.iter().map(|k| by_key(k).bytes).sum::<u64>();
        prop_assert!(after <= budget.max(held.min(budget)), "over budget: {} > {}", after, budget);
        for k in &d.fetch {
            prop_assert!(by_key(k).held_since.is_none(), "fetches a held slab");
        }
        let repairs = d.fetch.iter().any(|k| by_key(k).others < p.target);
        for k in &d.drop {
            let s = by_key(k);
            prop_assert!(s.held_since.is_some(), "drops a slab it does not hold");
            if held <= budget {
                prop_assert!(s.others >= p.target, "its drop puts {:?} below the target", k);
                if n.now < s.held_since.unwrap() + hold {
                    prop_assert!(repairs, "dropped within the hold time for no repair");
                    prop_assert!(s.excess, "drops {:?} early, which it is not to let go first", k);
                }
            }
        }
        let mut rotated = slabs.clone();
        let len = rotated.len().max(1);
        rotated.rotate_left(rot % len);
        prop_assert_eq!(decide(&n, &rotated, &p), d);
    }

    #[test]
    fn nodes_deciding_in_turn_settle_with_every_slab_at_target_when_room_allows(
        budgets in proptest::collection::vec((1u64..30, any::<bool>()), 2..8),
        demand in proptest::collection::vec(0.0f64..1000.0, 1..40),
    ) {
        let p = Policy { min_hold_secs: 0, ..Policy::default() };
        let s = demand.len();
        let nodes: Vec<NodeView> = budgets.iter().enumerate().map(|(i, &(b, phone))| {
            node(i as u8, if phone { NodeClass::Phone } else { NodeClass::Computer }, b * 10)
        }).collect();
        let mut holds: Vec<Vec<bool>> = vec![vec![false; s]; nodes.len()];
        let mut settled_at = None;
        for round in 0..40 {
            let mut changed = false;
            for (i, n) in nodes.iter().enumerate() {
                let views: Vec<SlabView> = (0..s).map(|j| view_of(&nodes, &holds, i, j, demand[j], &p)).collect();
                let d = decide(n, &views, &p);
                for k in &d.drop {
                    holds[i][(k.layer * 8 + k.expert) as usize] = false;
                }
                for k in &d.fetch {
                    holds[i][(k.layer * 8 + k.expert) as usize] = true;
                }
                changed |= !d.is_empty();
                let used = holds[i].iter().filter(|&&h| h).count() as u64 * 10;
                prop_assert!(used <= n.budget);
            }
            if !changed {
                settled_at = Some(round);
                break;
            }
        }
        prop_assert!(settled_at.is_some(), "still moving after 40 rounds");
        let room: usize = nodes.iter().map(|n| (n.budget / 10).min(s as u64) as usize).sum();
        if room >= p.target * s {
            for j in 0..s {
                let r = holds.iter().filter(|h| h[j]).count();
                prop_assert!(r >= p.target, "slab {} has {} replicas with room for all", j, r);
            }
        }
    }

    #[test]
    fn nodes_deciding_at_once_on_one_view_never_take_a_slab_below_its_target(
        budgets in proptest::collection::vec(1u64..30, 2..8),
        holding in proptest::collection::vec(proptest::collection::vec(any::<bool>(), 1..30), 8),
        demand in proptest::collection::vec(0.0f64..1000.0, 30),
    ) {
        // Freshly held everywhere (the hold time counts for nothing in a repair), every node
        // full or nearly, deciding on the same snapshot.
        let p = Policy::default();
        let s = holding.iter().map(Vec::len).min().unwrap_or(1);
        let nodes: Vec<NodeView> = budgets.iter().enumerate()
            .map(|(i, &b)| node(i as u8, NodeClass::Computer, b * 10)).collect();
        let holds: Vec<Vec<bool>> = (0..nodes.len()).map(|i| {
            let mut h = holding[i][..s].to_vec();
            let mut used = 0;
            for x in h.iter_mut() {
                if *x && used + 10 > nodes[i].budget { *x = false; }
                if *x { used += 10; }
            }
            h
        }).collect();
        let mut after = holds.clone();
        for (i, n) in nodes.iter().enumerate() {
            let views: Vec<SlabView> = (0..s)
                .map(|j| view_of(&nodes, &holds, i, j, demand[j], &p))
                .collect();
            let views: Vec<SlabView> = views.into_iter()
                .map(|v| SlabView { held_since: v.held_since.map(|_| n.now), ..v })
                .collect();
            let d = decide(n, &views, &p);
            for k in &d.drop { after[i][(k.layer * 8 + k.expert) as usize] = false; }
        }
        for j in 0..s {
            let before = holds.iter().filter(|h| h[j]).count();
            let now = after.iter().filter(|h| h[j]).count();
            prop_assert!(now >= before.min(p.target), "slab {} went from {} to {}", j, before, now);
        }
    }

    #[test]
    fn full_nodes_holding_fresh_replicas_still_repair_every_shortage_when_room_allows(
        budgets in proptest::collection::vec(1u64..12, 3..7),
        demand in proptest::collection::vec(0.0f64..1000.0, 4..16),
        seed in any::<u64>(),
    ) {
        // Every node full of slabs fetched a moment ago (the hold time blocks every swap but
        // a repair), placed at random: some slabs short, some with replicas to spare.
        let p = Policy::default();
        let s = demand.len();
        let nodes: Vec<NodeView> = budgets.iter().enumerate()
            .map(|(i, &b)| node(i as u8, NodeClass::Computer, b.min(s as u64) * 10)).collect();
        let mut rng = seed;
        let mut holds: Vec<Vec<bool>> = nodes.iter().map(|n| {
            let mut h = vec![false; s];
            let mut want = (n.budget / 10) as usize;
            while want > 0 {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let j = (rng >> 33) as usize % s;
                if !h[j] { h[j] = true; want -= 1; }
            }
            h
        }).collect();
        let room: usize = nodes.iter().map(|n| (n.budget / 10) as usize).sum();
        for _round in 0..60 {
            for (i, n) in nodes.iter().enumerate() {
                let views: Vec<SlabView> = (0..s)
                    .map(|j| view_of(&nodes, &holds, i, j, demand[j], &p))
                    .map(|v| SlabView { held_since: v.held_since.map(|_| n.now), ..v })
                    .collect();
                let d = decide(n, &views, &p);
                for k in &d.drop { holds[i][(k.layer * 8 + k.expert) as usize] = false; }
                for k in &d.fetch { holds[i][(k.layer * 8 + k.expert) as usize] = true; }
            }
        }
        if room >= p.target * s {
            for j in 0..s {
                let r = holds.iter().filter(|h| h[j]).count();
                prop_assert!(r >= p.target, "slab {} has {} replicas with room for all: {:?}", j, r, holds);
            }
        }
    }
}

proptest! {
    #[test]
    fn the_want_key_orders_as_tier_then_score_highest_first_then_tie(
        a in (0u8..3, any::<u64>(), any::<u64>()),
        b in (0u8..3, any::<u64>(), any::<u64>()),
    ) {
        let want = |(tier, bits, tie): (u8, u64, u64)| Want { rank: Rank { tier, score: f64::from_bits(bits) }, tie };
        let (x, y) = (want(a), want(b));
        let expected = x
            .rank
            .tier
            .cmp(&y.rank.tier)
            .then(y.rank.score.total_cmp(&x.rank.score))
            .then(x.tie.cmp(&y.tie));
        prop_assert_eq!(x.key().cmp(&y.key()), expected);
    }
}

#[test]
fn two_nodes_rank_the_slabs_of_a_layer_in_unrelated_orders() {
    let model = ModelId(BlobId::of(b"m"));
    let order = |n: u8| {
        let seed = TieSeed::of(&NodeKey([n; 32]), &model);
        let mut slabs: Vec<u32> = (0..256).collect();
        slabs.sort_by_key(|&e| seed.tie(7, e));
        slabs
    };
    // Spearman's rank correlation of two nodes' orders: near 0 for unrelated orders
    // (its deviation over 256 ranks is about 0.06), 1 for the same order.
    let (a, b) = (order(1), order(2));
    let rank = |o: &[u32]| {
        let mut r = [0f64; 256];
        for (i, &e) in o.iter().enumerate() {
            r[e as usize] = i as f64;
        }
        r
    };
    let (ra, rb) = (rank(&a), rank(&b));
    let d2: f64 = (0..256).map(|e| (ra[e] - rb[e]).powi(2)).sum();
    let rho = 1.0 - 6.0 * d2 / (256.0 * (256.0f64.powi(2) - 1.0));
    assert!(rho.abs() < 0.25, "rank correlation {rho}");
    assert_ne!(a, b);
    assert_eq!(
        tie(
            &NodeKey([1; 32]),
            &SlabKey {
                model,
                layer: 7,
                expert: 3
            }
        ),
        TieSeed::of(&NodeKey([1; 32]), &model).tie(7, 3)
    );
}
