//! Simulations of a moeswarm swarm.
//!
//! [`local`]: a whole swarm of real nodes on one machine (router, relay, workers on 127.0.0.1,
//! real libp2p and QUIC), run by `moeswarm sim`, compared bit for bit with a single-process
//! run. The large-scale discrete-event simulation over the real market code comes here next.
//! It is not the node: it starts nodes from `moeswarm-node` and drives them.

pub mod local;
