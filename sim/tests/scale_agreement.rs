//! The scale simulator agrees with real nodes: the same six-worker swarm, started as real
//! processes on 127.0.0.1 by `sim::local` (workers joining one by one, each once the previous
//! has settled) and told by the simulator with the same keys, model and budgets, ends with the
//! same slabs on each worker.

use moeswarm_testkit as common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::data;
use moeswarm_market::choice::NodeClass;
use moeswarm_sim::local::{start_local_swarm, SimOptions};
use moeswarm_sim::scale::fixed::{run_fixed, FixedSwarm};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_real_workers_and_the_simulator_end_with_the_same_slabs_on_each() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = SimOptions::new(dir.path().to_path_buf());
    o.model = Some(data("small-q4_k.gguf"));
    o.workers = 6;
    o.relayed = 1;
    o.deadline = Duration::from_secs(10);
    let swarm = start_local_swarm(&o).await.unwrap();
    let m = &swarm.manifest;
    let experts = m.hyper.n_expert;
    let sizes: BTreeSet<u64> = m.all_slabs().map(|(_, _, r)| r.bytes).collect();
    assert_eq!(sizes.len(), 1, "slabs of one size: {sizes:?}");
    let slab_bytes = *sizes.first().unwrap();

    let mut real = Vec::new();
    let mut nodes = Vec::new();
    for (w, relayed) in &swarm.workers {
        let held: BTreeSet<u32> = m
            .all_slabs()
            .filter(|(_, _, r)| w.store.contains(&r.id).unwrap())
            .map(|(l, e, _)| l * experts + e)
            .collect();
        // What the market gives the model: the capacity less what else the store holds
        // (the manifest), as the node's round counts it.
        let stored: u64 = w.store.blobs().unwrap().iter().map(|(_, e)| e.size).sum();
        let other = stored - held.len() as u64 * slab_bytes;
        let capacity = moeswarm_sim::local::default_capacity(m, o.workers);
        let class = if *relayed {
            NodeClass::Phone
        } else {
            NodeClass::Computer
        };
        nodes.push((w.handle.identity.key, capacity - other, class));
        real.push(held);
    }
    let seeder = swarm.router.handle.identity.key;
    let f = FixedSwarm {
        model: m.id(),
        layers: m.slab_layers(),
        experts,
        slab_bytes,
        seeder,
        nodes,
        join_every_secs: 600.0,
    };
    swarm.shutdown().await;
    let simulated = run_fixed(&f);
    for (i, (r, s)) in real.iter().zip(&simulated).enumerate() {
        assert_eq!(
            r,
            s,
            "worker {i}: real {} slabs, simulated {}; only real {:?}, only simulated {:?}",
            r.len(),
            s.len(),
            r.difference(s).collect::<Vec<_>>(),
            s.difference(r).collect::<Vec<_>>()
        );
    }
    // The swarm did spread the model: every slab on two workers.
    let total: usize = real.iter().map(BTreeSet::len).sum();
    assert!(total >= 2 * (f.layers * experts) as usize, "{total}");
}
