//! The swarm's market: pure, deterministic decisions about who holds and serves what.
//!
//! It will hold the coverage map built from verified holdings records, demand, the choice of
//! slabs for a joining node, the choice of replica for each dispatch and reputation. It does no
//! I/O and knows nothing of sockets or files; every rule is tested with properties.
//! Nothing is implemented yet: the control-plane issue fills it.
