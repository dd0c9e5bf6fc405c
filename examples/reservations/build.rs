//! Compiles `proto/reservations/v1/reservations.proto` without protoc (protox parses it).

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let file = root.join("reservations/v1/reservations.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
