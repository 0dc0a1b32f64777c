//! The control plane on libp2p: swarm, joining by bootstrap address, holdings, blob exchange.
//!
//! A [`SwarmNode`] runs a real libp2p swarm (TCP and QUIC, Noise, Yamux; Kademlia in server
//! mode under the project's protocol name, identify, ping, gossipsub, autonat, relay, dcutr,
//! and the blob exchange over request-response) in a tokio task, driven through a
//! [`NodeHandle`]. Holdings records travel on a gossipsub topic per model and are put in the
//! DHT; every received record is verified (signature, signer = the peer that published it,
//! freshness, expiry, size) before it reaches that model's coverage map, and refusals are
//! counted. [`Fetcher`] moves blobs between stores by verified ranges; [`RunningNode`] is a
//! whole node as `moeswarm node` runs it.

mod codec;
pub mod commands;
pub mod config;
pub mod fetch;
mod handle;
pub mod identity;
pub(crate) mod records;
pub mod serve;
pub mod service;
mod stats;
mod swarm;

pub use fetch::{gather_coverage, FetchReport, Fetcher, Selection};
pub use handle::NodeHandle;
pub use identity::NodeIdentity;
pub use records::{holdings_key, model_key};
#[cfg(feature = "test-faults")]
pub use serve::ServeFault;
pub use service::{NodeOptions, RunningNode};
pub use stats::NodeStats;
pub use swarm::{NodeConfig, SwarmNode};
