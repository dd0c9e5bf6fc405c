# One image, one binary: `retrychain edge|relay|ledger|health|…`.
# Build stage: the official Rust image. Run stage: slim Debian, non-root, no build tools.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin retrychain \
 && cp target/release/retrychain /retrychain

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin retrychain
COPY --from=build /retrychain /usr/local/bin/retrychain
USER retrychain
ENTRYPOINT ["retrychain"]
CMD ["--help"]
