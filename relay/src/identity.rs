//! Who a peer is: its PeerId, the ed25519 key inside it, and signatures made with that key.
//!
//! Every node has one ed25519 key. Its libp2p PeerId carries the public key inline (identity
//! multihash), so a PeerId is enough to check a signature, and it converts to and from the
//! 32-byte [`NodeKey`] that signed records carry. These are the only functions in moeswarm
//! that do either.

use libp2p_identity::{PeerId, PublicKey};
use moeswarm_protocol::NodeKey;

/// The public key named by `peer`, when it is an ed25519 PeerId with the key inline.
pub fn public_key_of(peer: &PeerId) -> Option<PublicKey> {
    // 0 = the identity multihash: the digest is the protobuf-encoded key itself.
    if peer.as_ref().code() != 0 {
        return None;
    }
    PublicKey::try_decode_protobuf(peer.as_ref().digest()).ok()
}

/// The PeerId of the node whose record key is `key` (`None` if it is not an ed25519 point).
pub fn peer_id_of(key: &NodeKey) -> Option<PeerId> {
    let pk = libp2p_identity::ed25519::PublicKey::try_from_bytes(&key.0).ok()?;
    Some(PublicKey::from(pk).to_peer_id())
}

/// The record key of the node named `peer`.
pub fn node_key_of(peer: &PeerId) -> Option<NodeKey> {
    Some(NodeKey(
        public_key_of(peer)?.try_into_ed25519().ok()?.to_bytes(),
    ))
}

/// Whether `signature` over `message` was made by `peer`'s key.
pub fn verify(peer: &PeerId, message: &[u8], signature: &[u8]) -> bool {
    public_key_of(peer).is_some_and(|k| k.verify(message, signature))
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p_identity::Keypair;

    #[test]
    fn peer_ids_and_node_keys_convert_both_ways() {
        let kp = Keypair::ed25519_from_bytes([7u8; 32]).unwrap();
        let peer = kp.public().to_peer_id();
        let key = node_key_of(&peer).unwrap();
        assert_eq!(peer_id_of(&key), Some(peer));
        let dalek = ed25519_dalek::SigningKey::from_bytes(&[7u8; 32]);
        assert_eq!(key.0, dalek.verifying_key().to_bytes());
    }

    #[test]
    fn a_signature_verifies_only_for_its_signer_and_message() {
        let a = Keypair::ed25519_from_bytes([1u8; 32]).unwrap();
        let b = Keypair::ed25519_from_bytes([2u8; 32]).unwrap();
        let sig = a.sign(b"hello").unwrap();
        assert!(verify(&a.public().to_peer_id(), b"hello", &sig));
        assert!(!verify(&a.public().to_peer_id(), b"hellp", &sig));
        assert!(!verify(&b.public().to_peer_id(), b"hello", &sig));
        // A PeerId that hashes its key (not inline) names no key to check against.
        let mut hashed = vec![0x12, 0x20]; // sha2-256, 32 bytes
        hashed.extend_from_slice(&[9u8; 32]);
        assert!(!verify(
            &PeerId::from_bytes(&hashed).unwrap(),
            b"hello",
            &sig
        ));
    }
}
