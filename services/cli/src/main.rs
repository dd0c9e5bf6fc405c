//! `retrychain`: everything is library code ([`retrychain::main`]); this file only picks
//! the allocator.

/// mimalloc, not glibc's malloc: after an overload every service's memory goes back near
/// its idle figure (freed pages are returned to the system after a short delay), where
/// glibc kept the edge at twice its idle size for good (docs/benchmarks.md, memory after
/// overload).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    retrychain::main()
}
