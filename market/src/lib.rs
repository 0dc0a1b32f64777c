//! The swarm's market: pure, deterministic decisions about who holds and serves what.
//!
//! Today it holds [`placement`]: assigning every slab of a model to devices with a replica
//! count, RAM budgets and load spread. The coverage map, demand, replica choice per dispatch and
//! reputation come with the control-plane issue. It does no I/O and knows nothing of sockets or
//! files; every rule is tested with properties.

pub mod placement;
