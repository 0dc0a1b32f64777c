//! Expert compute and the MoE layer: candle on CPU for the real path, f64 for the oracle.
//!
//! Gating ([`moe::route`]), dispatch grouping ([`moe::DispatchPlan`]) and combine
//! ([`moe::combine`]) are kept apart from expert compute ([`moe::ExpertCompute`]), because
//! in the swarm the experts run on other nodes while gating and combine stay at the router.

pub mod executor;
pub mod expert;
pub mod layer;
pub mod moe;
pub mod ops;
pub mod oracle;
pub mod quant;
pub mod trunk;

pub use executor::{ExpertExecutor, ExpertRequest, LocalExecutor};
pub use expert::{ExpertWeights, LocalExperts};
pub use moe::{combine, route, DispatchPlan, ExpertCompute, ExpertRows, Routing};
