//! Replica choice for one dispatch: which of the nodes holding a slab the router sends it to.
//!
//! The rule, in order: never a node excluded for this dispatch (it failed or is already being
//! retried); fewer recent failures first; then the lowest expected wait: the measured round
//! trip times one more than the requests in flight (a node never measured counts as twice the
//! median of those measured: new nodes get tried when the measured ones are busy, and a record
//! alone, made up or not, never outranks a node that answered; a measurement not refreshed for
//! a while moves toward the fastest one measured, [`STALE_HALF_LIFE_MS`], so a node once slow is
//! tried again rather than never measured again), doubled for a node behind a relay (one more hop,
//! and a relay's capacity is shared; doubled again for a node not yet proven); then direct
//! before relayed; then the smaller tie-break, a number the router draws from a secret of its
//! own and the node's key ([`tie_break`]), so that no one can grind a key that wins ties at
//! every router. So direct nodes are preferred, but relayed ones take load when direct ones
//! are busy. The same views give the same choice whatever their order.

use moeswarm_protocol::NodeKey;

/// What the router knows of one replica now.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaView {
    /// The node.
    pub node: NodeKey,
    /// Reached without a relay.
    pub direct: bool,
    /// Smoothed round trip in milliseconds, if measured.
    pub latency_ms: Option<f64>,
    /// How long ago that round trip was last measured, in milliseconds.
    pub latency_age_ms: u64,
    /// Requests to it in flight.
    pub in_flight: u32,
    /// Recent failures (timeouts, refusals, bad replies).
    pub failures: u32,
    /// Must not be chosen for this dispatch (it failed, or is quarantined).
    pub excluded: bool,
    /// Its answers passed the router's checks so far ([`crate::trust::CheckRecord::proven`]).
    pub proven: bool,
    /// Where it stands among equals ([`tie_break`]).
    pub tie_break: u64,
}

/// A node's tie-break at a router with secret `secret`: the first 8 bytes of the keyed
/// blake3 of its key. Unknown without the secret, so a key cannot be ground to come first.
pub fn tie_break(secret: &[u8; 32], node: &NodeKey) -> u64 {
    let h = blake3::keyed_hash(secret, &node.0);
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8]))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 1.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The index of the replica to use, or `None` when every one is excluded.
pub fn choose(replicas: &[ReplicaView]) -> Option<usize> {
    let typical = median(replicas.iter().filter_map(|r| r.latency_ms).collect());
    let best = replicas
        .iter()
        .filter_map(|r| r.latency_ms)
        .fold(f64::INFINITY, f64::min);
    let wait = |r: &ReplicaView| {
        let hop = if r.direct { 1.0 } else { 2.0 };
        let standing = if r.proven { 1.0 } else { 2.0 };
        let expected = match r.latency_ms {
            Some(l) => relax(l, best, r.latency_age_ms),
            None => 2.0 * typical,
        };
        expected.max(0.0) * (1 + r.in_flight) as f64 * hop * standing
    };
    replicas
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.excluded)
        .min_by(|(_, a), (_, b)| {
            a.failures
                .cmp(&b.failures)
                .then(wait(a).total_cmp(&wait(b)))
                .then((!a.direct).cmp(&!b.direct))
                .then(a.tie_break.cmp(&b.tie_break))
                .then(a.node.cmp(&b.node))
        })
        .map(|(i, _)| i)
}

/// How fast an unrefreshed round trip estimate moves toward the fastest one measured (what the
/// node might be doing now): half the way every
/// this many milliseconds. A node priced out of every choice is never measured again, so what
/// the router knows of it must age (one slow answer from a phone that has since become fast, a
/// worker whose first answers paid for its connection).
pub const STALE_HALF_LIFE_MS: u64 = 1_000;

/// `latency_ms` measured `age_ms` ago, moved toward `toward` by its age.
pub fn relax(latency_ms: f64, toward: f64, age_ms: u64) -> f64 {
    let kept = 0.5f64.powf(age_ms as f64 / STALE_HALF_LIFE_MS as f64);
    toward + (latency_ms - toward) * kept
}

/// How far above the estimate one sample counts: a single stall (a page fault, a preempted
/// thread) moves the estimate at most 75 % up, where taken whole it would price the worker
/// out of every choice (and, never chosen again, it would never be measured again). A worker
/// that really slowed down gets there in a few answers.
pub const SPIKE_CAP: f64 = 4.0;

/// Exponentially smoothed round trip: `old` moved a quarter of the way to `sample`, a sample
/// counting as at most [`SPIKE_CAP`] times `old`.
pub fn smooth_latency(old: Option<f64>, sample_ms: f64) -> f64 {
    match old {
        None => sample_ms,
        Some(o) => o + (sample_ms.min(o * SPIKE_CAP) - o) * 0.25,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn view(k: u8, direct: bool, lat: Option<f64>, in_flight: u32, failures: u32) -> ReplicaView {
        ReplicaView {
            node: NodeKey([k; 32]),
            direct,
            latency_ms: lat,
            latency_age_ms: 0,
            in_flight,
            failures,
            excluded: false,
            proven: true,
            tie_break: tie_break(&[7; 32], &NodeKey([k; 32])),
        }
    }

    #[test]
    fn reliable_then_fast_with_relays_counted_double() {
        let v = vec![
            view(1, false, Some(1.0), 0, 0),
            view(2, true, Some(1.5), 0, 0),
            view(3, true, Some(0.1), 0, 1),
        ];
        assert_eq!(
            choose(&v),
            Some(1),
            "relayed 1 ms waits 2 ms; the failed one is last"
        );
        let v = vec![
            view(1, false, Some(1.0), 0, 0),
            view(2, true, Some(1.0), 2, 0),
        ];
        assert_eq!(
            choose(&v),
            Some(0),
            "a busy direct node yields to an idle relayed one"
        );
        let v = vec![view(2, false, None, 0, 0), view(1, true, None, 0, 0)];
        assert_eq!(choose(&v), Some(1));
        // Among equals, the router's secret decides, not the key.
        let v = vec![view(1, true, None, 0, 0), view(2, true, None, 0, 0)];
        let by_secret = |s: u8| {
            let mut v = v.clone();
            for r in &mut v {
                r.tie_break = tie_break(&[s; 32], &r.node);
            }
            choose(&v)
        };
        let picks: std::collections::BTreeSet<_> = (0..16).map(by_secret).collect();
        assert_eq!(picks.len(), 2, "each key wins ties at some routers");
        let v = vec![
            view(1, true, Some(2.0), 0, 0),
            view(2, true, Some(1.0), 3, 0),
        ];
        assert_eq!(
            choose(&v),
            Some(0),
            "1 ms × 4 in flight waits longer than 2 ms × 1"
        );
        let mut v = vec![
            view(1, true, Some(1.0), 0, 0),
            view(2, true, Some(0.6), 0, 0),
        ];
        v[1].proven = false;
        assert_eq!(
            choose(&v),
            Some(0),
            "a fast node not yet proven counts double"
        );
        let mut v = vec![view(1, true, None, 0, 0)];
        v[0].excluded = true;
        assert_eq!(choose(&v), None);
    }

    fn arb_view() -> impl Strategy<Value = ReplicaView> {
        (
            any::<u8>(),
            any::<bool>(),
            proptest::option::of(0.0f64..100.0),
            0u32..5,
            0u32..3,
            any::<bool>(),
            any::<bool>(),
            0u64..10_000,
        )
            .prop_map(|(k, d, l, f, x, e, p, age)| {
                let mut v = view(k, d, l, f, x);
                v.excluded = e;
                v.proven = p;
                v.latency_age_ms = age;
                v
            })
    }

    #[test]
    fn a_node_once_slow_is_tried_again_once_what_is_known_of_it_has_aged() {
        // Eight groups for two nodes: the fast one's wait grows with each planned one.
        let pick_slow_for = |age_ms| {
            let mut fast = view(1, true, Some(0.5), 0, 0);
            let mut slow = view(2, true, Some(8.0), 0, 0);
            slow.latency_age_ms = age_ms;
            (0..8)
                .filter(|_| {
                    let v = vec![fast.clone(), slow.clone()];
                    let k = choose(&v).unwrap();
                    if k == 0 {
                        fast.in_flight += 1;
                    } else {
                        slow.in_flight += 1;
                    }
                    k == 1
                })
                .count()
        };
        assert_eq!(pick_slow_for(0), 0, "fresh, the slow one is passed over");
        assert!(
            pick_slow_for(10 * STALE_HALF_LIFE_MS) >= 1,
            "aged, it is tried"
        );
        assert!((relax(8.0, 2.0, 0) - 8.0).abs() < 1e-12);
        assert!((relax(8.0, 2.0, STALE_HALF_LIFE_MS) - 5.0).abs() < 1e-12);
        assert!((relax(1.0, 2.0, STALE_HALF_LIFE_MS) - 1.5).abs() < 1e-12);
    }

    #[test]
    fn one_stall_does_not_price_a_worker_out_and_a_lasting_slowdown_shows() {
        let spiked = smooth_latency(Some(1.0), 30.0);
        assert!((spiked - 1.75).abs() < 1e-12, "{spiked}");
        let mut l = 1.0;
        for _ in 0..6 {
            l = smooth_latency(Some(l), 10.0);
        }
        assert!(l > 7.0, "six answers at 10 ms move 1 ms to {l}");
    }

    proptest! {
        #[test]
        fn the_estimate_moves_towards_each_sample_and_at_most_three_quarters_up(
            old in 0.001f64..1e4,
            sample in 0.0f64..1e5,
        ) {
            let new = smooth_latency(Some(old), sample);
            prop_assert!(new <= old * 1.75 + 1e-9);
            prop_assert!((new - old) * (sample - old) >= 0.0);
            prop_assert!(new >= old.min(sample) - 1e-9 && new <= old.max(sample) + 1e-9);
        }

        #[test]
        fn the_choice_is_a_live_replica_and_ignores_order(
            mut v in proptest::collection::vec(arb_view(), 0..8).prop_map(|mut v| {
                v.sort_by_key(|r| r.node);
                v.dedup_by_key(|r| r.node);
                v
            }),
            seed in any::<u64>(),
        ) {
            let pick = choose(&v).map(|i| v[i].node);
            match pick {
                None => prop_assert!(v.iter().all(|r| r.excluded)),
                Some(k) => {
                    let r = v.iter().find(|r| r.node == k).unwrap();
                    prop_assert!(!r.excluded);
                    prop_assert!(v.iter().all(|o| o.excluded || o.failures >= r.failures));
                }
            }
            // Any order of the same views gives the same node.
            let n = v.len().max(1);
            v.rotate_left((seed as usize) % n);
            prop_assert_eq!(choose(&v).map(|i| v[i].node), pick);
        }
    }
}
