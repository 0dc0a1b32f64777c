//! The data plane's two ends in a node: the worker that computes dispatched slabs, and the
//! router's remote expert executor (which also counts the router's demand, and hole punches
//! the workers it reaches through a relay). The QUIC endpoints, framing, relay and the relay's
//! introductions are the relay crate's; the messages are the protocol crate's.

pub mod admission;
mod assign;
mod connections;
pub mod demand;
mod punch;
pub mod remote;
pub mod replicas;
pub mod stats;
pub mod timeline;
pub mod worker;

pub use assign::{HealthTable, RetryPolicy};
pub use demand::DemandCounter;
pub use moeswarm_market::trust::CheckPolicy;
pub use remote::{RemoteExecutor, SharedReplicas};
pub use replicas::{Replica, ReplicaTable, Route};
pub use stats::{DispatchFailure, DispatchStats, DispatchSummary, DropReason};
#[cfg(feature = "test-faults")]
pub use worker::WorkerFault;
pub use worker::{HeldExperts, WorkerService, WorkerStats};
