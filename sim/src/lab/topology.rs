//! A lab scenario (hosts, their NATs, their links) and the network built from it.
//!
//! One namespace, `wan`, is the internet: it routes between every host's link. A public host
//! sits directly on its link (address `10.202.i.2`, the wan side `10.202.i.1`). A host behind a
//! NAT sits in its own namespace on a private veth (`192.168.i.2`) behind a gateway namespace
//! whose link to the wan carries the public address and which translates with nftables:
//! `cone` masquerades keeping the port where it can, one mapping per inside address and port
//! whatever the destination (endpoint-independent mapping, as a home router), `symmetric`
//! with `random` ports (a new mapping per destination, as a third of mobile carriers). Linux
//! conntrack admits only answers to what went out, on either kind (address-and-port-dependent
//! filtering). Each host's link is shaped by the link emulator ([`super::link`]), both ways.

use std::net::Ipv4Addr;

use serde::Deserialize;

use super::link::{End, Link, Shape};
use super::netns::Namespace;
use super::LabError;

/// Most hosts a scenario may have.
pub const MAX_HOSTS: usize = 64;

/// How a host reaches the internet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Nat {
    /// A public address.
    #[default]
    None,
    /// Behind an endpoint-independent mapping ("full cone" mapping).
    Cone,
    /// Behind an address-and-port-dependent mapping ("symmetric").
    Symmetric,
}

/// One host of a scenario.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Its name (letters, digits and dashes, at most 12).
    pub name: String,
    /// Its NAT.
    #[serde(default)]
    pub nat: Nat,
    /// Its link to the internet, shaped the same both ways unless `up` is given.
    #[serde(default)]
    pub link: Shape,
    /// The host-to-internet direction, when it differs (an uplink slower than the downlink).
    #[serde(default)]
    pub up: Option<Shape>,
}

/// A scenario: `[[host]]` tables.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The hosts.
    #[serde(default)]
    pub host: Vec<HostSpec>,
}

impl Scenario {
    /// Parses and checks a scenario's TOML.
    pub fn parse(text: &str) -> Result<Self, LabError> {
        let s: Scenario = toml::from_str(text).map_err(|e| LabError::Scenario(e.to_string()))?;
        s.validate()?;
        Ok(s)
    }

    fn validate(&self) -> Result<(), LabError> {
        if self.host.is_empty() || self.host.len() > MAX_HOSTS {
            return Err(LabError::Scenario(format!(
                "{} hosts: a scenario has 1 to {MAX_HOSTS}",
                self.host.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for h in &self.host {
            let ok = !h.name.is_empty()
                && h.name.len() <= 12
                && h.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-');
            if !ok {
                return Err(LabError::Scenario(format!(
                    "host name {:?}: 1-12 letters, digits or dashes",
                    h.name
                )));
            }
            if !seen.insert(&h.name) {
                return Err(LabError::Scenario(format!("two hosts named {}", h.name)));
            }
            h.link.validate()?;
            if let Some(up) = &h.up {
                up.validate()?;
            }
        }
        Ok(())
    }
}

/// A host as built. Its link goes first when dropped, then its namespaces.
pub struct Host {
    /// Its link to the internet.
    pub link: Link,
    /// Its name in the scenario.
    pub name: String,
    /// Its NAT.
    pub nat: Nat,
    /// Where its processes run.
    pub ns: Namespace,
    /// Its own address (private behind a NAT).
    pub addr: Ipv4Addr,
    /// The address the internet sees: its own, or its gateway's.
    pub public: Ipv4Addr,
    /// Its gateway, behind a NAT. Kept so that it is deleted with the host.
    pub gateway: Option<Namespace>,
}

impl Host {
    /// Forgets every mapping its NAT holds (`conntrack -F` in the gateway), as a NAT whose
    /// mappings time out does: packets from outside to the old mappings are dropped until the
    /// host sends again. Nothing to do for a public host.
    pub fn expire_nat_mappings(&self) -> Result<(), LabError> {
        match &self.gateway {
            Some(gw) => gw.exec("conntrack", &["-F"]),
            None => Ok(()),
        }
    }
}

/// A built scenario; everything it made goes when it is dropped.
pub struct Network {
    /// The hosts, in the scenario's order (dropped before the wan).
    pub hosts: Vec<Host>,
    /// The internet's namespace.
    pub wan: Namespace,
}

impl Network {
    /// Builds `scenario`; loss and jitter draw from `seed`.
    pub fn build(scenario: &Scenario, seed: u64) -> Result<Self, LabError> {
        let wan = Namespace::create("wan")?;
        wan.exec("sh", &["-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])?;
        let mut hosts = Vec::new();
        for (i, spec) in scenario.host.iter().enumerate() {
            hosts.push(build_host(
                &wan,
                i as u8 + 1,
                spec,
                seed.wrapping_add(i as u64),
            )?);
        }
        Ok(Self { hosts, wan })
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> Option<&Host> {
        self.hosts.iter().find(|h| h.name == name)
    }
}

fn build_host(wan: &Namespace, i: u8, spec: &HostSpec, seed: u64) -> Result<Host, LabError> {
    let public = Ipv4Addr::new(10, 202, i, 2);
    let wan_side = Ipv4Addr::new(10, 202, i, 1);
    // The namespace on the link: the host itself, or its gateway.
    let edge = Namespace::create(&format!(
        "{}{}",
        spec.name,
        if spec.nat == Nat::None { "" } else { "-gw" }
    ))?;
    let up = spec.up.unwrap_or(spec.link);
    let link = Link::start(
        End {
            ns: &edge,
            device: "wan0".into(),
            addr: public,
        },
        End {
            ns: wan,
            device: format!("h{i}"),
            addr: wan_side,
        },
        up,
        spec.link,
        seed,
    )?;
    edge.ip(&["route", "add", "default", "dev", "wan0"])?;
    if spec.nat == Nat::None {
        return Ok(Host {
            name: spec.name.clone(),
            nat: spec.nat,
            ns: edge,
            addr: public,
            public,
            gateway: None,
            link,
        });
    }
    // Behind a NAT: the host on a veth to its gateway, which translates.
    let ns = Namespace::create(&spec.name)?;
    let (inside, gw) = (Ipv4Addr::new(192, 168, i, 2), Ipv4Addr::new(192, 168, i, 1));
    let veth = format!("v{i}");
    edge.ip(&[
        "link",
        "add",
        &veth,
        "type",
        "veth",
        "peer",
        "name",
        "lan0",
        "netns",
        ns.name(),
    ])?;
    edge.ip(&["addr", "add", &format!("{gw}/24"), "dev", &veth])?;
    edge.ip(&["link", "set", &veth, "up"])?;
    ns.ip(&["addr", "add", &format!("{inside}/24"), "dev", "lan0"])?;
    ns.ip(&["link", "set", "lan0", "up"])?;
    ns.ip(&["route", "add", "default", "via", &gw.to_string()])?;
    edge.exec("sh", &["-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])?;
    let how: &[&str] = match spec.nat {
        Nat::Symmetric => &["masquerade", "random"],
        _ => &["masquerade"],
    };
    edge.exec("nft", &["add", "table", "ip", "lab"])?;
    edge.exec(
        "nft",
        &[
            "add",
            "chain",
            "ip",
            "lab",
            "post",
            "{ type nat hook postrouting priority srcnat; policy accept; }",
        ],
    )?;
    let mut rule = vec!["add", "rule", "ip", "lab", "post", "oifname", "wan0"];
    rule.extend_from_slice(how);
    edge.exec("nft", &rule)?;
    Ok(Host {
        name: spec.name.clone(),
        nat: spec.nat,
        ns,
        addr: inside,
        public,
        gateway: Some(edge),
        link,
    })
}
