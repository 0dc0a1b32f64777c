//! Real quinn endpoints on 127.0.0.1: identity pinning, relay registration, splicing, limits.

use std::time::Duration;

use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_relay::{peer_of, DataEndpoint, Keypair, RelayClient, RelayLimits, RelayServer};

fn key() -> Keypair {
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    Keypair::ed25519_from_bytes(seed).unwrap()
}

fn local() -> std::net::SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn endpoint() -> DataEndpoint {
    DataEndpoint::bind(&key(), local(), &[DISPATCH_ALPN]).unwrap()
}

#[tokio::test]
async fn a_client_reaches_only_the_peer_it_expects_and_the_server_learns_who_called() {
    let (server, client, stranger) = (endpoint(), endpoint(), endpoint());
    let addr = server.local_addr().unwrap();
    let s = server.clone();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some((conn, p, alpn)) = s.accept().await {
            let _ = tx.send((p, alpn));
            held.push(conn);
        }
    });
    let conn = client
        .connect(addr, server.peer_id(), DISPATCH_ALPN)
        .await
        .unwrap();
    assert_eq!(peer_of(&conn).unwrap(), server.peer_id());
    let (who, alpn) = rx.recv().await.unwrap();
    assert_eq!(who, client.peer_id());
    assert_eq!(alpn, DISPATCH_ALPN);
    // Expecting someone else at that address fails in the handshake.
    let err = client
        .connect(addr, stranger.peer_id(), DISPATCH_ALPN)
        .await
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("handshake") && !text.contains("timed out"),
        "{text}"
    );
}

async fn echo_worker(client: RelayClient) {
    while let Ok((mut send, mut recv, _peer)) = client.accept().await {
        tokio::spawn(async move {
            let data = recv.read_to_end(1 << 24).await.unwrap_or_default();
            let _ = send.write_all(&data).await;
            let _ = send.finish();
        });
    }
}

#[tokio::test]
async fn the_relay_splices_registered_peers_and_refuses_the_rest() {
    let relay = RelayServer::spawn(
        &key(),
        local(),
        RelayLimits {
            bytes_per_stream: 1 << 20,
            ..RelayLimits::default()
        },
    )
    .unwrap();
    let (raddr, rpeer) = (relay.local_addr().unwrap(), relay.peer_id());
    let (worker_ep, router_ep, outsider_ep) = (endpoint(), endpoint(), endpoint());
    let worker = RelayClient::register(&worker_ep, raddr, rpeer)
        .await
        .unwrap();
    tokio::spawn(echo_worker(worker));
    let router = RelayClient::register(&router_ep, raddr, rpeer)
        .await
        .unwrap();

    // Bytes go through untouched, and the worker learns who called.
    let (mut send, mut recv) = router.open(worker_ep.peer_id()).await.unwrap();
    let msg: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
    send.write_all(&msg).await.unwrap();
    send.finish().unwrap();
    let back = tokio::time::timeout(Duration::from_secs(10), recv.read_to_end(1 << 24))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, msg);

    // Over the per-stream byte limit: the stream is cut.
    let (mut send, mut recv) = router.open(worker_ep.peer_id()).await.unwrap();
    let big = vec![1u8; 2 << 20];
    let _ = send.write_all(&big).await;
    let _ = send.finish();
    let got = tokio::time::timeout(Duration::from_secs(10), recv.read_to_end(4 << 20)).await;
    assert!(!matches!(got, Ok(Ok(ref b)) if b.len() == big.len()));

    // Unknown target.
    let err = router.open(outsider_ep.peer_id()).await.unwrap_err();
    assert!(format!("{err:#}").contains("not registered"), "{err:#}");

    // A peer that did not register cannot use the relay.
    let conn = outsider_ep
        .connect(raddr, rpeer, moeswarm_protocol::relay::RELAY_ALPN)
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    moeswarm_relay::framing::write_control(
        &mut send,
        &moeswarm_protocol::relay::RelayMessage::Connect {
            target: worker_ep.peer_id().to_string(),
        },
    )
    .await
    .unwrap();
    let answer = moeswarm_relay::framing::read_control(&mut recv)
        .await
        .unwrap();
    assert!(
        matches!(answer, moeswarm_protocol::relay::RelayMessage::Refused { ref reason } if reason.contains("not registered")),
        "{answer:?}"
    );
    // A registration signed for another relay (or by another key) is refused.
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    moeswarm_relay::framing::write_control(
        &mut send,
        &moeswarm_protocol::relay::RelayMessage::Hello,
    )
    .await
    .unwrap();
    let _challenge = moeswarm_relay::framing::read_control(&mut recv)
        .await
        .unwrap();
    let forged = key().sign(b"anything").unwrap();
    moeswarm_relay::framing::write_control(
        &mut send,
        &moeswarm_protocol::relay::RelayMessage::Register {
            signature: moeswarm_protocol::relay::to_hex(&forged),
        },
    )
    .await
    .unwrap();
    let answer = moeswarm_relay::framing::read_control(&mut recv)
        .await
        .unwrap();
    assert!(
        matches!(
            answer,
            moeswarm_protocol::relay::RelayMessage::Refused { .. }
        ),
        "{answer:?}"
    );
    assert!(
        relay
            .stats
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 3
    );
    relay.shutdown();
}

#[tokio::test]
async fn a_worker_registers_again_when_its_relay_comes_back() {
    let relay_key = key();
    let relay = RelayServer::spawn(&relay_key, local(), RelayLimits::default()).unwrap();
    let (raddr, rpeer) = (relay.local_addr().unwrap(), relay.peer_id());
    let (worker_ep, router_ep) = (endpoint(), endpoint());
    let worker = RelayClient::register(&worker_ep, raddr, rpeer)
        .await
        .unwrap();
    let serving = tokio::spawn(worker.serve_forever(|mut send, mut recv, _| {
        tokio::spawn(async move {
            let data = recv.read_to_end(1 << 20).await.unwrap_or_default();
            let _ = send.write_all(&data).await;
            let _ = send.finish();
        });
    }));
    relay.shutdown();
    // The relay comes back on the same address with the same key.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let relay = loop {
        match RelayServer::spawn(&relay_key, raddr, RelayLimits::default()) {
            Ok(r) => break r,
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "{e:#}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let router = RelayClient::register(&router_ep, raddr, rpeer)
        .await
        .unwrap();
    loop {
        if let Ok((mut send, mut recv)) = router.open(worker_ep.peer_id()).await {
            send.write_all(b"again").await.unwrap();
            send.finish().unwrap();
            assert_eq!(recv.read_to_end(1 << 20).await.unwrap(), b"again");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker never registered again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    serving.abort();
    relay.shutdown();
}

/// A relay on 127.0.0.1 with `limits`, a worker registered at it echoing every stream, and the
/// relay's address and PeerId.
async fn relay_with_echo_worker(
    limits: RelayLimits,
) -> (
    RelayServer,
    std::net::SocketAddr,
    moeswarm_relay::PeerId,
    DataEndpoint,
) {
    let relay = RelayServer::spawn(&key(), local(), limits).unwrap();
    let (raddr, rpeer) = (relay.local_addr().unwrap(), relay.peer_id());
    let worker_ep = endpoint();
    let worker = RelayClient::register(&worker_ep, raddr, rpeer)
        .await
        .unwrap();
    tokio::spawn(echo_worker(worker));
    (relay, raddr, rpeer, worker_ep)
}

/// Sends `msg` to `target` through `client` and reads the echo back.
async fn echo(client: &RelayClient, target: moeswarm_relay::PeerId, msg: &[u8]) -> Vec<u8> {
    let (mut send, mut recv) = client.open(target).await.unwrap();
    send.write_all(msg).await.unwrap();
    send.finish().unwrap();
    tokio::time::timeout(Duration::from_secs(30), recv.read_to_end(1 << 24))
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn a_caller_holding_its_share_of_a_workers_streams_leaves_room_for_others() {
    let (relay, raddr, rpeer, worker_ep) = relay_with_echo_worker(RelayLimits {
        streams_per_worker: 8,
        stream_idle: Duration::from_secs(1),
        ..RelayLimits::default()
    })
    .await;
    let hog = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    // The hog opens streams to the worker and sends nothing on them.
    let mut held = Vec::new();
    let refusal = loop {
        match hog.open(worker_ep.peer_id()).await {
            Ok(s) => held.push(s),
            Err(e) => break format!("{e:#}"),
        }
        assert!(held.len() <= 8, "the hog took every stream");
    };
    assert_eq!(
        held.len(),
        6,
        "alone, a caller gets three quarters: {refusal}"
    );
    assert!(refusal.contains("share"), "{refusal}");
    // Another caller still gets through, at once.
    let other = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    assert_eq!(echo(&other, worker_ep.peer_id(), b"room").await, b"room");
    // The hog's silent streams are closed after the idle limit, and give their slots back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(echo(&hog, worker_ep.peer_id(), b"again").await, b"again");
    drop(held);
    relay.shutdown();
}

#[tokio::test]
async fn a_full_registry_evicts_the_registrant_idle_longest() {
    let (relay, raddr, rpeer, worker_ep) = relay_with_echo_worker(RelayLimits {
        max_registrations: 3,
        ..RelayLimits::default()
    })
    .await;
    let router = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    let idle_ep = endpoint();
    let idle = RelayClient::register(&idle_ep, raddr, rpeer).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The router and the worker are in use; the third sits idle.
    assert_eq!(echo(&router, worker_ep.peer_id(), b"busy").await, b"busy");
    // A fourth registrant takes the idle one's place.
    let newcomer = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while idle.is_open() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the idle one was kept"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let err = router.open(idle_ep.peer_id()).await.unwrap_err();
    assert!(format!("{err:#}").contains("not registered"), "{err:#}");
    // Those in use stay, and the newcomer is served.
    assert_eq!(echo(&router, worker_ep.peer_id(), b"still").await, b"still");
    assert_eq!(echo(&newcomer, worker_ep.peer_id(), b"new").await, b"new");
    relay.shutdown();
}

#[tokio::test]
async fn a_registrants_bytes_are_paced_to_its_rate_after_a_burst() {
    let (relay, raddr, rpeer, worker_ep) = relay_with_echo_worker(RelayLimits {
        bytes_per_second: 1 << 20,
        byte_burst: 512 << 10,
        ..RelayLimits::default()
    })
    .await;
    let router = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    let msg: Vec<u8> = (0..(5u32 << 19)).map(|i| (i * 13) as u8).collect();
    let start = tokio::time::Instant::now();
    let back = echo(&router, worker_ep.peer_id(), &msg).await;
    let took = start.elapsed();
    assert_eq!(back, msg, "paced, not altered");
    // 2.5 MiB each way at 1 MiB/s after a 0.5 MiB burst: at least 2 s (a lower bound, which
    // a busy machine only lengthens).
    assert!(took >= Duration::from_millis(1900), "took {took:?}");
    relay.shutdown();
}

#[tokio::test]
async fn one_address_holds_only_so_many_registrations() {
    let (relay, raddr, rpeer, worker_ep) = relay_with_echo_worker(RelayLimits {
        registrations_per_ip: 3,
        ..RelayLimits::default()
    })
    .await;
    let router = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    let _third = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    // A fourth key from 127.0.0.1 is refused, saying why; those registered are served on.
    let err = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .err()
        .expect("a fourth registration from one address");
    assert!(
        format!("{err:#}").contains("127.0.0.1 holds 3 registrations"),
        "{err:#}"
    );
    assert_eq!(echo(&router, worker_ep.peer_id(), b"on").await, b"on");
    relay.shutdown();
}

#[tokio::test]
async fn a_caller_opening_streams_too_fast_is_refused_until_its_budget_refills() {
    let (relay, raddr, rpeer, worker_ep) = relay_with_echo_worker(RelayLimits {
        streams_per_second: 2,
        stream_burst: 4,
        ..RelayLimits::default()
    })
    .await;
    let router = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    // Streams opened back to back: the burst goes through, then a refusal, at the latest when
    // the refill since the start is spent too.
    let start = tokio::time::Instant::now();
    let mut opened = Vec::new();
    let refusal = loop {
        match router.open(worker_ep.peer_id()).await {
            Ok(s) => opened.push(s),
            Err(e) => break format!("{e:#}"),
        }
        assert!(opened.len() < 50, "never refused");
    };
    let refilled = (start.elapsed().as_secs_f64() * 2.0).ceil() as usize;
    assert!(
        opened.len() >= 4 && opened.len() <= 4 + refilled,
        "{} opened",
        opened.len()
    );
    assert!(refusal.contains("too fast"), "{refusal}");
    drop(opened);
    // Another caller has its own budget; and the first's refills.
    let other = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    assert_eq!(echo(&other, worker_ep.peer_id(), b"y").await, b"y");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(echo(&router, worker_ep.peer_id(), b"z").await, b"z");
    relay.shutdown();
}
