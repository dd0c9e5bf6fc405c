//! The `retrychain.v1` wire contract as Rust types: clients and servers for `Payments`
//! and `Control`, and the encoded descriptor set that gRPC reflection serves so that
//! `grpcurl list` works without proto files.

#![allow(missing_docs)] // generated code carries the proto comments, not Rust docs

/// Generated messages, clients and servers of package `retrychain.v1`.
pub mod v1 {
    tonic::include_proto!("retrychain.v1");
}

/// The encoded `FileDescriptorSet` of every retrychain proto, for tonic-reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/retrychain_descriptor.bin"));
