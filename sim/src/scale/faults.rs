//! Faults on purpose ([`Fault`]): many nodes leaving at once, a region cut off, a class of
//! nodes slowing down. Each is scheduled at its time and, where it lasts, healed after.
//!
//! A partition cuts the nodes of its regions off from everyone else, the routers included
//! (they are in the first region): their heartbeats and records stop reaching the others, who
//! count them dead once the heartbeats are missed; transfers and dispatches across the cut
//! fail; their slabs stop counting toward coverage (coverage is what the routers' side can
//! reach). Inside the cut, nodes go on with their rounds on the shared view (the simulator has
//! one view; what a cut-off node would believe is not modelled), fetching only from their own
//! side. When it heals, their records and heartbeats reach the others again.

use rand::Rng;

use super::scenario::Fault;
use super::world::{Event, World};

impl World {
    /// Schedules the scenario's faults and their ends.
    pub(super) fn schedule_faults(&mut self) {
        for (k, f) in self.sc.faults.clone().iter().enumerate() {
            let (at, lasts) = match f {
                Fault::MassLeave { at_secs, .. } => (*at_secs, None),
                Fault::Partition {
                    at_secs, for_secs, ..
                }
                | Fault::Slow {
                    at_secs, for_secs, ..
                } => (*at_secs, Some(*for_secs)),
            };
            let at = self.secs(at);
            self.queue.at(at, Event::Fault(k));
            if let Some(d) = lasts {
                let end = at + self.secs(d);
                self.queue.at(end, Event::Heal(k));
            }
        }
    }

    /// Fault `k` strikes.
    pub fn fault(&mut self, k: usize) {
        match self.sc.faults[k].clone() {
            Fault::MassLeave {
                share,
                within_secs,
                crash,
                ..
            } => {
                for i in 0..self.nodes.len() {
                    let n = &self.nodes[i];
                    if n.class.is_none() || !n.online || self.rng.random::<f64>() >= share {
                        continue;
                    }
                    let session = n.session;
                    let u: f64 = self.rng.random();
                    let when = self.secs(within_secs * u);
                    self.queue.after(
                        when,
                        Event::Leave {
                            node: i,
                            session,
                            crash,
                        },
                    );
                }
                self.churn.mass_leaves += 1;
            }
            Fault::Partition { regions, .. } => {
                let cut: Vec<usize> = self
                    .sc
                    .network
                    .regions
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| regions.contains(r))
                    .map(|(k, _)| k)
                    .collect();
                for i in 0..self.nodes.len() {
                    if cut.contains(&self.nodes[i].region) {
                        self.cut_off(i);
                    }
                }
            }
            Fault::Slow { class, factor, .. } => self.slow(&class, factor),
        }
    }

    /// Fault `k` ends.
    pub fn heal(&mut self, k: usize) {
        match self.sc.faults[k].clone() {
            Fault::MassLeave { .. } => {}
            Fault::Partition { .. } => {
                for i in 0..self.nodes.len() {
                    if self.nodes[i].cut {
                        self.rejoin(i);
                    }
                }
            }
            Fault::Slow { class, .. } => self.slow(&class, 1.0),
        }
    }

    fn slow(&mut self, class: &str, factor: f64) {
        let Some(c) = self.sc.classes.iter().position(|c| c.name == class) else {
            return;
        };
        for n in self.nodes.iter_mut().filter(|n| n.class == Some(c)) {
            n.slow = factor;
        }
    }

    /// Node `i` is cut off from the routers' side.
    fn cut_off(&mut self, i: usize) {
        if self.nodes[i].online {
            let held: Vec<u32> = self.nodes[i].held.keys().copied().collect();
            for s in held {
                self.count(i, s, false);
            }
            // Its heartbeats stop reaching the others.
            let session = self.nodes[i].session;
            let live_for = self.secs(self.sc.market.live_for_secs as f64);
            let dead = Event::Liveness {
                node: i,
                session,
                live: false,
            };
            self.queue.after(live_for, dead);
        }
        self.nodes[i].cut = true;
    }

    /// Node `i` reaches the routers' side again.
    fn rejoin(&mut self, i: usize) {
        self.nodes[i].cut = false;
        if !self.nodes[i].online {
            return;
        }
        self.announce(i);
    }

    /// Whether nodes `a` and `b` can reach each other now.
    pub fn reach(&self, a: usize, b: usize) -> bool {
        self.nodes[a].reaches(&self.nodes[b])
    }
}
