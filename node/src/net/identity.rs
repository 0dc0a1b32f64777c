//! The node's identity: one ed25519 key, created on first start and kept in the data dir.
//!
//! The same 32-byte seed gives the libp2p keypair (whose PeerId names the node everywhere)
//! and the ed25519-dalek key that signs holdings records. Converting between PeerIds and
//! record keys, and checking signatures, is `moeswarm_relay::identity`'s.

use std::fs;
use std::io::Write;
use std::path::Path;

use crate::error::{bail, Context, Result};
use ed25519_dalek::SigningKey;
use libp2p::identity::Keypair;
use libp2p::PeerId;
use moeswarm_protocol::NodeKey;

pub use moeswarm_relay::identity::{node_key_of, peer_id_of};

/// File name of the key inside the data dir.
pub const KEY_FILE: &str = "identity.key";

/// A node's keys.
#[derive(Clone)]
pub struct NodeIdentity {
    /// For libp2p.
    pub keypair: Keypair,
    /// For signing records.
    pub signing: SigningKey,
    /// The public key as records carry it.
    pub key: NodeKey,
    /// The libp2p name.
    pub peer_id: PeerId,
}

impl NodeIdentity {
    /// The identity of a 32-byte seed.
    pub fn from_seed(seed: [u8; 32]) -> Result<Self> {
        let keypair = Keypair::ed25519_from_bytes(seed).context("ed25519 seed")?;
        let signing = SigningKey::from_bytes(&seed);
        let key = NodeKey(signing.verifying_key().to_bytes());
        Ok(Self {
            peer_id: keypair.public().to_peer_id(),
            keypair,
            signing,
            key,
        })
    }

    /// Loads the key in `dir`, or creates one (mode 0600) on first start.
    pub fn load_or_create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(KEY_FILE);
        match fs::read(&path) {
            Ok(bytes) => {
                let seed: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
                    crate::error::Error::invalid(format!(
                        "{} holds {} bytes, not a 32-byte key",
                        path.display(),
                        bytes.len()
                    ))
                })?;
                Self::from_seed(seed)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut seed = [0u8; 32];
                rand::fill(&mut seed);
                // Written whole to a temporary file, synced, then renamed into place: a crash
                // leaves either no key or the whole key, never a short one.
                let tmp = dir.join(format!("{KEY_FILE}.tmp"));
                let mut opts = fs::OpenOptions::new();
                opts.write(true).create(true).truncate(true);
                #[cfg(unix)]
                std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
                let mut f = opts
                    .open(&tmp)
                    .with_context(|| format!("creating {}", tmp.display()))?;
                f.write_all(&seed)?;
                f.sync_all()?;
                drop(f);
                // Another process may have made the key meanwhile: the first one made wins.
                if path.exists() {
                    let _ = fs::remove_file(&tmp);
                    return Self::load_or_create(dir);
                }
                fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
                if let Ok(d) = fs::File::open(dir) {
                    let _ = d.sync_all();
                }
                Self::from_seed(seed)
            }
            Err(e) => bail!("reading {}: {e}", path.display()),
        }
    }
}
