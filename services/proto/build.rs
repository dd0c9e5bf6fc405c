//! Compiles `proto/retrychain/v1/*.proto` without protoc: protox parses the files into a
//! descriptor set, which feeds code generation and the reflection service.

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
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
