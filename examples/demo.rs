//! The README's first command (`scripts/demo` runs `cargo run --release --example demo`): the
//! same program as `examples/proxy-legacy.rs` (a legacy service behind palisade, and a zombie
//! refused).

#[path = "proxy-legacy.rs"]
mod proxy_legacy;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    proxy_legacy::main()
}
