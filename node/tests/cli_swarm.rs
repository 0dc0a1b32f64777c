//! `moeswarm node`, `fetch` and `coverage` as separate processes on 127.0.0.1.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::data;

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A `moeswarm node` child, killed when dropped.
struct NodeProcess {
    child: Child,
    addr: String,
    peer: String,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn node(store: &str, extra: &[&str]) -> NodeProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args(["node", "--store", store, "--listen", "/ip4/127.0.0.1/tcp/0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut addr, mut peer) = (None, None);
    let mut proc = NodeProcess {
        child,
        addr: String::new(),
        peer: String::new(),
    };
    while addr.is_none() || peer.is_none() {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the node printed its address in time");
        if let Some(a) = line.strip_prefix("listening on ") {
            addr = Some(a.to_string());
        }
        if let Some(p) = line.strip_prefix("peer id ") {
            peer = Some(p.to_string());
        }
    }
    proc.addr = addr.unwrap();
    proc.peer = peer.unwrap();
    proc
}

#[test]
fn a_node_process_serves_fetch_and_coverage_processes() {
    let dir = tempfile::tempdir().unwrap();
    let seed_store = dir.path().join("seed");
    let s = seed_store.to_str().unwrap();
    let (code, out, err) = moeswarm(&[
        "slice",
        data("tiny-q8_0.gguf").to_str().unwrap(),
        "--store",
        s,
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let model = serde_json::from_str::<serde_json::Value>(&out).unwrap()["model_id"]
        .as_str()
        .unwrap()
        .to_string();

    let seeder = node(s, &[]);
    assert!(seeder.addr.starts_with("/ip4/127.0.0.1/tcp/") && seeder.addr.ends_with(&seeder.peer));

    // A worker store gets layer 0's experts 0..3 through `fetch`.
    let worker_store = dir.path().join("worker");
    let w = worker_store.to_str().unwrap();
    let (code, out, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &seeder.addr,
        "--model",
        &model,
        "--store",
        w,
        "--layers",
        "0..1",
        "--experts",
        "0..3",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["fetched"], 3, "{report}");

    // The worker runs as a node and joins; coverage sees both.
    let worker = node(w, &["--bootstrap", &seeder.addr]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, out, err) = moeswarm(&[
            "coverage",
            "--bootstrap",
            &seeder.addr,
            "--model",
            &model,
            "--json",
        ]);
        if code == 0 {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            let layer0 = &v["layers"][0]["replicas"];
            if v["nodes"].as_object().unwrap().len() == 2 {
                assert_eq!(v["nodes"][&worker.peer], 3);
                assert_eq!(layer0[0], 2);
                assert_eq!(layer0[3], 1);
                assert_eq!(v["layers"][1]["replicas"][0], 1);
                assert_eq!(v["layers"][0]["holders"][0].as_array().unwrap().len(), 2);
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "coverage never showed both nodes: {out}{err}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // Bad input gets a named error.
    let (code, _, err) = moeswarm(&[
        "coverage",
        "--bootstrap",
        "/ip4/127.0.0.1/tcp/1",
        "--model",
        &model,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("/p2p/"), "{err}");
    let (code, _, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &seeder.addr,
        "--model",
        "zz",
        "--store",
        w,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--model"), "{err}");
}
