//! The HTTP blob server on a real socket on 127.0.0.1, spoken to with raw HTTP/1.1.

use moeswarm_testkit as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use common::data;
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_node::{NodeOptions, RunningNode};
use moeswarm_protocol::BlobId;

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn get(addr: std::net::SocketAddr, path: &str, extra: &str) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{extra}\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Reply {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    }
}

#[test]
fn blobs_and_expert_shards_over_http_with_etag_and_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (model, manifest, _) =
        slice(&data("tiny-q8_0.gguf"), &store, SliceOptions::default()).unwrap();
    let store = Arc::new(store);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (addr, task) = rt
        .block_on(moeswarm_node::http::serve(
            store.clone(),
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
    assert!(addr.ip().is_loopback());

    let trunk = manifest.trunk.id;
    let bytes = store.read(&trunk).unwrap();
    let r = get(addr, &format!("/blob/{trunk}"), "");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("etag"), Some(format!("\"{trunk}\"").as_str()));
    assert_eq!(r.header("accept-ranges"), Some("bytes"));
    assert!(r.body == bytes);

    let r = get(addr, &format!("/blob/{trunk}"), "Range: bytes=100-4195\r\n");
    assert_eq!(r.status, 206);
    assert_eq!(
        r.header("content-range"),
        Some(format!("bytes 100-4195/{}", bytes.len()).as_str())
    );
    assert!(r.body == bytes[100..4196]);
    let r = get(addr, &format!("/blob/{trunk}"), "Range: bytes=-10\r\n");
    assert!(r.status == 206 && r.body == bytes[bytes.len() - 10..]);
    let r = get(
        addr,
        &format!("/blob/{trunk}"),
        &format!("Range: bytes={}-\r\n", bytes.len()),
    );
    assert_eq!(r.status, 416);
    let r = get(
        addr,
        &format!("/blob/{trunk}"),
        &format!("If-None-Match: \"{trunk}\"\r\n"),
    );
    assert_eq!(r.status, 304);

    let slab = manifest.slab(1, 5).unwrap().id;
    let r = get(addr, &format!("/expert-shard/{model}/1/5"), "");
    assert_eq!(r.status, 200);
    assert_eq!(BlobId::of(&r.body), slab);
    assert_eq!(r.header("etag"), Some(format!("\"{slab}\"").as_str()));

    assert_eq!(
        get(addr, &format!("/expert-shard/{model}/1/99"), "").status,
        404
    );
    assert_eq!(
        get(addr, &format!("/blob/{}", BlobId::of(b"absent")), "").status,
        404
    );
    assert_eq!(get(addr, "/blob/not-an-id", "").status, 400);
    assert_eq!(get(addr, "/expert-shard/zz/1/1", "").status, 400);
    task.abort();
}

/// A node holding the small model, serving HTTP on a free port, on its own runtime.
fn node_with_http() -> (
    tempfile::TempDir,
    moeswarm_protocol::Manifest,
    tokio::runtime::Runtime,
    RunningNode,
) {
    let dir = tempfile::tempdir().unwrap();
    let manifest = common::sliced_small(dir.path());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut opts = NodeOptions::local(dir.path().to_path_buf(), Vec::new());
    opts.http = Some("127.0.0.1:0".parse().unwrap());
    let node = rt.block_on(RunningNode::start(opts)).unwrap();
    (dir, manifest, rt, node)
}

#[test]
fn three_hundred_half_open_connections_neither_stop_the_http_nor_the_joins() {
    let (_dir, manifest, rt, node) = node_with_http();
    let http = node.http_addr.unwrap();
    let boot = rt.block_on(node.addrs()).unwrap()[0].clone();

    // Each sends half a request line and then nothing.
    let mut held = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(http).unwrap();
        let _ = s.write_all(b"GET /blob/");
        held.push(s);
    }
    // Another client is served at once, whole.
    let slab = manifest.slab(0, 0).unwrap().id;
    let r = get(http, &format!("/blob/{slab}"), "");
    assert_eq!(r.status, 200);
    assert_eq!(BlobId::of(&r.body), slab);
    // And a node still joins through this one's libp2p side.
    let other_dir = tempfile::tempdir().unwrap();
    let other = rt
        .block_on(RunningNode::start(NodeOptions::local(
            other_dir.path().to_path_buf(),
            vec![boot],
        )))
        .expect("a node joins while the HTTP is flooded");
    // The half-open ones were closed to make room: most of them read an end.
    let closed = held
        .iter_mut()
        .map(|s| {
            s.set_read_timeout(Some(std::time::Duration::from_millis(50)))
                .unwrap();
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Err(e) => !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                // An end (0 bytes) or an answer: either way the server let go of it.
                Ok(_n) => true,
            }
        })
        .filter(|&c| c)
        .count();
    assert!(closed >= 300 - 64, "{closed} closed");
    rt.block_on(async {
        other.shutdown().await;
        node.shutdown().await;
    });
}

#[test]
fn a_nodes_page_and_data_show_its_own_table_and_no_throughput() {
    let (_dir, manifest, rt, node) = node_with_http();
    let http = node.http_addr.unwrap();

    let page = get(http, "/", "");
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert!(String::from_utf8_lossy(&page.body).contains("<canvas id=\"heatmap\""));

    let r = get(http, "/api/dashboard", "");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let d: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let me = node.handle.peer_id.to_string();
    assert_eq!(d["node"], me.as_str());
    assert_eq!(d["throughput"], serde_json::Value::Null);
    // It holds every slab of the model it sliced: one replica each, below the target of 2.
    let h = &manifest.hyper;
    let n = (h.n_layer * h.n_expert) as u64;
    let m = &d["models"][0];
    assert_eq!(m["model"], manifest.id().to_string());
    assert_eq!(
        (m["slabs"].as_u64(), m["covered"].as_u64()),
        (Some(n), Some(n))
    );
    assert_eq!(m["at_target"].as_u64(), Some(0));
    for l in m["layers"].as_array().unwrap() {
        assert!(l["replicas"].as_array().unwrap().iter().all(|r| r == 1));
    }
    assert_eq!(d["health"], format!("{n} of {n} slabs below 2×"));
    let peers = d["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0]["id"], me.as_str());
    assert_eq!(
        (&peers[0]["is_self"], &peers[0]["connected"]),
        (&true.into(), &true.into())
    );
    assert_eq!(peers[0]["slabs"].as_u64(), Some(n));
    rt.block_on(node.shutdown());
}

/// Sends `GET path` on a kept-alive connection and reads the whole answer; its status.
fn ping(s: &mut TcpStream, path: &str) -> u16 {
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        assert_eq!(
            s.read(&mut byte).unwrap(),
            1,
            "the connection ended mid-answer"
        );
        raw.push(byte[0]);
    }
    let head = String::from_utf8(raw).unwrap();
    let len: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .map_or(0, |(_, v)| v.trim().parse().unwrap());
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    head.split(' ').nth(1).unwrap().parse().unwrap()
}

#[test]
fn kept_alive_pingers_holding_every_connection_of_an_address_lock_nobody_out() {
    let (_dir, manifest, rt, node) = node_with_http();
    let http = node.http_addr.unwrap();
    let slab = manifest.slab(0, 0).unwrap().id;
    let path = format!("/blob/{slab}");

    // 256 kept-alive connections (the server's whole table), each having asked for something,
    // asking again now and then: idle between asks, never half-open.
    let mut pingers = Vec::new();
    for _ in 0..256 {
        let mut s = TcpStream::connect(http).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        if ping(&mut s, &path) == 200 {
            pingers.push(s);
        }
    }
    // Everything it asked for came (the address's older idle ones made the room for its
    // newer ones) but no more than its share stays open.
    assert_eq!(pingers.len(), 256);
    let alive = pingers
        .iter_mut()
        .map(|s| {
            s.set_nonblocking(true).unwrap();
            !matches!(s.read(&mut [0u8; 1]), Ok(0))
        })
        .filter(|&open| open)
        .count();
    assert!(
        alive <= 32,
        "{alive} of the pingers' connections still open"
    );
    // Another client asks 40 times; each is answered whole.
    for i in 0..40 {
        let r = get(http, &path, "");
        assert_eq!(r.status, 200, "request {i} of the other client");
        assert_eq!(BlobId::of(&r.body), slab);
    }
    drop(pingers);
    rt.block_on(node.shutdown());
}

#[test]
fn a_kept_alive_connection_left_idle_after_its_request_is_closed_by_the_server() {
    let (_dir, manifest, rt, node) = node_with_http();
    let http = node.http_addr.unwrap();
    let slab = manifest.slab(0, 0).unwrap().id;
    let mut s = TcpStream::connect(http).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    assert_eq!(ping(&mut s, &format!("/blob/{slab}")), 200);
    // Nothing more is asked: the server ends it (a kept-alive connection has the headers'
    // 10 s to start its next request) well before the minute this read waits.
    let began = std::time::Instant::now();
    let r = s.read(&mut [0u8; 1]);
    assert!(matches!(r, Ok(0)), "{r:?} after {:?}", began.elapsed());
    rt.block_on(node.shutdown());
}
