//! Hole punching through the relay's signalling, with real quinn endpoints on 127.0.0.1 (no NAT
//! here: the network lab's tests put a NAT in between). What is checked: the relay answers with
//! the address it sees the worker at, the worker sends towards the router first, and the
//! router's direct dial there reaches the worker; refusals say why.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_relay::punch::parse_punch_addr;
use moeswarm_relay::{DataEndpoint, Keypair, RelayClient, RelayLimits, RelayServer};

fn key() -> Keypair {
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    Keypair::ed25519_from_bytes(seed).unwrap()
}

fn endpoint() -> DataEndpoint {
    DataEndpoint::bind(&key(), "127.0.0.1:0".parse().unwrap(), &[DISPATCH_ALPN]).unwrap()
}

/// A relay on 127.0.0.1, its address and PeerId.
fn relay() -> (RelayServer, std::net::SocketAddr, moeswarm_relay::PeerId) {
    let relay = RelayServer::spawn(
        &key(),
        "127.0.0.1:0".parse().unwrap(),
        RelayLimits::default(),
    )
    .unwrap();
    let (addr, peer) = (relay.local_addr().unwrap(), relay.peer_id());
    (relay, addr, peer)
}

/// Keeps answering the relay's streams (and punch requests) for `client`.
fn serve_relay(client: RelayClient) {
    tokio::spawn(async move { while client.accept().await.is_ok() {} });
}

/// Accepts direct connections on `ep`, keeping them open.
fn accept_direct(ep: DataEndpoint) {
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some((conn, _, _)) = ep.accept().await {
            held.push(conn);
        }
    });
}

#[tokio::test]
async fn a_punch_names_where_the_relay_sees_the_worker_and_the_router_dials_it_there() {
    let (relay, raddr, rpeer) = relay();
    let (worker_ep, router_ep) = (endpoint(), endpoint());
    accept_direct(worker_ep.clone());
    accept_direct(router_ep.clone());
    serve_relay(
        RelayClient::register(&worker_ep, raddr, rpeer)
            .await
            .unwrap(),
    );
    let router = RelayClient::register(&router_ep, raddr, rpeer)
        .await
        .unwrap();

    let at = router.punch(worker_ep.peer_id()).await.unwrap();
    assert_eq!(at, worker_ep.local_addr().unwrap());
    // The worker sent towards the router's address before the relay answered: its punch
    // reached the router's endpoint, which turned the unknown protocol away.
    let until = Instant::now() + Duration::from_secs(10);
    while router_ep.accept_stats().failed.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < until, "no punch packet reached the router");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The direct dial at the named address reaches the worker, pinned to its PeerId.
    let conn = router_ep
        .connect(at, worker_ep.peer_id(), DISPATCH_ALPN)
        .await
        .unwrap();
    assert_eq!(moeswarm_relay::peer_of(&conn).unwrap(), worker_ep.peer_id());
    relay.shutdown();
}

#[tokio::test]
async fn a_punch_to_someone_not_registered_or_by_someone_not_registered_is_refused() {
    let (relay, raddr, rpeer) = relay();
    let router = RelayClient::register(&endpoint(), raddr, rpeer)
        .await
        .unwrap();
    let absent = endpoint().peer_id();
    let err = format!("{:#}", router.punch(absent).await.unwrap_err());
    assert!(err.contains("is not registered"), "{err}");
    // A worker that registered, then went away, is not introduced either.
    let gone_ep = endpoint();
    let gone = RelayClient::register(&gone_ep, raddr, rpeer).await.unwrap();
    drop(gone);
    gone_ep.close();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        match router.punch(gone_ep.peer_id()).await {
            Err(e) => {
                let e = format!("{e:#}");
                assert!(e.contains("not registered") || e.contains("punch"), "{e}");
                break;
            }
            Ok(at) => assert!(Instant::now() < until, "introduced to {at} after it left"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    relay.shutdown();
}

#[test]
fn a_punch_address_must_name_someone() {
    assert!(parse_punch_addr("10.0.0.1:4433").is_ok());
    for bad in [
        "0.0.0.0:4433",
        "10.0.0.1:0",
        "224.0.0.1:5",
        "nonsense",
        "[::]:1",
    ] {
        let e = parse_punch_addr(bad).unwrap_err().to_string();
        assert!(!e.is_empty(), "{bad}");
    }
}
