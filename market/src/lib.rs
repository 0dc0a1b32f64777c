//! The swarm's market: pure, deterministic decisions about who holds and serves what.
//!
//! Today it holds [`placement`] (assigning every slab of a model to devices with a replica
//! count, RAM budgets and load spread) and [`coverage`] (who holds which slab, from verified
//! holdings records) and [`replica`] (which holder of a slab a dispatch goes to). Demand and
//! reputation come next. It does no I/O and knows nothing of sockets or files; every rule is
//! tested with properties.

pub mod coverage;
pub mod placement;
pub mod replica;
