//! One worker on 127.0.0.1 against routers: a full queue answers busy at once, and malformed or
//! oversized frames end only their own stream.

use moeswarm_testkit as common;

use std::time::Duration;

use common::data;
use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest};
use moeswarm_engine::moe::{DispatchPlan, ExpertRows};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_node::dataplane::{
    DropReason, HeldExperts, RemoteExecutor, ReplicaTable, WorkerFault, WorkerService,
};
use moeswarm_node::net::NodeIdentity;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{Holdings, Manifest, Reach};
use moeswarm_relay::DataEndpoint;

fn identity(n: u8) -> NodeIdentity {
    NodeIdentity::from_seed([n; 32]).unwrap()
}

/// A worker holding layer 0's experts of the tiny model, and the replica table naming it.
fn worker(dir: &std::path::Path, fault: WorkerFault) -> (Manifest, WorkerService, ReplicaTable) {
    let (store, _) = Store::open(dir).unwrap();
    let (_, manifest, _) = slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    let n_expert = manifest.hyper.n_expert;
    let mut held = HeldExperts::default();
    HeldExperts::load_some(&store, &manifest, (0..n_expert).map(|e| (0, e)), &mut held).unwrap();
    let w = identity(1);
    let ep =
        DataEndpoint::bind(&w.keypair, "127.0.0.1:0".parse().unwrap(), &[DISPATCH_ALPN]).unwrap();
    let addr = ep.local_addr().unwrap();
    let service = WorkerService::spawn(held, Some(ep), None, w.keypair.clone(), 1, fault);
    let mut layers = vec![LayerBits::empty(n_expert); manifest.hyper.n_layer as usize];
    for e in 0..n_expert {
        layers[0].set(e);
    }
    let record = Holdings {
        model: manifest.id(),
        node: w.key,
        n_expert,
        layers,
        used_bytes: 0,
        free_bytes: 0,
        addrs: vec![format!("quic://{addr}")],
        reach: Reach::Direct,
        seq: 1,
        expires_at: u64::MAX,
    };
    let table = ReplicaTable::from_records(&manifest, [&record], None);
    (manifest, service, table)
}

fn router(manifest: &Manifest, table: &ReplicaTable, n: u8) -> RemoteExecutor {
    let ep = DataEndpoint::bind(
        &identity(n).keypair,
        "127.0.0.1:0".parse().unwrap(),
        &[DISPATCH_ALPN],
    )
    .unwrap();
    RemoteExecutor::new(
        manifest.clone(),
        ep,
        table.clone(),
        None,
        Duration::from_secs(10),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_busy_at_once_and_the_router_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (manifest, service, table) = worker(
        dir.path(),
        WorkerFault::SlowCompute(Duration::from_millis(800)),
    );
    let (a, b) = (router(&manifest, &table, 2), router(&manifest, &table, 3));
    let n_embd = manifest.hyper.n_embd as usize;
    let x = vec![0.5f32; n_embd];
    let plan = DispatchPlan {
        groups: vec![ExpertRows {
            expert: 0,
            tokens: vec![0],
        }],
    };
    let req = ExpertRequest {
        step: 0,
        layer: 0,
        x: &x,
        n_embd,
        plan: &plan,
    };
    let (ra, rb) = tokio::join!(a.compute(req), b.compute(req));
    // One got the queue's only place; the other was told busy, and with no other replica and
    // no weights of its own its router fails naming the expert.
    let (ok, err) = match (ra, rb) {
        (Ok(o), Err(e)) | (Err(e), Ok(o)) => (o, e),
        other => panic!("want one answer and one refusal: {other:?}"),
    };
    assert_eq!(ok.len(), 1);
    let text = format!("{err:#}");
    assert!(
        text.contains("expert 0 of layer 0") && text.contains("busy"),
        "{text}"
    );
    assert!(a.stats.dropped(DropReason::Busy) + b.stats.dropped(DropReason::Busy) >= 1);
    assert!(
        service
            .stats
            .busy
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_end_their_stream_and_the_worker_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let (manifest, service, table) = worker(dir.path(), WorkerFault::Honest);
    let replica = &table.replicas(0, 0)[0];
    let moeswarm_node::dataplane::Route::Direct(addr) = replica.route else {
        panic!("direct")
    };
    let ep = DataEndpoint::bind(
        &identity(4).keypair,
        "127.0.0.1:0".parse().unwrap(),
        &[DISPATCH_ALPN],
    )
    .unwrap();
    let conn = ep.connect(addr, replica.peer, DISPATCH_ALPN).await.unwrap();
    let frames: Vec<Vec<u8>> = vec![
        // A header length over the limit.
        u32::MAX.to_le_bytes().to_vec(),
        // A header that is not JSON.
        [&5u32.to_le_bytes()[..], b"hello", &0u64.to_le_bytes()].concat(),
        // A payload length that disagrees with the header.
        {
            let h = serde_json::json!({
                "ticket": {"model": manifest.id(), "epoch": 1, "step": 0, "layer": 0, "seq": 0},
                "n_embd": manifest.hyper.n_embd,
                "slabs": [{"slab": manifest.slab(0, 0).unwrap().id, "expert": 0, "rows": 1}],
            });
            let h = serde_json::to_vec(&h).unwrap();
            [
                &(h.len() as u32).to_le_bytes()[..],
                &h,
                &3u64.to_le_bytes(),
                b"abc",
            ]
            .concat()
        },
    ];
    for f in frames {
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        let _ = send.write_all(&f).await;
        let _ = send.finish();
        // The stream ends with no answer (or a reset); the connection stays up.
        let got = tokio::time::timeout(Duration::from_secs(10), recv.read_to_end(1 << 20)).await;
        assert!(
            matches!(got, Ok(Ok(ref b)) if b.is_empty()) || matches!(got, Ok(Err(_))),
            "{got:?}"
        );
    }
    assert!(
        service
            .stats
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
    // A good dispatch still works.
    let r = router(&manifest, &table, 5);
    let n_embd = manifest.hyper.n_embd as usize;
    let x = vec![0.25f32; n_embd];
    let plan = DispatchPlan {
        groups: vec![ExpertRows {
            expert: 3,
            tokens: vec![0],
        }],
    };
    let out = r
        .compute(ExpertRequest {
            step: 0,
            layer: 0,
            x: &x,
            n_embd,
            plan: &plan,
        })
        .await
        .unwrap();
    assert_eq!(out[0].len(), n_embd);
}
