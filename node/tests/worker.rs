//! One worker on 127.0.0.1 against routers: a token routed to several of its slabs travels
//! once, a full queue answers busy at once, malformed or oversized frames end only their own
//! stream, and a peer flooding it with large frames on every stream it may open neither grows
//! its memory past a bound nor keeps others out.

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
    worker_with_queue(dir, fault, 1)
}

/// [`worker`] with `queue` compute slots.
fn worker_with_queue(
    dir: &std::path::Path,
    fault: WorkerFault,
    queue: usize,
) -> (Manifest, WorkerService, ReplicaTable) {
    let (store, _) = Store::open(dir).unwrap();
    let (_, manifest, _) = slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    let n_expert = manifest.hyper.n_expert;
    let mut held = HeldExperts::default();
    HeldExperts::load_some(&store, &manifest, (0..n_expert).map(|e| (0, e)), &mut held).unwrap();
    let w = identity(1);
    let ep =
        DataEndpoint::bind(&w.keypair, "127.0.0.1:0".parse().unwrap(), &[DISPATCH_ALPN]).unwrap();
    let addr = ep.local_addr().unwrap();
    let service = WorkerService::spawn(held, Some(ep), None, w.keypair.clone(), queue, fault);
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

/// A connection to the worker `table` names, from node `n`, to send it frames made by hand
/// (and the endpoint it lives on).
async fn by_hand(table: &ReplicaTable, n: u8) -> (DataEndpoint, quinn::Connection) {
    let replica = &table.replicas(0, 0)[0];
    let moeswarm_node::dataplane::Route::Direct(addr) = replica.route else {
        panic!("direct")
    };
    let ep = DataEndpoint::bind(
        &identity(n).keypair,
        "127.0.0.1:0".parse().unwrap(),
        &[DISPATCH_ALPN],
    )
    .unwrap();
    let conn = ep.connect(addr, replica.peer, DISPATCH_ALPN).await.unwrap();
    (ep, conn)
}

/// Layer 0's `expert` given one row: token 0.
fn one_row(expert: u32) -> DispatchPlan {
    DispatchPlan {
        groups: vec![ExpertRows {
            expert,
            tokens: vec![0],
        }],
    }
}

/// Forward pass `step`'s layer-0 request of `x` (one row) by `plan`.
fn request<'a>(step: u64, x: &'a [f32], plan: &'a DispatchPlan) -> ExpertRequest<'a> {
    ExpertRequest {
        step,
        layer: 0,
        x,
        n_embd: x.len(),
        plan,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_routed_to_several_slabs_of_one_worker_travels_once_and_each_gets_its_row() {
    use moeswarm_engine::expert::ExpertWeights;
    use moeswarm_engine::layer::read_slab;

    let dir = tempfile::tempdir().unwrap();
    let (manifest, _service, table) = worker(dir.path(), WorkerFault::Honest);
    let n_embd = manifest.hyper.n_embd as usize;
    let x: Vec<f32> = (0..3 * n_embd)
        .map(|i| (i % 17) as f32 / 8.0 - 1.0)
        .collect();
    // Tokens 0 and 2 go to two of these experts, token 1 to two as well.
    let groups = [(1, vec![0, 2]), (3, vec![2, 0, 1]), (5, vec![1])];
    let plan = DispatchPlan {
        groups: groups
            .iter()
            .map(|(e, t)| ExpertRows {
                expert: *e,
                tokens: t.clone(),
            })
            .collect(),
    };
    let r = router(&manifest, &table, 7);
    let req = ExpertRequest {
        step: 0,
        layer: 0,
        x: &x,
        n_embd,
        plan: &plan,
    };
    let out = r.compute(req).await.unwrap();
    // The reference: each expert computed here on its rows, gathered one by one.
    let (store, _) = Store::open(dir.path()).unwrap();
    for ((e, tokens), got) in groups.iter().zip(&out) {
        let w =
            ExpertWeights::from_slab_bytes(&read_slab(&store, &manifest, 0, *e).unwrap()).unwrap();
        let rows: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| x[t as usize * n_embd..(t as usize + 1) * n_embd].to_vec())
            .collect();
        assert_eq!(got, &w.forward_rows(&rows).unwrap(), "expert {e}");
    }
    // Three distinct rows travelled, with an index of the six rows asked for.
    let sent = r.stats.bytes_out.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(sent, (6 * 4 + 3 * n_embd * 4) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_naming_a_row_that_was_not_sent_is_refused_with_the_reason() {
    use moeswarm_protocol::dispatch::{DispatchReply, ReplyStatus};

    let dir = tempfile::tempdir().unwrap();
    let (manifest, service, table) = worker(dir.path(), WorkerFault::Honest);
    let (_ep, conn) = by_hand(&table, 8).await;
    let n_embd = manifest.hyper.n_embd;
    // Two rows for expert 0 from one distinct row, the second naming row 1.
    let h = serde_json::json!({
        "ticket": {"model": manifest.id(), "epoch": 1, "step": 0, "layer": 0, "seq": 0},
        "n_embd": n_embd,
        "slabs": [{"slab": manifest.slab(0, 0).unwrap().id, "expert": 0, "rows": 2}],
        "distinct_rows": 1,
    });
    let h = serde_json::to_vec(&h).unwrap();
    let payload = [
        &0u32.to_le_bytes()[..],
        &1u32.to_le_bytes(),
        &vec![0u8; n_embd as usize * 4],
    ]
    .concat();
    let frame = [
        &(h.len() as u32).to_le_bytes()[..],
        &h,
        &(payload.len() as u64).to_le_bytes(),
        &payload,
    ]
    .concat();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&frame).await.unwrap();
    send.finish().unwrap();
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        moeswarm_relay::framing::read_frame::<DispatchReply>(&mut recv, |_| Ok(0)),
    )
    .await
    .unwrap()
    .unwrap()
    .unwrap()
    .0;
    assert!(
        matches!(&reply.status, ReplyStatus::Refused { reason } if reason.contains("row index 1 of 1")),
        "{reply:?}"
    );
    let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(count(&service.stats.refused), 1);
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
    let plan = one_row(0);
    let req = request(0, &x, &plan);
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
    let (_ep, conn) = by_hand(&table, 4).await;
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
        // The stream ends at once with no answer at all; the connection stays up.
        let got = tokio::time::timeout(Duration::from_secs(10), recv.read_to_end(1 << 20)).await;
        assert!(matches!(got, Ok(Ok(ref b)) if b.is_empty()), "{got:?}");
    }
    // Each of the three was counted as refused, nothing else.
    let stats = &service.stats;
    let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(count(&stats.refused), 3);
    assert_eq!((count(&stats.answered), count(&stats.busy)), (0, 0));
    // A good dispatch still works.
    let r = router(&manifest, &table, 5);
    let n_embd = manifest.hyper.n_embd as usize;
    let x = vec![0.25f32; n_embd];
    let plan = one_row(3);
    let out = r.compute(request(0, &x, &plan)).await.unwrap();
    assert_eq!(out[0].len(), n_embd);
}

/// This process's peak resident memory so far, in bytes (Linux).
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    kb << 10
}

/// What one peer may make a worker hold, by the worker's and endpoint's limits: the memory of
/// the dispatches admitted (payload, rows, outputs, reply), plus every connection's unread
/// receive window (576 MiB).
const WORKER_BOUND: u64 = moeswarm_node::dataplane::admission::DEFAULT_MEMORY_BYTES
    + moeswarm_relay::endpoint::MAX_CONNECTIONS_PER_PEER as u64
        * moeswarm_relay::endpoint::RECEIVE_WINDOW as u64;

/// Five dispatches of another router to the worker of `dir`, each answered with the numbers
/// the expert gives here.
async fn another_router_is_served(
    dir: &std::path::Path,
    manifest: &moeswarm_protocol::Manifest,
    table: &moeswarm_node::dataplane::ReplicaTable,
) {
    let n_embd = manifest.hyper.n_embd;
    let weights = {
        let (store, _) = Store::open(dir).unwrap();
        moeswarm_engine::layer::load_expert(&store, manifest, 0, 3).unwrap()
    };
    let r = router(manifest, table, 7);
    let n = n_embd as usize;
    for k in 0..5 {
        let x: Vec<f32> = (0..n).map(|i| ((i + k) % 7) as f32 * 0.125 - 0.3).collect();
        let plan = one_row(3);
        let out = r
            .compute(request(k as u64, &x, &plan))
            .await
            .expect("another router is served during the flood");
        let want = weights.forward_rows(&x).unwrap();
        assert_eq!(out[0], want);
    }
}

/// Opens streams on `conn` one after another until `stop`, each sending the frame head
/// `head` and `len` bytes of `chunk`s: what a flooding peer does (counted in `sent` and
/// `streams`).
async fn flood_streams(
    conn: quinn::Connection,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
    streams: std::sync::Arc<std::sync::atomic::AtomicU64>,
    head: std::sync::Arc<Vec<u8>>,
    chunk: std::sync::Arc<Vec<u8>>,
    len: u64,
) {
    use std::sync::atomic::Ordering;
    while !stop.load(Ordering::Relaxed) {
        let Ok(Ok((mut send, _recv))) =
            tokio::time::timeout(Duration::from_secs(1), conn.open_bi()).await
        else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        streams.fetch_add(1, Ordering::Relaxed);
        if send.write_all(&head).await.is_err() {
            continue;
        }
        let mut left = len;
        while left > 0 && !stop.load(Ordering::Relaxed) {
            let n = left.min(chunk.len() as u64) as usize;
            let w =
                tokio::time::timeout(Duration::from_millis(500), send.write_all(&chunk[..n])).await;
            match w {
                Ok(Ok(())) => {
                    left -= n as u64;
                    sent.fetch_add(n as u64, Ordering::Relaxed);
                }
                Ok(Err(_)) => break,
                Err(_) => continue,
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_sending_large_frames_on_256_streams_stays_under_the_bound_and_others_are_served() {
    use moeswarm_protocol::dispatch::{frame_head, DispatchRequest, DispatchTicket, SlabRows};
    use moeswarm_relay::endpoint::{MAX_CONNECTIONS_PER_PEER, MAX_STREAMS};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let (manifest, service, table) = worker_with_queue(dir.path(), WorkerFault::Honest, 8);
    let replica = &table.replicas(0, 0)[0];
    let moeswarm_node::dataplane::Route::Direct(addr) = replica.route else {
        panic!("direct")
    };
    let n_embd = manifest.hyper.n_embd;
    // Every frame is as large as a dispatch may be: 64 MiB of rows for expert 0.
    let max = moeswarm_protocol::dispatch::MAX_PAYLOAD_BYTES;
    let rows = (max / (4 * n_embd as u64)) as u32;
    let header = serde_json::to_vec(&DispatchRequest {
        ticket: DispatchTicket {
            model: manifest.id(),
            epoch: 9,
            step: 0,
            layer: 0,
            seq: 0,
        },
        n_embd,
        slabs: vec![SlabRows {
            slab: manifest.slab(0, 0).unwrap().id,
            expert: 0,
            rows,
        }],
        wire: Default::default(),
        distinct_rows: None,
    })
    .unwrap();
    let len = 4 * n_embd as u64 * rows as u64;
    assert!(len <= max && len > max - 4096);
    let head = Arc::new(frame_head(&header, len));

    let before = peak_rss();
    let flooder = DataEndpoint::bind(
        &identity(6).keypair,
        "127.0.0.1:0".parse().unwrap(),
        &[DISPATCH_ALPN],
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let streams = Arc::new(AtomicU64::new(0));
    let chunk = Arc::new(vec![0u8; 1 << 20]);
    // One connection more than a peer may hold: the worker closes one of them (whichever
    // handshake it finished last).
    let mut conns = Vec::new();
    for _ in 0..=MAX_CONNECTIONS_PER_PEER {
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_secs(5),
            flooder.connect(addr, replica.peer, DISPATCH_ALPN),
        )
        .await
        {
            conns.push(c);
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    conns.retain(|c| c.close_reason().is_none());
    assert_eq!(conns.len(), MAX_CONNECTIONS_PER_PEER, "connections kept");
    let mut tasks = Vec::new();
    for conn in conns {
        for _ in 0..MAX_STREAMS {
            let (conn, stop, sent, streams) =
                (conn.clone(), stop.clone(), sent.clone(), streams.clone());
            let (head, chunk) = (head.clone(), chunk.clone());
            tasks.push(tokio::spawn(flood_streams(
                conn, stop, sent, streams, head, chunk, len,
            )));
        }
    }
    // Meanwhile another router's dispatches are answered, with the right numbers.
    tokio::time::sleep(Duration::from_secs(1)).await;
    another_router_is_served(dir.path(), &manifest, &table).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    let grew = peak_rss().saturating_sub(before);
    let busy = service.stats.busy.load(Ordering::Relaxed);
    eprintln!(
        "flood: {} streams opened, {} MiB sent, {busy} answered busy; peak RSS grew {} MiB (bound {} MiB for the worker)",
        streams.load(Ordering::Relaxed),
        sent.load(Ordering::Relaxed) >> 20,
        grew >> 20,
        WORKER_BOUND >> 20
    );
    assert!(
        streams.load(Ordering::Relaxed) >= 256,
        "the flood opened every stream"
    );
    assert!(
        busy >= 200,
        "the worker turned most streams away unread: {busy}"
    );
    // The process holds the flooder too (its send buffers): the worker's bound plus 128 MiB.
    assert!(
        grew < WORKER_BOUND + (128 << 20),
        "peak RSS grew {} MiB",
        grew >> 20
    );
}

/// A dispatch frame's header for one row of expert `expert` of layer 0, without its payload.
fn header_only(manifest: &Manifest, expert: u32) -> Vec<u8> {
    let n_embd = manifest.hyper.n_embd;
    let h = serde_json::json!({
        "ticket": {"model": manifest.id(), "epoch": 7, "step": 0, "layer": 0, "seq": expert},
        "n_embd": n_embd,
        "slabs": [{"slab": manifest.slab(0, expert).unwrap().id, "expert": expert, "rows": 1}],
    });
    let h = serde_json::to_vec(&h).unwrap();
    [
        &(h.len() as u32).to_le_bytes()[..],
        &h,
        &(n_embd as u64 * 4).to_le_bytes(),
    ]
    .concat()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_keys_sending_headers_alone_neither_take_every_slot_nor_hold_theirs_for_long() {
    let dir = tempfile::tempdir().unwrap();
    let (manifest, service, table) = worker_with_queue(dir.path(), WorkerFault::Honest, 4);
    let n_embd = manifest.hyper.n_embd as usize;
    let x = vec![0.25f32; n_embd];
    let plan = one_row(3);
    let req = request(0, &x, &plan);
    // A router the worker has answered for a while.
    let honest = router(&manifest, &table, 2);
    for _ in 0..moeswarm_node::dataplane::admission::PROVEN_AFTER {
        honest.compute(req).await.unwrap();
    }
    // Two fresh keys from the same address send four headers each and never a payload.
    let moeswarm_node::dataplane::Route::Direct(addr) = table.replicas(0, 0)[0].route else {
        panic!("direct")
    };
    let peer = table.replicas(0, 0)[0].peer;
    let (mut held, mut keep) = (Vec::new(), Vec::new());
    for n in [5, 6] {
        let ep = DataEndpoint::bind(
            &identity(n).keypair,
            "127.0.0.1:0".parse().unwrap(),
            &[DISPATCH_ALPN],
        )
        .unwrap();
        let conn = ep.connect(addr, peer, DISPATCH_ALPN).await.unwrap();
        for e in 0..4 {
            let (mut send, recv) = conn.open_bi().await.unwrap();
            send.write_all(&header_only(&manifest, e)).await.unwrap();
            held.push((send, recv));
        }
        keep.push((ep, conn));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The proven router is served at once: the fresh keys share one address's share.
    let out = honest.compute(req).await.unwrap();
    assert_eq!(out[0].len(), n_embd);
    // And the headers' slots come back once their payloads are overdue: every stream ends
    // within the pace a one-row payload is given, unanswered or told busy.
    let within =
        moeswarm_node::dataplane::worker::payload_time(n_embd as u64 * 4) + Duration::from_secs(3);
    for (_send, mut recv) in held {
        let got = tokio::time::timeout(within, recv.read_to_end(1 << 20)).await;
        assert!(
            got.is_ok(),
            "a header-only stream still held after {within:?}"
        );
    }
    let busy = service
        .stats
        .busy
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(busy >= 1, "the eight headers did not all fit: {busy}");
    drop(keep);
}
