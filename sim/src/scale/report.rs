//! What a scale simulation reports: coverage over time, when it was first full, bytes moved,
//! churn handled, invariants broken; as JSON (byte-identical for one seed) or as text.

use serde::Serialize;

/// Coverage at one moment.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Sample {
    /// Simulated seconds since the start.
    pub secs: f64,
    /// Nodes online (seeders included).
    pub online: usize,
    /// Slabs held by at least one online node.
    pub at_least_one: usize,
    /// Slabs held by at least `target` online nodes.
    pub at_target: usize,
    /// The same two counting the market's nodes only (not the seeders).
    pub swarm_at_least_one: usize,
    /// See `swarm_at_least_one`.
    pub swarm_at_target: usize,
    /// Bytes moved so far.
    pub bytes_moved: u64,
}

/// How one class of nodes ended.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClassSummary {
    /// Its name.
    pub name: String,
    /// Nodes of it.
    pub nodes: usize,
    /// Online at the end.
    pub online: usize,
    /// Bytes its nodes hold over the bytes they offer, at the end.
    pub fill: f64,
}

/// Sessions begun and ended, and what leaving cost.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Churn {
    /// Sessions begun (first joins included).
    pub joins: u64,
    /// Sessions ended with a goodbye (records withdrawn).
    pub clean_leaves: u64,
    /// Sessions ended without one (counted dead after the heartbeats stop).
    pub crashes: u64,
    /// Transfers cut off because one end left.
    pub transfers_cut: u64,
    /// Fetches the market chose for which no live holder was to be found.
    pub fetches_without_source: u64,
}

/// The market's rounds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Rounds {
    /// Rounds in which a node ran the market's choice.
    pub decided: u64,
    /// Rounds known to find nothing to do without deciding (nothing it sees changed since
    /// its last idle round).
    pub skipped_idle: u64,
    /// Slabs fetched.
    pub fetched: u64,
    /// Slabs dropped.
    pub dropped: u64,
}

/// A whole run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ScaleReport {
    /// The seed.
    pub seed: u64,
    /// Market nodes (seeders not counted).
    pub nodes: usize,
    /// Seeders.
    pub seeders: usize,
    /// Simulated hours.
    pub hours: f64,
    /// Slabs of the model.
    pub slabs: usize,
    /// The replica target.
    pub target: usize,
    /// Seconds until every slab was held by `target` online nodes (seeders included); `None`
    /// if never.
    pub full_at_target_secs: Option<f64>,
    /// Seconds until 99 % of the slabs were held by `target` online nodes (seeders counted):
    /// with churn, the last few are often short for a while as their holders leave.
    pub at_target_99_secs: Option<f64>,
    /// Seconds until every slab was held by some online market node (no seeder needed).
    pub swarm_full_secs: Option<f64>,
    /// Seconds until every slab was held by `target` online market nodes.
    pub swarm_full_at_target_secs: Option<f64>,
    /// After it was first full at target: the seconds spent short of it, and the fewest slabs
    /// at target in that time.
    pub short_after_full_secs: f64,
    /// See `short_after_full_secs`.
    pub fewest_at_target_after_full: Option<usize>,
    /// Bytes moved between nodes.
    pub bytes_moved: u64,
    /// Sessions and what leaving cost.
    pub churn: Churn,
    /// The market's rounds.
    pub rounds: Rounds,
    /// Per class, at the end.
    pub classes: Vec<ClassSummary>,
    /// Coverage over time.
    pub samples: Vec<Sample>,
    /// Events processed.
    pub events: u64,
    /// Invariants broken (none expected): a node over its capacity, or advertising a slab it
    /// does not hold. The first few, described.
    pub violations: Vec<String>,
}

impl ScaleReport {
    /// The report for people.
    pub fn render(&self) -> String {
        let t = |s: Option<f64>| s.map_or("never".to_string(), |s| format!("{:.0} s", s));
        let gb = |b: u64| b as f64 / 1e9;
        let mut s = format!(
            "scale simulation: {} nodes and {} seeder(s), {} slabs at target {}, {:.1} h, seed {}\n",
            self.nodes, self.seeders, self.slabs, self.target, self.hours, self.seed
        );
        s += &format!(
            "full coverage at target: {} (seeders counted); the swarm alone: every slab {}, at target {}\n",
            t(self.full_at_target_secs),
            t(self.swarm_full_secs),
            t(self.swarm_full_at_target_secs)
        );
        s += &format!(
            "99 % of the slabs at target: {}\n",
            t(self.at_target_99_secs)
        );
        s += &format!(
            "after full: {:.0} s short of target, fewest slabs at target {}\n",
            self.short_after_full_secs,
            self.fewest_at_target_after_full
                .map_or("-".into(), |n| n.to_string())
        );
        let c = &self.churn;
        s += &format!(
            "moved {:.1} GB; churn: {} joins, {} clean leaves, {} crashes, {} transfers cut, {} fetches without a live source\n",
            gb(self.bytes_moved), c.joins, c.clean_leaves, c.crashes, c.transfers_cut, c.fetches_without_source
        );
        let r = &self.rounds;
        s += &format!(
            "rounds: {} decided, {} idle skipped; {} slabs fetched, {} dropped; {} events\n",
            r.decided, r.skipped_idle, r.fetched, r.dropped, self.events
        );
        for k in &self.classes {
            s += &format!(
                "  {:<10} {:>6} nodes, {:>6} online at the end, {:>5.1} % full\n",
                k.name,
                k.nodes,
                k.online,
                100.0 * k.fill
            );
        }
        let step = (self.samples.len() / 12).max(1);
        s += "      time   online   >=1    >=target   swarm >=1   swarm >=target\n";
        for x in self.samples.iter().step_by(step) {
            s += &format!(
                "  {:>7.0} s {:>7} {:>7} {:>9} {:>11} {:>14}\n",
                x.secs,
                x.online,
                x.at_least_one,
                x.at_target,
                x.swarm_at_least_one,
                x.swarm_at_target
            );
        }
        if self.violations.is_empty() {
            s += "invariants: held\n";
        } else {
            s += &format!("invariants BROKEN: {}\n", self.violations.join("; "));
        }
        s
    }
}
