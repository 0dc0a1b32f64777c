//! Slab fetch throughput over loopback beside a raw TCP copy of the same bytes, in the same run.
//!
//! `cargo bench -p moeswarm-node --bench fetch` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts; `MOESWARM_BENCH_LAYERS`, default 1: how many layers' slabs
//! are fetched). A seeder node holds the sliced model; a fresh node fetches the slabs through
//! the libp2p blob exchange (verified ranges, stored crash-safely). The reference sends the same
//! slab files' bytes over one plain TCP connection on 127.0.0.1 into a buffer.
//! `MOESWARM_BENCH_QUIC=1` runs libp2p over QUIC instead of TCP + Noise + Yamux.

use moeswarm_testkit as common;

use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use moeswarm_model::store::Store;
use moeswarm_node::net::Selection;
use moeswarm_node::{NodeOptions, RunningNode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn raw_tcp_copy(files: &[std::path::PathBuf]) -> anyhow::Result<(u64, Duration)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let files = files.to_vec();
    let sender = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await?;
        sock.set_nodelay(true)?;
        for f in files {
            let bytes = tokio::fs::read(&f).await?;
            sock.write_all(&bytes).await?;
        }
        sock.shutdown().await?;
        anyhow::Ok(())
    });
    let t = Instant::now();
    let mut sock = tokio::net::TcpStream::connect(addr).await?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let elapsed = t.elapsed();
    sender.await??;
    Ok((total, elapsed))
}

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let layers: u32 = std::env::var("MOESWARM_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let work = tempfile::tempdir_in(model.parent().expect("in bench-data"))?;
    let seed_dir = work.path().join("seed");
    let manifest = common::sliced(&model, &seed_dir)?;
    let (seed_store, _) = Store::open(&seed_dir)?;
    let files: Vec<_> = manifest
        .all_slabs()
        .filter(|(l, _, _)| *l < layers)
        .map(|(_, _, r)| seed_store.blob_path(&r.id))
        .collect();
    drop(seed_store);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        // The transport: TCP (Noise, Yamux) by default, QUIC with MOESWARM_BENCH_QUIC=1.
        let quic = std::env::var("MOESWARM_BENCH_QUIC").as_deref() == Ok("1");
        let opts = |dir: std::path::PathBuf, boot: Vec<libp2p::Multiaddr>| {
            let mut o = NodeOptions::local(dir, boot);
            if quic {
                o.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("a multiaddr")];
            }
            o
        };
        let seeder = RunningNode::start(opts(seed_dir.clone(), vec![])).await?;
        let boot = seeder.addrs().await?[0].clone();
        let mut best_raw = (0u64, Duration::MAX);
        let mut best_fetch = (0u64, Duration::MAX);
        for round in 0..3 {
            let raw = raw_tcp_copy(&files).await?;
            if raw.1 < best_raw.1 {
                best_raw = raw;
            }
            let dir = work.path().join(format!("fetch{round}"));
            let node = RunningNode::start(opts(dir.clone(), vec![boot.clone()])).await?;
            let t = Instant::now();
            let r = node
                .fetcher
                .fetch_model(
                    manifest.id(),
                    &Selection {
                        layers: Some(0..layers),
                        experts: None,
                        trunk: false,
                        only: None,
                    },
                    &ProgressBar::hidden(),
                )
                .await?;
            let elapsed = t.elapsed();
            if elapsed < best_fetch.1 {
                best_fetch = (r.bytes, elapsed);
            }
            node.shutdown().await;
            std::fs::remove_dir_all(dir)?;
        }
        seeder.shutdown().await;
        let gbps = |(b, d): (u64, Duration)| b as f64 / d.as_secs_f64() / 1e9;
        println!(
            "model {} : {} slabs of {} layer(s), {:.1} MB, libp2p over {}",
            model.display(),
            files.len(),
            layers,
            best_raw.0 as f64 / 1e6,
            if quic { "QUIC" } else { "TCP" }
        );
        println!(
            "raw TCP copy : {:.3} s  {:.2} GB/s",
            best_raw.1.as_secs_f64(),
            gbps(best_raw)
        );
        println!(
            "slab fetch   : {:.3} s  {:.2} GB/s (verified, stored)",
            best_fetch.1.as_secs_f64(),
            gbps(best_fetch)
        );
        println!(
            "ratio fetch/raw throughput: {:.2}",
            gbps(best_fetch) / gbps(best_raw)
        );
        anyhow::Ok(())
    })
}
