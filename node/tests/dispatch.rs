//! The router's dispatches over real QUIC endpoints on 127.0.0.1, each worker on a runtime of
//! its own (so that dropping it ends the worker the way a crash does, with nothing said to its
//! peers):
//! - a worker that crashed and came back at the same address is answered on a fresh
//!   connection: the router learns at once that its pooled connection died with the worker's
//!   last run (the new run's stateless reset says so, its key being the node's own), dials
//!   again, and gets the same outputs, with nothing dropped and no deadline waited out;
//! - a slow worker's lateness is its own: the other workers of the layer answer at their pace.

use moeswarm_testkit as common;

use std::net::SocketAddr;
use std::ops::Range;
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
use moeswarm_protocol::{Holdings, Manifest, Reach};
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

/// The tiny model sliced into a store, and its file.
struct Tiny {
    _dir: tempfile::TempDir,
    store: Store,
    manifest: Manifest,
    file: std::path::PathBuf,
}

fn tiny() -> Tiny {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let file = data("tiny-f32.gguf");
    let (_, manifest, _) = slice(&file, &store, SliceOptions::default()).unwrap();
    Tiny {
        _dir: dir,
        store,
        manifest,
        file,
    }
}

/// Worker `n` serving layer 0's `experts` at `addr` with `fault`, on a runtime of its own;
/// its record for the router.
fn start_worker(
    t: &Tiny,
    n: u8,
    experts: Range<u32>,
    addr: SocketAddr,
    fault: WorkerFault,
) -> (tokio::runtime::Runtime, Holdings) {
    let mut held = HeldExperts::default();
    HeldExperts::load_some(
        &t.store,
        &t.manifest,
        experts.clone().map(|e| (0, e)),
        &mut held,
    )
    .unwrap();
    let rt = runtime();
    let w = identity(n);
    let bound = rt.block_on(async {
        let ep = DataEndpoint::bind(&w.keypair, addr, &[DISPATCH_ALPN]).unwrap();
        let bound = ep.local_addr().unwrap();
        let service = WorkerService::spawn(held, Some(ep), None, w.keypair.clone(), 4, fault);
        // Lives as long as its runtime.
        std::mem::forget(service);
        bound
    });
    let n_expert = t.manifest.hyper.n_expert;
    let mut layers = vec![LayerBits::empty(n_expert); t.manifest.hyper.n_layer as usize];
    for e in experts {
        layers[0].set(e);
    }
    let record = Holdings {
        model: t.manifest.id(),
        node: w.key,
        n_expert,
        layers,
        used_bytes: 0,
        free_bytes: 0,
        addrs: vec![format!("quic://{bound}")],
        reach: Reach::Direct,
        seq: 1,
        expires_at: u64::MAX,
    };
    (rt, record)
}

/// A router (checks off) sending to `workers`, on a runtime of its own.
fn router(
    t: &Tiny,
    workers: &[&Holdings],
    deadline: Duration,
) -> (tokio::runtime::Runtime, RemoteExecutor) {
    let rt = runtime();
    let exec = rt.block_on(async {
        let ep = DataEndpoint::bind(
            &identity(100).keypair,
            "127.0.0.1:0".parse().unwrap(),
            &[DISPATCH_ALPN],
        )
        .unwrap();
        let table = ReplicaTable::from_records(&t.manifest, workers.iter().copied(), None);
        RemoteExecutor::new(t.manifest.clone(), ep, table, None, deadline)
            .with_checks(CheckPolicy::never())
    });
    (rt, exec)
}

/// Rows for three tokens, and every expert of layer 0 given two of them.
fn rows_and_plan(t: &Tiny) -> (Vec<f32>, DispatchPlan) {
    let n_embd = t.manifest.hyper.n_embd as usize;
    let x = (0..3 * n_embd).map(|i| (i as f32 * 0.37).sin()).collect();
    let plan = DispatchPlan {
        groups: (0..t.manifest.hyper.n_expert)
            .map(|e| ExpertRows {
                expert: e,
                tokens: vec![0, 2],
            })
            .collect(),
    };
    (x, plan)
}

fn request<'a>(t: &Tiny, x: &'a [f32], plan: &'a DispatchPlan) -> ExpertRequest<'a> {
    ExpertRequest {
        step: 0,
        layer: 0,
        x,
        n_embd: t.manifest.hyper.n_embd as usize,
        plan,
    }
}

fn local_outputs(t: &Tiny, req: ExpertRequest<'_>) -> Vec<Vec<f32>> {
    let local = LocalModel::load(&ModelSource::Gguf(t.file.clone())).unwrap();
    runtime()
        .block_on(LocalExecutor::compute(&local.experts, req))
        .unwrap()
}

#[test]
fn a_worker_restarted_at_its_address_is_answered_on_a_fresh_connection_with_the_same_outputs() {
    let t = tiny();
    let all = 0..t.manifest.hyper.n_expert;
    let any = "127.0.0.1:0".parse().unwrap();
    let (first, record) = start_worker(&t, 1, all.clone(), any, WorkerFault::Honest);
    let deadline = Duration::from_secs(5);
    let (rt, router) = router(&t, &[&record], deadline);
    let (x, plan) = rows_and_plan(&t);
    let req = request(&t, &x, &plan);
    let want = local_outputs(&t, req);
    assert_eq!(rt.block_on(router.compute(req)).unwrap(), want);

    // The worker crashes (its runtime goes, nothing is sent) and comes back at its address.
    drop(first);
    let (_second, again) = start_worker(&t, 1, all, record_addr(&record), WorkerFault::Honest);
    assert_eq!(again.addrs, record.addrs);

    let started = Instant::now();
    let outputs = rt.block_on(router.compute(req)).unwrap();
    let took = started.elapsed();
    assert_eq!(outputs, want);
    let s = router.stats.summary();
    assert_eq!(s.dropped.values().sum::<u64>(), 0, "{s:#?}");
    assert_eq!(s.accepted, 2, "{s:#?}");
    assert!(
        took < deadline / 2,
        "the dead connection was noticed after {took:?}"
    );
}

fn record_addr(r: &Holdings) -> SocketAddr {
    r.addrs[0].strip_prefix("quic://").unwrap().parse().unwrap()
}

#[test]
fn a_slow_workers_lateness_is_its_own_and_the_others_answer_at_their_pace() {
    let t = tiny();
    let n = t.manifest.hyper.n_expert;
    let any = "127.0.0.1:0".parse().unwrap();
    let slow = Duration::from_millis(400);
    let (_a, fast_one) = start_worker(&t, 1, 0..n / 2, any, WorkerFault::Honest);
    let (_b, slow_one) = start_worker(&t, 2, n / 2..n, any, WorkerFault::SlowCompute(slow));
    let (rt, router) = router(&t, &[&fast_one, &slow_one], Duration::from_secs(5));
    let (x, plan) = rows_and_plan(&t);
    let req = request(&t, &x, &plan);
    let want = local_outputs(&t, req);
    for _ in 0..3 {
        assert_eq!(rt.block_on(router.compute(req)).unwrap(), want);
    }
    let s = router.stats.summary();
    assert_eq!(s.accepted, 6, "{s:#?}");
    let p50 = |n: u8| s.worker_latency_ms[&identity(n).peer_id.to_string()][0];
    assert!(p50(2) >= slow.as_secs_f64() * 1e3, "{s:#?}");
    assert!(p50(1) < 100.0, "{s:#?}");
}
