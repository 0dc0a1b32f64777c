//! The data plane's two ends in a node: the worker that computes dispatched slabs, and the
//! router's remote expert executor. The QUIC endpoints, framing and relay are the relay
//! crate's; the messages are the protocol crate's.

pub mod remote;
pub mod worker;

pub use remote::{DispatchStats, DispatchSummary, RemoteExecutor, Replica, ReplicaTable, Route};
pub use worker::{HeldExperts, WorkerFault, WorkerService, WorkerStats};
