//! The market with real nodes on 127.0.0.1: empty nodes that join with a capacity choose,
//! fetch and serve slabs by themselves until every slab has its replicas; they recover from
//! nodes that stop or crash, follow the routers' demand, stay put once settled, and refuse
//! forged demand.

use moeswarm_node::net::RecordRefusal;
use moeswarm_testkit as common;

use moeswarm_testkit::eventually;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{data, held_out_passage, sliced, sliced_small, trained_model};
use moeswarm_engine::generate::{self, trunk_from_store};
use moeswarm_market::choice::Policy;
use moeswarm_node::auto::{AutoOptions, AutoSummary};
use moeswarm_node::router::{remote_executor, replica_table, RouterUpkeep};
use moeswarm_node::{NodeOptions, RunningNode};
use moeswarm_protocol::{Demand, Manifest, NodeKey, RecordBody, WireType};

/// Deadline for anything that waits on the network in these tests.
/// The longest a swarm may take to get somewhere: a crash is noticed after a heartbeat window
/// (35–45 s), then the market rounds and fetches follow.
const SETTLE: Duration = Duration::from_secs(120);

/// Bytes of every slab of the model once: "the model" when capacities are counted.
fn model_bytes(m: &Manifest) -> u64 {
    m.all_slabs().map(|(_, _, r)| r.bytes).sum()
}

/// A capacity of `fraction` of the model's slabs, plus room for its manifest.
fn capacity(m: &Manifest, fraction: f64) -> u64 {
    (model_bytes(m) as f64 * fraction) as u64 + m.to_bytes().len() as u64
}

async fn seeder(dir: &Path) -> RunningNode {
    // The default record lifetime: a crash is noticed by heartbeats, not by records expiring.
    let o = NodeOptions::local(dir.to_path_buf(), vec![]);
    let mut n = RunningNode::start(o).await.unwrap();
    n.keep_advertising();
    n
}

/// A worker that joins through `boot` empty, takes part in every model it hears of, and serves
/// dispatches for what it holds; returned once its first choices are fetched.
async fn market_node(
    dir: &Path,
    boot: &libp2p::Multiaddr,
    capacity: u64,
    min_hold_secs: u64,
) -> RunningNode {
    let mut o = NodeOptions::local(dir.to_path_buf(), vec![boot.clone()]);
    o.capacity = capacity;
    o.data_plane.listen = Some("127.0.0.1:0".parse().unwrap());
    o.auto = Some(AutoOptions {
        models: vec![],
        policy: Policy {
            min_hold_secs,
            ..Policy::default()
        },
        // Shorter than the default 10 s: these tests watch many rounds of choices in seconds.
        // The default round (and hold time) is what node/cli/tests/liveness.rs runs with.
        round: Duration::from_millis(300),
        ..AutoOptions::default()
    });
    let mut n = RunningNode::start(o).await.unwrap();
    n.keep_advertising();
    assert!(
        n.market.as_ref().unwrap().settled(SETTLE).await,
        "{:?}",
        n.market.as_ref().unwrap().summary()
    );
    n
}

fn key(n: &RunningNode) -> NodeKey {
    n.handle.identity.key
}

/// Replicas of every slab `[layer][expert]` in `observer`'s coverage map, not counting
/// `leaving_out`.
async fn replicas(
    observer: &RunningNode,
    m: &Manifest,
    leaving_out: &[NodeKey],
) -> Vec<Vec<usize>> {
    let map = observer.handle.coverage(m.id()).await.unwrap().unwrap();
    (0..m.slab_layers())
        .map(|l| {
            (0..m.hyper.n_expert)
                .map(|e| {
                    map.holders(l, e)
                        .iter()
                        .filter(|k| !leaving_out.contains(k))
                        .count()
                })
                .collect()
        })
        .collect()
}

/// Waits until every slab has at least `r` replicas besides `leaving_out` in `observer`'s view.
async fn wait_for_replicas(
    observer: &RunningNode,
    m: &Manifest,
    leaving_out: &[NodeKey],
    r: usize,
) {
    eventually(SETTLE, "replicas", || async {
        let got = replicas(observer, m, leaving_out).await;
        match got.iter().flatten().all(|&n| n >= r) {
            true => Ok::<_, String>(()),
            false => Err(format!("{r} replicas of every slab: {got:?}")),
        }
    })
    .await
}

/// Waits until `observer` sees `node`'s holdings gone from coverage (withdrawn or expired).
async fn wait_for_withdrawal(
    observer: &RunningNode,
    m: &Manifest,
    node: NodeKey,
    within: Duration,
) {
    eventually(within, "the withdrawal", || async {
        let map = observer.handle.coverage(m.id()).await.unwrap().unwrap();
        match map.record(&node).is_none_or(|h| h.slabs().count() == 0) {
            true => Ok::<_, String>(()),
            false => Err("the holdings of a node that stopped are still in coverage".into()),
        }
    })
    .await
}

fn store_bytes(n: &RunningNode) -> u64 {
    n.store.blobs().unwrap().iter().map(|(_, e)| e.size).sum()
}

fn moves(nodes: &[RunningNode]) -> Vec<(u64, u64)> {
    nodes
        .iter()
        .map(|n| {
            let s: AutoSummary = n.market.as_ref().unwrap().summary();
            (s.fetched_slabs, s.dropped_slabs)
        })
        .collect()
}

/// Asserts that no node fetches or drops anything for `period`.
async fn assert_still(nodes: &[RunningNode], period: Duration) {
    let before = moves(nodes);
    tokio::time::sleep(period).await;
    assert_eq!(
        moves(nodes),
        before,
        "a node moved slabs with nothing changed"
    );
}

/// A seeder of `model` and empty market workers joining it one by one, with
/// `fractions` of the model as capacities: the temp dirs (keep them), manifest, seeder, nodes.
async fn seeded_swarm(
    model: &Path,
    fractions: &[f64],
    min_hold_secs: u64,
) -> (
    Vec<tempfile::TempDir>,
    Manifest,
    RunningNode,
    Vec<RunningNode>,
) {
    let seed_dir = tempfile::tempdir().unwrap();
    let manifest = sliced(model, seed_dir.path()).unwrap();
    let seed = seeder(seed_dir.path()).await;
    let boot = seed.addrs().await.unwrap()[0].clone();
    let mut dirs = vec![seed_dir];
    let mut nodes = Vec::new();
    for &f in fractions {
        let d = tempfile::tempdir().unwrap();
        nodes.push(market_node(d.path(), &boot, capacity(&manifest, f), min_hold_secs).await);
        dirs.push(d);
    }
    (dirs, manifest, seed, nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_empty_nodes_cover_the_model_twice_over_by_themselves_and_the_seeder_can_leave() {
    // Capacities adding up to 3× the model, none able to hold it all.
    let fractions = [0.35, 0.4, 0.5, 0.55, 0.6, 0.6];
    let (_dirs, manifest, seed, nodes) =
        seeded_swarm(&data("small-q4_k.gguf"), &fractions, 300).await;
    wait_for_replicas(&seed, &manifest, &[key(&seed)], 2).await;
    for (n, f) in nodes.iter().zip(fractions) {
        assert!(
            store_bytes(n) <= capacity(&manifest, f),
            "a node is over its capacity"
        );
        assert!(!n.store.held_slabs(&manifest).unwrap().is_empty());
    }
    // Nothing changes: nobody moves.
    assert_still(&nodes, Duration::from_secs(3)).await;
    // The seeder leaves; its last record says so at once, and the rest still cover twice.
    let seed_key = key(&seed);
    seed.shutdown().await;
    wait_for_withdrawal(&nodes[0], &manifest, seed_key, Duration::from_secs(5)).await;
    let r = replicas(&nodes[0], &manifest, &[]).await;
    assert!(r.iter().flatten().all(|&n| n >= 2), "{r:?}");
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_clean_stop_and_a_crash_the_rest_restore_two_replicas() {
    // A hold time of 1 s: the survivors may also swap for demand (the repair needs no such
    // shortening; the process test shows it with the defaults).
    let (_dirs, manifest, seed, mut nodes) =
        seeded_swarm(&data("small-q4_k.gguf"), &[0.55; 6], 1).await;
    wait_for_replicas(&seed, &manifest, &[key(&seed)], 2).await;
    seed.shutdown().await;
    // One stops cleanly: its holdings leave the coverage at once, not after its record's life.
    let clean = nodes.remove(0);
    let clean_key = key(&clean);
    assert!(replicas(&nodes[0], &manifest, &[])
        .await
        .iter()
        .flatten()
        .all(|&n| n >= 2));
    clean.shutdown().await;
    wait_for_withdrawal(&nodes[0], &manifest, clean_key, Duration::from_secs(2)).await;
    // One crashes: it counts until it has been silent for a heartbeat window (35 s), then the
    // others take over its slabs.
    let crashed = nodes.remove(0);
    let crashed_key = key(&crashed);
    crashed.crash().await;
    let map = nodes[0]
        .handle
        .coverage(manifest.id())
        .await
        .unwrap()
        .unwrap();
    assert!(map.record(&crashed_key).is_some(), "a crash says nothing");
    // Four nodes of 0.55 each: room for two replicas of everything.
    wait_for_replicas(&nodes[0], &manifest, &[crashed_key, clean_key], 2).await;
    for n in &nodes {
        assert!(store_bytes(n) <= capacity(&manifest, 0.55));
    }
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slabs_a_router_uses_most_end_with_the_most_replicas_and_then_nothing_moves() {
    // The model trained here, so the demand is a real router's: a held-out passage of prose
    // sends some experts of each layer many more rows than others.
    // A hold time of 1 s: the moves to the hot slabs are swaps of slabs fetched a moment ago.
    let (_dirs, manifest, mut seed, nodes) = seeded_swarm(&trained_model(), &[0.6; 4], 1).await;
    // The seeder is the router.
    let table = replica_table(&seed, &manifest).await.unwrap();
    let upkeep = RouterUpkeep {
        period: Duration::from_millis(500),
        demand_window: Duration::from_secs(120),
        demand_ttl: Duration::from_secs(240),
    };
    let remote = remote_executor(
        &mut seed,
        &manifest,
        table,
        Duration::from_secs(10),
        WireType::F32,
        &upkeep,
    )
    .unwrap();
    let (trunk, _) = trunk_from_store(&seed.store, &manifest).unwrap();
    generate::logits(&trunk, &remote, &held_out_passage())
        .await
        .unwrap();
    let s = remote.stats.summary();
    assert_eq!(s.local, 0, "the workers computed every slab: {s:?}");

    // The workers learn the demand and move replicas to the hot slabs: per layer, the quarter
    // of the experts with the most rows against the half with the fewest.
    let seed_key = key(&seed);
    let hot_and_cold = || async {
        let book = nodes[0]
            .handle
            .demand(manifest.id())
            .await
            .unwrap()
            .unwrap();
        let demand = book.merged(unix_now());
        let r = replicas(&nodes[0], &manifest, &[seed_key]).await;
        let (mut hot, mut cold) = (Vec::new(), Vec::new());
        for (l, row) in demand.iter().enumerate() {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            hot.extend(order[..row.len() / 4].iter().map(|&e| r[l][e]));
            cold.extend(order[row.len() / 2..].iter().map(|&e| r[l][e]));
        }
        (hot, cold)
    };
    let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
    // Hot slabs hold more replicas than cold ones on average (a trained router's skew is mild:
    // the busiest quarter takes about a third of the rows, so the market's share follows it
    // only as far as a swap's gain allows; the proportional check below is the exact rule),
    // and no slab is left without a replica outside the router.
    eventually(SETTLE, "more replicas of the hot slabs", || async {
        let (hot, cold) = hot_and_cold().await;
        let done =
            !hot.is_empty() && mean(&hot) > mean(&cold) && hot.iter().chain(&cold).all(|&n| n >= 1);
        match done {
            true => Ok::<_, String>(()),
            false => Err(format!("hot {hot:?} cold {cold:?}")),
        }
    })
    .await;
    eventually(SETTLE, "the market at rest", || async {
        let before = moves(&nodes);
        tokio::time::sleep(Duration::from_secs(3)).await;
        match moves(&nodes) == before {
            true => Ok::<_, String>(()),
            false => Err(format!("still moving: {before:?}")),
        }
    })
    .await;
    let (hot, cold) = hot_and_cold().await;
    eprintln!("replicas: hot {hot:?}, cold {cold:?}");
    assert!(mean(&hot) > mean(&cold), "hot {hot:?} cold {cold:?}");
    assert_still(&nodes, Duration::from_secs(3)).await;
    // And proportionally: at rest, a slab some node could still take (it holds a spare
    // replica of another slab instead) carries at most 1 + swap_gain times the demand per
    // replica of that other slab, counted as the market counts it ((rows + 1) / replicas).
    let book = nodes[0]
        .handle
        .demand(manifest.id())
        .await
        .unwrap()
        .unwrap();
    let demand = book.merged(unix_now());
    let held: Vec<Vec<(u32, u32)>> = nodes
        .iter()
        .map(|n| n.store.held_slabs(&manifest).unwrap())
        .collect();
    let total = |l: u32, e: u32| 1 + held.iter().filter(|h| h.contains(&(l, e))).count();
    let per_replica = |l: u32, e: u32, r: usize| (demand[l as usize][e as usize] + 1.0) / r as f64;
    let gain = Policy::default().swap_gain;
    for h in &held {
        for &(bl, be) in h.iter().filter(|&&(l, e)| total(l, e) > 2) {
            for (al, ae, _) in manifest
                .all_slabs()
                .filter(|(l, e, _)| !h.contains(&(*l, *e)))
            {
                let (a, b) = (
                    per_replica(al, ae, total(al, ae) + 1),
                    per_replica(bl, be, total(bl, be)),
                );
                assert!(
                    a <= (1.0 + gain) * b + 1e-9,
                    "{al}/{ae} ({a} a replica with one more) is worth a swap for {bl}/{be} ({b})"
                );
            }
        }
    }
    for n in nodes {
        n.shutdown().await;
    }
    seed.shutdown().await;
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_replayed_and_oversized_demand_records_are_refused_and_counted() {
    let a_dir = tempfile::tempdir().unwrap();
    let manifest = sliced_small(a_dir.path());
    let model = manifest.id();
    let a = seeder(a_dir.path()).await;
    let boot = a.addrs().await.unwrap()[0].clone();
    let b_dir = tempfile::tempdir().unwrap();
    let b = market_node(b_dir.path(), &boot, capacity(&manifest, 0.2), 300).await;
    let now = unix_now();
    let demand = |router: NodeKey, seq: u64| {
        let mut counts = vec![vec![0u64; 16]; 3];
        counts[1][2] = 40;
        let (slabs, total_rows) = Demand::entries_of(&counts);
        Demand {
            model,
            router,
            n_layer: 3,
            n_expert: 16,
            window_secs: 60,
            total_rows,
            slabs,
            issued_at: now,
            seq,
            expires_at: now + 600,
        }
    };
    let bk = &b.handle.identity;
    let old = demand(bk.key, 1).sign(&bk.signing);
    let new = demand(bk.key, 2).sign(&bk.signing);
    b.handle.publish_demand(model, new.clone()).await.unwrap();
    let c = moeswarm_node::net::NodeIdentity::from_seed([9; 32]).unwrap();
    let forged = demand(c.key, 1).sign(&c.signing);
    let mut flipped = new.to_wire();
    let at = flipped.len() - 3;
    flipped[at] ^= 1;
    let attempts: [(RecordRefusal, Vec<u8>); 3] = [
        (RecordRefusal::WrongSigner, forged.to_wire()),
        (RecordRefusal::Stale, old.to_wire()),
        (RecordRefusal::Malformed, flipped),
    ];
    let refused =
        |s: &BTreeMap<RecordRefusal, u64>, k: RecordRefusal| s.get(&k).copied().unwrap_or(0);
    for (reason, wire) in attempts {
        eventually(SETTLE, &format!("{reason} refused"), || async {
            b.handle
                .publish_raw_demand(model, wire.clone())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let s = a.handle.stats().await.unwrap().demand_refused;
            (refused(&s, reason) > 0
                || (reason == RecordRefusal::Malformed
                    && refused(&s, RecordRefusal::BadSignature) > 0))
                .then_some(())
        })
        .await;
    }
    // A record too large for the swarm, passed on by a peer.
    a.handle
        .learn(model, vec![], vec![vec![0u8; 13 * 1024]])
        .await
        .unwrap();
    let s = a.handle.stats().await.unwrap().demand_refused;
    assert_eq!(refused(&s, RecordRefusal::Oversized), 1, "{s:?}");
    // a still holds b's newest record, untouched by the forgeries.
    let book = a.handle.demand(model).await.unwrap().unwrap();
    let held: Vec<&Demand> = book.records().collect();
    assert_eq!(held.len(), 1);
    assert_eq!((held[0].router, held[0].seq), (bk.key, 2));
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_room_for_one_model_takes_the_one_a_router_demands_not_the_first_announced() {
    // A seeder serving two models; a router's demand names the one whose id sorts last.
    let a_dir = tempfile::tempdir().unwrap();
    let m1 = sliced(&data("tiny-f32.gguf"), a_dir.path()).unwrap();
    let m2 = sliced(&data("tiny-q8_0.gguf"), a_dir.path()).unwrap();
    let (first, demanded) = if m1.id() < m2.id() {
        (m1, m2)
    } else {
        (m2, m1)
    };
    let a = seeder(a_dir.path()).await;
    let router = &a.handle.identity;
    let now = unix_now();
    let h = &demanded.hyper;
    let mut counts = vec![vec![0u64; h.n_expert as usize]; demanded.slab_layers() as usize];
    counts[0][0] = 40;
    let (slabs, total_rows) = Demand::entries_of(&counts);
    let record = Demand {
        model: demanded.id(),
        router: router.key,
        n_layer: demanded.slab_layers(),
        n_expert: h.n_expert,
        window_secs: 60,
        total_rows,
        slabs,
        issued_at: now,
        seq: 1,
        expires_at: now + 600,
    };
    a.handle
        .publish_demand(demanded.id(), record.sign(&router.signing))
        .await
        .unwrap();
    let boot = a.addrs().await.unwrap()[0].clone();

    // A node with room in its market for one model only.
    let b_dir = tempfile::tempdir().unwrap();
    let mut o = NodeOptions::local(b_dir.path().to_path_buf(), vec![boot]);
    o.capacity = 1 << 30;
    o.auto = Some(AutoOptions {
        max_models: 1,
        round: Duration::from_millis(300),
        ..AutoOptions::default()
    });
    let b = RunningNode::start(o).await.unwrap();
    eventually(SETTLE, "the demanded model's slabs held", || async {
        let held = b.store.held_slabs(&demanded).unwrap().len();
        (held > 0).then_some(())
    })
    .await;
    assert!(b.market.as_ref().unwrap().settled(SETTLE).await);
    assert_eq!(
        b.store.held_slabs(&first).unwrap(),
        vec![],
        "the first announced taken"
    );
    b.shutdown().await;
    a.shutdown().await;
}
