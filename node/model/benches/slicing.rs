//! Slicing throughput beside a plain copy of the same file, in the same run, each as a user
//! times it: `cp FILE DIR && sync` against opening a fresh store, slicing into it and closing
//! it (every blob synced, renamed and indexed: the store's crash guarantees).
//!
//! `cargo bench -p moeswarm-model --bench slicing` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts; the model is synthesized once into `target/bench-data`).

use moeswarm_testkit as common;

use std::process::Command;
use std::time::Instant;

use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;

fn sh(cmd: &str, args: &[&std::ffi::OsStr]) -> anyhow::Result<()> {
    let status = Command::new(cmd).args(args).status()?;
    anyhow::ensure!(status.success(), "{cmd} failed: {status}");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let dir = model.parent().expect("in bench-data").to_path_buf();
    let bytes = std::fs::metadata(&model)?.len() as f64;
    let work = tempfile::tempdir_in(&dir)?;

    let mut best_copy = f64::MAX;
    let mut best_slice = f64::MAX;
    for round in 0..3 {
        // Each starts with nothing dirty: what the last one wrote is on disk.
        sh("sync", &[])?;
        let out = work.path().join(format!("copy{round}"));
        let t = Instant::now();
        sh("cp", &[model.as_os_str(), out.as_os_str()])?;
        sh("sync", &[])?;
        best_copy = best_copy.min(t.elapsed().as_secs_f64());
        std::fs::remove_file(out)?;

        sh("sync", &[])?;
        let store_dir = work.path().join(format!("store{round}"));
        let t = Instant::now();
        let (store, _) = Store::open(&store_dir)?;
        slice(&model, &store, SliceOptions::default())?;
        drop(store);
        best_slice = best_slice.min(t.elapsed().as_secs_f64());
        std::fs::remove_dir_all(store_dir)?;
    }
    println!("model {} ({:.2} GB)", model.display(), bytes / 1e9);
    println!(
        "cp && sync : {:.3} s  {:.2} GB/s",
        best_copy,
        bytes / best_copy / 1e9
    );
    println!(
        "slice      : {:.3} s  {:.2} GB/s",
        best_slice,
        bytes / best_slice / 1e9
    );
    println!("ratio slice/copy throughput: {:.2}", best_copy / best_slice);
    Ok(())
}
