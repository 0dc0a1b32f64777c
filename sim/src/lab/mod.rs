//! The network lab: real networks on one machine, built from network namespaces.
//!
//! A lab is a set of namespaces (one per host; see [`netns`]) joined by links with delay,
//! jitter, loss and bandwidth emulated in userspace over TUN devices ([`link`]: this kernel
//! has no netem), checked by a UDP probe of its own ([`probe`]); [`topology`] builds a
//! scenario's hosts, public or behind a NAT of a given kind, around an internet namespace. Everything a lab makes is
//! named after the process that made it and removed when dropped, or by the next run if the
//! process was killed. Needs root, `ip` and `/dev/net/tun` ([`netns::unavailable`] says which
//! is missing). It builds networks and measures them; [`procs`] runs `moeswarm` processes in
//! them and [`bench`](mod@bench) is `moeswarm lab`'s benchmark (a swarm's token cost at given round trips,
//! a fetch through a limited uplink).

pub mod bench;
pub mod link;
pub mod netns;
pub mod probe;
pub mod procs;
pub mod topology;

/// Why the lab cannot run here (for tests to skip with), or `None` when it can: then the
/// namespaces a killed run left behind are swept first.
pub fn skip_reason() -> Option<String> {
    let why = netns::unavailable();
    if why.is_none() {
        netns::sweep_leftovers();
    }
    why
}

/// Why the lab failed.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// A command that shapes the network failed.
    #[error("network lab: {0}")]
    Command(String),
    /// The scenario asks for something the lab cannot build.
    #[error("lab scenario: {0}")]
    Scenario(String),
    /// A measurement got no answer.
    #[error("lab probe: {0}")]
    Probe(String),
}
