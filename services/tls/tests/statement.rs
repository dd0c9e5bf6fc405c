//! Signed statements between two services of one authority (`retrychain_tls::statement`):
//! verified only as signed by whom, over what, with a trusted chain.

#![allow(clippy::unwrap_used, missing_docs)] // tests: a panic is the failure report

use retrychain_tls::{
    ClientAuth, Identity, Tls,
    issue::Authority,
    statement::{CONTEXT, Signature, StatementError},
};
use rustls::SignatureScheme;

fn service(authority: &Authority, name: &str, dir: &std::path::Path) -> Tls {
    retrychain_tls::issue::service(authority, name, dir, ClientAuth::Required).unwrap()
}

#[test]
fn a_statement_verifies_only_as_signed_by_whom_and_over_what() {
    let dir = tempfile::tempdir().unwrap();
    let authority = Authority::new("test").unwrap();
    let edge = service(&authority, "edge", dir.path());
    let hop2 = service(&authority, "hop2", dir.path());
    let ledger = service(&authority, "ledger", dir.path());
    let edge_id = Identity::named("edge");

    let (signature, chain) = edge.sign_statement(b"alice charges 5").unwrap();
    ledger
        .verify_statement(&edge_id, &chain, b"alice charges 5", &signature)
        .unwrap();
    // Twice: the second check takes the remembered chain, and still checks the
    // signature.
    ledger
        .verify_statement(&edge_id, &chain, b"alice charges 5", &signature)
        .unwrap();
    assert!(matches!(
        ledger.verify_statement(&edge_id, &chain, b"alice charges 6", &signature),
        Err(StatementError::BadSignature)
    ));

    // hop2's key makes a good signature, of hop2: not the edge's word.
    let (forged, hop2_chain) = hop2.sign_statement(b"alice charges 5").unwrap();
    assert!(matches!(
        ledger.verify_statement(&edge_id, &hop2_chain, b"alice charges 5", &forged),
        Err(StatementError::WrongSigner { .. })
    ));
    // hop2's signature presented with the edge's certificate.
    assert!(matches!(
        ledger.verify_statement(&edge_id, &chain, b"alice charges 5", &forged),
        Err(StatementError::BadSignature)
    ));

    // An edge certificate from another authority is not trusted.
    let other = Authority::new("other").unwrap();
    let impostor = service(&other, "edge", &dir.path().join("other"));
    let (signature, chain) = impostor.sign_statement(b"alice charges 5").unwrap();
    assert!(matches!(
        ledger.verify_statement(&edge_id, &chain, b"alice charges 5", &signature),
        Err(StatementError::Untrusted(_))
    ));

    // A chain that is not one, and a scheme outside the list.
    assert!(matches!(
        ledger.verify_statement(&edge_id, &[0, 0, 0, 9, 1], b"x", &signature),
        Err(StatementError::MalformedChain)
    ));
    let rsa_pkcs1 = Signature {
        scheme: u16::from(SignatureScheme::RSA_PKCS1_SHA256),
        bytes: vec![0; 64],
    };
    let (_, chain) = edge.sign_statement(b"x").unwrap();
    assert!(matches!(
        ledger.verify_statement(&edge_id, &chain, b"x", &rsa_pkcs1),
        Err(StatementError::Scheme(_))
    ));
}

#[test]
fn a_statement_is_not_a_tls_handshake_signature() {
    // The signed bytes start with the statement's context, never TLS 1.3's 64 spaces.
    assert!(!CONTEXT.starts_with(b" "));
    assert!(CONTEXT.ends_with(b"\0"));
}
