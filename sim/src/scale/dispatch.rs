//! One dispatch's time: the network between a router and a worker, and the worker's compute.
//!
//! A round trip is twice the two ends' one-way latencies, plus the regions' distance, plus a
//! relay's detour when the worker can only be reached through one (behind a symmetric NAT: the
//! router dials it, and no hole can be punched). The rows travel as f16 at the slower of the
//! two links each way (no faster than the relay through one). A worker computes one dispatch
//! at a time: each dispatch takes the first stretch of its time line free for as long as it
//! needs from when its rows have arrived ([`Calendar`]). The simulator works out a router's
//! whole step when it begins, so a worker's time is booked ahead; a later booking for an
//! earlier time fits in a gap before it, as the worker would have served it first.

use super::scenario::{Compute, Nat};

/// A worker's booked compute: intervals `[start, end)` in ms, ascending, not overlapping.
#[derive(Debug, Clone, Default)]
pub struct Calendar {
    busy: Vec<(f64, f64)>,
}

impl Calendar {
    /// Books `len` ms at the first free time from `ready`; returns when it starts. Forgets
    /// what ended before `now` (nothing is booked before now).
    pub fn book(&mut self, now: f64, ready: f64, len: f64) -> f64 {
        let gone = self.busy.partition_point(|&(_, end)| end <= now);
        self.busy.drain(..gone);
        let mut t = ready;
        let mut at = self.busy.len();
        for (k, &(s, e)) in self.busy.iter().enumerate() {
            if e <= t {
                continue;
            }
            if s >= t + len {
                at = k;
                break;
            }
            t = t.max(e);
        }
        self.busy.insert(at, (t, t + len));
        t
    }
}

/// One end of a dispatch, as the network and the compute see it.
#[derive(Debug, Clone, Copy)]
pub struct End {
    /// One-way latency to the internet, ms.
    pub latency_ms: f64,
    /// Its region.
    pub region: usize,
    /// Link rates, bytes a ms.
    pub up: f64,
    pub down: f64,
    pub nat: Nat,
}

/// The network's constants.
#[derive(Debug, Clone, Copy)]
pub struct Net {
    pub relay_ms: f64,
    /// Bytes a ms through a relay.
    pub relay_rate: f64,
    pub inter_region_ms: f64,
}

/// Whether a router (which has a public address) reaches `worker` only through a relay.
pub fn via_relay(worker: Nat) -> bool {
    worker == Nat::Symmetric
}

/// A dispatch's round trip without its bytes or compute, ms.
pub fn round_trip(net: &Net, router: &End, worker: &End) -> f64 {
    let mut rtt = 2.0 * (router.latency_ms + worker.latency_ms);
    if router.region != worker.region {
        rtt += net.inter_region_ms;
    }
    if via_relay(worker.nat) {
        rtt += net.relay_ms;
    }
    rtt
}

/// Ms to carry `bytes` from `a` to `b` (through a relay when `relay`).
pub fn carry(net: &Net, bytes: f64, a: &End, b: &End, relay: bool) -> f64 {
    let mut rate = a.up.min(b.down);
    if relay {
        rate = rate.min(net.relay_rate);
    }
    bytes / rate
}

/// Ms a worker computes `experts` experts over `rows` rows in all (each expert at least one).
pub fn compute_ms(c: &Compute, experts: u32, rows: u32) -> f64 {
    experts as f64 * c.expert_ms + rows.saturating_sub(experts) as f64 * c.row_ms
}

/// Bytes of `rows` activation rows of `hidden` f16 values.
pub fn row_bytes(rows: u32, hidden: u32) -> f64 {
    rows as f64 * hidden as f64 * 2.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bookings_never_overlap_and_start_once_ready(
            asks in proptest::collection::vec((0.0f64..100.0, 0.1f64..20.0), 1..40),
        ) {
            let mut c = Calendar::default();
            let mut got = Vec::new();
            for &(ready, len) in &asks {
                let s = c.book(0.0, ready, len);
                prop_assert!(s >= ready);
                got.push((s, s + len));
            }
            got.sort_by(|a, b| a.0.total_cmp(&b.0));
            for w in got.windows(2) {
                prop_assert!(w[0].1 <= w[1].0 + 1e-9, "{:?}", w);
            }
        }
    }

    #[test]
    fn an_earlier_dispatch_fits_in_the_gap_before_a_later_booking() {
        let mut c = Calendar::default();
        assert_eq!(c.book(0.0, 150.0, 10.0), 150.0);
        assert_eq!(c.book(0.0, 20.0, 2.0), 20.0, "served first");
        assert_eq!(
            c.book(0.0, 145.0, 10.0),
            160.0,
            "does not fit before: after"
        );
        // Forgotten once over.
        assert_eq!(c.book(200.0, 200.0, 1.0), 200.0);
        assert_eq!(c.busy.len(), 1);
    }

    #[test]
    fn a_relay_and_another_region_lengthen_the_round_trip() {
        let net = Net {
            relay_ms: 20.0,
            relay_rate: 2500.0,
            inter_region_ms: 80.0,
        };
        let end = |nat, region| End {
            latency_ms: 10.0,
            region,
            up: 1e4,
            down: 1e4,
            nat,
        };
        let r = end(Nat::None, 0);
        assert_eq!(round_trip(&net, &r, &end(Nat::Cone, 0)), 40.0);
        assert_eq!(round_trip(&net, &r, &end(Nat::Symmetric, 0)), 60.0);
        assert_eq!(round_trip(&net, &r, &end(Nat::Cone, 1)), 120.0);
        let bytes = row_bytes(1, 3072);
        assert_eq!(carry(&net, bytes, &r, &r, true), bytes / 2500.0);
        let c = Compute {
            expert_ms: 1.0,
            row_ms: 0.5,
        };
        assert_eq!(compute_ms(&c, 2, 5), 2.0 + 1.5);
    }
}
