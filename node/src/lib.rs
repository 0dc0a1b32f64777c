//! The running moeswarm node: the swarm's network roles on top of the model and the engine.
//!
//! The composition root that runs a whole node ([`node`]) from its settings ([`config`]); what
//! the node holds and says it holds ([`holdings`]); one-shot operations that join a swarm for
//! one job ([`ops`]); the libp2p control plane, blob exchange and record collection ([`net`]);
//! the worker and the router's remote executor on the QUIC data plane ([`dataplane`]); the
//! router role that joins a swarm and runs a model through it and publishes its demand
//! ([`router`]); taking part in the market by itself ([`auto`]); HTTP ([`http`]), the
//! OpenAI-compatible API with continuous batching ([`api`]) and the web dashboard
//! ([`dashboard`]). It is not the model files or the store
//! (`moeswarm-model`), not compute (`moeswarm-engine`), not the protocol (ids, records,
//! messages and limits: `moeswarm-protocol`), not the market's choices (`moeswarm-market`) and
//! not the QUIC plumbing (`moeswarm-relay`).

pub mod api;
pub mod auto;
pub mod config;
pub mod dashboard;
pub mod dataplane;
pub mod error;
#[cfg(feature = "test-faults")]
pub mod faults;
#[cfg(not(feature = "test-faults"))]
mod faults;
pub mod holdings;
pub mod http;
pub mod net;
pub mod node;
pub mod ops;
pub mod router;

pub use error::{Error, Result};
pub use holdings::holdings_record;
pub use node::{DataPlaneOptions, NodeOptions, RunningNode};
