//! A node's market round and what carries it out: it decides on what it sees with the
//! market's own [`views`] and [`decide`], drops at once, fetches from the live holder that
//! would send soonest, advertises what it holds after the round's fetches, and decides again.
//! The checks of a node's invariants (capacity, advertising only what it holds) run after each
//! round and each fetch.

use moeswarm_market::choice::{decide, views, Decision, NodeView, SlabKey, SlabState, TieSeed};

use moeswarm_protocol::NodeKey;

use super::quick::{quick, Me, Shape, SCAN_LIMIT};

use super::queue::Millis;
use super::world::{bytes_per_ms, relayed, Event, World};

/// Most violations described in the report.
const MAX_VIOLATIONS: usize = 20;

impl World {
    /// Node `i`'s market round (if still in `session`).
    pub fn round(&mut self, i: usize, session: u64) {
        let node = &self.nodes[i];
        if !node.online || node.session != session || !node.inflight.is_empty() {
            return;
        }
        let now = self.now_secs();
        // Demand moves with time (records age), so a node that weighs any decides every round.
        let demand = (!self.demand.is_empty()).then(|| self.demand.merged(now));
        if let Some((epoch, next_age)) = node.idle.filter(|_| demand.is_none()) {
            if epoch == self.view.epoch() && now < next_age {
                self.rounds.skipped_idle += 1;
                let wait = self.round_wait(false);
                self.queue.after(wait, Event::Round { node: i, session });
                return;
            }
        }
        let quick = if demand.is_none() && self.sc.market.quick_choice {
            self.quick_decision(i)
        } else {
            None
        };
        let was_quick = quick.is_some();
        self.rounds.quick += u64::from(was_quick);
        let decision = match quick {
            Some(d) => d,
            None => self.full_decision(i, demand.as_deref()),
        };
        self.rounds.decided += 1;
        let node = &self.nodes[i];
        if decision.is_empty() {
            // After a full choice, remember what it depended on; a quick one costs less than
            // that bookkeeping.
            self.nodes[i].idle = (!was_quick).then(|| {
                let hold = self.policy.min_hold_secs;
                let next_age = node
                    .held
                    .values()
                    .map(|&t| t.saturating_add(hold))
                    .filter(|&t| t > now)
                    .min()
                    .unwrap_or(u64::MAX);
                (self.view.epoch(), next_age)
            });
            let wait = self.round_wait(false);
            self.queue.after(wait, Event::Round { node: i, session });
            return;
        }
        self.nodes[i].idle = None;
        let experts = self.sc.model.experts;
        let index = |k: &SlabKey| k.layer * experts + k.expert;
        for k in &decision.drop {
            let s = index(k);
            if self.nodes[i].unhold(s) {
                if let Err(at) = self.nodes[i].ghosts.binary_search(&s) {
                    if self.view.counted(i).binary_search(&s).is_ok() {
                        self.nodes[i].ghosts.insert(at, s);
                    }
                }
                self.count(i, s, false);
                self.rounds.dropped += 1;
            }
        }
        if !decision.drop.is_empty() {
            self.publish(i, false);
        }
        self.nodes[i].fetched_this_round = false;
        for k in &decision.fetch {
            self.start_fetch(i, index(k));
        }
        if self.nodes[i].inflight.is_empty() {
            let wait = self.round_wait(true);
            self.queue.after(wait, Event::Round { node: i, session });
        }
        self.check(i);
    }

    /// Node `i`'s decision by the quick choice, where it answers (no demand: see [`quick`]).
    fn quick_decision(&mut self, i: usize) -> Option<Decision> {
        let node = &self.nodes[i];
        let me = Me {
            key: node.key,
            holders: &self.view,
            seed: TieSeed::of(&node.key, &self.model),
            class: node.market_class,
            budget: node.capacity,
            now: self.now_secs(),
            held: &node.held,
            holds: &node.holds,
            counted: self.view.counted(i),
            ghosts: &node.ghosts,
        };
        let shape = Shape {
            model: self.model,
            experts: self.sc.model.experts,
            slab_bytes: self.sc.model.slab_bytes,
        };
        let order = &mut self.tie_orders[i];
        quick(
            &me,
            shape,
            self.view.counts(),
            &self.policy,
            order,
            SCAN_LIMIT,
        )
    }

    /// Node `i`'s decision by the market's views and choice over every slab, with the merged
    /// `demand` (rows per window by layer and expert) if any.
    fn full_decision(&self, i: usize, demand: Option<&[Vec<f64>]>) -> Decision {
        let node = &self.nodes[i];
        let (experts, bytes) = (self.sc.model.experts, self.sc.model.slab_bytes);
        let slab_key = |s: u32| SlabKey {
            model: self.model,
            layer: s / experts,
            expert: s % experts,
        };
        let holders: Vec<Vec<NodeKey>> = (0..self.sc.slabs())
            .map(|s| self.view.holder_keys(s))
            .collect();
        let states: Vec<SlabState> = (0..self.sc.slabs() as u32)
            .map(|s| SlabState {
                slab: slab_key(s),
                bytes,
                holders: &holders[s as usize],
                held_since: node.held.get(&s).copied(),
                demand: demand.map_or(0.0, |d| d[(s / experts) as usize][(s % experts) as usize]),
            })
            .collect();
        let seen = views(&node.key, &states, self.view.known(), self.policy.target);
        let me = NodeView {
            node: node.key,
            class: node.market_class,
            budget: node.capacity,
            now: self.now_secs(),
        };
        decide(&me, &seen, &self.policy)
    }

    /// Keeps each node's ghosts (slabs the view still counts it as holding that it dropped)
    /// in step with the view's changes.
    pub(super) fn sync_ghosts(&mut self) {
        for (i, s, came) in self.view.take_changes() {
            let node = &mut self.nodes[i as usize];
            match node.ghosts.binary_search(&s) {
                Ok(at) if !came => {
                    node.ghosts.remove(at);
                }
                Err(at) if came && !node.held.contains_key(&s) => node.ghosts.insert(at, s),
                _ => {}
            }
        }
    }

    /// Starts fetching slab `s` for node `i` from the live holder it sees that would have sent
    /// it soonest (none: the fetch fails, and the next round decides again).
    fn start_fetch(&mut self, i: usize, s: u32) {
        let now = self.queue.now();
        let bytes = self.sc.model.slab_bytes as f64;
        let nodes = &self.nodes;
        let sent_by = |j: usize| nodes[j].up_free.max(now) + (bytes / nodes[j].up).ceil() as Millis;
        let source = self
            .view
            .holders(s as usize)
            .iter()
            .map(|&j| j as usize)
            .filter(|&j| j != i && nodes[j].online && nodes[j].held.contains_key(&s))
            .filter(|&j| nodes[j].reaches(&nodes[i]))
            .min_by_key(|&j| (sent_by(j), j));
        let Some(j) = source else {
            self.churn.fetches_without_source += 1;
            return;
        };
        // Each link passes the bytes at its own rate, after what it already carries; the
        // transfer ends when both ends have passed them (and no sooner than a relay allows).
        let (a, b) = (&self.nodes[j], &self.nodes[i]);
        let sent = now.max(a.up_free) + (bytes / a.up).ceil() as Millis;
        let got = now.max(b.down_free) + (bytes / b.down).ceil() as Millis;
        let mut end = sent.max(got);
        if relayed(a.nat, b.nat) {
            let relay = bytes_per_ms(self.sc.network.relay_mbps);
            end = end.max(now + (bytes / relay).ceil() as Millis);
        }
        let from_session = a.session;
        self.nodes[j].up_free = sent;
        let node = &mut self.nodes[i];
        node.down_free = got;
        node.inflight.push(s);
        let session = node.session;
        self.queue.at(
            end,
            Event::Transfer {
                node: i,
                session,
                slab: s,
                from: j,
                from_session,
            },
        );
    }

    /// A fetch of node `i` ends: the slab is held if both ends stayed; after the round's last
    /// one the node advertises and decides again soon.
    pub fn transfer_done(
        &mut self,
        i: usize,
        session: u64,
        s: u32,
        from: usize,
        from_session: u64,
    ) {
        let node = &self.nodes[i];
        if !node.online || node.session != session {
            return;
        }
        let src = &self.nodes[from];
        if src.online && src.session == from_session && self.reach(i, from) {
            let now = self.now_secs();
            self.nodes[i].hold(s, now);
            self.count(i, s, true);
            self.bytes_moved += self.sc.model.slab_bytes;
            self.rounds.fetched += 1;
            self.nodes[i].fetched_this_round = true;
        } else {
            self.churn.transfers_cut += 1;
        }
        let node = &mut self.nodes[i];
        node.inflight.retain(|&x| x != s);
        if node.inflight.is_empty() {
            if node.fetched_this_round {
                self.publish(i, false);
            }
            let wait = self.round_wait(true);
            self.queue.after(wait, Event::Round { node: i, session });
        }
        self.check(i);
    }

    /// Node `i` republishes its record (if still in `session`).
    pub fn refresh(&mut self, i: usize, session: u64) {
        let node = &self.nodes[i];
        if node.online && node.session == session {
            self.publish(i, false);
            let again = self.secs(self.sc.market.record_ttl_secs as f64 / 2.0);
            self.queue.after(again, Event::Refresh { node: i, session });
        }
    }

    /// Checks node `i`'s invariants: within its capacity (what it holds and fetches), and its
    /// latest record names only slabs it holds.
    pub(super) fn check(&mut self, i: usize) {
        let node = &self.nodes[i];
        let used = (node.held.len() + node.inflight.len()) as u64 * self.sc.model.slab_bytes;
        let mut broken = Vec::new();
        if used > node.capacity {
            broken.push(format!(
                "node {i} holds and fetches {used} bytes over its {} at {} ms",
                node.capacity,
                self.queue.now()
            ));
        }
        let unheld = node.published.iter().find(|&&s| !node.holds_slab(s));
        if let Some(s) = unheld {
            broken.push(format!(
                "node {i} advertises slab {s} it does not hold at {} ms",
                self.queue.now()
            ));
        }
        for b in broken {
            self.violation_count += 1;
            if self.violations.len() < MAX_VIOLATIONS {
                self.violations.push(b);
            }
        }
    }
}
