//! The routers' checks of their workers' answers, against workers that lie.
//!
//! As the node does (`moeswarm_node::dataplane::remote::check`): whether a dispatch is checked
//! is the market's sampling rule ([`sampled`] at [`CheckRecord::check_rate`]: always while a
//! worker is on probation or after it was caught, at the policy's rate once proven), decided
//! per dispatch; a checked dispatch is re-computed on a uniform sample of its groups
//! ([`sample_groups`]) by another holder, asked at the same time; where the two disagree, the
//! router fetches the slab and computes it itself (what the node does when it holds no third
//! replica that could settle it), and whoever disagrees with it is caught
//! ([`CheckRecord::fail`]: quarantined, checked more afterwards). A caught worker's answer is
//! not used: its experts are asked of another holder. An unchecked wrong answer is used: it
//! reaches the user, and is counted.
//!
//! A lie is a whole dispatch answered wrong (with the scenario's lie rate); two wrong answers
//! never agree (liars do not collude here).

use moeswarm_market::trust::sample::sample_groups;
use moeswarm_market::trust::{sampled, CheckPolicy};
use rand::Rng;

use super::dispatch;
use super::scenario::Serving;
use super::world::World;

/// What a router made of one answer.
pub(super) struct Judged {
    /// When the router is done with it (the answer, and any second and third opinion).
    pub at: f64,
    /// The answer is used.
    pub used: bool,
    /// It was used and is wrong.
    pub wrong: bool,
}

/// The check policy of a run's routers.
pub(super) fn policy(sv: &Serving) -> CheckPolicy {
    CheckPolicy {
        rate: sv.check_rate,
        ..CheckPolicy::default()
    }
}

impl World {
    /// Router `r` judges node `j`'s answer to `slabs` (`rows` each), sent at `start` and in
    /// at `done`.
    pub(super) fn judge(
        &mut self,
        r: usize,
        j: usize,
        (slabs, rows): (&[u32], &[u32]),
        (start, done): (f64, f64),
        sv: &Serving,
    ) -> Judged {
        let lied = self.lies(j);
        let policy = policy(sv);
        let rate = self.routers[r].seen[j].checks.check_rate(&policy);
        if !sampled(rate, self.rng.random()) {
            if lied {
                self.serving.wrong_used += 1;
            }
            return Judged {
                at: done,
                used: true,
                wrong: lied,
            };
        }
        self.serving.checked += 1;
        let picked = sample_groups(slabs.len(), policy.groups as usize, self.rng.random());
        let mut at = done;
        let (mut worker_caught, mut agreed) = (false, true);
        for k in picked {
            let (slab, n) = (slabs[k], rows[k]);
            let second = self.choose(r, slab as usize, &[j], &Default::default());
            let opinion = second.and_then(|h| {
                let t = self.dispatch(r, h, &[slab], n, start, sv).ok()?;
                Some((h, t, !self.lies(h)))
            });
            let (h, t, right) = match opinion {
                Some(o) => (Some(o.0), o.1, o.2),
                // Nobody else answered: the router computes it itself.
                None => (None, start + self.referee_ms(r, n), true),
            };
            at = at.max(t);
            if right && !lied {
                continue;
            }
            agreed = false;
            // A disagreement with another holder: the router fetches the slab and computes it
            // (right). Where the router's own result was the second opinion, it already has.
            if h.is_some() {
                at = at.max(t + self.referee_ms(r, n));
            }
            if lied {
                worker_caught = true;
            }
            if let (Some(h), false) = (h, right) {
                self.convict(r, h, t, &policy);
            }
        }
        if worker_caught {
            self.convict(r, j, at, &policy);
        } else if agreed {
            self.routers[r].seen[j].checks.pass();
        }
        Judged {
            at,
            used: !worker_caught,
            wrong: false,
        }
    }

    /// Whether node `j` answers this dispatch wrong.
    fn lies(&mut self, j: usize) -> bool {
        self.nodes[j].liar && self.rng.random::<f64>() < self.sc.liars.lie_rate
    }

    /// Router `r` caught node `j` at `at` (ms).
    fn convict(&mut self, r: usize, j: usize, at: f64, policy: &CheckPolicy) {
        self.routers[r].seen[j].checks.fail(policy, at as u64);
        self.serving.caught += 1;
        let n = &mut self.nodes[j];
        if n.caught_ms.is_none() {
            n.caught_ms = Some(at);
        }
        if !n.liar {
            self.serving.honest_convicted += 1;
        }
    }

    /// What the router computing `rows` rows of one slab itself costs: fetching it (at its
    /// download rate) and computing it at a server's speed.
    fn referee_ms(&self, r: usize, rows: u32) -> f64 {
        let fetch = self.sc.model.slab_bytes as f64 / self.routers[r].end.down;
        fetch + dispatch::compute_ms(&self.sc.seeders.compute, 1, rows)
    }
}
