//! The market from join to coverage: six empty nodes, whose capacities add up to 3× the model,
//! join a seeder one by one and choose their slabs; beside plain fetches of the bytes strictly
//! needed, in the same run.
//!
//! `cargo bench -p moeswarm-node --bench market` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts: 512 slabs, 1.35 GB). Printed: the time from the first join
//! until every slab has 2 replicas outside the seeder, and until every node has settled; the
//! bytes the nodes fetched; and the reference: two nodes fetching the whole model one after
//! the other (2 replicas × the model, the least any assignment moves), its time and bytes.

use moeswarm_testkit as common;

use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use moeswarm_node::auto::AutoOptions;
use moeswarm_node::net::Selection;
use moeswarm_node::{NodeOptions, RunningNode};

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let work = tempfile::tempdir_in(model.parent().expect("in bench-data"))?;
    let seed_dir = work.path().join("seed");
    let manifest = common::sliced(&model, &seed_dir)?;
    let model_bytes: u64 = manifest.all_slabs().map(|(_, _, r)| r.bytes).sum();
    let slabs = manifest.all_slabs().count();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let seeder = RunningNode::start(NodeOptions::local(seed_dir.clone(), vec![])).await?;
        let boot = seeder.addrs().await?[0].clone();

        // The reference: the needed bytes, fetched plainly, one node after the other.
        let t = Instant::now();
        let mut ref_bytes = 0;
        for i in 0..2 {
            let dir = work.path().join(format!("plain{i}"));
            let node = RunningNode::start(NodeOptions::local(dir.clone(), vec![boot.clone()])).await?;
            ref_bytes += node
                .fetcher
                .fetch_model(manifest.id(), &Selection::default(), &ProgressBar::hidden())
                .await?
                .bytes;
            node.shutdown().await;
            std::fs::remove_dir_all(dir)?;
        }
        let ref_time = t.elapsed();

        // The market: empty nodes join one by one, each once the one before has settled.
        let fractions = [0.35, 0.4, 0.5, 0.55, 0.6, 0.6];
        let t = Instant::now();
        let mut nodes = Vec::new();
        let mut covered_at = None;
        for (i, f) in fractions.iter().enumerate() {
            let mut o = NodeOptions::local(work.path().join(format!("market{i}")), vec![boot.clone()]);
            o.capacity = (model_bytes as f64 * f) as u64 + manifest.to_bytes().len() as u64;
            o.auto = Some(AutoOptions {
                round: Duration::from_millis(500),
                ..AutoOptions::default()
            });
            let node = RunningNode::start(o).await?;
            let market = node.market.clone().expect("a market node");
            if !market.settled(Duration::from_secs(600)).await {
                anyhow::bail!("node {i} did not settle: {:?}", market.summary());
            }
            nodes.push(node);
            if covered_at.is_none() {
                let map = seeder.handle.coverage(manifest.id()).await?.expect("followed");
                let me = seeder.handle.identity.key;
                let outside = |l, e| map.holders(l, e).iter().filter(|k| **k != me).count();
                if manifest.all_slabs().all(|(l, e, _)| outside(l, e) >= 2) {
                    covered_at = Some(t.elapsed());
                }
            }
        }
        let settled = t.elapsed();
        let moved: u64 = nodes
            .iter()
            .map(|n| n.market.as_ref().map_or(0, |m| m.summary().fetched_bytes))
            .sum();
        for n in nodes {
            n.shutdown().await;
        }
        seeder.shutdown().await;

        let needed = 2 * model_bytes;
        println!(
            "model {} : {slabs} slabs, {:.1} MB; 6 nodes, capacities 3.0× the model",
            model.display(),
            model_bytes as f64 / 1e6
        );
        println!(
            "plain fetch of 2 replicas : {:.2} s, {:.1} MB",
            ref_time.as_secs_f64(),
            ref_bytes as f64 / 1e6
        );
        match covered_at {
            Some(c) => println!(
                "market: 2 replicas outside the seeder after {:.2} s (ratio to plain {:.2}), all settled after {:.2} s",
                c.as_secs_f64(),
                c.as_secs_f64() / ref_time.as_secs_f64(),
                settled.as_secs_f64()
            ),
            None => println!("market: NOT every slab at 2 replicas after {:.2} s", settled.as_secs_f64()),
        }
        println!(
            "market moved {:.1} MB: {:.2}× the bytes strictly needed ({:.1} MB = 2 replicas × the model)",
            moved as f64 / 1e6,
            moved as f64 / needed as f64,
            needed as f64 / 1e6
        );
        anyhow::Ok(())
    })
}
