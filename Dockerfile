# One image, one binary: `retrychain edge|relay|ledger|health|…`.
# Build stage: the official Rust image. Run stage: slim Debian, non-root, no build tools.
FROM rust:1.95-bookworm AS build
WORKDIR /src

# 1. Dependencies, in a layer of their own: only the manifests and the lock file go in, with
#    an empty source file for every crate of the workspace (and the proto crate's build
#    script with the .proto files, so protox and the code generator are built here too),
#    so this layer (the 200-odd crates from crates.io, about 3 minutes on 2 cores) is
#    rebuilt only when a manifest, Cargo.lock or the wire contract changes — not when the
#    project's code does.
COPY Cargo.toml Cargo.lock ./
COPY services/proto/Cargo.toml services/proto/build.rs services/proto/
COPY proto proto
COPY services/resilience/Cargo.toml services/resilience/
COPY services/idempotency/Cargo.toml services/idempotency/
COPY services/tempgres/Cargo.toml services/tempgres/
COPY services/domain/Cargo.toml services/domain/
COPY services/node/Cargo.toml services/node/
COPY services/hop/Cargo.toml services/hop/
COPY services/ledger/Cargo.toml services/ledger/
COPY services/bench/Cargo.toml services/bench/
COPY services/serve/Cargo.toml services/serve/
COPY services/harness/Cargo.toml services/harness/
COPY services/experiments/Cargo.toml services/experiments/
COPY services/top/Cargo.toml services/top/
COPY services/chaos/Cargo.toml services/chaos/
COPY services/tls/Cargo.toml services/tls/
COPY examples/reservations/Cargo.toml examples/reservations/
RUN for crate in proto resilience idempotency tempgres domain node hop ledger bench serve harness experiments top chaos tls cli; do \
      mkdir -p services/$crate/src && touch services/$crate/src/lib.rs; \
    done \
 && for example in reservations; do \
      mkdir -p examples/$example/src && touch examples/$example/src/lib.rs; \
    done \
 && mkdir -p services/bench/src/bin \
 && echo 'fn main() {}' > services/bench/src/bin/hop-cost.rs \
 && echo 'fn main() {}' > services/cli/src/main.rs \
 && cargo build --release --locked --bin retrychain \
 && rm -rf target/release/.fingerprint/retrychain* target/release/.fingerprint/resilience-* \
           target/release/.fingerprint/idempotency-* target/release/deps/*idempotency* \
           target/release/.fingerprint/tempgres-* target/release/deps/*retrychain* \
           target/release/deps/*resilience* target/release/deps/*tempgres* \
           target/release/build/retrychain-*

# 2. The project itself: only its own crates compile here.
COPY services services
RUN cargo build --release --locked --bin retrychain \
 && cp target/release/retrychain /retrychain

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin retrychain
COPY --from=build /retrychain /usr/local/bin/retrychain
USER retrychain
ENTRYPOINT ["retrychain"]
CMD ["--help"]
