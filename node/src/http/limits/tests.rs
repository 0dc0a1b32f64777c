//! Properties of the eviction choice, over any table of open connections.

use super::*;
use proptest::prelude::*;

fn limits(max: usize, per: usize) -> HttpLimits {
    HttpLimits {
        max_connections: max,
        per_client: per,
        ..HttpLimits::default()
    }
}

fn ip(n: u8) -> IpAddr {
    IpAddr::from([10, 0, 0, n])
}

/// Open connections within the bounds: (address 0..6, busy, idle since).
fn table() -> impl Strategy<Value = (Vec<ConnectionView>, usize, usize)> {
    (1usize..24, 1usize..12).prop_flat_map(|(max, per)| {
        proptest::collection::vec((0u8..6, any::<bool>(), 0u64..1000), 0..=max).prop_map(
            move |rows| {
                let mut held = HashMap::new();
                let open = rows
                    .into_iter()
                    .enumerate()
                    .filter(|(_, (a, _, _))| {
                        let n = held.entry(*a).or_insert(0usize);
                        *n += 1;
                        *n <= per
                    })
                    .map(|(k, (a, busy, since))| ConnectionView {
                        key: k as u64,
                        ip: ip(a),
                        busy,
                        idle_since_ms: since,
                    })
                    .collect();
                (open, max, per)
            },
        )
    })
}

proptest! {
    #[test]
    fn a_newcomer_is_turned_away_only_when_all_it_could_displace_are_serving(
        (open, max, per) in table(), from in 0u8..7,
    ) {
        let l = limits(max, per);
        let newcomer = ip(from);
        match choose_eviction(&open, newcomer, &l) {
            Admission::Room => {
                prop_assert!(open.len() < max);
                prop_assert!(open.iter().filter(|c| c.ip == newcomer).count() < per);
            }
            Admission::Evict(key) => {
                let gone = open.iter().find(|c| c.key == key).unwrap();
                prop_assert!(!gone.busy, "a connection serving a request was cut");
                let mut after: Vec<_> = open.iter().filter(|c| c.key != key).copied().collect();
                after.push(ConnectionView { key: 999, ip: newcomer, busy: false, idle_since_ms: 0 });
                prop_assert!(after.len() <= max.max(open.len()));
                prop_assert!(after.iter().filter(|c| c.ip == newcomer).count() <= per);
                // At the address bound only the address's own connections are cut.
                if open.iter().filter(|c| c.ip == newcomer).count() >= per {
                    prop_assert_eq!(gone.ip, newcomer);
                }
            }
            Admission::Refuse => {
                let mine_full = open.iter().filter(|c| c.ip == newcomer).count() >= per;
                let idle_in_scope = open
                    .iter()
                    .any(|c| !c.busy && (!mine_full || c.ip == newcomer));
                prop_assert!(!idle_in_scope, "turned away while an idle connection could go");
            }
        }
    }

    #[test]
    fn at_the_total_bound_the_biggest_holder_loses_its_longest_idle_connection(
        (open, max, per) in table(), from in 0u8..7,
    ) {
        let l = limits(max, per);
        let newcomer = ip(from);
        let mine = open.iter().filter(|c| c.ip == newcomer).count();
        if let (true, Admission::Evict(key)) = (mine < per, choose_eviction(&open, newcomer, &l)) {
            let count = |a: IpAddr| open.iter().filter(|c| c.ip == a).count();
            let gone = open.iter().find(|c| c.key == key).unwrap();
            for c in open.iter().filter(|c| !c.busy) {
                prop_assert!(count(c.ip) <= count(gone.ip));
                if c.ip == gone.ip {
                    prop_assert!(c.idle_since_ms >= gone.idle_since_ms);
                }
            }
        }
    }
}

#[test]
fn kept_alive_pingers_from_four_addresses_never_lock_out_a_fifth() {
    // The default bounds, and bounds where four addresses can fill the table.
    for l in [HttpLimits::default(), limits(256, 64)] {
        pingers_and_a_fifth(l);
    }
}

fn pingers_and_a_fifth(l: HttpLimits) {
    let mut open = Vec::new();
    // 256 kept-alive connections from four addresses, between pings (idle).
    for k in 0..256u64 {
        let from = ip((k % 4) as u8);
        if let Admission::Evict(gone) = choose_eviction(&open, from, &l) {
            open.retain(|c: &ConnectionView| c.key != gone);
        }
        open.push(ConnectionView {
            key: k,
            ip: from,
            busy: false,
            idle_since_ms: k,
        });
    }
    assert!(open.len() <= l.max_connections);
    for a in 0..4 {
        assert!(open.iter().filter(|c| c.ip == ip(a)).count() <= l.per_client);
    }
    // Forty newcomers from another address each get in, are served and close; where the
    // pingers filled the table, the first one's room was one of theirs.
    let full = l.per_client * 4 >= l.max_connections;
    assert_eq!(open.len() == l.max_connections, full);
    for k in 0..40u64 {
        match choose_eviction(&open, ip(5), &l) {
            Admission::Evict(gone) => {
                let cut = open.iter().find(|c| c.key == gone).unwrap();
                assert_ne!(
                    cut.ip,
                    ip(5),
                    "a pinger's connection goes, not the newcomer's own"
                );
                open.retain(|c| c.key != gone);
            }
            Admission::Room => assert!(!full || k > 0, "room in a full table"),
            Admission::Refuse => panic!("newcomer {k} turned away"),
        }
    }
}
