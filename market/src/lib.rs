//! The swarm's market: pure, deterministic decisions about who holds and serves what.
//!
//! [`coverage`] (who holds which slab, from verified holdings records), [`demand`] (how much
//! the routers use each slab, merged from their verified demand records so no one router
//! steers it), [`choice`] (what one node should fetch and drop, under its capacity),
//! [`placement`] (assigning every slab of a model to known devices at once, for planning) and
//! [`replica`] (which holder of a slab a dispatch goes to), [`trust`] (how often a worker's
//! answers are checked, and what a failed check costs it), [`share`] (fair shares of a
//! worker's slots and bytes, or a relayed worker's streams) and [`table`] (whom a full table of
//! records keeps). It does no I/O and knows nothing
//! of sockets, files or clocks (time comes in as a number); every rule is tested with
//! properties.

pub mod choice;
pub mod coverage;
pub mod demand;
pub mod placement;
pub mod replica;
pub mod share;
pub mod table;
pub mod trust;
