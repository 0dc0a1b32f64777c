//! A crash is noticed in seconds: `moeswarm node` processes with the default settings (no TTL
//! flag), one killed with SIGKILL, one paused with SIGSTOP for 20 s, the seeder stopped with
//! SIGTERM; what `moeswarm coverage` says of each, in time.

use moeswarm_testkit as common;

use std::time::{Duration, Instant};

use common::data;

mod nodes;
use nodes::{node, NodeProcess};

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    common::run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

fn signal(p: &NodeProcess, sig: libc::c_int) {
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    let r = unsafe { libc::kill(p.child.id() as libc::pid_t, sig) };
    assert_eq!(r, 0, "signal {sig}: {}", std::io::Error::last_os_error());
}

/// Slabs each node holds, by PeerId, as `moeswarm coverage` through `via` says.
fn holders(via: &NodeProcess, model: &str) -> std::collections::BTreeMap<String, u64> {
    let (code, out, err) = moeswarm(&[
        "coverage",
        "--bootstrap",
        &via.addr,
        "--model",
        model,
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["nodes"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, n)| (k.clone(), n["slabs"].as_u64().unwrap()))
        .filter(|(_, slabs)| *slabs > 0)
        .collect()
}

/// Waits up to `within` for `ok` of the holders seen through `via`; how long it took.
fn until(
    via: &NodeProcess,
    model: &str,
    within: Duration,
    what: &str,
    ok: impl Fn(&std::collections::BTreeMap<String, u64>) -> bool,
) -> Duration {
    let t0 = Instant::now();
    loop {
        let h = holders(via, model);
        if ok(&h) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "{what} not within {within:?}: {h:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn a_killed_node_leaves_the_coverage_within_a_minute_and_a_paused_one_stays() {
    let dir = tempfile::tempdir().unwrap();
    let seed = dir.path().join("seed");
    let seed = seed.to_str().unwrap();
    let file = data("tiny-q8_0.gguf");
    let (code, out, err) = moeswarm(&["slice", file.to_str().unwrap(), "--store", seed, "--json"]);
    assert_eq!(code, 0, "{err}");
    let model = serde_json::from_str::<serde_json::Value>(&out).unwrap()["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut seeder = node(seed, &[]);
    // Three holders of the whole model, each fetched by `fetch`, then running with defaults.
    let mut holders_ = Vec::new();
    for name in ["a", "b", "c"] {
        let store = dir.path().join(name);
        let store = store.to_str().unwrap().to_string();
        let (code, _, err) = moeswarm(&[
            "fetch",
            "--bootstrap",
            &seeder.addr,
            "--model",
            &model,
            "--store",
            &store,
        ]);
        assert_eq!(code, 0, "{err}");
        holders_.push(node(&store, &["--bootstrap", &seeder.addr]));
    }
    let [a, b, c] = [&holders_[0], &holders_[1], &holders_[2]];
    until(
        a,
        &model,
        Duration::from_secs(60),
        "all four holders seen",
        |h| [&seeder, a, b, c].iter().all(|n| h.contains_key(&n.peer)),
    );

    // b crashes; c sleeps for 20 s, as a phone off Wi-Fi.
    signal(b, libc::SIGKILL);
    signal(c, libc::SIGSTOP);
    let paused = Instant::now();
    let gone = until(
        a,
        &model,
        Duration::from_secs(60),
        "the killed node gone",
        |h| !h.contains_key(&b.peer),
    );
    assert!(
        gone >= Duration::from_secs(10),
        "gone after {gone:?}: too soon to be a heartbeat window"
    );
    // A pause of 20 s is a blip: c is counted throughout.
    while paused.elapsed() < Duration::from_secs(20) {
        assert!(
            holders(a, &model).contains_key(&c.peer),
            "the paused node dropped"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    signal(c, libc::SIGCONT);
    assert!(holders(a, &model).contains_key(&c.peer));

    // SIGTERM: the seeder leaves cleanly (its withdrawal empties its record at once) and exits.
    signal(&seeder, libc::SIGTERM);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = seeder.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the seeder did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status:?}");
    until(
        a,
        &model,
        Duration::from_secs(10),
        "the seeder's withdrawal",
        |h| !h.contains_key(&seeder.peer) && h.contains_key(&c.peer) && h.contains_key(&a.peer),
    );
}
