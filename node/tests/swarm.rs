//! The control plane with real libp2p nodes on 127.0.0.1: joining, fetching shares of a sliced
//! model, advertising, coverage, restarts, lying and truncating peers, forged records.

use moeswarm_node::net::RecordRefusal;
use moeswarm_testkit as common;
use moeswarm_testkit::eventually;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use indicatif::ProgressBar;
use moeswarm_model::store::BlobKind;
use moeswarm_node::holdings_record;
use moeswarm_node::net::{Selection, ServeFault};
use moeswarm_node::ops::{coverage, coverage_map};
use moeswarm_node::{NodeOptions, RunningNode};
use moeswarm_protocol::{Manifest, ModelId};

/// Deadline for anything that waits on the network in these tests.
const SETTLE: Duration = Duration::from_secs(30);

use common::sliced_small as sliced;

async fn start(dir: &Path, bootstrap: &[libp2p::Multiaddr]) -> RunningNode {
    RunningNode::start(NodeOptions::local(dir.to_path_buf(), bootstrap.to_vec()))
        .await
        .unwrap()
}

/// A node holding the whole small model, started alone, and where to join it.
async fn seeder() -> (tempfile::TempDir, Manifest, RunningNode, libp2p::Multiaddr) {
    let dir = tempfile::tempdir().unwrap();
    let manifest = sliced(dir.path());
    let node = start(dir.path(), &[]).await;
    let boot = node.addrs().await.unwrap()[0].clone();
    (dir, manifest, node, boot)
}

/// `n` signed records of nodes nobody runs (keys from `tag` and their index), each claiming
/// what `seeder` holds.
fn made_up_records(
    seeder: &RunningNode,
    manifest: &Manifest,
    n: u32,
    tag: u8,
    ttl: Duration,
) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let mut seed = [tag; 32];
            seed[..4].copy_from_slice(&i.to_le_bytes());
            let id = moeswarm_node::net::NodeIdentity::from_seed(seed).unwrap();
            holdings_record(&seeder.store, manifest, &id, ttl, 0)
                .unwrap()
                .to_wire()
        })
        .collect()
}

/// `[layer][expert]` → PeerIds, from each node's own store: the truth.
fn truth(manifest: &Manifest, nodes: &[&RunningNode]) -> Vec<Vec<BTreeSet<String>>> {
    let h = &manifest.hyper;
    let mut t = vec![vec![BTreeSet::new(); h.n_expert as usize]; h.n_layer as usize];
    for n in nodes {
        for (l, e) in n.store.held_slabs(manifest).unwrap() {
            t[l as usize][e as usize].insert(n.handle.peer_id.to_string());
        }
    }
    t
}

/// Polls `moeswarm coverage`'s query until it equals `want` (bounded by [`SETTLE`]).
async fn coverage_settles_to(
    bootstrap: &libp2p::Multiaddr,
    model: ModelId,
    want: &[Vec<BTreeSet<String>>],
) {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let got = coverage(vec![bootstrap.clone()], model).await;
        let map = coverage_map(vec![bootstrap.clone()], model).await;
        let seen: Option<Vec<Vec<BTreeSet<String>>>> = map.as_ref().ok().map(|(m, _, _)| {
            (0..want.len() as u32)
                .map(|l| {
                    (0..want[l as usize].len() as u32)
                        .map(|e| {
                            m.holders(l, e)
                                .iter()
                                .filter_map(moeswarm_node::net::identity::peer_id_of)
                                .map(|p| p.to_string())
                                .collect()
                        })
                        .collect()
                })
                .collect()
        });
        if seen.as_deref() == Some(want) {
            let r = got.unwrap();
            for (l, layer) in r.layers.iter().enumerate() {
                for (e, &n) in layer.replicas.iter().enumerate() {
                    assert_eq!(n, want[l][e].len());
                }
                assert_eq!(
                    layer.missing,
                    (0..want[l].len() as u32)
                        .filter(|&e| want[l][e as usize].is_empty())
                        .collect::<Vec<_>>()
                );
            }
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "coverage did not settle to the truth: {:?}",
            got.map(|r| r.nodes)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_join_fetch_their_share_advertise_and_coverage_is_the_truth() {
    let (_seed_dir, manifest, seeder, boot) = seeder().await;
    let model = manifest.id();

    let n_expert = manifest.hyper.n_expert;
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut workers = Vec::new();
    for (i, d) in dirs.iter().enumerate() {
        let w = start(d.path(), std::slice::from_ref(&boot)).await;
        // Worker i takes the experts e with e % 4 == i of every layer; worker 0 also layer 0 whole.
        let share = Selection {
            layers: None,
            experts: Some((0..n_expert).filter(|e| e % 4 == i as u32).collect()),
            trunk: false,
            only: None,
        };
        let r = w
            .fetch(model, &share, &ProgressBar::hidden())
            .await
            .unwrap();
        assert!(r.fetched > 0 && r.rejected.is_empty(), "{r:?}");
        workers.push(w);
    }
    let extra = Selection {
        layers: Some(0..1),
        experts: None,
        trunk: true,
        only: None,
    };
    workers[0]
        .fetch(model, &extra, &ProgressBar::hidden())
        .await
        .unwrap();

    // What each worker stored is byte-identical to the seeder's blobs.
    for w in &workers {
        let held = w.store.held_slabs(&manifest).unwrap();
        assert!(!held.is_empty());
        for (l, e) in held {
            let id = manifest.slab(l, e).unwrap().id;
            assert_eq!(w.store.read(&id).unwrap(), seeder.store.read(&id).unwrap());
        }
    }
    assert_eq!(
        workers[0].store.read(&manifest.trunk.id).unwrap(),
        seeder.store.read(&manifest.trunk.id).unwrap()
    );

    let mut all: Vec<&RunningNode> = vec![&seeder];
    all.extend(workers.iter());
    let want = truth(&manifest, &all);
    assert!(
        want.iter().flatten().all(|h| h.len() >= 2),
        "every slab has 2 replicas"
    );
    coverage_settles_to(&boot, model, &want).await;

    // A worker restarted with the same data dir keeps its PeerId and its holdings.
    let w0 = workers.remove(0);
    let (peer, held) = (w0.handle.peer_id, w0.store.held_slabs(&manifest).unwrap());
    w0.shutdown().await;
    let w0 = start(dirs[0].path(), std::slice::from_ref(&boot)).await;
    assert_eq!(w0.handle.peer_id, peer);
    assert_eq!(w0.store.held_slabs(&manifest).unwrap(), held);
    workers.insert(0, w0);
    let mut all: Vec<&RunningNode> = vec![&seeder];
    all.extend(workers.iter());
    assert_eq!(truth(&manifest, &all), want);
    coverage_settles_to(&boot, model, &want).await;

    for w in workers {
        w.shutdown().await;
    }
    seeder.shutdown().await;
}

/// Copies a closed store directory.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else if e.file_name() != "identity.key" {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// `me` fetches the trunk `id` from `sources`, verified.
async fn fetch_trunk(
    me: &RunningNode,
    id: moeswarm_protocol::BlobId,
    sources: &[libp2p::PeerId],
) -> anyhow::Result<moeswarm_node::net::fetch::BlobFetch> {
    Ok(me
        .fetcher
        .fetch_blob(id, BlobKind::Trunk, sources, &ProgressBar::hidden())
        .await?)
}

/// An honest seeder, a faulty copy of it, and a fresh node that joined through the seeder.
async fn honest_faulty_and_me(
    fault: ServeFault,
) -> (
    Vec<tempfile::TempDir>,
    Manifest,
    RunningNode,
    RunningNode,
    RunningNode,
) {
    let honest_dir = tempfile::tempdir().unwrap();
    let manifest = sliced(honest_dir.path());
    let faulty_dir = tempfile::tempdir().unwrap();
    copy_dir(honest_dir.path(), faulty_dir.path());
    let honest = start(honest_dir.path(), &[]).await;
    let boot = honest.addrs().await.unwrap()[0].clone();
    let mut opts = NodeOptions::local(faulty_dir.path().to_path_buf(), vec![boot.clone()]);
    opts.serve_fault = fault;
    let faulty = RunningNode::start(opts).await.unwrap();
    let me_dir = tempfile::tempdir().unwrap();
    let me = start(me_dir.path(), std::slice::from_ref(&boot)).await;
    // Where the faulty one listens, as its record would say (the tests name it as a source
    // directly, before the DHT may have learnt its address).
    let faulty_addrs = faulty.handle.listen_addrs().await.unwrap();
    me.handle
        .add_addresses(faulty.handle.peer_id, faulty_addrs)
        .await;
    (
        vec![honest_dir, faulty_dir, me_dir],
        manifest,
        honest,
        faulty,
        me,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_peer_is_caught_counted_and_the_blob_comes_from_an_honest_one() {
    let (_dirs, manifest, honest, liar, me) = honest_faulty_and_me(ServeFault::CorruptRanges).await;
    let id = manifest.trunk.id;
    let (liar_id, honest_id) = (liar.handle.peer_id, honest.handle.peer_id);

    // Only the liar: nothing is stored.
    let err = fetch_trunk(&me, id, &[liar_id]).await.unwrap_err();
    assert!(
        format!("{err:#}").contains("failed verification"),
        "{err:#}"
    );
    assert!(!me.store.contains(&id).unwrap());

    // Liar first, then the honest peer: the blob completes, byte-identical.
    let got = fetch_trunk(&me, id, &[liar_id, honest_id]).await.unwrap();
    assert_eq!(me.store.read(&id).unwrap(), honest.store.read(&id).unwrap());
    assert!(
        got.rejected.get(&liar_id).copied().unwrap_or(0) >= 1,
        "{got:?}"
    );
    assert!(!got.rejected.contains_key(&honest_id));
    let stats = me.handle.stats().await.unwrap();
    assert!(
        stats
            .penalties
            .get(&liar_id.to_string())
            .copied()
            .unwrap_or(0)
            >= 2,
        "{stats:?}"
    );
    assert!(!stats.penalties.contains_key(&honest_id.to_string()));

    me.shutdown().await;
    liar.shutdown().await;
    honest.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_transfer_keeps_what_verified_and_resumes_elsewhere() {
    let (_dirs, manifest, honest, short, me) =
        honest_faulty_and_me(ServeFault::TruncateRanges).await;
    let (id, size) = (manifest.trunk.id, manifest.trunk.bytes);

    let err = fetch_trunk(&me, id, &[short.handle.peer_id])
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("kept"), "{err:#}");
    assert!(!me.store.contains(&id).unwrap());

    let got = fetch_trunk(&me, id, &[honest.handle.peer_id])
        .await
        .unwrap();
    // The second attempt asked only for what the first did not verify.
    assert!(got.bytes > 0 && got.bytes < size, "{} of {size}", got.bytes);
    assert_eq!(me.store.read(&id).unwrap(), honest.store.read(&id).unwrap());

    me.shutdown().await;
    short.shutdown().await;
    honest.shutdown().await;
}

/// A seeder `a` of the small model and a node `b` that joined it and fetched one slab.
async fn seeder_and_one_slab_holder(
    layer: u32,
    expert: u32,
) -> (Vec<tempfile::TempDir>, Manifest, RunningNode, RunningNode) {
    let a_dir = tempfile::tempdir().unwrap();
    let manifest = sliced(a_dir.path());
    let a = start(a_dir.path(), &[]).await;
    let boot = a.addrs().await.unwrap()[0].clone();
    let b_dir = tempfile::tempdir().unwrap();
    let b = start(b_dir.path(), std::slice::from_ref(&boot)).await;
    let one = Selection {
        layers: Some(layer..layer + 1),
        experts: Some(vec![expert]),
        ..Selection::default()
    };
    b.fetch(manifest.id(), &one, &ProgressBar::hidden())
        .await
        .unwrap();
    (vec![a_dir, b_dir], manifest, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_replayed_and_corrupt_records_are_refused_and_counted() {
    let (_dirs, manifest, a, b) = seeder_and_one_slab_holder(0, 0).await;
    let model = manifest.id();
    let ttl = Duration::from_secs(600);
    let old = holdings_record(&b.store, &manifest, &b.handle.identity, ttl, 0).unwrap();
    let new = holdings_record(&b.store, &manifest, &b.handle.identity, ttl, 0).unwrap();
    b.handle.publish(model, new.clone()).await.unwrap();

    // Signed by a third node, sent by b.
    let c = moeswarm_node::net::NodeIdentity::from_seed([9; 32]).unwrap();
    let forged = holdings_record(&b.store, &manifest, &c, ttl, 0).unwrap();
    let mut flipped = new.to_wire();
    let last = flipped.len() - 3;
    flipped[last] ^= 1;
    let attempts: [(RecordRefusal, Vec<u8>); 3] = [
        (RecordRefusal::WrongSigner, forged.to_wire()),
        (RecordRefusal::Stale, old.to_wire()),
        (RecordRefusal::Malformed, flipped),
    ];
    for (reason, wire) in attempts {
        eventually(SETTLE, &format!("{reason} refused"), || async {
            b.handle.publish_raw(model, wire.clone()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let refused = a.handle.stats().await.unwrap().records_refused;
            let count = |r: RecordRefusal| refused.get(&r).copied().unwrap_or(0);
            (count(reason) > 0
                || (reason == RecordRefusal::Malformed && count(RecordRefusal::BadSignature) > 0))
                .then_some(())
        })
        .await;
    }
    // a still holds b's newest record, untouched by the forgeries.
    let map = a.handle.coverage(model).await.unwrap().unwrap();
    let rec = map.record(&b.handle.identity.key).expect("b's record");
    let newest = serde_json::from_slice::<moeswarm_protocol::Holdings>(&new.body).unwrap();
    assert_eq!(rec.seq, newest.seq);
    assert_eq!(map.holders(0, 0).len(), 2);

    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_fetch_resumes_after_the_node_restarts() {
    let (dirs, manifest, honest, short, me) =
        honest_faulty_and_me(ServeFault::TruncateRanges).await;
    let (id, size) = (manifest.trunk.id, manifest.trunk.bytes);
    let boot = [
        honest.addrs().await.unwrap()[0].clone(),
        short.addrs().await.unwrap()[0].clone(),
    ];
    let err = fetch_trunk(&me, id, &[short.handle.peer_id])
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("failed verification"),
        "{err:#}"
    );
    // The process ends (here: the node stops and its store is closed), then starts again.
    me.shutdown().await;
    let me = start(dirs[2].path(), &boot).await;
    me.handle
        .wait_for_peers(2, SETTLE)
        .await
        .expect("connected to both");
    assert!(!me.store.contains(&id).unwrap());
    let got = fetch_trunk(&me, id, &[honest.handle.peer_id])
        .await
        .unwrap();
    assert!(got.bytes > 0 && got.bytes < size, "{} of {size}", got.bytes);
    assert_eq!(me.store.read(&id).unwrap(), honest.store.read(&id).unwrap());
    // Nothing of the partial is left behind.
    assert_eq!(
        std::fs::read_dir(dirs[2].path().join("partial"))
            .unwrap()
            .count(),
        0
    );
    me.shutdown().await;
    short.shutdown().await;
    honest.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_and_manifest_providers_are_found_in_the_dht() {
    let (_dirs, manifest, a, b) = seeder_and_one_slab_holder(1, 3).await;
    let model = manifest.id();
    let boot = a.addrs().await.unwrap()[0].clone();
    let c_dir = tempfile::tempdir().unwrap();
    let c = start(c_dir.path(), std::slice::from_ref(&boot)).await;
    let key = moeswarm_node::net::holdings_key(&model, &b.handle.identity.key);
    eventually(
        SETTLE,
        "the providers and the record in the DHT",
        || async {
            let providers = c.handle.providers(model).await.unwrap();
            let record = c.handle.dht_record(key.clone()).await.unwrap();
            let held = record.as_ref().and_then(|wire| {
                let s = moeswarm_protocol::SignedHoldings::from_wire(wire).ok()?;
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs();
                let h = s.verify(None, None, now).ok()?;
                Some(h.slabs().collect::<Vec<_>>())
            });
            match providers.contains(&a.handle.peer_id) && held == Some(vec![(1, 3)]) {
                true => Ok(()),
                false => Err(format!("providers {providers:?}, record {held:?}")),
            }
        },
    )
    .await;
    c.shutdown().await;
    b.shutdown().await;
    a.shutdown().await;
}

/// Flips one byte of blob `id`'s file in the store at `dir`, keeping its size.
fn corrupt(dir: &Path, id: &moeswarm_protocol::BlobId) {
    let path = dir.join("blobs").join(id.to_hex());
    let mut bytes = std::fs::read(&path).unwrap();
    let k = bytes.len() / 2;
    bytes[k] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_gone_bad_on_a_running_node_is_served_to_no_one_and_leaves_its_coverage() {
    use std::io::{Read, Write};
    let seed_dir = tempfile::tempdir().unwrap();
    let manifest = sliced(seed_dir.path());
    let model = manifest.id();
    let mut opts = NodeOptions::local(seed_dir.path().to_path_buf(), Vec::new());
    opts.http = Some("127.0.0.1:0".parse().unwrap());
    let seeder = RunningNode::start(opts).await.unwrap();
    let boot = seeder.addrs().await.unwrap()[0].clone();
    let other_dir = tempfile::tempdir().unwrap();
    let other = start(other_dir.path(), std::slice::from_ref(&boot)).await;
    coverage_settles_to(&boot, model, &truth(&manifest, &[&seeder])).await;

    // One slab goes bad under HTTP, another under the blob exchange.
    let (by_http, by_exchange) = (
        manifest.slab(0, 1).unwrap().id,
        manifest.slab(1, 2).unwrap().id,
    );
    corrupt(seed_dir.path(), &by_http);
    corrupt(seed_dir.path(), &by_exchange);

    let http = seeder.http_addr.unwrap();
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(http).unwrap();
        write!(
            s,
            "GET /blob/{by_http} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        String::from_utf8_lossy(&raw).to_string()
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 500"), "{answer}");
    assert!(answer.contains("corrupt"), "{answer}");

    let fetched = other
        .fetcher
        .fetch_blob(
            by_exchange,
            BlobKind::Slab {
                layer: 1,
                expert: 2,
            },
            &[seeder.handle.peer_id],
            &ProgressBar::hidden(),
        )
        .await;
    assert!(fetched.is_err(), "{fetched:?}");
    assert!(!other.store.contains(&by_exchange).unwrap());

    // The seeder holds neither any more, and its record soon says so.
    assert!(!seeder.store.contains(&by_http).unwrap());
    assert!(!seeder.store.contains(&by_exchange).unwrap());
    coverage_settles_to(&boot, model, &truth(&manifest, &[&seeder])).await;
    let t = truth(&manifest, &[&seeder]);
    assert!(t[0][1].is_empty() && t[1][2].is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_lying_about_the_manifests_size_makes_no_one_allocate_it() {
    let (dirs, manifest, honest, liar, me) = honest_faulty_and_me(ServeFault::HugeSizes).await;
    let model = manifest.id();
    let sources = [liar.handle.peer_id];
    // Only the liar: refused on its word alone, before anything is allocated.
    let err = me
        .fetcher
        .fetch_blob(
            model.0,
            BlobKind::Manifest,
            &sources,
            &ProgressBar::hidden(),
        )
        .await
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(text.contains("over the limit of 16777216"), "{text}");
    let partial: u64 = std::fs::read_dir(dirs[2].path().join("partial"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(partial < 16 << 20, "{partial} bytes set aside");
    // With an honest peer too, the manifest comes from it.
    let both = [liar.handle.peer_id, honest.handle.peer_id];
    me.fetcher
        .fetch_blob(model.0, BlobKind::Manifest, &both, &ProgressBar::hidden())
        .await
        .unwrap();
    assert_eq!(me.fetcher.manifest(model).await.unwrap(), manifest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_on_a_port_in_use_is_an_error_and_the_first_serves_on() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: libp2p::Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut opts = NodeOptions::local(a.path().to_path_buf(), Vec::new());
    opts.listen = vec![addr.clone()];
    let first = RunningNode::start(opts).await.unwrap();
    let mut opts = NodeOptions::local(b.path().to_path_buf(), Vec::new());
    opts.listen = vec![addr];
    let err = RunningNode::start(opts)
        .await
        .err()
        .expect("the port is taken");
    let text = format!("{err:#}");
    assert!(
        text.contains(&format!("tcp/{port}")) && text.contains("in use"),
        "{text}"
    );
    // Joins still reach the first.
    let boot = first.addrs().await.unwrap()[0].clone();
    let c = tempfile::tempdir().unwrap();
    let _joined = start(c.path(), &[boot]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_gets_every_record_a_peer_knows_page_by_page() {
    let (_seed_dir, manifest, seeder, boot) = seeder().await;
    let model = manifest.id();
    // 700 other nodes' records, more than one answer carries.
    let ttl = Duration::from_secs(600);
    let wires = made_up_records(&seeder, &manifest, 700, 0xEE, ttl);
    seeder.handle.learn(model, wires, Vec::new()).await.unwrap();
    let newcomer_dir = tempfile::tempdir().unwrap();
    let newcomer = start(newcomer_dir.path(), std::slice::from_ref(&boot)).await;
    let got = moeswarm_node::net::collect_records(&newcomer.handle, model)
        .await
        .unwrap();
    assert_eq!(
        got.len(),
        701,
        "the seeder's own record and the 700 it knows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_asking_for_records_without_end_is_told_busy_and_others_are_still_answered() {
    use moeswarm_protocol::{ExchangeRequest, ResponseHeader};
    let (_seed_dir, manifest, seeder, boot) = seeder().await;
    let model = manifest.id();
    let greedy_dir = tempfile::tempdir().unwrap();
    let greedy = start(greedy_dir.path(), std::slice::from_ref(&boot)).await;
    let (mut answered, mut busy) = (0, 0);
    for _ in 0..300 {
        let req = ExchangeRequest::Holdings { model, after: None };
        let r = greedy
            .handle
            .request(seeder.handle.peer_id, req)
            .await
            .unwrap();
        match r.header {
            ResponseHeader::Holdings { .. } => answered += 1,
            ResponseHeader::Refused { reason } => {
                assert!(reason.starts_with("busy"), "{reason}");
                busy += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    // Its burst of 64, and 16 a second while it asked.
    assert!((64..200).contains(&answered), "{answered} answered");
    assert_eq!(answered + busy, 300);
    let shed = seeder.handle.stats().await.unwrap().requests_shed;
    assert!(shed >= busy as u64, "{shed} shed");
    // Another node reads the records at once.
    let other_dir = tempfile::tempdir().unwrap();
    let other = start(other_dir.path(), std::slice::from_ref(&boot)).await;
    let got = moeswarm_node::net::collect_records(&other.handle, model)
        .await
        .unwrap();
    let key = moeswarm_relay::identity::node_key_of(&seeder.handle.peer_id).unwrap();
    assert!(got.iter().any(|h| h.node == key), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_keeps_forwarding_forged_records_is_banned() {
    let (_dirs, manifest, a, b) = seeder_and_one_slab_holder(0, 0).await;
    let model = manifest.id();
    let ttl = Duration::from_secs(600);
    let deadline = tokio::time::Instant::now() + SETTLE;
    let mut n = 0u8;
    loop {
        // Each signed by a different key than the one that sends it.
        n = n.wrapping_add(1);
        let c = moeswarm_node::net::NodeIdentity::from_seed([n; 32]).unwrap();
        let forged = holdings_record(&b.store, &manifest, &c, ttl, 0).unwrap();
        let _ = b.handle.publish_raw(model, forged.to_wire()).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let s = a.handle.stats().await.unwrap();
        if s.banned.contains_key(&b.handle.peer_id.to_string()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never banned: {s:?}"
        );
    }
    // Its connections are closed, and it cannot come back while the ban lasts.
    eventually(SETTLE, "the banned peer disconnected", || async {
        (!a.handle.peers().await.unwrap().contains(&b.handle.peer_id)).then_some(())
    })
    .await;
    let boot = a.addrs().await.unwrap()[0].clone();
    let _ = b.handle.dial(boot).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!a.handle.peers().await.unwrap().contains(&b.handle.peer_id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_made_up_records_do_not_keep_a_met_node_out_of_the_table() {
    let (_seed_dir, manifest, seeder, boot) = seeder().await;
    let model = manifest.id();
    // 5,000 records signed by keys nobody has met, more than the table holds.
    let ttl = Duration::from_secs(600);
    let sybils = made_up_records(&seeder, &manifest, 5000, 0x5A, ttl);
    seeder
        .handle
        .learn(model, sybils, Vec::new())
        .await
        .unwrap();
    let s = seeder.handle.stats().await.unwrap();
    assert!(
        s.records_refused
            .get(&RecordRefusal::TooManyNodes)
            .copied()
            .unwrap_or(0)
            > 0,
        "{s:?}"
    );

    // An honest node joins, takes a share and advertises it: the seeder has met it, so its
    // record takes the place of a made-up one.
    let honest_dir = tempfile::tempdir().unwrap();
    let honest = start(honest_dir.path(), std::slice::from_ref(&boot)).await;
    let share = Selection {
        layers: Some(0..1),
        experts: Some(vec![0, 1]),
        trunk: false,
        only: None,
    };
    honest
        .fetch(model, &share, &ProgressBar::hidden())
        .await
        .unwrap();
    let honest_key = honest.handle.identity.key;
    let deadline = tokio::time::Instant::now() + SETTLE;
    for round in 0.. {
        // The seeder asks its peers for what it missed (as a node does when it takes up a
        // model), now and then: its own table, bounded, then holds the honest node's record.
        if round % 10 == 0 {
            moeswarm_node::net::learn_records(&seeder.handle, model)
                .await
                .unwrap();
        }
        let map = seeder.handle.coverage(model).await.unwrap().unwrap();
        assert!(map.nodes().count() <= 4096);
        if let Some(h) = map.record(&honest_key) {
            assert_eq!(h.slabs().collect::<Vec<_>>(), vec![(0, 0), (0, 1)]);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the honest node was kept out"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // A newcomer asking the seeder learns it too, within the same bound.
    let newcomer_dir = tempfile::tempdir().unwrap();
    let newcomer = start(newcomer_dir.path(), std::slice::from_ref(&boot)).await;
    let got = moeswarm_node::net::collect_records(&newcomer.handle, model)
        .await
        .unwrap();
    assert!(got.len() <= 4096 + 3, "{} records", got.len());
    assert!(got.iter().any(|h| h.node == honest_key));
}

/// A node that only proves its key: a libp2p endpoint (TCP, noise, yamux, ping) on
/// 127.0.0.1, and the task that runs it.
async fn key_only_node(
    id: &moeswarm_node::net::NodeIdentity,
) -> (libp2p::Multiaddr, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(id.keypair.clone())
        .with_tokio()
        .with_tcp(
            libp2p::tcp::Config::default(),
            libp2p::noise::Config::new,
            libp2p::yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|_| libp2p::ping::Behaviour::default())
        .unwrap()
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(10)))
        .build();
    swarm
        .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
        .unwrap();
    let addr = loop {
        if let libp2p::swarm::SwarmEvent::NewListenAddr { address, .. } =
            swarm.select_next_some().await
        {
            break address;
        }
    };
    let task = tokio::spawn(async move {
        loop {
            swarm.select_next_some().await;
        }
    });
    (addr, task)
}

/// `n` honest nodes, each running (it proves its key when dialed) and each holding one slab
/// of `manifest`: together every slab, none of them all. Each one's key, slab, address and
/// signed record, and the tasks that run them.
#[allow(clippy::type_complexity)]
async fn honest_nodes(
    manifest: &Manifest,
    n: u32,
    expires_at: u64,
) -> (
    Vec<(
        moeswarm_protocol::NodeKey,
        (u32, u32),
        libp2p::Multiaddr,
        Vec<u8>,
    )>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    use moeswarm_protocol::holdings::LayerBits;
    use moeswarm_protocol::{Holdings, Reach, RecordBody};
    let model = manifest.id();
    let (n_layer, n_expert) = (manifest.hyper.n_layer, manifest.hyper.n_expert);
    let slabs = n_layer * n_expert;
    let mut honest = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut seed = [0x0Bu8; 32];
        seed[..4].copy_from_slice(&i.to_le_bytes());
        let id = moeswarm_node::net::NodeIdentity::from_seed(seed).unwrap();
        let (addr, task) = key_only_node(&id).await;
        tasks.push(task);
        let (l, e) = ((i % slabs) / n_expert, i % n_expert);
        let mut layers = vec![LayerBits::empty(n_expert); n_layer as usize];
        layers[l as usize].set(e);
        let record = Holdings {
            model,
            node: id.key,
            n_expert,
            layers,
            used_bytes: 0,
            free_bytes: 0,
            addrs: vec![addr.to_string()],
            reach: Reach::Direct,
            seq: 1,
            expires_at,
        }
        .sign(&id.signing);
        honest.push((id.key, (l, e), addr, record.to_wire()));
    }
    (honest, tasks)
}

/// `n` records of nodes nobody runs, each claiming every slab of `manifest` and giving one of
/// `addrs` (a dial reaches a node, but not that key) or a port nobody listens on.
fn made_up_full_records(
    manifest: &Manifest,
    n: u32,
    addrs: &[String],
    expires_at: u64,
) -> Vec<Vec<u8>> {
    use moeswarm_protocol::holdings::LayerBits;
    use moeswarm_protocol::{Holdings, Reach, RecordBody};
    let model = manifest.id();
    let (n_layer, n_expert) = (manifest.hyper.n_layer, manifest.hyper.n_expert);
    (0..n)
        .map(|i| {
            let mut seed = [0x5Bu8; 32];
            seed[..4].copy_from_slice(&i.to_le_bytes());
            let id = moeswarm_node::net::NodeIdentity::from_seed(seed).unwrap();
            let mut layers = vec![LayerBits::empty(n_expert); n_layer as usize];
            for bits in &mut layers {
                for e in 0..n_expert {
                    bits.set(e);
                }
            }
            let addr = match i % 2 {
                0 => addrs[i as usize % addrs.len()].clone(),
                _ => "/ip4/127.0.0.1/tcp/9".to_string(),
            };
            Holdings {
                model,
                node: id.key,
                n_expert,
                layers,
                used_bytes: 0,
                free_bytes: u64::MAX / 2,
                addrs: vec![addr],
                reach: Reach::Direct,
                seq: 1,
                expires_at,
            }
            .sign(&id.signing)
            .to_wire()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beside_five_thousand_made_up_records_a_newcomer_learns_all_six_hundred_honest_nodes() {
    let (_seed_dir, manifest, seeder, boot) = seeder().await;
    let model = manifest.id();
    let (n_layer, n_expert) = (manifest.hyper.n_layer, manifest.hyper.n_expert);
    let slabs = n_layer * n_expert;
    assert!(slabs <= 600);
    let expires_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let (honest, tasks) = honest_nodes(&manifest, 600, expires_at).await;
    // The seeder knows them.
    let wires = honest.iter().map(|h| h.3.clone()).collect();
    seeder.handle.learn(model, wires, Vec::new()).await.unwrap();

    // A newcomer was flooded first: 5,000 records of nodes nobody runs, claiming every slab,
    // each giving an honest node's address (a dial reaches a node, but not that key) or a
    // port nobody listens on.
    let newcomer_dir = tempfile::tempdir().unwrap();
    let newcomer = start(newcomer_dir.path(), &[]).await;
    newcomer
        .handle
        .subscribe(model, n_layer, n_expert)
        .await
        .unwrap();
    let addrs: Vec<String> = honest.iter().map(|h| h.2.to_string()).collect();
    let sybils = made_up_full_records(&manifest, 5000, &addrs, expires_at);
    newcomer
        .handle
        .learn(model, sybils, Vec::new())
        .await
        .unwrap();

    // It joins through the seeder and asks its peers for records now and then, as a node
    // does: the honest nodes' records wait for a dial, which proves them, and take the
    // places of made-up ones.
    newcomer.handle.dial(boot).await.unwrap();
    // About 1,600 handshakes to vet (10 s alone, 30 s beside two CPU hogs): a bound, not a
    // timing.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut round = 0;
    let map = loop {
        if round % 10 == 0 {
            moeswarm_node::net::learn_records(&newcomer.handle, model)
                .await
                .unwrap();
        }
        round += 1;
        let map = newcomer.handle.coverage(model).await.unwrap().unwrap();
        let stats = newcomer.handle.stats().await.unwrap();
        // Its memory stays bounded all along: the table, and the strangers waiting.
        assert!(map.nodes().count() <= 4096);
        assert!(stats.strangers_waiting <= 1024, "{stats:?}");
        assert!(stats.strangers_waiting_bytes <= 8 << 20, "{stats:?}");
        let known = honest.iter().filter(|h| map.record(&h.0).is_some()).count();
        if known == honest.len() {
            break map;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{known} of 600 honest nodes known: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // Coverage is complete without the seeder and without a made-up record: every slab has
    // an honest holder, exactly the one whose record says so.
    for (key, (l, e), _, _) in &honest {
        let h = map.record(key).unwrap();
        assert_eq!(h.slabs().collect::<Vec<_>>(), vec![(*l, *e)]);
    }
    let mut covered = BTreeSet::new();
    for (_, slab, _, _) in &honest {
        covered.insert(*slab);
    }
    assert_eq!(covered.len() as u32, slabs);
    // Only the honest were proven: no made-up record got in through an honest address.
    let stats = newcomer.handle.stats().await.unwrap();
    assert_eq!(stats.strangers_vetted, 600, "{stats:?}");
    for t in tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_are_heard_and_a_forged_one_is_refused_and_counted() {
    use moeswarm_protocol::{Heartbeat, RecordBody};
    let (_dirs, _manifest, a, b) = seeder_and_one_slab_holder(0, 0).await;
    // Each advertising node says it is up every few seconds (a counts only others').
    eventually(SETTLE, "b's heartbeat heard by a", || async {
        (a.handle.stats().await.unwrap().heartbeats_heard > 0).then_some(())
    })
    .await;
    // A heartbeat naming b whose signature is not b's (c's, over another body).
    let c = moeswarm_node::net::NodeIdentity::from_seed([9; 32]).unwrap();
    let mut forged = Heartbeat {
        node: b.handle.identity.key,
        seq: u64::MAX / 4,
        expires_at: 4_000_000_000,
    }
    .sign(&b.handle.identity.signing);
    forged.signature = Heartbeat {
        node: c.key,
        seq: 1,
        expires_at: 4_000_000_000,
    }
    .sign(&c.signing)
    .signature;
    // c's own heartbeat, passed on by b as if it were b's: c cannot be kept alive by others.
    let relayed = Heartbeat {
        node: c.key,
        seq: 2,
        expires_at: 4_000_000_000,
    }
    .sign(&c.signing);
    for (record, why) in [
        (forged, RecordRefusal::BadSignature),
        (relayed, RecordRefusal::WrongSigner),
    ] {
        eventually(
            SETTLE,
            &format!("a forged heartbeat refused ({why})"),
            || {
                let record = record.clone();
                async {
                    b.handle.publish_raw_heartbeat(record).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let s = a.handle.stats().await.unwrap();
                    (s.heartbeats_refused.get(&why).copied().unwrap_or(0) > 0).then_some(())
                }
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holder_counts_for_a_heartbeat_window_then_leaves_the_coverage() {
    let (_dirs, manifest, a, b) = seeder_and_one_slab_holder(0, 0).await;
    let model = manifest.id();
    let bk = b.handle.identity.key;
    let holds_b = |map: Option<moeswarm_market::coverage::CoverageMap>| {
        map.is_some_and(|m| m.record(&bk).is_some())
    };
    eventually(SETTLE, "b heard by a", || async {
        let s = a.handle.stats().await.unwrap();
        (s.heartbeats_heard > 0 && holds_b(a.handle.coverage(model).await.unwrap())).then_some(())
    })
    .await;
    b.crash().await;
    let t0 = std::time::Instant::now();
    // Counted through the heartbeat window (35 s after its last word, at least 25 s after the
    // crash), then gone within 60 s.
    loop {
        let held = holds_b(a.handle.coverage(model).await.unwrap());
        let t = t0.elapsed();
        if !held {
            assert!(t >= Duration::from_secs(20), "b left after {t:?}: too soon");
            break;
        }
        assert!(t < Duration::from_secs(60), "b still counted after {t:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_gets_no_answer_says_why_by_kind() {
    use moeswarm_node::net::RequestFailure;
    use moeswarm_node::Error;
    let dir = tempfile::tempdir().unwrap();
    let a = start(dir.path(), &[]).await;
    let ask = |peer| {
        a.handle
            .request(peer, moeswarm_protocol::ExchangeRequest::Models)
    };

    let err = ask(a.handle.peer_id).await.unwrap_err();
    assert!(
        matches!(err.root(), Error::Request(f) if **f == RequestFailure::ToItself),
        "{err:#}"
    );

    // A node that was there and is gone: its port is closed now.
    let gone_dir = tempfile::tempdir().unwrap();
    let gone = start(gone_dir.path(), &[]).await;
    let (peer, addrs) = (gone.handle.peer_id, gone.addrs().await.unwrap());
    gone.shutdown().await;
    a.handle.add_addresses(peer, addrs).await;
    let err = tokio::time::timeout(SETTLE, ask(peer))
        .await
        .expect("a dial to a closed port fails at once")
        .unwrap_err();
    assert!(
        matches!(err.root(), Error::Request(f)
            if matches!(&**f, RequestFailure::Unreachable { peer: p, .. } if *p == peer)),
        "{err:#}"
    );
}
