//! The moeswarm node: everything that touches files, memory and compute.
//!
//! Today it holds the model engine: the GGUF reader and writer ([`gguf`]), what a MoE GGUF
//! means and the slab format ([`model`]), slicing ([`slice`]) into the content-addressed
//! [`store`], expert compute and the MoE layer with its f64 oracle ([`engine`]) and
//! [`verify`]. It is not the protocol (ids, manifest and limits are `moeswarm-protocol`'s) and
//! not the market's choices; the network roles come later, in this crate, on top of these.

pub mod dataplane;
pub mod engine;
pub mod gguf;
pub mod http;
pub mod inspect;
pub mod localswarm;
pub mod model;
pub mod net;
pub mod plan;
pub mod run;
pub mod slice;
pub mod store;
pub mod text;
pub mod verify;
