//! The data plane: QUIC (quinn) endpoints whose TLS identity is the node's ed25519 key, the
//! framed activation streams between router and workers, and the relay that splices streams
//! for workers that can only dial out.
//!
//! It carries bytes with deadlines and size limits; it does not compute experts or choose
//! replicas. Nothing is implemented yet: the distributed-decode issue fills it.
