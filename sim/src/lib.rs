//! Simulation: a local swarm of real nodes on 127.0.0.1, and a discrete-event simulation of
//! the market and network at large scale.
//!
//! It drives `moeswarm-node`; it holds no protocol or model logic of its own. Nothing is
//! implemented yet: the distributed-decode issue adds the local swarm.
