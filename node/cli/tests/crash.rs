//! `kill -9` at moments spread over the run of `slice` and of `fetch`: afterwards every blob
//! present verifies (a scrub finds nothing to drop or quarantine), nothing finished is lost
//! (the blobs only ever grow), and the work completes when it is run again.

use moeswarm_testkit as common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::data;

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    common::run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

/// Starts `moeswarm args`, lets it run `delay`, and kills it (SIGKILL).
fn killed_after(args: &[&str], delay: Duration) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(delay);
    let _ = child.kill();
    let _ = child.wait();
}

fn blob_names(store: &Path) -> BTreeSet<String> {
    match std::fs::read_dir(store.join("blobs")) {
        Ok(d) => d
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => BTreeSet::new(),
    }
}

/// Scrubs `store`: every blob verifies, none is dropped or quarantined.
fn scrub_is_clean(store: &Path) {
    if !store.join("blobs").exists() {
        return;
    }
    let (code, out, err) = moeswarm(&["scrub", "--store", store.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["dropped"], serde_json::json!([]), "{r}");
    assert_eq!(r["quarantined"], serde_json::json!([]), "{r}");
}

/// Twenty delays spread over `0..span`, in an order that jumps about.
fn moments(span: Duration) -> Vec<Duration> {
    (0..20u32).map(|i| span * ((i * 7) % 20) / 20).collect()
}

#[test]
fn slice_killed_twenty_times_loses_nothing_and_completes_when_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let file = data("small-q4_k.gguf");
    let f = file.to_str().unwrap();
    let reference = dir.path().join("reference");
    let (code, out, err) =
        moeswarm(&["slice", f, "--store", reference.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let model = serde_json::from_str::<serde_json::Value>(&out).unwrap()["model_id"].clone();
    let store = dir.path().join("store");
    let s = store.to_str().unwrap();
    let mut seen = BTreeSet::new();
    for delay in moments(Duration::from_millis(150)) {
        killed_after(&["slice", f, "--store", s], delay);
        scrub_is_clean(&store);
        let now = blob_names(&store);
        assert!(now.is_superset(&seen), "a finished blob was lost");
        seen = now;
    }
    let (code, out, err) = moeswarm(&["slice", f, "--store", s, "--json"]);
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["model_id"], model);
    assert_eq!(blob_names(&store), blob_names(&reference));
    scrub_is_clean(&store);
}

/// A `moeswarm node` serving `store`, and its address; killed when dropped.
struct Seeder(Child, String);

impl Drop for Seeder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn seeder(store: &str) -> Seeder {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args(["node", "--store", store, "--listen", "/ip4/127.0.0.1/tcp/0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    // Killed when dropped, also if it never says it is ready.
    let mut node = Seeder(child, String::new());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the node said it was ready in time");
        if let Some(a) = line.strip_prefix("listening on ") {
            node.1 = a.to_string();
        }
        if line == "ready" {
            return node;
        }
    }
}

#[test]
fn fetch_killed_twenty_times_loses_nothing_and_completes_when_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let file = data("small-q4_k.gguf");
    let seed = dir.path().join("seed");
    let (code, out, err) = moeswarm(&[
        "slice",
        file.to_str().unwrap(),
        "--store",
        seed.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let model = serde_json::from_str::<serde_json::Value>(&out).unwrap()["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    let node = seeder(seed.to_str().unwrap());
    let store = dir.path().join("fetched");
    let s = store.to_str().unwrap();
    let args = [
        "fetch",
        "--bootstrap",
        &node.1,
        "--model",
        &model,
        "--store",
        s,
        "--trunk",
    ];
    let mut seen = BTreeSet::new();
    for delay in moments(Duration::from_millis(1200)) {
        killed_after(&args, delay);
        scrub_is_clean(&store);
        let now = blob_names(&store);
        assert!(now.is_superset(&seen), "a finished blob was lost");
        seen = now;
    }
    let (code, _, err) = moeswarm(&args);
    assert_eq!(code, 0, "{err}");
    assert_eq!(blob_names(&store), blob_names(&seed));
    scrub_is_clean(&store);
}
