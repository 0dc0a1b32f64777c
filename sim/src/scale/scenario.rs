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
    /// Relayed transfers.
    #[serde(default)]
    pub network: Network,
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
}

impl Default for Seeders {
    fn default() -> Self {
        Self {
            count: 1,
            up_mbps: 1000.0,
            leave_after_hours: None,
        }
    }
}

/// Transfers between two nodes that cannot reach each other directly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Network {
    /// A transfer through a relay goes no faster than this, Mbit/s.
    pub relay_mbps: f64,
}

impl Default for Network {
    fn default() -> Self {
        Self { relay_mbps: 20.0 }
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
            {
                return bad(format!(
                    "class {:?}: share, capacity, rates and session_hours must be above 0, \
                     offline_hours at least 0, crash a fraction",
                    c.name
                ));
            }
        }
        Ok(())
    }
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
