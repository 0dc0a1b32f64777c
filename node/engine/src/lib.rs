//! Compute: the numbers of a MoE model, on candle (CPU) and in float64.
//!
//! Numeric building blocks ([`ops`], [`quant`]), expert compute ([`expert`], [`layer`]), the MoE
//! layer split the way the swarm splits it ([`moe`]: gating, dispatch plan, combine), the seam
//! through which the trunk asks for experts ([`executor`]), the trunk itself ([`trunk`]), the
//! float64 oracle ([`oracle`], [`verify`]), tokenizer and sampling ([`text`]), running a model in
//! this process ([`generate`]) and random-weight models for tests ([`synth`]). It reads models
//! through `moeswarm-model`; it is not the network: remote experts plug in through
//! [`ExpertExecutor`] from `moeswarm-node`.

pub mod bench;
pub mod error;
pub mod executor;
pub mod expert;
pub mod generate;
pub mod kernels;
pub mod layer;
pub mod moe;
pub mod ops;
pub mod oracle;
pub mod projection;
pub mod quant;
pub mod speculative;
pub mod synth;
pub mod text;
pub mod trunk;
pub mod verify;

pub use error::{Error, Result};
pub use executor::{ExpertExecutor, ExpertRequest, LocalExecutor};
pub use expert::{ExpertWeights, LocalExperts};
pub use moe::{combine, route, DispatchPlan, ExpertCompute, ExpertRows, Routing};
