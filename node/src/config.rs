//! The node's settings: flags, over environment variables, over a TOML file, over defaults.
//!
//! One type, [`NodeSettings`], is at once the `moeswarm node` flags (clap, each with its
//! `MOESWARM_*` environment variable) and the config file (serde):
//!
//! ```toml
//! store = "/var/lib/moeswarm"
//! listen = ["/ip4/0.0.0.0/tcp/4001", "/ip4/0.0.0.0/udp/4001/quic-v1"]
//! bootstrap = ["/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW..."]
//! http = "127.0.0.1:8080"
//! relay_server = false
//! record_ttl_secs = 3600
//! capacity = "64GiB"                    # take part in the market with this much
//! models = ["<model id>"]                # only these models (default: all announced)
//! no_auto = false                        # true: serve only what is in the store
//! phone = false                          # a phone: takes cold slabs
//! market_round_secs = 10
//! min_hold_secs = 300
//! dispatch = "203.0.113.8:4433"          # serve dispatches here (QUIC)
//! via_relay = "12D3KooW...@203.0.113.7:4433"  # or be reached through this relay
//! relay_listen = "0.0.0.0:4433"          # with relay_server: the data-plane relay's address
//! ```
//!
//! [`NodeSettings::over`] merges two layers (a value given in the upper one wins);
//! [`NodeSettings::resolve`] reads the config file it names, merges, applies the defaults and
//! checks the result, naming what is wrong.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::error::{bail, Context, Result};
use libp2p::Multiaddr;
use moeswarm_model::ByteSize;
use serde::Deserialize;

use crate::auto::AutoOptions;
#[cfg(feature = "test-faults")]
use crate::net::serve::ServeFault;
use crate::node::{DataPlaneOptions, NodeOptions};
use moeswarm_protocol::ModelId;

/// Largest config file read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Default lifetime of the signed holdings records, in seconds.
const DEFAULT_TTL_SECS: u64 = 3600;

/// A relay's data plane, written `PEERID@IP:PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayTarget {
    /// The relay's PeerId (its certificate is pinned to it).
    pub peer: moeswarm_relay::PeerId,
    /// Its data-plane UDP address.
    pub addr: SocketAddr,
}

impl FromStr for RelayTarget {
    type Err = crate::error::Error;

    fn from_str(s: &str) -> Result<Self> {
        let (peer, addr) = s
            .split_once('@')
            .with_context(|| format!("relay {s:?}: want PEERID@IP:PORT"))?;
        Ok(Self {
            peer: peer
                .parse()
                .ok()
                .with_context(|| format!("relay {s:?}: {peer:?} is not a PeerId"))?,
            addr: addr
                .parse()
                .ok()
                .with_context(|| format!("relay {s:?}: {addr:?} is not IP:PORT"))?,
        })
    }
}

impl fmt::Display for RelayTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.peer, self.addr)
    }
}

/// Deserializes any `FromStr` type from its text (multiaddrs, sizes, relay targets).
fn from_text<'de, D: serde::Deserializer<'de>, T: FromStr>(d: D) -> Result<Option<T>, D::Error>
where
    T::Err: fmt::Display,
{
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) => s.parse().map(Some).map_err(serde::de::Error::custom),
    }
}

/// Deserializes a list of `FromStr` values from their texts.
fn list_from_text<'de, D: serde::Deserializer<'de>, T: FromStr>(d: D) -> Result<Vec<T>, D::Error>
where
    T::Err: fmt::Display,
{
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| s.parse().map_err(serde::de::Error::custom))
        .collect()
}

/// Every setting of a node, each optional: the `moeswarm node` flags and the config file.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSettings {
    /// Data dir: the store and the node's key.
    #[arg(long, env = "MOESWARM_STORE")]
    pub store: Option<PathBuf>,
    /// libp2p listen address (repeatable; default: all interfaces, TCP and QUIC, free ports).
    #[arg(long, env = "MOESWARM_LISTEN", value_delimiter = ',')]
    #[serde(default, deserialize_with = "list_from_text")]
    pub listen: Vec<Multiaddr>,
    /// Address of a node to join through, ending in /p2p/<peer id> (repeatable; none: start
    /// a new swarm).
    #[arg(long, env = "MOESWARM_BOOTSTRAP", value_delimiter = ',')]
    #[serde(default, deserialize_with = "list_from_text")]
    pub bootstrap: Vec<Multiaddr>,
    /// Serve blobs over HTTP on this address, e.g. 127.0.0.1:8080.
    #[arg(long, env = "MOESWARM_HTTP")]
    pub http: Option<SocketAddr>,
    /// Also be a relay for nodes that cannot accept connections: a libp2p relay server, and
    /// a data-plane relay (on --relay-listen).
    #[arg(long = "relay")]
    #[serde(default)]
    pub relay_server: bool,
    /// Lifetime of the signed holdings records, in seconds.
    #[arg(long, env = "MOESWARM_RECORD_TTL_SECS")]
    pub record_ttl_secs: Option<u64>,
    /// Bytes of blobs this node will hold, e.g. 64GiB (advertised as free capacity). With a
    /// capacity the node takes part in the market: it chooses, fetches and serves slabs by
    /// itself (unless --no-auto).
    #[arg(long, env = "MOESWARM_CAPACITY")]
    #[serde(default, deserialize_with = "from_text")]
    pub capacity: Option<ByteSize>,
    /// Take part only in this model (repeatable; default: every model the peers serve).
    #[arg(long = "model", env = "MOESWARM_MODELS", value_delimiter = ',')]
    #[serde(default, deserialize_with = "list_from_text")]
    pub models: Vec<ModelId>,
    /// Serve only what is in the store: choose and fetch nothing.
    #[arg(long)]
    #[serde(default)]
    pub no_auto: bool,
    /// This node is a phone (slow, sleeps): in the market it takes cold slabs.
    #[arg(long)]
    #[serde(default)]
    pub phone: bool,
    /// Seconds between the node's market rounds.
    #[arg(long, env = "MOESWARM_MARKET_ROUND_SECS")]
    pub market_round_secs: Option<u64>,
    /// Seconds a fetched slab is kept before the market may swap it out.
    #[arg(long, env = "MOESWARM_MIN_HOLD_SECS")]
    pub min_hold_secs: Option<u64>,
    /// Serve dispatches for the held slabs on this UDP address (QUIC), e.g. 203.0.113.8:4433;
    /// it is advertised as is, or as this host's interface addresses for 0.0.0.0:PORT.
    #[arg(long, env = "MOESWARM_DISPATCH")]
    pub dispatch: Option<SocketAddr>,
    /// Serve dispatches through a relay instead (for nodes that cannot accept
    /// connections): PEERID@IP:PORT of the relay's data plane.
    #[arg(long, env = "MOESWARM_VIA_RELAY")]
    #[serde(default, deserialize_with = "from_text")]
    pub via_relay: Option<RelayTarget>,
    /// With --relay: the UDP address of the data-plane relay.
    #[arg(long, env = "MOESWARM_RELAY_LISTEN")]
    pub relay_listen: Option<SocketAddr>,
    /// A TOML config file (flags and environment win over it).
    #[arg(long, env = "MOESWARM_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Tests only (built with the `test-faults` feature): answer dispatches wrongly, as
    /// KIND[:RATE]: wrong-values, nan (RATE a fraction, default 1), never-read, freeze,
    /// wrong-ticket, wrong-shape, answer-twice, stall:SECONDS, slow:SECONDS.
    #[cfg(feature = "test-faults")]
    #[arg(long, value_parser = crate::faults::WorkerFault::parse)]
    #[serde(skip)]
    pub misbehave: Option<crate::faults::WorkerFault>,
    /// Tests only (built with the `test-faults` feature): read the clock this many seconds
    /// off (negative: behind).
    #[cfg(feature = "test-faults")]
    #[arg(long, allow_hyphen_values = true)]
    #[serde(skip)]
    pub clock_skew_secs: Option<i64>,
}

impl NodeSettings {
    /// Reads and parses a config file.
    pub fn read(path: &Path) -> Result<Self> {
        let len = std::fs::metadata(path)
            .with_context(|| format!("reading config {}", path.display()))?
            .len();
        if len > MAX_CONFIG_BYTES {
            bail!(
                "config {} is {len} bytes: over the limit of {MAX_CONFIG_BYTES}",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
    }

    /// These settings over `lower`: each value given here wins, the rest comes from `lower`.
    pub fn over(self, lower: NodeSettings) -> NodeSettings {
        fn list<T>(upper: Vec<T>, lower: Vec<T>) -> Vec<T> {
            if upper.is_empty() {
                lower
            } else {
                upper
            }
        }
        NodeSettings {
            store: self.store.or(lower.store),
            listen: list(self.listen, lower.listen),
            bootstrap: list(self.bootstrap, lower.bootstrap),
            http: self.http.or(lower.http),
            relay_server: self.relay_server || lower.relay_server,
            record_ttl_secs: self.record_ttl_secs.or(lower.record_ttl_secs),
            capacity: self.capacity.or(lower.capacity),
            models: list(self.models, lower.models),
            no_auto: self.no_auto || lower.no_auto,
            phone: self.phone || lower.phone,
            market_round_secs: self.market_round_secs.or(lower.market_round_secs),
            min_hold_secs: self.min_hold_secs.or(lower.min_hold_secs),
            dispatch: self.dispatch.or(lower.dispatch),
            via_relay: self.via_relay.or(lower.via_relay),
            relay_listen: self.relay_listen.or(lower.relay_listen),
            config: self.config.or(lower.config),
            #[cfg(feature = "test-faults")]
            misbehave: self.misbehave.or(lower.misbehave),
            #[cfg(feature = "test-faults")]
            clock_skew_secs: self.clock_skew_secs.or(lower.clock_skew_secs),
        }
    }

    /// The node's options: these settings over their config file (if they name one) over the
    /// defaults, checked.
    pub fn resolve(self) -> Result<NodeOptions> {
        let merged = match &self.config {
            Some(f) => {
                let file = Self::read(f)?;
                self.over(file)
            }
            None => self,
        };
        merged.into_options()
    }

    /// The options from these settings alone (no file read), with the defaults filled in.
    pub fn into_options(self) -> Result<NodeOptions> {
        let data_dir = self
            .store
            .context("no store: give --store DIR (or MOESWARM_STORE, or `store` in the config)")?;
        let listen = if self.listen.is_empty() {
            vec![
                "/ip4/0.0.0.0/tcp/0".parse()?,
                "/ip4/0.0.0.0/udp/0/quic-v1".parse()?,
            ]
        } else {
            self.listen
        };
        // A test's skewed clock is the process's: set once, here, before anything reads it.
        #[cfg(feature = "test-faults")]
        if let Some(s) = self.clock_skew_secs {
            crate::faults::set_clock_skew_secs(s);
        }
        let ttl = self.record_ttl_secs.unwrap_or(DEFAULT_TTL_SECS);
        let max_ttl = moeswarm_protocol::holdings::MAX_TTL_SECS;
        if !(10..=max_ttl).contains(&ttl) {
            bail!("record lifetime {ttl} s is outside 10..={max_ttl} s");
        }
        let data_plane = DataPlaneOptions {
            listen: self.dispatch,
            via_relay: self.via_relay.map(|r| (r.peer, r.addr)),
            relay_server: self.relay_server.then(|| {
                self.relay_listen
                    .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)))
            }),
            #[cfg(feature = "test-faults")]
            fault: self.misbehave.unwrap_or_default(),
            ..Default::default()
        };
        let round = self.market_round_secs.unwrap_or(10);
        if !(1..=3600).contains(&round) {
            bail!("market round of {round} s is outside 1..=3600 s");
        }
        let auto = (self.capacity.is_some() && !self.no_auto).then(|| {
            let mut a = AutoOptions {
                models: self.models.clone(),
                round: Duration::from_secs(round),
                ..AutoOptions::default()
            };
            if let Some(h) = self.min_hold_secs {
                a.policy.min_hold_secs = h;
            }
            a
        });
        Ok(NodeOptions {
            capacity: self.capacity.map_or(u64::MAX, |c| c.0),
            advertise: true,
            phone: self.phone,
            auto,
            data_dir,
            listen,
            bootstrap: self.bootstrap,
            http: self.http,
            relay_server: self.relay_server,
            record_ttl: Duration::from_secs(ttl),
            #[cfg(feature = "test-faults")]
            serve_fault: ServeFault::Honest,
            data_plane,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        settings: NodeSettings,
    }

    fn flags(args: &[&str]) -> Result<NodeSettings, clap::Error> {
        let mut all = vec!["node"];
        all.extend_from_slice(args);
        Flags::try_parse_from(all).map(|f| f.settings)
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let file: NodeSettings = toml::from_str(
            r#"
            store = "/from/file"
            listen = ["/ip4/127.0.0.1/tcp/4001"]
            http = "127.0.0.1:9000"
            record_ttl_secs = 600
            capacity = "2GiB"
            "#,
        )
        .unwrap();
        let o = flags(&["--store", "/from/flag"])
            .unwrap()
            .over(file.clone())
            .into_options()
            .unwrap();
        assert_eq!(o.data_dir, PathBuf::from("/from/flag"));
        assert_eq!(o.listen[0].to_string(), "/ip4/127.0.0.1/tcp/4001");
        assert_eq!(o.http, Some("127.0.0.1:9000".parse().unwrap()));
        assert_eq!(o.record_ttl, Duration::from_secs(600));
        assert_eq!(o.capacity, 2 << 30);
        let o = flags(&["--capacity", "1GiB", "--record-ttl-secs", "60"])
            .unwrap()
            .over(file)
            .into_options()
            .unwrap();
        assert_eq!((o.capacity, o.record_ttl.as_secs()), (1 << 30, 60));
        assert!(
            o.auto.is_some(),
            "a capacity means taking part in the market"
        );
        let o = flags(&["--store", "/s", "--capacity", "1GiB", "--no-auto"])
            .unwrap()
            .into_options()
            .unwrap();
        assert!(o.auto.is_none());
        let o = flags(&["--store", "/s"]).unwrap().into_options().unwrap();
        assert!(o.auto.is_none(), "no capacity: serve the store only");
        let o = NodeSettings::default().into_options();
        assert!(o.unwrap_err().to_string().contains("no store"));
    }

    #[test]
    fn a_config_file_named_by_flag_is_read_beneath_the_flags() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        std::fs::write(&file, "store = \"/from/file\"\nrelay_server = true\n").unwrap();
        let o = flags(&["--config", file.to_str().unwrap(), "--http", "127.0.0.1:1"])
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(o.data_dir, PathBuf::from("/from/file"));
        assert!(o.relay_server && o.data_plane.relay_server.is_some());
        assert_eq!(o.http, Some("127.0.0.1:1".parse().unwrap()));
    }

    #[test]
    fn bad_settings_are_named() {
        assert!(toml::from_str::<NodeSettings>("colour = 3").is_err());
        let e = toml::from_str::<NodeSettings>("capacity = \"3 parsecs\"").unwrap_err();
        assert!(e.to_string().contains("parsecs"), "{e}");
        let e = flags(&["--bootstrap", "not-an-addr"]).err().unwrap();
        assert!(e.to_string().contains("not-an-addr"), "{e}");
        let e = flags(&["--capacity", "lots"]).err().unwrap();
        assert!(e.to_string().contains("not a number"), "{e}");
        let e = flags(&["--store", "/s", "--record-ttl-secs", "1"])
            .unwrap()
            .into_options()
            .unwrap_err();
        assert!(e.to_string().contains("record lifetime"), "{e}");
        assert!("nobody@1.2.3.4:5".parse::<RelayTarget>().is_err());
        assert!("12D3KooWH1rTmNR3ozkdZkeRNpKLwBYfsX9MP9ZuZ9UcF7qob2Zi"
            .parse::<RelayTarget>()
            .is_err());
        let r: RelayTarget = "12D3KooWH1rTmNR3ozkdZkeRNpKLwBYfsX9MP9ZuZ9UcF7qob2Zi@127.0.0.1:9"
            .parse()
            .unwrap();
        assert_eq!(r.addr.port(), 9);
    }
}
