use std::collections::BTreeMap;

use moeswarm_market::choice::{decide, views, NodeView, SlabState};
use moeswarm_protocol::{BlobId, NodeKey};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

/// One random market round: other nodes' holdings, the deciding node's store and record,
/// the policy; the quick choice's answer (if any) beside `decide`'s.
fn round(seed: u64) -> (Option<Decision>, Decision) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (layers, experts) = (rng.random_range(1..=3u32), rng.random_range(2..=6u32));
    let slabs = (layers * experts) as usize;
    let model = ModelId(BlobId::of(b"quick"));
    let policy = Policy {
        target: rng.random_range(1..=3),
        swap_gain: [0.0, 0.5, 1.0][rng.random_range(0..3)],
        min_hold_secs: rng.random_range(0..=600),
        max_swaps: rng.random_range(0..=2),
        max_fetches: rng.random_range(0..=3),
    };
    let key = |n: u64| NodeKey(BlobId::of(&[seed.to_le_bytes(), n.to_le_bytes()].concat()).0);
    let me = key(u64::MAX);
    let others: Vec<NodeKey> = (0..rng.random_range(0..=8)).map(key).collect();
    let p: f64 = rng.random();
    let holds: Vec<Vec<bool>> = others
        .iter()
        .map(|_| (0..slabs).map(|_| rng.random_bool(p)).collect())
        .collect();
    let now = 1_000_000;
    let q: f64 = rng.random();
    let mut held = BTreeMap::new();
    let (mut counted, mut ghosts) = (Vec::new(), Vec::new());
    for s in 0..slabs as u32 {
        if rng.random_bool(q) {
            held.insert(s, now - rng.random_range(0..1000));
            // Fetched but not yet advertised, now and then.
            if rng.random_bool(0.9) {
                counted.push(s);
            }
        } else if rng.random_bool(0.1) {
            // Dropped, the record that named it still counted.
            counted.push(s);
            ghosts.push(s);
        }
    }
    let bytes = 100;
    let room = [0, 0, 1, 2, 3, 5][rng.random_range(0..6)] * bytes + rng.random_range(0..bytes);
    let budget = (held.len() as u64 * bytes + room).saturating_sub(if rng.random_bool(0.05) {
        2 * bytes
    } else {
        0
    });
    let class = if rng.random_bool(0.5) {
        NodeClass::Computer
    } else {
        NodeClass::Phone
    };

    let mut counts = Counts::new(slabs);
    let holders: Vec<Vec<NodeKey>> = (0..slabs)
        .map(|s| {
            let mut h: Vec<NodeKey> = (0..others.len())
                .filter(|&o| holds[o][s])
                .map(|o| others[o])
                .collect();
            if counted.contains(&(s as u32)) {
                h.push(me);
            }
            for _ in 0..h.len() {
                counts.up(s as u32);
            }
            h
        })
        .collect();
    let states: Vec<SlabState> = (0..slabs as u32)
        .map(|s| SlabState {
            slab: SlabKey {
                model,
                layer: s / experts,
                expert: s % experts,
            },
            bytes,
            holders: &holders[s as usize],
            held_since: held.get(&s).copied(),
            demand: 0.0,
        })
        .collect();
    let seen = views(&me, &states, others.iter().copied(), policy.target);
    let node = NodeView {
        node: me,
        class,
        budget,
        now,
    };
    let full = decide(&node, &seen, &policy);

    let lists = Lists(holders.clone());
    let bits: SlabBits = held.keys().copied().collect();
    let quick_me = Me {
        holds: &bits,
        key: me,
        holders: &lists,
        seed: TieSeed::of(&me, &model),
        class,
        budget,
        now,
        held: &held,
        counted: &counted,
        ghosts: &ghosts,
    };
    let shape = Shape {
        model,
        experts,
        slab_bytes: bytes,
    };
    let scan_limit = [0, 1, 3, SCAN_LIMIT][rng.random_range(0..4)];
    let mut order = None;
    let fast = quick(&quick_me, shape, &counts, &policy, &mut order, scan_limit);
    (fast, full)
}

struct Lists(Vec<Vec<NodeKey>>);

impl Holders for Lists {
    fn of(&self, s: u32) -> Vec<NodeKey> {
        self.0[s as usize].clone()
    }
}

#[test]
fn the_quick_choice_is_the_markets_wherever_it_answers_and_it_answers_most_rounds() {
    let (mut answered, mut fetching, mut idle, mut swapping) = (0, 0, 0, 0);
    let cases = 20_000;
    for seed in 0..cases {
        let (fast, full) = round(seed);
        if let Some(fast) = fast {
            assert_eq!(fast, full, "seed {seed}");
            answered += 1;
            if fast.is_empty() {
                idle += 1;
            } else if fast.drop.is_empty() {
                fetching += 1;
            } else {
                swapping += 1;
            }
        }
    }
    // Every kind of answer is exercised, and most rounds are answered.
    let kinds = format!("{fetching} fetching, {swapping} swapping, {idle} idle");
    assert!(
        answered > cases * 3 / 4,
        "answered {answered} of {cases}: {kinds}"
    );
    assert!(
        fetching > cases / 10 && idle > cases / 20 && swapping > cases / 50,
        "{kinds}"
    );
    eprintln!("{answered} of {cases} answered: {kinds}");
}

#[test]
fn a_node_with_room_takes_the_slabs_nobody_holds_in_its_tie_order() {
    let model = ModelId(BlobId::of(b"quick"));
    let me = NodeKey([7; 32]);
    let seed = TieSeed::of(&me, &model);
    let mut counts = Counts::new(64);
    // Slabs 0..60 have one holder; 60..64 none.
    for s in 0..60 {
        counts.up(s);
    }
    let held = BTreeMap::new();
    let lists = Lists(vec![Vec::new(); 64]);
    let node = Me {
        holds: &SlabBits::default(),
        key: me,
        holders: &lists,
        seed,
        class: NodeClass::Computer,
        budget: 10_000,
        now: 0,
        held: &held,
        counted: &[],
        ghosts: &[],
    };
    let shape = Shape {
        model,
        experts: 8,
        slab_bytes: 100,
    };
    let policy = Policy::default();
    let mut order = None;
    let d = quick(&node, shape, &counts, &policy, &mut order, 0).expect("room for two");
    let mut nobody: Vec<u32> = (60..64).collect();
    nobody.sort_by_key(|&s| seed.tie(s / 8, s % 8));
    let mut expected: Vec<SlabKey> = nobody[..2]
        .iter()
        .map(|&s| SlabKey {
            model,
            layer: s / 8,
            expert: s % 8,
        })
        .collect();
    expected.sort();
    assert_eq!(d.fetch, expected);
    assert!(d.drop.is_empty());
    assert!(
        order.is_some(),
        "the group of 4 was walked in the tie order"
    );
}
