//! `moeswarm` processes in the network lab (`moeswarm_sim::lab`): a seeder with the relay on a
//! public host, a public worker, a worker behind a cone NAT and one behind a symmetric NAT, each
//! link with its own round trip; the router's generation through them gives the local run's
//! tokens, and still does over a link that loses 2 % of its packets. Workers behind a NAT
//! register with the relay; the router punches a hole to each through the relay's signalling:
//! the cone NAT lets the punched path in, the symmetric one does not (that worker stays on the
//! relay). Skipped, saying why, where the lab cannot run.

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

/// The swarm of `scenario` (with `worker_loss` on the public worker's link), running: its
/// seeder (with the relay) and three workers, each in its namespace.
struct Lab {
    net: Network,
    seeder: NodeProcess,
    model: String,
    dir: tempfile::TempDir,
    workers: Vec<NodeProcess>,
}

impl Lab {
    fn start(worker_loss: f64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let net = Network::build(&scenario(worker_loss), 1).unwrap();
        let (seed, model) = sliced_tiny(dir.path());
        let hub = net.host("hub").unwrap();
        let hub_ip = hub.addr.to_string();
        let relay_listen = format!("{hub_ip}:0");
        // The seeder relays and serves no dispatches itself.
        let seeder = node_in(
            Some(hub.ns.name()),
            &hub_ip,
            &seed,
            &["--relay", "--relay-listen", &relay_listen],
        );
        let relay = seeder.relay.clone().expect("the relay's address");
        let mut workers = Vec::new();
        for name in ["pubw", "home", "phone"] {
            let h = net.host(name).unwrap();
            let store = dir.path().join(name);
            let store = store.to_str().unwrap();
            let fetch = ["fetch", "--bootstrap", &seeder.addr, "--model", &model];
            let (code, _, err) =
                moeswarm_in(h.ns.name(), &[&fetch[..], &["--store", store]].concat());
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
        Self {
            net,
            seeder,
            model,
            dir,
            workers,
        }
    }

    /// `moeswarm generate --swarm` in the hub's namespace with `args`, spawned with its stdout
    /// piped.
    fn spawn_router(&self, args: &[&str]) -> std::process::Child {
        let router = self.dir.path().join("router");
        let hub = self.net.host("hub").unwrap();
        let swarm = [
            "generate",
            "--swarm",
            "--bootstrap",
            &self.seeder.addr,
            "--store",
            router.to_str().unwrap(),
            "--model-id",
            &self.model,
        ];
        std::process::Command::new("ip")
            .args(["netns", "exec", hub.ns.name(), BIN])
            .args(swarm)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Runs the router with `args` until it succeeds (the workers' records may not have
    /// reached the seeder yet), calling `on_output` once its first bytes are out; its stdout
    /// and stderr.
    fn generate(&self, args: &[&str], mut on_output: impl FnMut()) -> (String, String) {
        use std::io::Read;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut child = self.spawn_router(args);
            let mut stdout = child.stdout.take().unwrap();
            let mut stderr = child.stderr.take().unwrap();
            let err = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = stderr.read_to_string(&mut s);
                s
            });
            let mut out = Vec::new();
            let mut first = [0u8; 1];
            if stdout.read(&mut first).unwrap_or(0) == 1 {
                out.push(first[0]);
                on_output();
                stdout.read_to_end(&mut out).unwrap();
            }
            let code = child.wait().unwrap().code();
            let err = err.join().unwrap();
            if code == Some(0) {
                return (String::from_utf8(out).unwrap(), err);
            }
            assert!(Instant::now() < deadline, "{err}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // The processes go before the namespaces they run in.
        self.workers.clear();
    }
}

/// The local run's output for `args`.
fn local_run(args: &[&str]) -> String {
    let file = data("tiny-q8_0.gguf");
    let (code, out, err) = common::run_program(
        BIN,
        &[&["generate", "--model", file.to_str().unwrap()][..], args].concat(),
    );
    assert_eq!(code, 0, "{err}");
    out
}

/// The tokens the router generates through the lab (with `worker_loss` on the public worker's
/// link), and the local run's.
fn generate_through_the_lab(worker_loss: f64) -> (serde_json::Value, serde_json::Value) {
    let lab = Lab::start(worker_loss);
    let args = [
        "--prompt",
        "through the lab",
        "--max-tokens",
        "16",
        "--json",
    ];
    let (remote, _) = lab.generate(&args, || {});
    drop(lab);
    let local = local_run(&args);
    (
        serde_json::from_str(&remote).unwrap(),
        serde_json::from_str(&local).unwrap(),
    )
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
    // All three answered: the public one at its own address, the one behind the cone NAT on a
    // hole-punched path, the one behind the symmetric NAT through the relay; the report says
    // which path each took and why.
    let answered = d["worker_latency_ms"].as_object().map_or(0, |m| m.len());
    assert_eq!(answered, 3, "{d}");
    let paths: Vec<&str> = d["worker_paths"]
        .as_object()
        .map(|m| m.values().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(paths.len(), 3, "{d}");
    let count = |f: &dyn Fn(&str) -> bool| paths.iter().filter(|p| f(p)).count();
    let public = count(&|p| p.starts_with("direct 10.202.2.2:") && p.contains("own address"));
    let punched = count(&|p| p.starts_with("direct ") && p.contains("hole punched"));
    let relayed = count(&|p| p.starts_with("relay ") && p.contains("hole punch failed"));
    assert_eq!((public, punched, relayed), (1, 1, 1), "{paths:?}");
}

#[test]
fn a_link_losing_two_percent_of_its_packets_changes_no_token() {
    if !lab_runs_here() {
        return;
    }
    let (remote, local) = generate_through_the_lab(0.02);
    assert_eq!(remote["tokens"], local["tokens"], "{remote}");
}

#[test]
fn nat_mappings_expiring_mid_generation_change_no_token() {
    if !lab_runs_here() {
        return;
    }
    let lab = Lab::start(0.0);
    // Text as it is generated, so the mappings can be made to expire while it goes on.
    let args = [
        "--prompt",
        "mappings expire",
        "--max-tokens",
        "48",
        "--speculative",
        "off",
    ];
    let mut expired = 0;
    let (remote, err) = lab.generate(&args, || {
        for nat in ["home", "phone"] {
            lab.net.host(nat).unwrap().expire_nat_mappings().unwrap();
            expired += 1;
        }
    });
    assert_eq!(expired, 2, "the first piece came out");
    drop(lab);
    assert_eq!(remote, local_run(&args), "{err}");
}

/// The lab's namespaces named after process `pid`.
fn namespaces_of(pid: u32) -> Vec<String> {
    let mine = format!("msl-{pid}-");
    moeswarm_sim::lab::netns::lab_namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&mine))
        .collect()
}

fn home_scenario() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.join("sim/scenarios/home.toml")
        .to_string_lossy()
        .into_owned()
}

#[test]
fn the_lab_benchmark_reports_each_round_trip_beside_its_floor_and_leaves_nothing_behind() {
    if !lab_runs_here() {
        return;
    }
    let scenario = home_scenario();
    let args = [
        "lab",
        "--scenario",
        &scenario,
        "--rtt-ms",
        "0,6",
        "--tokens",
        "6",
        "--json",
    ];
    let child = std::process::Command::new(BIN)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The trained qwen35moe: four MoE layers and an MTP block.
    assert_eq!(r["moe_layers"], 4, "{r}");
    let local = r["local_ms_per_token"].as_f64().unwrap();
    assert!(local > 0.0, "{r}");
    let rtts = r["rtts"].as_array().unwrap();
    assert_eq!(rtts.len(), 2, "{r}");
    for (x, rtt) in rtts.iter().zip([0.0, 6.0]) {
        assert_eq!(x["rtt_ms"], rtt);
        let floor = x["floor_ms_per_token"].as_f64().unwrap();
        assert!((floor - (4.0 * rtt + local)).abs() < 1e-9, "{x}");
        // Four round trips of 6 ms cannot take less than 24 ms: the links hold the delay.
        let ms = x["ms_per_token"].as_f64().unwrap();
        assert!(ms >= 4.0 * rtt * 0.9, "{x}");
        assert!(x["speculative_ms_per_token"].as_f64().unwrap() > 0.0, "{x}");
    }
    // The fetch came through the 10 MB/s uplink: never faster than it.
    let f = &r["fetch"];
    assert!(f["bytes"].as_u64().unwrap() > 1_000_000, "{f}");
    let of = f["of_uplink"].as_f64().unwrap();
    assert!(of > 0.0 && of <= 1.05, "{f}");
    assert_eq!(namespaces_of(pid), Vec::<String>::new());
}

#[test]
fn a_lab_stopped_by_ctrl_c_removes_its_namespaces_and_processes() {
    if !lab_runs_here() {
        return;
    }
    let scenario = home_scenario();
    let child = std::process::Command::new(BIN)
        .args(["lab", "--scenario", &scenario, "--rtt-ms", "10"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Stopped once its network stands and its nodes run.
    let until = Instant::now() + Duration::from_secs(120);
    while namespaces_of(pid).len() < 6 {
        assert!(Instant::now() < until, "the lab built no network");
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(3));
    let (_, kids, _) = common::run_program("ps", &["-o", "pid=", "--ppid", &pid.to_string()]);
    let kids: Vec<String> = kids.split_whitespace().map(str::to_string).collect();
    assert!(!kids.is_empty(), "it runs moeswarm processes");
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert_eq!(namespaces_of(pid), Vec::<String>::new());
    // Nothing it started runs on.
    std::thread::sleep(Duration::from_millis(500));
    let alive: Vec<&String> = kids
        .iter()
        .filter(|k| {
            std::fs::read_to_string(format!("/proc/{k}/stat"))
                .is_ok_and(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
        })
        .collect();
    assert!(alive.is_empty(), "{alive:?} outlived the lab");
}
