//! Hard limits on what a node accepts from disk or the network.

/// Largest manifest accepted, in bytes. Qwen3.5-122B-A10B's manifest (48 × 256 slabs) is about
/// 1.3 MB; this leaves room for models several times larger.
pub const MAX_MANIFEST_BYTES: usize = 16 << 20;

/// Most layers a manifest may describe.
pub const MAX_LAYERS: u32 = 1024;

/// Most routed experts per layer a manifest may describe.
pub const MAX_EXPERTS: u32 = 4096;

/// Largest architecture or model name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// Bytes of any one blob a node fetches (the trunk is the largest: about 10 GB for the target
/// model).
pub const MAX_BLOB_BYTES: u64 = 64 << 30;
