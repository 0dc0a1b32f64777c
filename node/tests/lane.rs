//! The plain TCP lane of blob fetches, between real nodes on 127.0.0.1: bytes taken there are
//! verified like any others, what is rewritten there is asked again over libp2p without
//! blaming anyone, and the lane's server holds to its limits.

use moeswarm_testkit as common;

use std::path::Path;
use std::time::Duration;

use indicatif::ProgressBar;
use moeswarm_node::net::{Selection, ServeFault};
use moeswarm_node::{NodeOptions, RunningNode};
use moeswarm_protocol::exchange::MAX_REQUEST_BYTES;
use moeswarm_protocol::{ExchangeRequest, ExchangeResponse, Manifest, ResponseHeader};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn start(dir: &Path, bootstrap: &[libp2p::Multiaddr], fault: ServeFault) -> RunningNode {
    let mut opts = NodeOptions::local(dir.to_path_buf(), bootstrap.to_vec());
    opts.serve_fault = fault;
    RunningNode::start(opts).await.unwrap()
}

/// A seeder of the small model serving as `fault`, and a fresh node joined to it.
async fn seeder_and_me(
    fault: ServeFault,
) -> (Vec<tempfile::TempDir>, Manifest, RunningNode, RunningNode) {
    let seed_dir = tempfile::tempdir().unwrap();
    let manifest = common::sliced_small(seed_dir.path());
    let seeder = start(seed_dir.path(), &[], fault).await;
    let boot = seeder.addrs().await.unwrap()[0].clone();
    let me_dir = tempfile::tempdir().unwrap();
    let me = start(me_dir.path(), &[boot], ServeFault::Honest).await;
    (vec![seed_dir, me_dir], manifest, seeder, me)
}

fn layer0() -> Selection {
    Selection {
        layers: Some(0..1),
        experts: None,
        trunk: false,
        only: None,
    }
}

fn assert_same_slabs(manifest: &Manifest, me: &RunningNode, seeder: &RunningNode) {
    let held = me.store.held_slabs(manifest).unwrap();
    assert_eq!(held.len() as u32, manifest.hyper.n_expert);
    for (l, e) in held {
        let id = manifest.slab(l, e).unwrap().id;
        assert_eq!(me.store.read(&id).unwrap(), seeder.store.read(&id).unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_takes_its_bytes_over_the_plain_lane_and_stores_them_byte_identical() {
    let (_dirs, manifest, seeder, me) = seeder_and_me(ServeFault::Honest).await;
    let r = me
        .fetch(manifest.id(), &layer0(), &ProgressBar::hidden())
        .await
        .unwrap();
    assert!(r.bytes > 0 && r.rejected.is_empty(), "{r:?}");
    assert_eq!(
        r.lane_bytes, r.bytes,
        "every range came over the lane: {r:?}"
    );
    assert_same_slabs(&manifest, &me, &seeder);
    me.shutdown().await;
    seeder.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_rewritten_on_the_lane_are_asked_again_over_libp2p_and_held_against_no_one() {
    let (_dirs, manifest, seeder, me) = seeder_and_me(ServeFault::CorruptBulkLane).await;
    let r = me
        .fetch(manifest.id(), &layer0(), &ProgressBar::hidden())
        .await
        .unwrap();
    // Every blob whole and right; what the lane spoilt came over libp2p.
    assert_same_slabs(&manifest, &me, &seeder);
    assert!(r.lane_bytes < r.bytes, "{r:?}");
    assert!(r.rejected.is_empty(), "{r:?}");
    let stats = me.handle.stats().await.unwrap();
    assert!(stats.penalties.is_empty(), "{stats:?}");
    me.shutdown().await;
    seeder.shutdown().await;
}

/// Where `seeder`'s lane listens, as it tells `me` over libp2p.
async fn lane_of(seeder: &RunningNode, me: &RunningNode) -> std::net::SocketAddr {
    let r = me
        .handle
        .request(seeder.handle.peer_id, ExchangeRequest::BulkPort)
        .await
        .unwrap();
    let ResponseHeader::BulkPort { port } = r.header else {
        panic!("no lane: {:?}", r.header)
    };
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

async fn send_frame(sock: &mut tokio::net::TcpStream, len: u32, body: &[u8]) {
    sock.write_all(&len.to_le_bytes()).await.unwrap();
    sock.write_all(body).await.unwrap();
}

async fn read_answer(sock: &mut tokio::net::TcpStream) -> ExchangeResponse {
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    sock.read_exact(&mut body).await.unwrap();
    ExchangeResponse::decode(&body).unwrap()
}

/// Whether the server closed `sock` (within a bound).
async fn closed(sock: &mut tokio::net::TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), sock.read(&mut b)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lane_answers_ranges_only_and_closes_on_an_oversized_frame() {
    let (_dirs, manifest, seeder, me) = seeder_and_me(ServeFault::Honest).await;
    let addr = lane_of(&seeder, &me).await;
    let id = manifest.slab(0, 0).unwrap().id;
    let range = ExchangeRequest::Range {
        id,
        start: 0,
        end: 1000,
    }
    .encode();

    // A range, then anything else (refused), on one connection.
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    send_frame(&mut sock, range.len() as u32, &range).await;
    let a = read_answer(&mut sock).await;
    assert!(
        matches!(a.header, ResponseHeader::Range { id: got, start: 0, end: 1000 } if got == id),
        "{:?}",
        a.header
    );
    let models = ExchangeRequest::Models.encode();
    send_frame(&mut sock, models.len() as u32, &models).await;
    let a = read_answer(&mut sock).await;
    assert!(
        matches!(a.header, ResponseHeader::Refused { .. }),
        "{:?}",
        a.header
    );

    // A frame over the limit is not read: the connection is closed.
    send_frame(&mut sock, MAX_REQUEST_BYTES as u32 + 1, b"").await;
    assert!(closed(&mut sock).await);
    // So is one that is not a request.
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    send_frame(&mut sock, 5, b"hello").await;
    assert!(closed(&mut sock).await);

    // And the lane serves on.
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    send_frame(&mut sock, range.len() as u32, &range).await;
    let a = read_answer(&mut sock).await;
    assert!(matches!(a.header, ResponseHeader::Range { .. }));
    me.shutdown().await;
    seeder.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_the_server_closed_costs_a_new_one_not_the_lane() {
    use moeswarm_node::net::bulk::{BulkLanes, BulkServer};
    let dir = tempfile::tempdir().unwrap();
    let manifest = common::sliced_small(dir.path());
    let (store, _) = moeswarm_model::store::Store::open(dir.path()).unwrap();
    let store = std::sync::Arc::new(store);
    let id = manifest.slab(0, 0).unwrap().id;
    let req = ExchangeRequest::Range {
        id,
        start: 0,
        end: 4096,
    };
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let first = BulkServer::bind(any, store.clone(), ServeFault::Honest)
        .await
        .unwrap();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], first.port()));
    let lanes = BulkLanes::default();
    let a = lanes.range(addr, &req).await.unwrap();
    // The server goes (its connections with it, the kept one too) and comes back.
    drop(first);
    let mut again = None;
    for _ in 0..100 {
        // The port is free once the stopped service's task has let go of it.
        match BulkServer::bind(addr, store.clone(), ServeFault::Honest).await {
            Ok(s) => {
                again = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    assert!(again.is_some(), "the port was not free again within 5 s");
    let b = lanes.range(addr, &req).await.unwrap();
    assert_eq!(a, b);
    assert!(matches!(b.header, ResponseHeader::Range { .. }));
}
