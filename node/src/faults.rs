//! Misbehaviour on purpose: nodes that lie to fetchers and workers that cheat routers, so that
//! the defences are tested against real peers. The options that switch them on exist only with
//! the `test-faults` feature (the tests'); the `moeswarm` binary is built without it, so its
//! nodes are always honest.
#![cfg_attr(not(feature = "test-faults"), allow(dead_code))]

use std::time::Duration;

/// How a node serves ranges. Anything but [`ServeFault::Honest`] exists to test fetchers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ServeFault {
    /// Serves the bytes it holds.
    #[default]
    Honest,
    /// Flips one byte in the last quarter of every range it sends.
    CorruptRanges,
    /// Sends only the first half of every range.
    TruncateRanges,
}

/// How a worker answers. Anything but [`WorkerFault::Honest`] exists to test routers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WorkerFault {
    /// Answers what it is asked.
    #[default]
    Honest,
    /// Answers with another ticket.
    WrongTicket,
    /// Answers one row fewer for the first slab.
    WrongShape,
    /// Answers twice on the same stream.
    AnswerTwice,
    /// Answers only after this long.
    Stall(Duration),
    /// Computes this much slower (holding its place in the queue).
    SlowCompute(Duration),
}
