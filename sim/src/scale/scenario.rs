//! What a scale simulation runs: the model's shape, the market's knobs, the seeders and the
//! classes of nodes, read from a TOML file (`sim/scenarios/`). Every field but the model and
//! the classes has a default; unknown fields are refused, so a misspelt knob is an error, not a
//! silent default.

use serde::{Deserialize, Serialize};

/// The default scenario: Qwen3.5-122B-A10B's 48 × 256 Q4_K slabs over servers, laptops and
/// phones (`sim/scenarios/qwen35-122b.toml`).
pub const DEFAULT: &str = include_str!("../../scenarios/qwen35-122b.toml");

/// A scale scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The model's shape.
    pub model: ModelShape,
    /// The market's knobs and the records' timing.
    #[serde(default)]
    pub market: Market,
    /// The nodes that hold the whole model from the start.
    #[serde(default)]
    pub seeders: Seeders,
    /// Latency between nodes, regions and relayed transfers.
    #[serde(default)]
    pub network: Network,
    /// Routers serving requests (none when absent).
    #[serde(default)]
    pub serving: Option<Serving>,
    /// Workers that answer wrong.
    #[serde(default)]
    pub liars: Liars,
    /// Faults on purpose, at set times.
    #[serde(default, rename = "fault")]
    pub faults: Vec<Fault>,
    /// The kinds of nodes, with their shares of the swarm.
    #[serde(rename = "class")]
    pub classes: Vec<Class>,
}

/// The model: `layers × experts` slabs of `slab_bytes` each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// MoE layers.
    pub layers: u32,
    /// Experts per layer.
    pub experts: u32,
    /// Bytes of one slab.
    pub slab_bytes: u64,
    /// Values of one activation row (the model's hidden size): what a dispatch carries per
    /// row each way, as f16.
    #[serde(default = "default_hidden")]
    pub hidden: u32,
}

fn default_hidden() -> u32 {
    3072
}

/// The market's knobs (those of [`moeswarm_market::choice::Policy`]) and the timing of rounds
/// and records, as the node has them by default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Market {
    /// Replicas every slab should have.
    pub target: usize,
    /// Seconds between a node's market rounds when idle (a quarter after a busy one), each
    /// wait jittered by ×0.5–1.5.
    pub round_secs: f64,
    /// Most slabs a node fetches a round.
    pub max_fetches: usize,
    /// Most swaps a round.
    pub max_swaps: usize,
    /// Seconds a slab is kept once fetched.
    pub min_hold_secs: u64,
    /// A swap needs the newcomer worth `1 + swap_gain` times the slab dropped.
    pub swap_gain: f64,
    /// A record reaches the other nodes this many seconds after it is published, drawn
    /// uniformly between the two.
    pub gossip_delay_secs: [f64; 2],
    /// Seconds a holdings record lives (republished at half of it).
    pub record_ttl_secs: u64,
    /// Seconds, by the others' clocks, a node counts as live after its last heartbeat.
    pub live_for_secs: u64,
    /// Seconds between heartbeats.
    pub heartbeat_secs: u64,
    /// Nodes first come up at a time drawn uniformly within this many seconds of the start.
    pub join_spread_secs: f64,
    /// Answer rounds without a look at every slab where that gives the same decision
    /// (`sim::scale::quick`); off, every round runs the market's choice over all of them
    /// (the same history, slower: for checking).
    pub quick_choice: bool,
}

impl Default for Market {
    fn default() -> Self {
        let p = moeswarm_market::choice::Policy::default();
        Self {
            target: p.target,
            round_secs: 10.0,
            max_fetches: p.max_fetches,
            max_swaps: p.max_swaps,
            min_hold_secs: p.min_hold_secs,
            swap_gain: p.swap_gain,
            gossip_delay_secs: [0.5, 5.0],
            record_ttl_secs: 3600,
            live_for_secs: moeswarm_protocol::heartbeat::LIVE_FOR_SECS,
            heartbeat_secs: moeswarm_protocol::heartbeat::HEARTBEAT_PERIOD_SECS,
            join_spread_secs: 300.0,
            quick_choice: true,
        }
    }
}

/// Nodes holding every slab from the start (whoever sliced and published the model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Seeders {
    /// How many.
    pub count: usize,
    /// Upload, Mbit/s.
    pub up_mbps: f64,
    /// Leave (cleanly) this many hours in; never when absent.
    pub leave_after_hours: Option<f64>,
    /// How fast they compute (they serve dispatches like any holder).
    pub compute: Compute,
    /// One-way latency to the internet, ms (drawn uniformly between the two).
    pub latency_ms: [f64; 2],
}

impl Default for Seeders {
    fn default() -> Self {
        Self {
            count: 1,
            up_mbps: 1000.0,
            leave_after_hours: None,
            compute: Compute {
                expert_ms: 0.15,
                row_ms: 0.05,
            },
            latency_ms: [2.0, 5.0],
        }
    }
}

/// How fast a node computes a dispatch: each expert of it costs `expert_ms` (reading its
/// weights: what one row costs), each further row of that expert `row_ms`. A node computes one
/// dispatch at a time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compute {
    /// One expert on one row, ms.
    pub expert_ms: f64,
    /// Each further row of an expert, ms.
    pub row_ms: f64,
}

impl Default for Compute {
    fn default() -> Self {
        Self {
            expert_ms: 0.6,
            row_ms: 0.3,
        }
    }
}

/// Workers that answer dispatches wrong, caught (or not) by the routers' checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Liars {
    /// Share of the market's nodes that lie.
    pub share: f64,
    /// Chance that a liar's answer to a dispatch is wrong.
    pub lie_rate: f64,
}

impl Default for Liars {
    fn default() -> Self {
        Self {
            share: 0.0,
            lie_rate: 1.0,
        }
    }
}

/// A fault on purpose.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// `share` of the market's online nodes leave within `within_secs` of `at_secs`, crashing
    /// (no goodbye) or cleanly.
    MassLeave {
        at_secs: f64,
        share: f64,
        within_secs: f64,
        #[serde(default)]
        crash: bool,
    },
    /// From `at_secs` for `for_secs`, the nodes in `regions` reach nobody outside them (nor
    /// the routers, which are in the first region): to the others they fall silent.
    Partition {
        at_secs: f64,
        for_secs: f64,
        regions: Vec<String>,
    },
    /// From `at_secs` for `for_secs`, the nodes of class `class` compute `factor` times slower
    /// (a phone that heats up, a laptop on battery).
    Slow {
        at_secs: f64,
        for_secs: f64,
        class: String,
        factor: f64,
    },
}

/// Where nodes are and how they reach each other. A round trip between two nodes is twice the
/// sum of their one-way latencies, plus `inter_region_ms` when their regions differ, plus
/// `relay_ms` when the way between them goes through a relay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Network {
    /// A transfer through a relay goes no faster than this, Mbit/s.
    pub relay_mbps: f64,
    /// What a relay adds to a round trip, ms.
    pub relay_ms: f64,
    /// The regions; every node is in one, drawn uniformly (seeders and routers in the first).
    pub regions: Vec<String>,
    /// What a round trip between two regions adds, ms.
    pub inter_region_ms: f64,
}

impl Default for Network {
    fn default() -> Self {
        Self {
            relay_mbps: 20.0,
            relay_ms: 20.0,
            regions: vec!["one".into()],
            inter_region_ms: 80.0,
        }
    }
}

/// Routers serving requests: each runs the trunk and, per token, dispatches each MoE layer's
/// rows to holders of the experts they route to, and waits for the slowest (see `serve`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Serving {
    /// Routers (each reached directly, in the first region).
    pub routers: usize,
    /// Requests reaching each router a minute (a Poisson process).
    pub requests_per_min: f64,
    /// Tokens of each request's prompt (one prefill step).
    pub prompt_tokens: u32,
    /// Tokens generated for each request.
    pub output_tokens: u32,
    /// Most sequences a router steps together (continuous batching; the rest wait).
    pub max_batch: usize,
    /// Experts each token is routed to in every layer.
    pub experts_per_token: u32,
    /// Skew of the routing: in every layer the experts, in an order drawn per layer, are chosen
    /// with weight `1 / rank^zipf` (0: uniform).
    pub zipf: f64,
    /// The router's own work per layer and step (attention, norms, the router itself), ms.
    pub trunk_ms: f64,
    /// ... and per row of the step, ms.
    pub trunk_row_ms: f64,
    /// Router links, Mbit/s.
    pub up_mbps: f64,
    /// See `up_mbps`.
    pub down_mbps: f64,
    /// The router's one-way latency to the internet, ms (drawn between the two).
    pub latency_ms: [f64; 2],
    /// A dispatch not answered within this many ms is given up and asked of another holder.
    pub deadline_ms: f64,
    /// Holders a dispatch is tried on before its sequences fail.
    pub tries: u32,
    /// Routers start taking requests this many seconds in (once the market has covered).
    pub start_secs: f64,
    /// Seconds between a router's demand records (and the window they count: 12 of them).
    pub demand_period_secs: u64,
    /// Lifetime of a demand record, seconds.
    pub demand_ttl_secs: u64,
    /// Share of a proven worker's dispatches a router checks (the rest of the market's
    /// `CheckPolicy` as the node has it: new workers on probation, checked always).
    pub check_rate: f64,
}

impl Default for Serving {
    fn default() -> Self {
        Self {
            routers: 2,
            requests_per_min: 0.5,
            prompt_tokens: 64,
            output_tokens: 64,
            max_batch: 8,
            experts_per_token: 8,
            zipf: 1.0,
            trunk_ms: 2.0,
            trunk_row_ms: 0.1,
            up_mbps: 100.0,
            down_mbps: 300.0,
            latency_ms: [5.0, 15.0],
            deadline_ms: 5000.0,
            tries: 3,
            start_secs: 900.0,
            demand_period_secs: 10,
            demand_ttl_secs: 300,
            check_rate: moeswarm_market::trust::CheckPolicy::default().rate,
        }
    }
}

/// How a node is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Nat {
    /// A public address.
    None,
    /// Behind a NAT that keeps one mapping per socket: hole punching reaches it.
    Cone,
    /// Behind a NAT with a mapping per destination: reached only through a relay.
    Symmetric,
}

/// One kind of node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    /// Its name in reports.
    pub name: String,
    /// Its share of the nodes (shares are weights: they need not add to 1).
    pub share: f64,
    /// Whether it is a phone (the market gives phones, and nodes reached only through a
    /// relay, cold slabs).
    #[serde(default)]
    pub phone: bool,
    /// Bytes it gives to slabs, in GB (10^9).
    pub capacity_gb: f64,
    /// Upload, Mbit/s.
    pub up_mbps: f64,
    /// Download, Mbit/s.
    pub down_mbps: f64,
    /// How it is reached.
    pub nat: Nat,
    /// Mean hours online in one session (exponentially distributed).
    pub session_hours: f64,
    /// Mean hours offline between sessions (exponentially distributed).
    pub offline_hours: f64,
    /// Share of sessions that end in a crash (the rest end cleanly).
    #[serde(default)]
    pub crash: f64,
    /// One-way latency to the internet, ms (drawn uniformly between the two per node).
    #[serde(default = "default_latency")]
    pub latency_ms: [f64; 2],
    /// How fast it computes.
    #[serde(default)]
    pub compute: Compute,
}

fn default_latency() -> [f64; 2] {
    [10.0, 40.0]
}

/// Why a scenario cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// Not TOML, or not this shape.
    #[error("scenario is not valid: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value out of its range.
    #[error("scenario: {0}")]
    Invalid(String),
}

impl Scenario {
    /// Reads a scenario from TOML text and checks its values.
    pub fn parse(text: &str) -> Result<Self, ScenarioError> {
        let s: Scenario = toml::from_str(text)?;
        s.check()?;
        Ok(s)
    }

    /// The default scenario ([`DEFAULT`]).
    pub fn default_scenario() -> Self {
        Self::parse(DEFAULT).expect("the default scenario is valid")
    }

    /// Slabs of the model.
    pub fn slabs(&self) -> usize {
        self.model.layers as usize * self.model.experts as usize
    }

    fn check(&self) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        let m = &self.model;
        if m.layers == 0 || m.experts == 0 || m.slab_bytes == 0 {
            return bad("the model needs layers, experts and slab_bytes above 0".into());
        }
        if m.experts > moeswarm_protocol::limits::MAX_EXPERTS
            || m.layers > moeswarm_protocol::limits::MAX_LAYERS
        {
            return bad(format!(
                "a model of {} layers × {} experts is beyond what records carry",
                m.layers, m.experts
            ));
        }
        let k = &self.market;
        let [lo, hi] = k.gossip_delay_secs;
        if k.target == 0 || k.max_fetches == 0 || !positive(k.round_secs) {
            return bad("market: target, max_fetches and round_secs must be above 0".into());
        }
        if !non_negative(lo) || !non_negative(hi - lo) || !non_negative(k.join_spread_secs) {
            return bad("market: gossip_delay_secs is [low, high] with 0 <= low <= high".into());
        }
        if k.record_ttl_secs < 2 || k.heartbeat_secs == 0 || k.live_for_secs < k.heartbeat_secs {
            return bad(
                "market: record_ttl_secs >= 2 and live_for_secs >= heartbeat_secs > 0".into(),
            );
        }
        if !positive(self.seeders.up_mbps) || !positive(self.network.relay_mbps) {
            return bad("seeders.up_mbps and network.relay_mbps must be above 0".into());
        }
        let n = &self.network;
        if n.regions.is_empty() || !non_negative(n.relay_ms) || !non_negative(n.inter_region_ms) {
            return bad(
                "network: at least one region; relay_ms, inter_region_ms at least 0".into(),
            );
        }
        let sd = &self.seeders;
        if !range(sd.latency_ms) || !compute(sd.compute) {
            return bad("seeders: latency_ms [low, high] at least 0, compute above 0".into());
        }
        if let Some(v) = &self.serving {
            v.check(m.experts)?;
        }
        let l = &self.liars;
        if !(0.0..=1.0).contains(&l.share) || !(0.0..=1.0).contains(&l.lie_rate) {
            return bad("liars: share and lie_rate are fractions".into());
        }
        for f in &self.faults {
            self.check_fault(f)?;
        }
        if self.classes.is_empty() {
            return bad("no [[class]] of nodes".into());
        }
        for c in &self.classes {
            let rates = [
                c.share,
                c.capacity_gb,
                c.up_mbps,
                c.down_mbps,
                c.session_hours,
            ];
            if !rates.iter().all(|&v| positive(v))
                || !non_negative(c.offline_hours)
                || !(0.0..=1.0).contains(&c.crash)
                || !range(c.latency_ms)
                || !compute(c.compute)
            {
                return bad(format!(
                    "class {:?}: share, capacity, rates, session_hours and compute must be \
                     above 0, offline_hours at least 0, crash a fraction, latency_ms \
                     [low, high] with 0 <= low <= high",
                    c.name
                ));
            }
        }
        Ok(())
    }
}

impl Scenario {
    fn check_fault(&self, f: &Fault) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        match f {
            Fault::MassLeave {
                at_secs,
                share,
                within_secs,
                ..
            } => {
                if !non_negative(*at_secs)
                    || !non_negative(*within_secs)
                    || !(0.0..=1.0).contains(share)
                {
                    return bad(
                        "fault mass_leave: at_secs, within_secs at least 0; share a fraction"
                            .into(),
                    );
                }
            }
            Fault::Partition {
                at_secs,
                for_secs,
                regions,
            } => {
                if !non_negative(*at_secs) || !non_negative(*for_secs) {
                    return bad("fault partition: at_secs and for_secs at least 0".into());
                }
                if let Some(r) = regions.iter().find(|r| !self.network.regions.contains(r)) {
                    return bad(format!(
                        "fault partition: no region {r:?} in [network] regions"
                    ));
                }
            }
            Fault::Slow {
                at_secs,
                for_secs,
                class,
                factor,
            } => {
                if !non_negative(*at_secs) || !non_negative(*for_secs) || !positive(*factor) {
                    return bad("fault slow: at_secs, for_secs at least 0, factor above 0".into());
                }
                if !self.classes.iter().any(|c| &c.name == class) {
                    return bad(format!("fault slow: no class {class:?}"));
                }
            }
        }
        Ok(())
    }
}

impl Serving {
    fn check(&self, experts: u32) -> Result<(), ScenarioError> {
        let ok = self.requests_per_min.is_finite()
            && self.requests_per_min >= 0.0
            && self.prompt_tokens >= 1
            && self.output_tokens >= 1
            && self.max_batch >= 1
            && (1..=experts).contains(&self.experts_per_token)
            && non_negative(self.zipf)
            && non_negative(self.trunk_ms)
            && non_negative(self.trunk_row_ms)
            && positive(self.up_mbps)
            && positive(self.down_mbps)
            && range(self.latency_ms)
            && positive(self.deadline_ms)
            && self.tries >= 1
            && non_negative(self.start_secs)
            && self.demand_period_secs >= 1
            && self.demand_ttl_secs >= self.demand_period_secs
            && (0.0..=1.0).contains(&self.check_rate);
        if ok {
            Ok(())
        } else {
            Err(ScenarioError::Invalid(format!(
                "serving: requests_per_min at least 0; prompt_tokens, output_tokens, max_batch, \
                 tries at least 1; experts_per_token 1 to {experts}; zipf, trunk times and \
                 start_secs at least 0; rates and deadline_ms above 0; latency_ms [low, high]; \
                 demand_ttl_secs >= demand_period_secs >= 1; check_rate a fraction"
            )))
        }
    }
}

/// `[low, high]` with 0 <= low <= high, finite.
fn range([lo, hi]: [f64; 2]) -> bool {
    non_negative(lo) && non_negative(hi - lo)
}

/// A compute speed that takes time.
fn compute(c: Compute) -> bool {
    positive(c.expert_ms) && non_negative(c.row_ms)
}

/// A finite number above 0.
fn positive(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// A finite number at least 0.
fn non_negative(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_scenario_is_the_real_models_shape() {
        let s = Scenario::default_scenario();
        assert_eq!((s.model.layers, s.model.experts), (48, 256));
        // Three matrices of 3072 × 1024 in Q4_K (144 bytes a block of 256).
        assert_eq!(s.model.slab_bytes, 3 * 3072 * 1024 / 256 * 144);
        assert_eq!(s.slabs(), 12_288);
    }

    #[test]
    fn a_misspelt_knob_or_a_value_out_of_range_is_refused_with_the_reason() {
        let base = DEFAULT.replace("[market]", "[market]\ntargte = 3");
        let e = Scenario::parse(&base).unwrap_err().to_string();
        assert!(e.contains("targte"), "{e}");
        let bad = DEFAULT.replacen("share = ", "share = -", 1);
        let e = Scenario::parse(&bad).unwrap_err().to_string();
        assert!(e.contains("share"), "{e}");
        let e = Scenario::parse("[model]\nlayers = 1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("experts"), "{e}");
    }
}
