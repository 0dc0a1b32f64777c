//! The holders a router sends to: at most 8 of a slab, the best by its own standing of them.
//! Made-up records, however many, never push out a worker it has measured, and holders it
//! knows nothing of are ordered by a secret of each router's own, so no key can be ground to
//! come first everywhere.

use moeswarm_testkit as common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::data;
use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest, LocalExecutor};
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::moe::{DispatchPlan, ExpertRows};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_node::dataplane::replicas::MAX_REPLICAS;
use moeswarm_node::dataplane::{
    HeldExperts, RemoteExecutor, ReplicaTable, WorkerFault, WorkerService,
};
use moeswarm_node::net::NodeIdentity;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{Holdings, Manifest, NodeKey, Reach};
use moeswarm_relay::DataEndpoint;

fn identity(n: u16) -> NodeIdentity {
    let mut seed = [7u8; 32];
    seed[..2].copy_from_slice(&n.to_le_bytes());
    NodeIdentity::from_seed(seed).unwrap()
}

/// A record of `node` holding all of layer 0 at `addr`.
fn record(manifest: &Manifest, node: NodeKey, addr: std::net::SocketAddr) -> Holdings {
    let n_expert = manifest.hyper.n_expert;
    let mut layers = vec![LayerBits::empty(n_expert); manifest.hyper.n_layer as usize];
    for e in 0..n_expert {
        layers[0].set(e);
    }
    Holdings {
        model: manifest.id(),
        node,
        n_expert,
        layers,
        used_bytes: 0,
        free_bytes: 0,
        addrs: vec![format!("quic://{addr}")],
        reach: Reach::Direct,
        seq: 1,
        expires_at: u64::MAX,
    }
}

/// 300 made-up holders of layer 0, at addresses where nobody answers.
fn made_up(manifest: &Manifest) -> Vec<Holdings> {
    (1000..1300u16)
        .map(|n| {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
            record(manifest, identity(n).key, addr)
        })
        .collect()
}

fn router(manifest: &Manifest, table: ReplicaTable, n: u16) -> RemoteExecutor {
    let ep = DataEndpoint::bind(
        &identity(n).keypair,
        "127.0.0.1:0".parse().unwrap(),
        &[DISPATCH_ALPN],
    )
    .unwrap();
    RemoteExecutor::new(manifest.clone(), ep, table, None, Duration::from_secs(5))
}

#[test]
fn a_flood_of_holders_is_cut_to_eight_chosen_by_each_routers_own_secret() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (_, manifest, _) = slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    let records = made_up(&manifest);
    let kept = |n: u16| -> BTreeSet<NodeKey> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let _g = rt.enter();
        let r = router(
            &manifest,
            ReplicaTable::from_records(&manifest, &records, None),
            n,
        );
        let table = r.shared_replicas();
        let table = table.read().unwrap();
        let holders = table.replicas(0, 0);
        assert_eq!(holders.len(), MAX_REPLICAS);
        holders.iter().map(|h| h.key).collect()
    };
    // Two routers keep different eights: which made-up key is kept is not the key's to say.
    assert_ne!(kept(1), kept(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_holders_never_push_out_a_worker_the_router_has_measured() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (_, manifest, _) = slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    let n_expert = manifest.hyper.n_expert;
    let mut held = HeldExperts::default();
    HeldExperts::load_some(&store, &manifest, (0..n_expert).map(|e| (0, e)), &mut held).unwrap();
    let w = identity(1);
    let ep =
        DataEndpoint::bind(&w.keypair, "127.0.0.1:0".parse().unwrap(), &[DISPATCH_ALPN]).unwrap();
    let honest = record(&manifest, w.key, ep.local_addr().unwrap());
    let _service = WorkerService::spawn(
        held,
        Some(ep),
        None,
        w.keypair.clone(),
        4,
        WorkerFault::Honest,
    );

    // Checks off: every dispatch here is one the router chose to send.
    let r = router(
        &manifest,
        ReplicaTable::from_records(&manifest, [&honest], None),
        2,
    )
    .with_checks(moeswarm_node::dataplane::CheckPolicy::never());
    let n_embd = manifest.hyper.n_embd as usize;
    let x: Vec<f32> = (0..2 * n_embd).map(|i| (i as f32 * 0.37).sin()).collect();
    let plan = DispatchPlan {
        groups: (0..n_expert)
            .map(|e| ExpertRows {
                expert: e,
                tokens: vec![0, 1],
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
    let local = LocalModel::load(&ModelSource::Gguf(data("tiny-f32.gguf"))).unwrap();
    let want = LocalExecutor::compute(&local.experts, req).await.unwrap();
    // The router measures the worker.
    for _ in 0..3 {
        assert_eq!(r.compute(req).await.unwrap(), want);
    }
    // Then 300 made-up holders of every slab it uses are announced.
    let mut all = made_up(&manifest);
    all.push(honest.clone());
    let standing = r.standing();
    let table = ReplicaTable::from_records(&manifest, &all, None).capped(|h| standing.rank(h));
    for e in 0..n_expert {
        let holders = table.replicas(0, e);
        assert_eq!(holders.len(), MAX_REPLICAS);
        assert_eq!(
            holders[0].key, w.key,
            "the measured worker first for expert {e}"
        );
    }
    *r.shared_replicas().write().unwrap() = table;
    // Its answers stay whole and right. The first may try the made-up holders kept beside the
    // worker (unmeasured ones take groups off a busy one), each once; found silent, they are
    // passed over, and every answer after comes from the worker in one dispatch.
    assert_eq!(r.compute(req).await.unwrap(), want);
    let s = r.stats.summary();
    let tried = s.dropped.values().sum::<u64>();
    assert!(tried < MAX_REPLICAS as u64, "{s:#?}");
    for _ in 0..3 {
        assert_eq!(r.compute(req).await.unwrap(), want);
    }
    let after = r.stats.summary();
    assert_eq!(after.sent - s.sent, 3, "{after:#?}");
    assert_eq!(after.dropped.values().sum::<u64>(), tried, "{after:#?}");
}
