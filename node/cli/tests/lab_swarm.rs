//! `moeswarm` processes in the network lab (`moeswarm_sim::lab`): a seeder with the relay on a
//! public host, a public worker, a worker behind a cone NAT and one behind a symmetric NAT, each
//! link with its own round trip; the router's generation through them gives the local run's
//! tokens, and still does over a link that loses 2 % of its packets. Workers behind a NAT serve
//! through the relay (hole punching is not built yet). Skipped, saying why, where the lab
//! cannot run.

use moeswarm_testkit as common;

use std::time::{Duration, Instant};

use common::data;
use moeswarm_sim::lab::topology::{Nat, Network, Scenario};

mod nodes;
use nodes::{node_in, sliced_tiny, NodeProcess};

const BIN: &str = env!("CARGO_BIN_EXE_moeswarm");

/// `moeswarm args…` inside `ns`.
fn moeswarm_in(ns: &str, args: &[&str]) -> (i32, String, String) {
    let all: Vec<&str> = ["netns", "exec", ns, BIN]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    common::run_program("ip", &all)
}

fn scenario(worker_loss: f64) -> Scenario {
    Scenario::parse(&format!(
        r#"
        [[host]]
        name = "hub"
        link = {{ delay = 1.0 }}
        [[host]]
        name = "pubw"
        link = {{ delay = 3.0, jitter = 1.0, loss = {worker_loss} }}
        [[host]]
        name = "home"
        nat = "cone"
        link = {{ delay = 5.0, jitter = 1.0 }}
        [[host]]
        name = "phone"
        nat = "symmetric"
        link = {{ delay = 10.0, jitter = 2.0 }}
        "#
    ))
    .unwrap()
}

/// The swarm of `scenario` (with `worker_loss` on the public worker's link): the tokens the
/// router generates through it, and the local run's.
fn generate_through_the_lab(worker_loss: f64) -> (serde_json::Value, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let net = Network::build(&scenario(worker_loss), 1).unwrap();
    let host = |n: &str| net.host(n).unwrap();
    let file = data("tiny-q8_0.gguf");
    let f = file.to_str().unwrap();
    let (seed, model) = sliced_tiny(dir.path());
    let seed = seed.as_str();

    let hub = host("hub");
    let hub_ip = hub.addr.to_string();
    let relay_listen = format!("{hub_ip}:0");
    // The seeder relays and serves no dispatches itself.
    let seeder = node_in(
        Some(hub.ns.name()),
        &hub_ip,
        seed,
        &["--relay", "--relay-listen", &relay_listen],
    );
    let relay = seeder.relay.clone().expect("the relay's address");
    let mut workers: Vec<NodeProcess> = Vec::new();
    for name in ["pubw", "home", "phone"] {
        let h = host(name);
        let store = dir.path().join(name);
        let store = store.to_str().unwrap();
        let (code, _, err) = moeswarm_in(
            h.ns.name(),
            &[
                "fetch",
                "--bootstrap",
                &seeder.addr,
                "--model",
                &model,
                "--store",
                store,
            ],
        );
        assert_eq!(code, 0, "{name} fetching: {err}");
        let ip = h.addr.to_string();
        // Bound to every address, as on a LAN: it advertises the ones a router can dial.
        let reach: [&str; 2] = if h.nat == Nat::None {
            ["--dispatch", "0.0.0.0:0"]
        } else {
            ["--via-relay", &relay]
        };
        let mut args = vec!["--bootstrap", seeder.addr.as_str()];
        args.extend_from_slice(&reach);
        workers.push(node_in(Some(h.ns.name()), &ip, store, &args));
    }
    let router = dir.path().join("router");
    let router = router.to_str().unwrap();
    let args = ["--prompt", "through the lab", "--max-tokens", "8", "--json"];
    let swarm = [
        "generate",
        "--swarm",
        "--bootstrap",
        &seeder.addr,
        "--store",
        router,
        "--model-id",
        &model,
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    let remote = loop {
        let (code, out, err) = moeswarm_in(hub.ns.name(), &[&swarm[..], &args].concat());
        if code == 0 {
            break serde_json::from_str::<serde_json::Value>(&out).unwrap();
        }
        // The workers' records may not have reached the seeder yet.
        assert!(Instant::now() < deadline, "{err}");
        std::thread::sleep(Duration::from_millis(500));
    };
    let (code, out, err) =
        common::run_program(BIN, &[&["generate", "--model", f][..], &args].concat());
    assert_eq!(code, 0, "{err}");
    drop(workers);
    (remote, serde_json::from_str(&out).unwrap())
}

fn lab_runs_here() -> bool {
    let why = moeswarm_sim::lab::skip_reason();
    if let Some(why) = &why {
        eprintln!("skipped: {why}");
    }
    why.is_none()
}

#[test]
fn a_router_generates_the_local_tokens_through_workers_behind_cone_and_symmetric_nats() {
    if !lab_runs_here() {
        return;
    }
    let (remote, local) = generate_through_the_lab(0.0);
    assert_eq!(remote["tokens"], local["tokens"], "{remote}");
    let d = &remote["dispatch"];
    eprintln!("dispatch: {d}");
    assert_eq!(d["local"], 0, "{d}");
    // All three answered: the public one at its own address, the others through the relay,
    // and the report says which path each took.
    let answered = d["worker_latency_ms"].as_object().map_or(0, |m| m.len());
    assert_eq!(answered, 3, "{d}");
    let paths: Vec<&str> = d["worker_paths"]
        .as_object()
        .map(|m| m.values().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(paths.len(), 3, "{d}");
    let direct = paths
        .iter()
        .filter(|p| p.starts_with("direct 10.202.2.2:"))
        .count();
    let relayed = paths.iter().filter(|p| p.starts_with("relay ")).count();
    assert_eq!((direct, relayed), (1, 2), "{paths:?}");
}

#[test]
fn a_link_losing_two_percent_of_its_packets_changes_no_token() {
    if !lab_runs_here() {
        return;
    }
    let (remote, local) = generate_through_the_lab(0.02);
    assert_eq!(remote["tokens"], local["tokens"], "{remote}");
}
