//! The moeswarm protocol: the names and the shared records every node agrees on.
//!
//! It holds content ids ([`BlobId`], [`ModelId`]), the canonical model [`Manifest`], the
//! metadata keys that make a GGUF file a slab, signed records (holdings, demand), the blob exchange
//! messages, the data plane's dispatch and relay messages (with how rows travel: `wire`, and
//! how a payload lays them out: `rows`), and the limits that bound what a node accepts.
//! It does no I/O: parsing, validation and serialization only, so every rule here is tested
//! with properties. Files, sockets and the model math live in `moeswarm-node`.

pub mod context;
#[cfg(test)]
use context::test_error as error;
pub mod demand;
pub mod dispatch;
pub mod exchange;
pub mod heartbeat;
pub mod holdings;
pub mod ids;
pub mod limits;
pub mod manifest;
pub mod record;
pub mod relay;
pub mod rows;
pub mod slab;
pub mod wire;

pub use demand::{Demand, DemandEntry, SignedDemand};
pub use dispatch::{
    DispatchReply, DispatchRequest, DispatchTicket, ReplyStatus, RequestDigest, SlabRows, WireType,
};
pub use exchange::{ExchangeRequest, ExchangeResponse, ResponseHeader, WireError};
pub use heartbeat::{Heartbeat, SignedHeartbeat};
pub use holdings::{Holdings, Reach, SignedHoldings};
pub use ids::{BlobId, IdParseError, ModelId};
pub use manifest::{BlobRef, HyperParams, LayerKind, Manifest, ManifestError};
pub use record::{NodeKey, RecordBody, RecordError, Signed};
