//! The data plane's TLS 1.3 configurations: libp2p's certificates and libp2p's checks of them,
//! with the cipher suites in the order this CPU runs fastest.
//!
//! A node's certificate is the one `libp2p_tls` makes (a fresh self-signed certificate whose
//! extension carries the node's key and its signature). A peer's certificate is checked as
//! libp2p's specification asks: exactly one is presented, it parses as a libp2p certificate
//! (self-signature and extension signature valid), the handshake is signed by its key, and on
//! a dial it names the PeerId dialed.
//!
//! What differs from `libp2p_tls::make_*_config` is only the cipher suites' order, which the
//! dialing side's list decides: libp2p puts ChaCha20-Poly1305 first; here AES-GCM comes first
//! where the CPU has AES instructions (a fraction of ChaCha20's cost there, and the data plane
//! encrypts every activation it carries) and ChaCha20 first where it has not. Every order
//! offers all three suites, so any two nodes agree on one. libp2p's own connections (the
//! control plane) keep libp2p's configuration.

use std::sync::Arc;

use libp2p_identity::{Keypair, PeerId};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::aws_lc_rs::cipher_suite::{
    TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme,
    SupportedCipherSuite,
};

use crate::error::{Error, Result};

/// Whether this CPU has the instructions AES-GCM runs fast on.
pub fn has_aes_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
            && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// The TLS 1.3 cipher suites in the order this node asks for them (see the module docs).
pub fn cipher_suites(aes_instructions: bool) -> Vec<SupportedCipherSuite> {
    if aes_instructions {
        vec![
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS13_CHACHA20_POLY1305_SHA256,
        ]
    } else {
        vec![
            TLS13_CHACHA20_POLY1305_SHA256,
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
        ]
    }
}

fn provider(aes_instructions: bool) -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::aws_lc_rs::default_provider();
    p.cipher_suites = cipher_suites(aes_instructions);
    Arc::new(p)
}

/// The server side: this node's certificate, every client asked for one and checked.
pub fn server_config(keypair: &Keypair) -> Result<rustls::ServerConfig> {
    server_config_with(keypair, has_aes_instructions())
}

/// The client side: this node's certificate, the server's checked to be `dialed`'s.
pub fn client_config(keypair: &Keypair, dialed: PeerId) -> Result<rustls::ClientConfig> {
    client_config_with(keypair, dialed, has_aes_instructions())
}

fn server_config_with(keypair: &Keypair, aes_instructions: bool) -> Result<rustls::ServerConfig> {
    // libp2p's configuration only lends its certificate.
    let libp2p = libp2p_tls::make_server_config(keypair)?;
    Ok(
        rustls::ServerConfig::builder_with_provider(provider(aes_instructions))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::invalid(format!("TLS server: {e}")))?
            .with_client_cert_verifier(Arc::new(PeerCertificate { dialed: None }))
            .with_cert_resolver(libp2p.cert_resolver),
    )
}

fn client_config_with(
    keypair: &Keypair,
    dialed: PeerId,
    aes_instructions: bool,
) -> Result<rustls::ClientConfig> {
    let libp2p = libp2p_tls::make_client_config(keypair, Some(dialed))?;
    Ok(
        rustls::ClientConfig::builder_with_provider(provider(aes_instructions))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::invalid(format!("TLS client: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerCertificate {
                dialed: Some(dialed),
            }))
            .with_client_cert_resolver(libp2p.client_auth_cert_resolver),
    )
}

/// libp2p's checks of a peer's certificate (see the module docs).
#[derive(Debug)]
struct PeerCertificate {
    /// The PeerId a dial expects; `None` on the accepting side, which takes any peer.
    dialed: Option<PeerId>,
}

/// The PeerId that the one certificate presented proves, or why it proves none.
fn presented(
    end_entity: &CertificateDer,
    intermediates: &[CertificateDer],
) -> Result<PeerId, rustls::Error> {
    if !intermediates.is_empty() {
        return Err(rustls::Error::General(
            "a libp2p peer presents exactly one certificate".into(),
        ));
    }
    let cert = libp2p_tls::certificate::parse(end_entity)
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    Ok(cert.peer_id())
}

/// Whether `signature` over `message` was made by the key of `cert`.
fn signed_by(
    cert: &CertificateDer,
    message: &[u8],
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    libp2p_tls::certificate::parse(cert)
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?
        .verify_signature(dss.scheme, message, dss.signature())
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadSignature))?;
    Ok(HandshakeSignatureValid::assertion())
}

/// The schemes a libp2p certificate's key may sign the handshake with.
fn schemes() -> Vec<SignatureScheme> {
    vec![
        SignatureScheme::ECDSA_NISTP384_SHA384,
        SignatureScheme::ECDSA_NISTP256_SHA256,
        SignatureScheme::ED25519,
        SignatureScheme::RSA_PSS_SHA512,
        SignatureScheme::RSA_PSS_SHA384,
        SignatureScheme::RSA_PSS_SHA256,
        SignatureScheme::RSA_PKCS1_SHA512,
        SignatureScheme::RSA_PKCS1_SHA384,
        SignatureScheme::RSA_PKCS1_SHA256,
    ]
}

/// TLS 1.2 is never negotiated (the versions allow 1.3 only); a 1.2 signature is refused.
fn no_tls12() -> Result<HandshakeSignatureValid, rustls::Error> {
    Err(rustls::Error::PeerIncompatible(
        rustls::PeerIncompatible::Tls13RequiredForQuic,
    ))
}

impl ServerCertVerifier for PeerCertificate {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer,
        intermediates: &[CertificateDer],
        _server_name: &ServerName,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let peer = presented(end_entity, intermediates)?;
        if self.dialed.is_some_and(|d| d != peer) {
            return Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        no_tls12()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        signed_by(cert, message, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        schemes()
    }
}

impl ClientCertVerifier for PeerCertificate {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer,
        intermediates: &[CertificateDer],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        presented(end_entity, intermediates)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        no_tls12()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        signed_by(cert, message, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::{ClientConnection, ServerConnection};

    /// A TLS handshake in memory between a client with `client_aes` dialing `dialed` and a
    /// server of `server_key` with `server_aes`: the suite agreed, or the error.
    fn handshake(
        client_aes: bool,
        server_key: &Keypair,
        server_aes: bool,
        dialed: PeerId,
    ) -> std::result::Result<SupportedCipherSuite, rustls::Error> {
        let client_key = Keypair::ed25519_from_bytes([3u8; 32]).unwrap();
        let cc = client_config_with(&client_key, dialed, client_aes).unwrap();
        let sc = server_config_with(server_key, server_aes).unwrap();
        let name = ServerName::try_from("libp2p").unwrap();
        let mut client = ClientConnection::new(Arc::new(cc), name).unwrap();
        let mut server = ServerConnection::new(Arc::new(sc)).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            client.write_tls(&mut buf).unwrap();
            server.read_tls(&mut &buf[..]).unwrap();
            server.process_new_packets()?;
            let mut buf = Vec::new();
            server.write_tls(&mut buf).unwrap();
            client.read_tls(&mut &buf[..]).unwrap();
            client.process_new_packets()?;
            if !client.is_handshaking() && !server.is_handshaking() {
                let suite = client.negotiated_cipher_suite().unwrap();
                assert_eq!(Some(suite), server.negotiated_cipher_suite());
                return Ok(suite);
            }
        }
        panic!("the handshake did not end");
    }

    #[test]
    fn the_dialing_sides_first_suite_is_agreed_whatever_the_other_prefers() {
        let server = Keypair::ed25519_from_bytes([1u8; 32]).unwrap();
        let id = server.public().to_peer_id();
        for (client_aes, server_aes) in [(true, true), (true, false), (false, true), (false, false)]
        {
            let suite = handshake(client_aes, &server, server_aes, id).unwrap();
            assert_eq!(
                suite,
                cipher_suites(client_aes)[0],
                "client aes {client_aes}"
            );
        }
        // Where the CPU has AES instructions, AES-GCM is what the data plane runs.
        assert_eq!(
            cipher_suites(true)[0].suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
    }

    #[test]
    fn a_server_that_is_not_the_peer_dialed_is_refused() {
        let server = Keypair::ed25519_from_bytes([1u8; 32]).unwrap();
        let someone_else = Keypair::ed25519_from_bytes([2u8; 32])
            .unwrap()
            .public()
            .to_peer_id();
        let e = handshake(true, &server, true, someone_else).unwrap_err();
        assert!(
            matches!(
                e,
                rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure)
            ),
            "{e:?}"
        );
    }
}
