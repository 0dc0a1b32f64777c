//! The node's configuration file (TOML), beneath environment variables and flags.
//!
//! ```toml
//! store = "/var/lib/moeswarm"
//! listen = ["/ip4/0.0.0.0/tcp/4001", "/ip4/0.0.0.0/udp/4001/quic-v1"]
//! bootstrap = ["/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW..."]
//! http = "127.0.0.1:8080"
//! relay_server = false
//! record_ttl_secs = 3600
//! capacity = "64GiB"
//! dispatch = "203.0.113.8:4433"          # serve dispatches here (QUIC)
//! via_relay = "12D3KooW...@203.0.113.7:4433"  # or be reached through this relay
//! relay_listen = "0.0.0.0:4433"          # with relay_server: the data-plane relay's address
//! ```
//!
//! A value given by flag (or its environment variable) wins over the file; the file wins over
//! the defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use libp2p::Multiaddr;
use serde::Deserialize;

use super::serve::ServeFault;
use super::service::NodeOptions;

/// Largest config file read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The file's settings; every one optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Data dir.
    pub store: Option<PathBuf>,
    /// libp2p listen addresses.
    pub listen: Option<Vec<String>>,
    /// Bootstrap addresses.
    pub bootstrap: Option<Vec<String>>,
    /// HTTP address.
    pub http: Option<SocketAddr>,
    /// Be a relay server.
    pub relay_server: Option<bool>,
    /// Lifetime of holdings records, in seconds.
    pub record_ttl_secs: Option<u64>,
    /// Bytes of blobs the node will hold, e.g. `"64GiB"`.
    pub capacity: Option<String>,
    /// Serve dispatches on this UDP address.
    pub dispatch: Option<SocketAddr>,
    /// Be reached through this relay: `PEERID@IP:PORT`.
    pub via_relay: Option<String>,
    /// Address of the data-plane relay (with `relay_server`).
    pub relay_listen: Option<SocketAddr>,
}

impl ConfigFile {
    /// Reads and parses `path`.
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
}

/// Settings given on the command line (flag or environment), before the file fills gaps.
#[derive(Debug, Clone, Default)]
pub struct CommandLine {
    /// `--store`.
    pub store: Option<PathBuf>,
    /// `--listen` (empty when not given).
    pub listen: Vec<String>,
    /// `--bootstrap` (empty when not given).
    pub bootstrap: Vec<String>,
    /// `--http`.
    pub http: Option<SocketAddr>,
    /// `--relay`.
    pub relay_server: bool,
    /// `--record-ttl-secs`.
    pub record_ttl_secs: Option<u64>,
    /// `--capacity`.
    pub capacity: Option<String>,
    /// `--dispatch`.
    pub dispatch: Option<SocketAddr>,
    /// `--via-relay`.
    pub via_relay: Option<String>,
    /// `--relay-listen`.
    pub relay_listen: Option<SocketAddr>,
}

/// Parses multiaddrs, naming the one that is wrong.
pub fn parse_addrs(what: &str, addrs: &[String]) -> Result<Vec<Multiaddr>> {
    addrs
        .iter()
        .map(|a| {
            a.parse::<Multiaddr>()
                .with_context(|| format!("{what} address {a:?} is not a multiaddr"))
        })
        .collect()
}

/// The node's options: command line over file over defaults.
pub fn resolve(cli: CommandLine, file: ConfigFile) -> Result<NodeOptions> {
    let data_dir = cli
        .store
        .or(file.store)
        .context("no store: give --store DIR (or MOESWARM_STORE, or `store` in the config)")?;
    let listen = if !cli.listen.is_empty() {
        cli.listen
    } else {
        file.listen.unwrap_or_else(|| {
            vec![
                "/ip4/0.0.0.0/tcp/0".into(),
                "/ip4/0.0.0.0/udp/0/quic-v1".into(),
            ]
        })
    };
    let bootstrap = if !cli.bootstrap.is_empty() {
        cli.bootstrap
    } else {
        file.bootstrap.unwrap_or_default()
    };
    let ttl = cli.record_ttl_secs.or(file.record_ttl_secs).unwrap_or(3600);
    if !(10..=moeswarm_protocol::holdings::MAX_TTL_SECS).contains(&ttl) {
        bail!(
            "record lifetime {ttl} s is outside 10..={} s",
            moeswarm_protocol::holdings::MAX_TTL_SECS
        );
    }
    let capacity = match cli.capacity.or(file.capacity) {
        Some(c) => crate::plan::parse_size(&c).with_context(|| format!("capacity {c:?}"))?,
        None => u64::MAX,
    };
    let via_relay = match cli.via_relay.or(file.via_relay) {
        Some(v) => Some(parse_relay(&v)?),
        None => None,
    };
    let relay_server = cli.relay_server || file.relay_server.unwrap_or(false);
    let data_plane = super::service::DataPlaneOptions {
        listen: cli.dispatch.or(file.dispatch),
        via_relay,
        relay_server: relay_server.then(|| {
            cli.relay_listen
                .or(file.relay_listen)
                .unwrap_or_else(|| "0.0.0.0:0".parse().expect("an address"))
        }),
        ..Default::default()
    };
    Ok(NodeOptions {
        capacity,
        data_dir,
        listen: parse_addrs("listen", &listen)?,
        bootstrap: parse_addrs("bootstrap", &bootstrap)?,
        http: cli.http.or(file.http),
        relay_server,
        record_ttl: Duration::from_secs(ttl),
        serve_fault: ServeFault::Honest,
        data_plane,
    })
}

/// Parses `PEERID@IP:PORT`, a relay's PeerId and data-plane address.
pub fn parse_relay(s: &str) -> Result<(moeswarm_relay::PeerId, SocketAddr)> {
    let (peer, addr) = s
        .split_once('@')
        .with_context(|| format!("relay {s:?}: want PEERID@IP:PORT"))?;
    Ok((
        peer.parse()
            .with_context(|| format!("relay {s:?}: {peer:?} is not a PeerId"))?,
        addr.parse()
            .with_context(|| format!("relay {s:?}: {addr:?} is not IP:PORT"))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let file: ConfigFile = toml::from_str(
            r#"
            store = "/from/file"
            listen = ["/ip4/127.0.0.1/tcp/4001"]
            http = "127.0.0.1:9000"
            record_ttl_secs = 600
            capacity = "2GiB"
            "#,
        )
        .unwrap();
        let cli = CommandLine {
            store: Some("/from/flag".into()),
            ..CommandLine::default()
        };
        let o = resolve(cli, file.clone()).unwrap();
        assert_eq!(o.data_dir, PathBuf::from("/from/flag"));
        assert_eq!(o.listen[0].to_string(), "/ip4/127.0.0.1/tcp/4001");
        assert_eq!(o.http, Some("127.0.0.1:9000".parse().unwrap()));
        assert_eq!(o.record_ttl, Duration::from_secs(600));
        assert_eq!(o.capacity, 2 << 30);
        let o = resolve(CommandLine::default(), ConfigFile::default());
        assert!(o.unwrap_err().to_string().contains("no store"));
    }

    #[test]
    fn bad_settings_are_named() {
        assert!(toml::from_str::<ConfigFile>("colour = 3").is_err());
        let cli = CommandLine {
            store: Some("/s".into()),
            bootstrap: vec!["not-an-addr".into()],
            ..CommandLine::default()
        };
        let e = resolve(cli, ConfigFile::default()).unwrap_err();
        assert!(format!("{e:#}").contains("not-an-addr"), "{e:#}");
        assert!(parse_relay("nobody@1.2.3.4:5").is_err());
        assert!(parse_relay("12D3KooWH1rTmNR3ozkdZkeRNpKLwBYfsX9MP9ZuZ9UcF7qob2Zi").is_err());
        let (_, a) =
            parse_relay("12D3KooWH1rTmNR3ozkdZkeRNpKLwBYfsX9MP9ZuZ9UcF7qob2Zi@127.0.0.1:9")
                .unwrap();
        assert_eq!(a.port(), 9);
    }
}
