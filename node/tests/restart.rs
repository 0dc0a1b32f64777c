//! A worker that crashed and came back at the same address is answered on a fresh connection:
//! the router learns at once that its pooled connection died with the worker's last run (the
//! new run's stateless reset says so, its key being the node's own), dials again, and gets the
//! same outputs, with nothing dropped and no deadline waited out.

use moeswarm_testkit as common;

use std::time::{Duration, Instant};

use common::data;
use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest, LocalExecutor};
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::moe::{DispatchPlan, ExpertRows};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_node::dataplane::{
    CheckPolicy, HeldExperts, RemoteExecutor, ReplicaTable, WorkerFault, WorkerService,
};
use moeswarm_node::net::NodeIdentity;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{Holdings, Reach};
use moeswarm_relay::DataEndpoint;

fn identity(n: u8) -> NodeIdentity {
    NodeIdentity::from_seed([n; 32]).unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// A worker serving `held` at `addr`, on a runtime of its own: dropping the runtime ends it
/// the way a crash does, with nothing said to its peers.
fn start_worker(
    held: &HeldExperts,
    addr: std::net::SocketAddr,
) -> (tokio::runtime::Runtime, std::net::SocketAddr) {
    let rt = runtime();
    let w = identity(1);
    let bound = rt.block_on(async {
        let ep = DataEndpoint::bind(&w.keypair, addr, &[DISPATCH_ALPN]).unwrap();
        let bound = ep.local_addr().unwrap();
        let service = WorkerService::spawn(
            held.clone(),
            Some(ep),
            None,
            w.keypair.clone(),
            4,
            WorkerFault::Honest,
        );
        // Lives as long as its runtime.
        std::mem::forget(service);
        bound
    });
    (rt, bound)
}

#[test]
fn a_worker_restarted_at_its_address_is_answered_on_a_fresh_connection_with_the_same_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let model = data("tiny-f32.gguf");
    let (_, manifest, _) = slice(&model, &store, SliceOptions::default()).unwrap();
    let n_expert = manifest.hyper.n_expert;
    let mut held = HeldExperts::default();
    HeldExperts::load_some(&store, &manifest, (0..n_expert).map(|e| (0, e)), &mut held).unwrap();
    let (first, addr) = start_worker(&held, "127.0.0.1:0".parse().unwrap());

    let mut layers = vec![LayerBits::empty(n_expert); manifest.hyper.n_layer as usize];
    for e in 0..n_expert {
        layers[0].set(e);
    }
    let record = Holdings {
        model: manifest.id(),
        node: identity(1).key,
        n_expert,
        layers,
        used_bytes: 0,
        free_bytes: 0,
        addrs: vec![format!("quic://{addr}")],
        reach: Reach::Direct,
        seq: 1,
        expires_at: u64::MAX,
    };
    let router_rt = runtime();
    let deadline = Duration::from_secs(5);
    let router = router_rt.block_on(async {
        let ep = DataEndpoint::bind(
            &identity(2).keypair,
            "127.0.0.1:0".parse().unwrap(),
            &[DISPATCH_ALPN],
        )
        .unwrap();
        let table = ReplicaTable::from_records(&manifest, [&record], None);
        RemoteExecutor::new(manifest.clone(), ep, table, None, deadline)
            .with_checks(CheckPolicy::never())
    });
    let n_embd = manifest.hyper.n_embd as usize;
    let x: Vec<f32> = (0..3 * n_embd).map(|i| (i as f32 * 0.37).sin()).collect();
    let plan = DispatchPlan {
        groups: (0..n_expert)
            .map(|e| ExpertRows {
                expert: e,
                tokens: vec![0, 2],
            })
            .collect(),
    };
    let req = ExpertRequest {
        step: 0,
        layer: 0,
        x: &x,
        n_embd,
        plan: &plan,
    };
    let local = LocalModel::load(&ModelSource::Gguf(model)).unwrap();
    let want = router_rt
        .block_on(LocalExecutor::compute(&local.experts, req))
        .unwrap();
    assert_eq!(router_rt.block_on(router.compute(req)).unwrap(), want);

    // The worker crashes (its runtime goes, nothing is sent) and comes back at its address.
    drop(first);
    let (_second, again) = start_worker(&held, addr);
    assert_eq!(again, addr);

    let t = Instant::now();
    let outputs = router_rt.block_on(router.compute(req)).unwrap();
    let took = t.elapsed();
    assert_eq!(outputs, want);
    let s = router.stats.summary();
    assert_eq!(s.dropped.values().sum::<u64>(), 0, "{s:#?}");
    assert_eq!(s.accepted, 2, "{s:#?}");
    assert!(
        took < deadline / 2,
        "the dead connection was noticed after {took:?}"
    );
}
