//! Slab fetch throughput over loopback beside a raw TCP copy of the same bytes, in the same run.
//!
//! `cargo bench -p moeswarm-node --bench fetch` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts; `MOESWARM_BENCH_LAYERS`, default 1: how many layers' slabs
//! are fetched). A seeder node holds the sliced model; a fresh node fetches the slabs through
//! the libp2p blob exchange (verified ranges, stored crash-safely). The references send the same
//! slab files' bytes over one plain TCP connection on 127.0.0.1: into a file each, synced (what
//! a user copying them with `nc` and `sync` gets), and into a buffer (the network alone).
//! `MOESWARM_BENCH_QUIC=1` runs libp2p over QUIC instead of TCP + Noise + Yamux.

use moeswarm_testkit as common;

use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use moeswarm_model::store::Store;
use moeswarm_node::net::Selection;
use moeswarm_node::{NodeOptions, RunningNode};

/// Where the reference copy puts the bytes it receives.
#[derive(Clone, Copy, PartialEq)]
enum Sink {
    /// A buffer, reused: the network alone (no disk).
    Buffer,
    /// A file per blob, all synced at the end: what `nc host port > file` for each and then
    /// `sync` give a user.
    SyncedFiles,
}

/// The reference: the files' bytes over one plain TCP connection on 127.0.0.1, blocking I/O on
/// a thread each side, as `nc` does.
fn raw_tcp_copy(
    files: &[std::path::PathBuf],
    sink: Sink,
    into: &std::path::Path,
) -> anyhow::Result<(u64, Duration)> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let sizes: Vec<u64> = files
        .iter()
        .map(|f| Ok(std::fs::metadata(f)?.len()))
        .collect::<anyhow::Result<_>>()?;
    let sent = files.to_vec();
    let sender = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept()?;
        for f in sent {
            std::io::copy(&mut std::fs::File::open(f)?, &mut sock)?;
        }
        anyhow::Ok(())
    });
    let t = Instant::now();
    let mut sock = std::net::TcpStream::connect(addr)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    let mut written = Vec::new();
    for (i, size) in sizes.iter().enumerate() {
        let mut file = match sink {
            Sink::Buffer => None,
            Sink::SyncedFiles => Some(std::fs::File::create(into.join(format!("{i}")))?),
        };
        let mut left = *size;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = sock.read(&mut buf[..want])?;
            anyhow::ensure!(n > 0, "the sender stopped {left} bytes short");
            if let Some(f) = file.as_mut() {
                f.write_all(&buf[..n])?;
            }
            left -= n as u64;
            total += n as u64;
        }
        written.extend(file);
    }
    // Then `sync`: every file, and the directory they are in.
    for f in written {
        f.sync_all()?;
    }
    if sink == Sink::SyncedFiles {
        std::fs::File::open(into)?.sync_all()?;
    }
    let elapsed = t.elapsed();
    sender
        .join()
        .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
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
        let mut best_synced = (0u64, Duration::MAX);
        let mut best_fetch = (0u64, Duration::MAX);
        for round in 0..3 {
            let copies = work.path().join(format!("copy{round}"));
            std::fs::create_dir_all(&copies)?;
            let raw = raw_tcp_copy(&files, Sink::Buffer, &copies)?;
            if raw.1 < best_raw.1 {
                best_raw = raw;
            }
            let synced = raw_tcp_copy(&files, Sink::SyncedFiles, &copies)?;
            if synced.1 < best_synced.1 {
                best_synced = synced;
            }
            std::fs::remove_dir_all(&copies)?;
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
        let line = |what: &str, (b, d): (u64, Duration)| {
            println!(
                "{what:<34}: {:.3} s  {:.2} GB/s",
                d.as_secs_f64(),
                gbps((b, d))
            )
        };
        line("raw TCP copy into a buffer", best_raw);
        line("raw TCP copy into files, synced", best_synced);
        line("slab fetch (verified, stored)", best_fetch);
        println!(
            "ratio fetch / raw copy into files, synced: {:.2}",
            gbps(best_fetch) / gbps(best_synced)
        );
        println!(
            "ratio fetch / raw copy into a buffer: {:.2}",
            gbps(best_fetch) / gbps(best_raw)
        );
        anyhow::Ok(())
    })
}
