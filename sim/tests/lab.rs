//! The network lab's links against a probe of their own: the round trip asked for is the one
//! measured, losses are lost, bandwidth is bounded, and nothing the lab made outlives it.
//! Skipped, saying why, where the lab cannot run (no root, no `ip`, no TUN).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use moeswarm_sim::lab::link::{End, Link, Shape};
use moeswarm_sim::lab::netns::{self, Namespace};
use moeswarm_sim::lab::probe::{round_trips, Echo};

const A: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);

fn lab_runs_here() -> bool {
    let why = moeswarm_sim::lab::skip_reason();
    if let Some(why) = &why {
        eprintln!("skipped: {why}");
    }
    why.is_none()
}

/// Two namespaces joined by a link shaped `ab` from a to b and `ba` back.
fn pair(ab: Shape, ba: Shape, seed: u64) -> (Namespace, Namespace, Link) {
    let a = Namespace::create("a").unwrap();
    let b = Namespace::create("b").unwrap();
    let end = |ns, addr| End {
        ns,
        device: "lab0".into(),
        addr,
    };
    let link = Link::start(end(&a, A), end(&b, B), ab, ba, seed).unwrap();
    (a, b, link)
}

fn one_way(ms: f64) -> Shape {
    Shape {
        delay: Duration::from_secs_f64(ms / 1e3),
        ..Shape::default()
    }
}

#[test]
fn a_link_gives_the_round_trip_asked_for_within_a_tenth_and_a_fifth_of_a_millisecond() {
    if !lab_runs_here() {
        return;
    }
    for ms in [0.0, 1.0, 5.0, 15.0] {
        let (a, b, _link) = pair(one_way(ms), one_way(ms), 1);
        let echo = Echo::start(&b, B).unwrap();
        let r = round_trips(&a, A, echo.addr, 60, Duration::from_secs(1)).unwrap();
        assert_eq!(r.lost(), 0.0, "{r:?}");
        let asked = 2.0 * ms;
        let got = r.median().unwrap().as_secs_f64() * 1e3;
        eprintln!("asked {asked} ms, measured {got:.3} ms");
        // With nothing asked, what is left is the emulator's own hand-offs (four thread
        // wake-ups a round trip): tens of microseconds on a quiet machine, 0.2 ms and more
        // where builds share the cores.
        let within = if ms == 0.0 { 1.0 } else { 0.1 * asked + 0.2 };
        assert!(
            (got - asked).abs() <= within,
            "asked {asked} ms, measured {got:.3} ms"
        );
    }
}

#[test]
fn jitter_spreads_round_trips_within_its_bounds_and_loss_loses_that_share() {
    if !lab_runs_here() {
        return;
    }
    let shape = Shape {
        delay: Duration::from_millis(4),
        jitter: Duration::from_millis(2),
        loss: 0.1,
        rate: 0,
    };
    let (a, b, link) = pair(shape, shape, 7);
    let echo = Echo::start(&b, B).unwrap();
    let r = round_trips(&a, A, echo.addr, 600, Duration::from_millis(50)).unwrap();
    // Both ways at 10 %: 19 % of round trips lost (binomial sd 1.6 % over 600).
    assert!((0.13..0.25).contains(&r.lost()), "lost {}", r.lost());
    let mut ms: Vec<f64> = r.times.iter().map(|t| t.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    // Between 4 and 12 ms; the 5th and 95th percentiles (a busy machine's scheduler may hold a
    // thread a millisecond now and then).
    let (lo, hi) = (ms[ms.len() / 20], ms[ms.len() * 19 / 20]);
    eprintln!(
        "round trips: 5th percentile {lo:.2} ms, 95th {hi:.2} ms, lost {:.3}",
        r.lost()
    );
    assert!(ms[0] >= 4.0 - 0.2 && hi <= 12.0 + 0.5, "{lo}..{hi}");
    assert!(
        hi - lo > 4.0,
        "jitter did not spread the round trips: {lo}..{hi}"
    );
    let st = &link.stats[0];
    assert!(st.dropped.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn a_links_rate_bounds_a_tcp_transfer() {
    if !lab_runs_here() {
        return;
    }
    let rate = 2_000_000;
    let shape = Shape {
        delay: Duration::from_millis(1),
        rate,
        ..Shape::default()
    };
    let (a, b, _link) = pair(shape, shape, 3);
    let listener = b.within(|| TcpListener::bind((B, 0))).unwrap().unwrap();
    let to = listener.local_addr().unwrap();
    let bytes = 3_000_000usize;
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut got = 0;
        let mut buf = vec![0u8; 65536];
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            got += n;
        }
        got
    });
    let secs = a
        .within(move || {
            let mut s = TcpStream::connect(to).unwrap();
            let chunk = vec![7u8; 65536];
            let t = Instant::now();
            let mut sent = 0;
            while sent < bytes {
                let n = chunk.len().min(bytes - sent);
                s.write_all(&chunk[..n]).unwrap();
                sent += n;
            }
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut end = [0u8; 1];
            let _ = s.read(&mut end);
            t.elapsed().as_secs_f64()
        })
        .unwrap();
    assert_eq!(server.join().unwrap(), bytes);
    let achieved = bytes as f64 / secs;
    eprintln!("{achieved:.0} B/s through a {rate} B/s link");
    // Headers take ~4 % of the wire; the transfer's start and end a little more.
    assert!(
        (0.8 * rate as f64..=1.02 * rate as f64).contains(&achieved),
        "{achieved} B/s through a {rate} B/s link"
    );
}

#[test]
fn a_lab_leaves_nothing_behind_and_the_next_run_sweeps_what_a_killed_one_left() {
    if !lab_runs_here() {
        return;
    }
    let list = || {
        let out = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let name = {
        let (a, _b, _link) = pair(one_way(1.0), one_way(1.0), 1);
        let name = a.name().to_string();
        assert!(list().contains(&name));
        name
    };
    assert!(!list().contains(&name), "{name} outlived its lab");
    // A namespace named after a process that no longer exists, as a killed run leaves it.
    let stale = format!("{}999999999-0-x", netns::PREFIX);
    netns::ip(&["netns", "add", &stale]).unwrap();
    netns::sweep_leftovers();
    assert!(!list().contains(&stale), "{stale} was not swept");
}

#[test]
fn a_cone_nat_keeps_one_mapping_for_every_destination_and_a_symmetric_one_does_not() {
    use moeswarm_sim::lab::probe::seen_from;
    use moeswarm_sim::lab::topology::{Nat, Network, Scenario};
    if !lab_runs_here() {
        return;
    }
    let scenario = Scenario::parse(
        r#"
        [[host]]
        name = "pub1"
        link = { delay = 1.0 }
        [[host]]
        name = "pub2"
        link = { delay = 1.0 }
        [[host]]
        name = "home"
        nat = "cone"
        link = { delay = 2.0 }
        [[host]]
        name = "phone"
        nat = "symmetric"
        link = { delay = 2.0 }
        "#,
    )
    .unwrap();
    let net = Network::build(&scenario, 1).unwrap();
    let r1 = Echo::reflector(
        &net.host("pub1").unwrap().ns,
        net.host("pub1").unwrap().addr,
    )
    .unwrap();
    let r2 = Echo::reflector(
        &net.host("pub2").unwrap().ns,
        net.host("pub2").unwrap().addr,
    )
    .unwrap();
    let seen = |name: &str| {
        let h = net.host(name).unwrap();
        (h, seen_from(&h.ns, h.addr, &[r1.addr, r2.addr]).unwrap())
    };
    // A public host is seen as itself.
    let (pub2, s) = seen("pub2");
    assert_eq!(s[0].ip(), pub2.addr);
    assert_eq!(pub2.nat, Nat::None);
    // Behind the cone NAT: the gateway's address, one port for both destinations.
    let (home, s) = seen("home");
    assert_eq!(s[0].ip(), home.public, "{s:?}");
    assert_ne!(home.addr, home.public);
    assert_eq!(s[0], s[1], "a cone NAT mapped one socket twice: {s:?}");
    // Behind the symmetric NAT: a new port for each destination.
    let (phone, s) = seen("phone");
    assert_eq!(s[0].ip(), phone.public, "{s:?}");
    assert_ne!(
        s[0].port(),
        s[1].port(),
        "a symmetric NAT kept one mapping: {s:?}"
    );
    // And nobody outside reaches a NAT'd host unasked.
    let echo = Echo::start(&home.ns, home.addr).unwrap();
    let unasked = round_trips(
        &net.host("pub1").unwrap().ns,
        net.host("pub1").unwrap().addr,
        std::net::SocketAddr::from((home.public, echo.addr.port())),
        3,
        Duration::from_millis(100),
    )
    .unwrap();
    assert_eq!(unasked.lost(), 1.0);
}

#[test]
fn scenarios_that_cannot_be_built_are_refused_with_the_reason() {
    use moeswarm_sim::lab::topology::Scenario;
    for (text, why) in [
        ("", "0 hosts"),
        ("[[host]]\nname = \"a b\"", "host name"),
        (
            "[[host]]\nname = \"a\"\n[[host]]\nname = \"a\"",
            "two hosts named a",
        ),
        (
            "[[host]]\nname = \"a\"\nlink = { loss = 1.5 }",
            "not a probability",
        ),
        (
            "[[host]]\nname = \"a\"\nlink = { delay = 1.0, jitter = 3.0 }",
            "exceeds the delay",
        ),
        (
            "[[host]]\nname = \"a\"\nnat = \"carrier\"",
            "unknown variant",
        ),
        ("[[host]]\nname = \"a\"\nlink = { delay = -1.0 }", "outside"),
    ] {
        let e = Scenario::parse(text).unwrap_err().to_string();
        assert!(e.contains(why), "{text:?}: {e}");
    }
}
