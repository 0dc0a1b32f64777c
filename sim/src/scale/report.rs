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
    /// Serving since the last sample (with routers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serving: Option<ServingSample>,
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
    /// Mass departures (faults).
    pub mass_leaves: u64,
}

/// The market's rounds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Rounds {
    /// Rounds in which a node ran the market's choice.
    pub decided: u64,
    /// Of them, rounds the quick choice answered (the others ran `decide` over every slab).
    pub quick: u64,
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
    /// What the routers did (with a `[serving]` section).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serving: Option<ServingReport>,
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
            "rounds: {} decided ({} by the quick choice), {} idle skipped; {} slabs fetched, {} dropped; {} events\n",
            r.decided, r.quick, r.skipped_idle, r.fetched, r.dropped, self.events
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
        if let Some(v) = &self.serving {
            s += &v.render();
            s += &serving_over_time(&self.samples, step);
        }
        if self.violations.is_empty() {
            s += "invariants: held\n";
        } else {
            s += &format!("invariants BROKEN: {}\n", self.violations.join("; "));
        }
        s
    }
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Failed {
    /// A slab it was routed to had no holder the router counted live.
    NoHolder,
    /// A dispatch failed on every holder tried (gone, refused, late).
    Dispatch,
}

/// What the routers did, as it accumulates.
#[derive(Debug, Clone, Default)]
pub struct ServeStats {
    pub arrived: u64,
    pub completed: u64,
    pub failed_no_holder: u64,
    pub failed_dispatch: u64,
    pub tokens: u64,
    /// Time between a sequence's tokens, ms.
    pub token_ms: Vec<f32>,
    /// Time from a request's arrival to its first token, ms.
    pub first_token_ms: Vec<f32>,
    /// Where `token_ms` stood at the last sample.
    pub sampled_tokens: usize,
    pub dispatches: u64,
    pub gone: u64,
    pub not_held: u64,
    pub late: u64,
    /// Dispatches checked; workers caught (a liar, or an honest one wrongly); wrong answers
    /// used unchecked; requests completed with one.
    pub checked: u64,
    pub caught: u64,
    pub honest_convicted: u64,
    pub wrong_used: u64,
    pub completed_wrong: u64,
}

impl ServeStats {
    /// A request failed.
    pub fn failed(&mut self, why: Failed) {
        match why {
            Failed::NoHolder => self.failed_no_holder += 1,
            Failed::Dispatch => self.failed_dispatch += 1,
        }
    }
}

/// Percentiles of a set of times, ms.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub count: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    /// Of `v` (nearest rank; all zero when empty).
    pub fn of(v: &[f32]) -> Self {
        let mut s = v.to_vec();
        s.sort_by(f32::total_cmp);
        let at = |q: f64| {
            if s.is_empty() {
                return 0.0;
            }
            let k = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1;
            s[k] as f64
        };
        Self {
            count: s.len(),
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

/// Serving over one sampling interval.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ServingSample {
    /// Tokens a second of each router over the interval.
    pub tokens_per_sec: Vec<f64>,
    /// Time between tokens over the interval.
    pub token_ms: Percentiles,
}

/// Serving over a whole run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ServingReport {
    /// Routers.
    pub routers: usize,
    /// Requests that arrived.
    pub requests: u64,
    /// Requests that got all their tokens.
    pub completed: u64,
    /// Requests that failed because a slab had no live holder.
    pub failed_no_holder: u64,
    /// Requests that failed because a dispatch failed on every holder tried.
    pub failed_dispatch: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Tokens a second of each router, over the time routers were serving.
    pub tokens_per_sec: Vec<f64>,
    /// Time between a sequence's tokens.
    pub token_ms: Percentiles,
    /// Time from a request's arrival to its first token.
    pub first_token_ms: Percentiles,
    /// Dispatches sent.
    pub dispatches: u64,
    /// Dispatches to a holder that had gone (no answer within the deadline).
    pub dispatch_gone: u64,
    /// Dispatches refused: the holder no longer held a slab its record named.
    pub dispatch_not_held: u64,
    /// Dispatches whose answer would have come after the deadline.
    pub dispatch_late: u64,
    /// Online holders of a slab at the end, on average over each quarter of the experts by
    /// how often the routing picks them (hottest quarter first): what demand did to
    /// placement.
    pub replicas_by_rank: Vec<f64>,
    /// What the checks did.
    pub checks: CheckSummary,
}

/// The routers' checks, and the liars.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CheckSummary {
    /// Dispatches checked.
    pub checked: u64,
    /// Times a router caught a worker.
    pub caught: u64,
    /// Times an honest worker was caught (never expected).
    pub honest_caught: u64,
    /// Wrong answers used (unchecked), and requests completed with one.
    pub wrong_answers_used: u64,
    pub requests_answered_wrong: u64,
    /// Liars among the nodes; those sent at least one dispatch; those caught by some router.
    pub liars: usize,
    pub liars_dispatched: usize,
    pub liars_caught: usize,
    /// The longest time from a caught liar's first dispatch to its first catch, ms.
    pub worst_time_to_catch_ms: f64,
}

impl ServingReport {
    /// The serving lines of the report for people.
    pub fn render(&self) -> String {
        let p = |x: &Percentiles| {
            format!(
                "p50 {:.0} ms, p90 {:.0}, p99 {:.0}, max {:.0} (of {})",
                x.p50, x.p90, x.p99, x.max, x.count
            )
        };
        let rates: Vec<String> = self
            .tokens_per_sec
            .iter()
            .map(|t| format!("{t:.2}"))
            .collect();
        let mut s = format!(
            "serving: {} routers, {} requests: {} completed, {} failed (no live holder {}, \
             dispatch failed everywhere {}); {} tokens, tokens/s per router {}\n",
            self.routers,
            self.requests,
            self.completed,
            self.failed_no_holder + self.failed_dispatch,
            self.failed_no_holder,
            self.failed_dispatch,
            self.tokens,
            rates.join(", ")
        );
        s += &format!("  time between tokens: {}\n", p(&self.token_ms));
        s += &format!("  time to first token: {}\n", p(&self.first_token_ms));
        s += &format!(
            "  {} dispatches: {} to a holder gone, {} refused (slab dropped), {} late\n",
            self.dispatches, self.dispatch_gone, self.dispatch_not_held, self.dispatch_late
        );
        let c = &self.checks;
        s +=
            &format!(
            "  checks: {} dispatches checked, {} catches ({} of honest workers); {} wrong answers \
             used, {} requests answered wrong; liars {}: {} sent work, {} caught, within {:.0} ms \
             of their first dispatch at worst\n",
            c.checked, c.caught, c.honest_caught, c.wrong_answers_used, c.requests_answered_wrong,
            c.liars, c.liars_dispatched, c.liars_caught, c.worst_time_to_catch_ms
        );
        let q: Vec<String> = self
            .replicas_by_rank
            .iter()
            .map(|r| format!("{r:.1}"))
            .collect();
        s += &format!(
            "  replicas per slab by how hot its expert is (quarters, hottest first): {}\n",
            q.join(", ")
        );
        s
    }
}

/// Serving sample by sample (every `step`th): tokens a second per router, time between tokens.
fn serving_over_time(samples: &[Sample], step: usize) -> String {
    let mut s = "      time   tokens/s per router        between tokens p50 / p99 ms (each over the interval before)\n".to_string();
    for x in samples.iter().step_by(step) {
        let Some(v) = &x.serving else {
            continue;
        };
        let rates: Vec<String> = v.tokens_per_sec.iter().map(|t| format!("{t:.2}")).collect();
        s += &format!(
            "  {:>7.0} s   {:<24} {:>8.0} / {:.0}\n",
            x.secs,
            rates.join(" "),
            v.token_ms.p50,
            v.token_ms.p99
        );
    }
    s
}
