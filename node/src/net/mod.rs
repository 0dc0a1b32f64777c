//! The control plane on libp2p: swarm, joining by bootstrap address, holdings, blob exchange.
//!
//! A [`SwarmNode`] runs a real libp2p swarm (TCP and QUIC, Noise, Yamux; Kademlia in server
//! mode under the project's protocol name, identify, ping, gossipsub, autonat, relay, dcutr,
//! and the blob exchange over request-response) in a tokio task, driven through a
//! [`NodeHandle`]. Holdings records travel on a gossipsub topic per model and are put in the
//! DHT; every received record is verified (signature, signer = the peer that published it,
//! freshness, expiry, size) before it reaches that model's coverage map, and refusals are
//! counted. [`Fetcher`] moves blobs between stores by verified ranges, their bytes over a plain
//! TCP lane beside libp2p where the peer offers one (`bulk`); record collection
//! (asking peers for a model's records, building its coverage) is in `collect`. It is not
//! the node's composition ([`crate::node`]), its settings ([`crate::config`]), what it holds
//! ([`crate::holdings`]) or the one-shot operations ([`crate::ops`]): it imports none of them.

pub mod bulk;
mod codec;
mod collect;
pub mod fetch;
mod handle;
pub mod identity;
pub(crate) mod records;
pub mod serve;
mod stats;
mod swarm;

pub use collect::{collect_demand, collect_records, gather_coverage, learn_records};
pub use fetch::{FetchReport, Fetcher, Selection};
pub use handle::NodeHandle;
pub use identity::NodeIdentity;
pub use records::{holdings_key, model_key};
#[cfg(feature = "test-faults")]
pub use serve::ServeFault;
pub use stats::{NodeStats, RecordRefusal, RequestFailure};
pub use swarm::{NodeConfig, SwarmNode};
