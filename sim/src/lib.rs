//! Simulation of the swarm at scale: a discrete-event simulation of the market and the network
//! (thousands of nodes, churn, demand), to come.
//!
//! It drives the market crate's rules; it holds no protocol or model logic of its own. The
//! local swarm of real nodes on 127.0.0.1 (`moeswarm sim`) lives in `moeswarm-node`'s
//! `localswarm` module, since the `moeswarm` binary belongs to the node crate. Nothing is
//! implemented here yet.
