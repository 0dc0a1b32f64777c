//! A crash is noticed in seconds: `moeswarm node` processes with the default settings (no TTL
//! flag), one killed with SIGKILL, one paused with SIGSTOP for 20 s, the seeder stopped with
//! SIGTERM; what a live node's coverage (its dashboard's data) says of each, in time.

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

/// `via`'s dashboard data (`/api/dashboard`).
fn dashboard(via: &NodeProcess) -> serde_json::Value {
    let addr = via.http.as_deref().expect("the node serves HTTP");
    let answer = String::from_utf8(nodes::http_get(addr, "/api/dashboard")).unwrap();
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

/// Slabs each node holds, by PeerId, in `via`'s coverage (its dashboard's data: what its
/// market and its router count).
fn holders(via: &NodeProcess) -> std::collections::BTreeMap<String, u64> {
    dashboard(via)["models"][0]["nodes"]
        .as_object()
        .map(|nodes| {
            nodes
                .iter()
                .map(|(k, n)| (k.clone(), n["slabs"].as_u64().unwrap_or(0)))
                .filter(|(_, slabs)| *slabs > 0)
                .collect()
        })
        .unwrap_or_default()
}

/// Waits up to `within` for `ok` of the holders seen through `via`; how long it took.
fn until(
    via: &NodeProcess,
    within: Duration,
    what: &str,
    ok: impl Fn(&std::collections::BTreeMap<String, u64>) -> bool,
) -> Duration {
    let t0 = Instant::now();
    loop {
        let h = holders(via);
        if ok(&h) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "{what} not within {within:?}: {h:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The tiny model sliced into `dir/seed` and a seeder node serving it: the seeder and the
/// model id.
fn seeder(dir: &std::path::Path) -> (NodeProcess, String) {
    let seed = dir.join("seed");
    let seed = seed.to_str().unwrap();
    let file = data("tiny-q8_0.gguf");
    let (code, out, err) = moeswarm(&["slice", file.to_str().unwrap(), "--store", seed, "--json"]);
    assert_eq!(code, 0, "{err}");
    let model = serde_json::from_str::<serde_json::Value>(&out).unwrap()["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    (node(seed, &["--http", "127.0.0.1:0"]), model)
}

/// A node holding the whole model (fetched by `fetch` into `dir/name`), then running with the
/// default settings and `extra` flags.
fn holder(
    dir: &std::path::Path,
    name: &str,
    seeder: &NodeProcess,
    model: &str,
    extra: &[&str],
) -> NodeProcess {
    let store = dir.join(name);
    let store = store.to_str().unwrap().to_string();
    let (code, _, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &seeder.addr,
        "--model",
        model,
        "--store",
        &store,
    ]);
    assert_eq!(code, 0, "{err}");
    let mut args = vec!["--bootstrap", &seeder.addr, "--http", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    node(&store, &args)
}

#[test]
fn a_killed_node_leaves_the_coverage_within_a_minute_and_a_paused_one_stays() {
    let dir = tempfile::tempdir().unwrap();
    let (mut seeder, model) = seeder(dir.path());
    let holders_: Vec<NodeProcess> = ["a", "b", "c"]
        .iter()
        .map(|n| holder(dir.path(), n, &seeder, &model, &[]))
        .collect();
    let [a, b, c] = [&holders_[0], &holders_[1], &holders_[2]];
    until(a, Duration::from_secs(60), "all four holders seen", |h| {
        [&seeder, a, b, c].iter().all(|n| h.contains_key(&n.peer))
    });

    // b crashes; c sleeps for 20 s, as a phone off Wi-Fi.
    signal(b, libc::SIGKILL);
    signal(c, libc::SIGSTOP);
    let paused = Instant::now();
    eprintln!("after: {:?}", holders(a));
    eprintln!(
        "after, via seeder: {:?} ({:?})",
        holders(&seeder),
        paused.elapsed()
    );
    // One watch, once a second: c is counted throughout its 20 s pause and after it wakes
    // (woken at 20 s whether or not b is gone yet); b is gone within a minute, but not before
    // a heartbeat window has passed.
    let mut woken = false;
    let gone = loop {
        let h = holders(a);
        let t = paused.elapsed();
        assert!(
            h.contains_key(&c.peer),
            "the paused node dropped at {t:?} (woken: {woken}): {h:?}"
        );
        if !h.contains_key(&b.peer) {
            break t;
        }
        assert!(
            t < Duration::from_secs(60),
            "the killed node still counted: {h:?}"
        );
        if !woken && t >= Duration::from_secs(20) {
            signal(c, libc::SIGCONT);
            woken = true;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(
        gone >= Duration::from_secs(10),
        "gone after {gone:?}: too soon to be a heartbeat window"
    );
    if !woken {
        while paused.elapsed() < Duration::from_secs(20) {
            assert!(holders(a).contains_key(&c.peer), "the paused node dropped");
            std::thread::sleep(Duration::from_secs(1));
        }
        signal(c, libc::SIGCONT);
    }
    assert!(holders(a).contains_key(&c.peer));

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
    until(a, Duration::from_secs(10), "the seeder's withdrawal", |h| {
        !h.contains_key(&seeder.peer) && h.contains_key(&c.peer) && h.contains_key(&a.peer)
    });
}

#[test]
fn two_of_ten_killed_at_once_leave_and_nodes_with_clocks_five_minutes_off_stay() {
    let dir = tempfile::tempdir().unwrap();
    let (seeder, model) = seeder(dir.path());
    // Nine holders: one whose clock is 5 minutes ahead, one 5 minutes behind.
    let nodes: Vec<NodeProcess> = (0..9)
        .map(|i| {
            let skew: &[&str] = match i {
                0 => &["--clock-skew-secs", "300"],
                1 => &["--clock-skew-secs", "-300"],
                _ => &[],
            };
            holder(dir.path(), &format!("n{i}"), &seeder, &model, skew)
        })
        .collect();
    let all =
        |h: &std::collections::BTreeMap<String, u64>| nodes.iter().all(|n| h.contains_key(&n.peer));
    until(
        &nodes[2],
        Duration::from_secs(60),
        "all ten holders seen",
        all,
    );
    // 20 % of the ten, at once.
    signal(&nodes[7], libc::SIGKILL);
    signal(&nodes[8], libc::SIGKILL);
    let (dead, live) = (&nodes[7..], &nodes[..7]);
    until(
        &nodes[2],
        Duration::from_secs(60),
        "the killed nodes gone",
        |h| dead.iter().all(|n| !h.contains_key(&n.peer)),
    );
    // Every live node, the skewed ones too, still counts, as seen from the seeder.
    until(
        &seeder,
        Duration::from_secs(30),
        "the live nodes counted",
        |h| {
            live.iter().all(|n| h.contains_key(&n.peer))
                && dead.iter().all(|n| !h.contains_key(&n.peer))
        },
    );
}

/// The holders (PeerIds) of every slab in `via`'s coverage.
fn cells(via: &NodeProcess) -> Vec<Vec<String>> {
    let v = dashboard(via);
    let m = &v["models"][0];
    let (Some(model), Some(layers)) = (m["model"].as_str(), m["layers"].as_array()) else {
        return Vec::new();
    };
    let addr = via.http.as_deref().expect("the node serves HTTP");
    let mut out = Vec::new();
    // The dashboard counts; who holds a slab is asked for slab by slab.
    for (l, layer) in layers.iter().enumerate() {
        let experts = layer["replicas"].as_array().map_or(0, Vec::len);
        for e in 0..experts {
            let path = format!("/api/holders/{model}/{l}/{e}/0");
            let answer = String::from_utf8(nodes::http_get(addr, &path)).unwrap();
            let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            let page: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
            let hs = page["holders"].as_array().cloned().unwrap_or_default();
            out.push(
                hs.iter()
                    .filter_map(|h| h.as_str().map(String::from))
                    .collect(),
            );
        }
    }
    out
}

/// The fewest holders of any slab in `via`'s coverage, leaving out `except`.
fn least_replicas(via: &NodeProcess, except: &[&str]) -> usize {
    cells(via)
        .iter()
        .map(|hs| hs.iter().filter(|h| !except.contains(&h.as_str())).count())
        .min()
        .unwrap_or(0)
}

/// The blob files in a store: what a fetch adds to.
fn blobs(store: &std::path::Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(store.join("blobs"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Bytes held in a store's blobs.
fn stored_bytes(store: &std::path::Path) -> u64 {
    std::fs::read_dir(store.join("blobs"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// `moeswarm node --capacity` processes on `stores`, joining `seeder`, each serving dispatches
/// and HTTP.
fn market_nodes(
    stores: &[std::path::PathBuf],
    seeder: &NodeProcess,
    capacity: u64,
) -> Vec<NodeProcess> {
    let capacity = capacity.to_string();
    stores
        .iter()
        .map(|s| {
            let args = [
                "--bootstrap",
                &seeder.addr,
                "--capacity",
                &capacity,
                "--dispatch",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
            ];
            node(s.to_str().unwrap(), &args)
        })
        .collect()
}

/// Waits (up to `within`) until `snapshot` has not changed for `quiet`.
fn still_for<T: PartialEq>(quiet: Duration, within: Duration, snapshot: impl Fn() -> T) {
    let mut last = (snapshot(), Instant::now());
    let start = Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = snapshot();
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() >= quiet {
            return;
        }
        assert!(start.elapsed() < within, "never still for {quiet:?}");
    }
}

/// Two of `nodes` (at indices among `among`) whose slabs all keep a holder in `watcher`'s
/// coverage once they and the seeder are gone (else no one could restore them), and, where
/// there is such a pair, after whom some slab has one replica left, for the others to
/// restore.
fn victims(
    watcher: &NodeProcess,
    nodes: &[NodeProcess],
    seeder: &NodeProcess,
    among: &[usize],
) -> (usize, usize) {
    let now = cells(watcher);
    let fewest_left = |i: usize, j: usize| {
        let gone = [nodes[i].peer.as_str(), nodes[j].peer.as_str(), &seeder.peer];
        now.iter()
            .map(|hs| hs.iter().filter(|h| !gone.contains(&h.as_str())).count())
            .min()
            .unwrap_or(0)
    };
    let (i, j) = among
        .iter()
        .flat_map(|&i| among.iter().map(move |&j| (i, j)))
        .filter(|&(i, j)| i < j && fewest_left(i, j) >= 1)
        .min_by_key(|&(i, j)| fewest_left(i, j))
        .unwrap_or_else(|| panic!("every pair holds a slab alone: {now:?}"));
    eprintln!(
        "killing {i} and {j}: fewest replicas left {}",
        fewest_left(i, j)
    );
    (i, j)
}

#[test]
fn six_market_nodes_restore_two_replicas_after_two_crashes_and_the_seeder_leaving() {
    let dir = tempfile::tempdir().unwrap();
    let (mut seeder, _model) = seeder(dir.path());
    // Each node has room for 55 % of the slabs and the manifest: 3.3× the model in all, and
    // the four that survive 2.2× (at exactly 3×, four would need a perfect packing).
    let seed_blobs = dir.path().join("seed").join("blobs");
    let slab_bytes: u64 = 16 * 7072;
    let manifest_bytes = std::fs::read_dir(&seed_blobs)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok().map(|m| m.len()))
        .filter(|&len| len < 7072)
        .max()
        .unwrap();
    let capacity = slab_bytes * 55 / 100 + manifest_bytes;
    let stores: Vec<std::path::PathBuf> =
        (0..6).map(|i| dir.path().join(format!("m{i}"))).collect();
    let nodes_ = market_nodes(&stores, &seeder, capacity);
    let watcher = &nodes_[2];
    let wait = |what: &str, within: Duration, ok: &dyn Fn() -> bool| {
        let t0 = Instant::now();
        while !ok() {
            assert!(
                t0.elapsed() < within,
                "{what} not within {within:?}: {:?}",
                cells(watcher)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        t0.elapsed()
    };
    // Every slab twice outside the seeder, by the market alone.
    wait(
        "two replicas outside the seeder",
        Duration::from_secs(180),
        &|| least_replicas(watcher, &[&seeder.peer]) >= 2,
    );
    // Settled: no store changes for 15 s (a market round is 10 s).
    let snapshot = || stores.iter().map(|s| blobs(s)).collect::<Vec<_>>();
    still_for(Duration::from_secs(15), Duration::from_secs(90), snapshot);

    // A node paused for 20 s, as a phone off Wi-Fi, then resumed: nothing is fetched anywhere,
    // during the pause or for two rounds after it.
    let before = snapshot();
    signal(&nodes_[5], libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(20));
    signal(&nodes_[5], libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(20));
    assert_eq!(snapshot(), before, "a 20 s pause made the market move");
    for s in &stores {
        assert!(stored_bytes(s) <= capacity, "a node is over its capacity");
    }

    // Two crash and the seeder leaves cleanly: two whose slabs all keep a holder (else no one
    // could restore them), and, where there is such a pair, after whom some slab has one
    // replica left, for the others to restore.
    let (i, j) = victims(watcher, &nodes_, &seeder, &[0, 1, 3, 4, 5]);
    let dead = [nodes_[i].peer.clone(), nodes_[j].peer.clone()];
    signal(&nodes_[i], libc::SIGKILL);
    signal(&nodes_[j], libc::SIGKILL);
    signal(&seeder, libc::SIGTERM);
    let crashed_at = Instant::now();
    let gone = wait(
        "the dead gone from the coverage",
        Duration::from_secs(60),
        &|| {
            let h = holders(watcher);
            dead.iter().all(|d| !h.contains_key(d)) && !h.contains_key(&seeder.peer)
        },
    );
    eprintln!("the dead left the coverage after {gone:?}");
    let left = Duration::from_secs(120).saturating_sub(crashed_at.elapsed());
    wait("two live replicas again", left, &|| {
        least_replicas(watcher, &[]) >= 2
    });
    eprintln!("two replicas again after {:?}", crashed_at.elapsed());
    assert!(seeder
        .child
        .try_wait()
        .unwrap()
        .is_some_and(|s| s.success()));
    for (k, s) in stores.iter().enumerate() {
        if k != i && k != j {
            assert!(stored_bytes(s) <= capacity, "a node is over its capacity");
        }
    }
}
