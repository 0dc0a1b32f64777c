//! The simulated swarm: its nodes, what each holds, and what happens to them event by event.
//!
//! A node joins (publishes its record, its heartbeats make it live to the others after the
//! gossip delay), runs market rounds (`round`: the market's own choice on what it sees),
//! carries them out (drops at once, fetches as transfers limited by both ends' links),
//! republishes its record at half its lifetime, and leaves: cleanly
//! (withdrawing its record) or by crashing (the others count it dead
//! [`Market::live_for_secs`](super::scenario::Market) after its last heartbeat). Its store
//! survives the time offline. Each link passes bytes at its rate, transfers in the order asked;
//! a transfer ends once both its ends have passed its bytes (no sooner than a relay's rate
//! allows when neither end can be reached directly): a slow receiver slows its own transfers,
//! not the sender's others.

use moeswarm_market::choice::{NodeClass, Policy};
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{BlobId, Holdings, ModelId, NodeKey, Reach};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use moeswarm_market::demand::DemandBook;
use moeswarm_protocol::Demand;

use super::queue::{Millis, Queue};
use super::quick::TieOrder;
use super::report::{Churn, Rounds, ServeStats};
use super::routing::Routing;
use super::scenario::{Nat, Scenario};
use super::serve::{router_end, Router};
use super::view::View;

pub use super::node::Node;

/// Unix seconds at which every simulation starts (records carry absolute times).
pub const START_SECS: u64 = 1_800_000_000;

/// What can happen.
pub enum Event {
    /// A node comes online.
    Join(usize),
    /// It leaves.
    Leave {
        node: usize,
        session: u64,
        crash: bool,
    },
    /// Its market round.
    Round { node: usize, session: u64 },
    /// A fetch ends.
    Transfer {
        node: usize,
        session: u64,
        slab: u32,
        from: usize,
        from_session: u64,
    },
    /// A record reaches the others.
    Arrive(Box<Holdings>),
    /// The others count a node live (its first heartbeat reached them) or dead.
    Liveness {
        node: usize,
        session: u64,
        live: bool,
    },
    /// A node republishes its record before it expires.
    Refresh { node: usize, session: u64 },
    /// Records may have expired (a sweep once a minute).
    Expire,
    /// Coverage is sampled.
    Sample,
    /// A request reaches a router.
    Request(usize),
    /// A router's step ends (and the next begins).
    Step(usize),
    /// A router publishes its demand.
    PublishDemand(usize),
    /// A demand record reaches the nodes.
    DemandArrives(Box<Demand>),
    /// A fault of the scenario strikes (by index).
    Fault(usize),
    /// It ends.
    Heal(usize),
}

/// The whole simulated swarm.
pub struct World {
    pub sc: Scenario,
    pub model: ModelId,
    pub nodes: Vec<Node>,
    pub view: View,
    pub queue: Queue<Event>,
    pub rng: ChaCha8Rng,
    pub(super) policy: Policy,
    /// Each node's slabs in its tie order, made when its quick choice first needs it.
    pub(super) tie_orders: Vec<Option<TieOrder>>,
    /// Online holders of each slab: all nodes, and market nodes only.
    pub count_all: Vec<u32>,
    pub count_swarm: Vec<u32>,
    /// Slabs with at least 1 and at least `target` holders, by those counts.
    pub all_ge1: usize,
    pub all_ge_target: usize,
    pub swarm_ge1: usize,
    pub swarm_ge_target: usize,
    pub bytes_moved: u64,
    pub churn: Churn,
    pub rounds: Rounds,
    pub violations: Vec<String>,
    pub violation_count: u64,
    /// The routers (none without a `[serving]` section), their routing and what they did.
    pub routers: Vec<Router>,
    pub routing: Option<Routing>,
    pub serving: ServeStats,
    /// The routers' demand as the nodes have it.
    pub demand: DemandBook,
    /// When serving was last sampled, ms.
    pub last_sample: Millis,
}

/// A link rate in Mbit/s as bytes a millisecond.
pub(super) fn bytes_per_ms(mbps: f64) -> f64 {
    mbps * 1e6 / 8.0 / 1000.0
}

fn key_of(seed: u64, i: usize) -> NodeKey {
    NodeKey(BlobId::of(format!("moeswarm sim node {seed} {i}").as_bytes()).0)
}

impl World {
    /// `n` market nodes of the scenario's classes (drawn by share from `seed`) and its
    /// seeders, all offline, nothing scheduled.
    pub fn new(sc: Scenario, n: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let total_share: f64 = sc.classes.iter().map(|c| c.share).sum();
        let mut nodes = Vec::with_capacity(n + sc.seeders.count);
        for i in 0..n {
            let mut x = rng.random::<f64>() * total_share;
            let mut class = sc.classes.len() - 1;
            for (k, c) in sc.classes.iter().enumerate() {
                if x < c.share {
                    class = k;
                    break;
                }
                x -= c.share;
            }
            let c = &sc.classes[class];
            let phone = c.phone || c.nat == Nat::Symmetric;
            let mut node = Node::new(
                key_of(seed, i),
                Some(class),
                (c.capacity_gb * 1e9) as u64,
                bytes_per_ms(c.up_mbps),
                bytes_per_ms(c.down_mbps),
                c.nat,
                if phone {
                    NodeClass::Phone
                } else {
                    NodeClass::Computer
                },
            );
            let [lo, hi] = c.latency_ms;
            node.latency_ms = lo + (hi - lo) * rng.random::<f64>();
            node.region = rng.random_range(0..sc.network.regions.len());
            node.compute = c.compute;
            node.liar = rng.random::<f64>() < sc.liars.share;
            nodes.push(node);
        }
        let all = sc.slabs() as u64 * sc.model.slab_bytes;
        for i in 0..sc.seeders.count {
            let up = bytes_per_ms(sc.seeders.up_mbps);
            let mut node = Node::new(
                key_of(seed, n + i),
                None,
                all,
                up,
                up,
                Nat::None,
                NodeClass::Computer,
            );
            let [lo, hi] = sc.seeders.latency_ms;
            node.latency_ms = lo + (hi - lo) * rng.random::<f64>();
            node.compute = sc.seeders.compute;
            nodes.push(node);
        }
        let (layers, experts) = (sc.model.layers, sc.model.experts);
        let (mut routers, mut routing) = (Vec::new(), None);
        if let Some(sv) = &sc.serving {
            routing = Some(Routing::new(layers, experts, sv.zipf, &mut rng));
            let keys: Vec<NodeKey> = nodes.iter().map(|n| n.key).collect();
            for k in 0..sv.routers {
                let end = router_end(sv, &mut rng);
                routers.push(Router::new(seed, k, end, &keys, (layers, experts), sv));
            }
        }
        let model = ModelId(BlobId::of(b"moeswarm sim model"));
        let keys = nodes.iter().map(|n| n.key).collect();
        let view = View::new(model, sc.model.layers, sc.model.experts, keys);
        let k = &sc.market;
        let policy = Policy {
            target: k.target,
            swap_gain: k.swap_gain,
            min_hold_secs: k.min_hold_secs,
            max_swaps: k.max_swaps,
            max_fetches: k.max_fetches,
        };
        let slabs = sc.slabs();
        let tie_orders = (0..nodes.len()).map(|_| None).collect();
        Self {
            sc,
            model,
            nodes,
            view,
            queue: Queue::default(),
            rng,
            policy,
            tie_orders,
            count_all: vec![0; slabs],
            count_swarm: vec![0; slabs],
            all_ge1: 0,
            all_ge_target: 0,
            swarm_ge1: 0,
            swarm_ge_target: 0,
            bytes_moved: 0,
            churn: Churn::default(),
            rounds: Rounds::default(),
            violations: Vec::new(),
            violation_count: 0,
            routers,
            routing,
            serving: ServeStats::default(),
            demand: DemandBook::new(model, layers, experts),
            last_sample: 0,
        }
    }

    /// Brings the seeders (the nodes from index `market_nodes` on) online, holding every slab
    /// from the start.
    pub fn start_seeders(&mut self, market_nodes: usize) {
        for i in market_nodes..self.nodes.len() {
            for s in 0..self.sc.slabs() as u32 {
                self.nodes[i].hold(s, START_SECS);
            }
            self.join(i);
        }
    }

    /// Unix seconds now.
    pub fn now_secs(&self) -> u64 {
        START_SECS + self.queue.now() / 1000
    }

    pub(super) fn secs(&self, s: f64) -> Millis {
        (s.max(0.0) * 1000.0) as Millis
    }

    /// A draw from an exponential distribution of mean `hours`, in ms.
    fn exp_ms(&mut self, hours: f64) -> Millis {
        let u: f64 = self.rng.random();
        self.secs(-hours * 3600.0 * (1.0 - u).ln())
    }

    pub(super) fn gossip_delay(&mut self) -> Millis {
        let [lo, hi] = self.sc.market.gossip_delay_secs;
        let d = lo + (hi - lo) * self.rng.random::<f64>();
        self.secs(d)
    }

    /// A round's wait: the round (a quarter of it after a busy one), jittered ×0.5–1.5.
    pub(super) fn round_wait(&mut self, busy: bool) -> Millis {
        let base = self.sc.market.round_secs / if busy { 4.0 } else { 1.0 };
        let j: f64 = self.rng.random_range(0.5..1.5);
        self.secs(base * j)
    }

    /// Slab `s` gained (`+1`) or lost (`-1`) an online holder, node `i`.
    pub(super) fn count(&mut self, i: usize, s: u32, up: bool) {
        // A node cut off counts for nothing the routers' side can reach.
        if self.nodes[i].cut {
            return;
        }
        let target = self.sc.market.target as u32;
        let swarm = self.nodes[i].class.is_some();
        let s = s as usize;
        let step = |c: &mut u32, ge1: &mut usize, ge_t: &mut usize| {
            let before = *c;
            *c = if up {
                before + 1
            } else {
                before.saturating_sub(1)
            };
            let after = *c;
            if (before >= 1) != (after >= 1) {
                if after >= 1 {
                    *ge1 += 1
                } else {
                    *ge1 -= 1
                }
            }
            if (before >= target) != (after >= target) {
                if after >= target {
                    *ge_t += 1
                } else {
                    *ge_t -= 1
                }
            }
        };
        step(
            &mut self.count_all[s],
            &mut self.all_ge1,
            &mut self.all_ge_target,
        );
        if swarm {
            step(
                &mut self.count_swarm[s],
                &mut self.swarm_ge1,
                &mut self.swarm_ge_target,
            );
        }
    }

    /// Node `i` publishes a record of what it holds (nothing, `withdraw`); the others get it
    /// after the gossip delay.
    pub(super) fn publish(&mut self, i: usize, withdraw: bool) {
        let now = self.now_secs();
        let (layers, experts) = (self.sc.model.layers, self.sc.model.experts);
        let ttl = self.sc.market.record_ttl_secs;
        let bytes = self.sc.model.slab_bytes;
        let node = &mut self.nodes[i];
        node.seq += 1;
        let mut bits = vec![LayerBits::empty(experts); layers as usize];
        node.published.clear();
        if !withdraw {
            for &s in node.held.keys() {
                bits[(s / experts) as usize].set(s % experts);
                node.published.push(s);
            }
        }
        let used = node.published.len() as u64 * bytes;
        let record = Holdings {
            model: self.model,
            node: node.key,
            n_expert: experts,
            layers: bits,
            used_bytes: used,
            free_bytes: node.capacity.saturating_sub(used),
            addrs: Vec::new(),
            reach: Reach::Direct,
            seq: node.seq,
            expires_at: now + ttl,
        };
        let delay = self.gossip_delay();
        // From behind a partition, nothing reaches the others.
        if !self.nodes[i].cut {
            self.queue.after(delay, Event::Arrive(Box::new(record)));
        }
    }

    /// Brings node `i` online: its store's slabs count again, its record and heartbeats go out,
    /// its rounds and its end are scheduled.
    pub fn join(&mut self, i: usize) {
        if self.nodes[i].online {
            return;
        }
        let node = &mut self.nodes[i];
        node.online = true;
        node.session += 1;
        node.idle = None;
        let session = node.session;
        self.churn.joins += 1;
        self.announce(i);
        let refresh = self.secs(self.sc.market.record_ttl_secs as f64 / 2.0);
        self.queue
            .after(refresh, Event::Refresh { node: i, session });
        match self.nodes[i].class {
            Some(c) => {
                let (hours, crash) = (self.sc.classes[c].session_hours, self.sc.classes[c].crash);
                let stay = self.exp_ms(hours);
                let crash = self.rng.random::<f64>() < crash;
                self.queue.after(
                    stay,
                    Event::Leave {
                        node: i,
                        session,
                        crash,
                    },
                );
                let first = self.round_wait(false);
                self.queue.after(first, Event::Round { node: i, session });
            }
            None => {
                if let Some(h) = self.sc.seeders.leave_after_hours {
                    let at = self.secs(h * 3600.0);
                    let leave = Event::Leave {
                        node: i,
                        session,
                        crash: false,
                    };
                    self.queue.at(at, leave);
                }
            }
        }
    }

    /// Node `i`'s slabs count again, its record goes out and its heartbeats make it live to
    /// the others after the gossip delay (it joined, or its partition healed).
    pub(super) fn announce(&mut self, i: usize) {
        let held: Vec<u32> = self.nodes[i].held.keys().copied().collect();
        for s in held {
            self.count(i, s, true);
        }
        self.publish(i, false);
        let session = self.nodes[i].session;
        let delay = self.gossip_delay();
        let live = Event::Liveness {
            node: i,
            session,
            live: true,
        };
        self.queue.after(delay, live);
    }

    /// Node `i` leaves (if still in `session`); it comes back after its offline time.
    pub fn leave(&mut self, i: usize, session: u64, crash: bool) {
        let node = &mut self.nodes[i];
        if !node.online || node.session != session {
            return;
        }
        node.online = false;
        node.inflight.clear();
        node.idle = None;
        let held: Vec<u32> = node.held.keys().copied().collect();
        for s in held {
            self.count(i, s, false);
        }
        let k = &self.sc.market;
        let (live_for, beat) = (self.secs(k.live_for_secs as f64), k.heartbeat_secs as f64);
        let dead = Event::Liveness {
            node: i,
            session,
            live: false,
        };
        if crash {
            self.churn.crashes += 1;
            // Dead to the others once its last heartbeat is too old.
            let r: f64 = self.rng.random();
            let since_beat = self.secs(beat * r);
            let delay = self.gossip_delay();
            self.queue
                .after((live_for + delay).saturating_sub(since_beat), dead);
        } else {
            self.churn.clean_leaves += 1;
            self.publish(i, true);
            self.queue.after(live_for, dead);
        }
        if let Some(c) = self.nodes[i].class {
            let away = self.exp_ms(self.sc.classes[c].offline_hours);
            self.queue.after(away, Event::Join(i));
        }
    }
}

/// Whether a transfer between nodes reached as `a` and `b` must go through a relay: neither
/// has a public address and one of them is behind a symmetric NAT (two cone NATs punch a
/// hole; a public address is dialled from behind any NAT).
pub fn relayed(a: Nat, b: Nat) -> bool {
    a != Nat::None && b != Nat::None && (a == Nat::Symmetric || b == Nat::Symmetric)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checker_reports_a_node_over_capacity_and_a_slab_advertised_but_not_held() {
        let mut sc = Scenario::default_scenario();
        sc.model.experts = 8;
        let bytes = sc.model.slab_bytes;
        let mut w = World::new(sc, 2, 1);
        w.nodes[0].capacity = bytes;
        w.nodes[0].hold(0, START_SECS);
        w.check(0);
        assert!(w.violations.is_empty(), "{:?}", w.violations);
        w.nodes[0].inflight.push(1);
        w.check(0);
        assert!(w.violations[0].contains("over its"), "{:?}", w.violations);
        w.nodes[1].hold(2, START_SECS);
        w.nodes[1].published = vec![2, 3];
        w.check(1);
        assert!(
            w.violations[1].contains("advertises slab 3"),
            "{:?}",
            w.violations
        );
        assert_eq!(w.violation_count, 2);
    }

    #[test]
    fn only_two_nodes_behind_nats_one_of_them_symmetric_need_a_relay() {
        use Nat::*;
        assert!(relayed(Symmetric, Symmetric) && relayed(Cone, Symmetric));
        assert!(!relayed(Cone, Cone) && !relayed(None, Symmetric) && !relayed(Cone, None));
    }
}
