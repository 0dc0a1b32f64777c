//! The moeswarm node: everything that touches files, memory and compute.
//!
//! It holds the model engine: the GGUF reader and writer ([`gguf`]), what a MoE GGUF means and
//! the slab format ([`model`]), slicing ([`slice`]) into the content-addressed [`store`],
//! expert compute, the MoE layer and the trunk with the f64 oracle ([`engine`], [`verify`]);
//! and the network roles on top of them: the libp2p control plane and blob exchange ([`net`]),
//! the worker and the router's remote executor on the data plane ([`dataplane`]), the router
//! role ([`router`]), a whole swarm on one machine ([`localswarm`]), and HTTP ([`http`]). It is
//! not the protocol (ids, records, messages and limits are `moeswarm-protocol`'s), not the
//! market's choices, and not the QUIC plumbing (`moeswarm-relay`'s).

pub mod dataplane;
pub mod engine;
pub mod gguf;
pub mod http;
pub mod inspect;
pub mod localswarm;
pub mod model;
pub mod net;
pub mod plan;
pub mod router;
pub mod run;
pub mod slice;
pub mod store;
pub mod text;
pub mod verify;
