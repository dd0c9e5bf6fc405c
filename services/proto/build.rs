//! Compiles `proto/retrychain/v1/*.proto` without protoc: protox parses the files into a
//! descriptor set, which feeds code generation and the reflection service.
//!
//! `Payments` is generated twice from it: once with prost's messages (what the edge and
//! the ledger decode and validate), and once with each message left as its encoded bytes
//! (`retrychain_proto::passthrough`), for the relays that only forward them. Both come from
//! the same descriptor, so a method added to the proto reaches both.

use std::{env, fs, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let file = proto_root.join("retrychain/v1/retrychain.proto");
    println!("cargo:rerun-if-changed={}", file.display());

    let fds = protox::compile([&file], [&proto_root])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(
        out_dir.join("retrychain_descriptor.bin"),
        fds.encode_to_vec(),
    )?;
    let payments = passthrough_payments(&fds)?;
    tonic_prost_build::configure().compile_fds(fds)?;
    // `retrychain.v1.Payments.rs`, beside prost's `retrychain.v1.rs`.
    tonic_build::manual::Builder::new()
        .build_transport(false)
        .compile(&[payments]);
    Ok(())
}

/// `retrychain.v1.Payments` with every message as `Bytes`, encoded and decoded by
/// `crate::passthrough::BytesCodec`.
fn passthrough_payments(
    fds: &prost_types::FileDescriptorSet,
) -> Result<tonic_build::manual::Service, Box<dyn std::error::Error>> {
    let file = fds
        .file
        .iter()
        .find(|file| file.package() == "retrychain.v1")
        .ok_or("no package retrychain.v1")?;
    let service = file
        .service
        .iter()
        .find(|service| service.name() == "Payments")
        .ok_or("no service Payments")?;
    let mut builder = tonic_build::manual::Service::builder()
        .name("Payments")
        .package("retrychain.v1")
        .comment(" `Payments` forwarded as encoded messages, never decoded.");
    for method in &service.method {
        if method.client_streaming() || method.server_streaming() {
            return Err(format!("{}: a relay forwards unary methods only", method.name()).into());
        }
        builder = builder.method(
            tonic_build::manual::Method::builder()
                .name(snake_case(method.name()))
                .route_name(method.name())
                .input_type("::prost::bytes::Bytes")
                .output_type("::prost::bytes::Bytes")
                .codec_path("crate::passthrough::BytesCodec")
                .build(),
        );
    }
    Ok(builder.build())
}

/// `GetAccount` → `get_account`, as prost names the methods of its generated traits.
fn snake_case(name: &str) -> String {
    let mut snake = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                snake.push('_');
            }
            snake.push(c.to_ascii_lowercase());
        } else {
            snake.push(c);
        }
    }
    snake
}
