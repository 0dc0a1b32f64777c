//! The whole QUIC data-plane transport (the crate keeps the folder name `relay/`, but the relay
//! is only one part of it): QUIC (quinn) endpoints whose TLS identity is the node's ed25519
//! key ([`endpoint`]; its TLS configurations in [`tls`]), PeerId ↔ key and signatures ([`identity`]), framed dispatch streams
//! between router and workers ([`framing`]), and the relay that splices streams for workers
//! that can only dial out ([`relay`], [`registry`]), which also introduces router and worker
//! for a direct path through their NATs ([`punch`]).
//!
//! It carries bytes with deadlines and size limits; it does not compute experts, choose
//! replicas or look inside tensors. The messages themselves are the protocol crate's
//! (`dispatch`, `relay`); the worker and the router that use this crate are the node's.

pub mod endpoint;
pub mod error;
pub mod faults;
#[cfg(feature = "test-faults")]
pub mod flood;
pub mod framing;
pub mod identity;
pub mod punch;
pub mod registry;
pub mod relay;
pub mod tls;

pub use endpoint::{peer_of, DataEndpoint};
pub use error::{Error, Result};
pub use faults::Tamper;
pub use libp2p_identity::{Keypair, PeerId};
pub use relay::{RelayClient, RelayLimits, RelayServer, RelayStats};
