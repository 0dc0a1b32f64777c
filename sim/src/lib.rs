//! Simulations of a moeswarm swarm.
//!
//! [`local`]: a whole swarm of real nodes on one machine (router, relay, workers on 127.0.0.1,
//! real libp2p and QUIC), run by `moeswarm sim`, compared bit for bit with a single-process
//! run. [`lab`]: real networks on one machine (network namespaces, emulated links) for such
//! swarms to run in. [`scale`]: thousands of nodes as a deterministic discrete-event simulation
//! over the real market code (`moeswarm sim --scale N`).
//! It is not the node: it starts nodes from `moeswarm-node` and drives them.

pub mod lab;
pub mod local;
pub mod scale;

use std::path::PathBuf;

/// The qwen35moe model trained on this project's corpus (`sim/train/`, `docs/training.md`):
/// what `moeswarm sim` runs unless told otherwise. A path into the source tree this crate was
/// built from.
pub fn trained_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/fortunes-qwen35moe-q8_0.gguf")
}
