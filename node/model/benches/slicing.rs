//! Slicing throughput beside a plain copy of the same bytes, in the same run.
//!
//! `cargo bench -p moeswarm-node --bench slicing` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts; the model is synthesized once into `target/bench-data`).

use moeswarm_testkit as common;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::time::Instant;

use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let dir = model.parent().expect("in bench-data").to_path_buf();
    let bytes = std::fs::metadata(&model)?.len() as f64;
    let work = tempfile::tempdir_in(&dir)?;

    let mut best_copy = f64::MAX;
    let mut best_slice = f64::MAX;
    for round in 0..3 {
        // Plain copy: mapped source, buffered write, synced: the same I/O without hashing or splitting.
        let t = Instant::now();
        let src = File::open(&model)?;
        let map = unsafe { memmap2::Mmap::map(&src)? };
        let out = work.path().join(format!("copy{round}"));
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&out)?);
        w.write_all(&map)?;
        w.into_inner()?.sync_all()?;
        best_copy = best_copy.min(t.elapsed().as_secs_f64());
        std::fs::remove_file(out)?;

        let store_dir = work.path().join(format!("store{round}"));
        let (store, _) = Store::open(&store_dir)?;
        let t = Instant::now();
        slice(&model, &store, SliceOptions::default())?;
        best_slice = best_slice.min(t.elapsed().as_secs_f64());
        drop(store);
        std::fs::remove_dir_all(store_dir)?;
    }
    println!("model {} ({:.2} GB)", model.display(), bytes / 1e9);
    println!(
        "plain copy : {:.3} s  {:.2} GB/s",
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
