//! lock-http: an axum service fenced by palisade's `FenceLayer`, and a zombie lock holder.
//!
//! 1. owner A takes the lock `orders` (in-memory coordination store, 1 s leases) and writes
//!    order 42 with its token;
//! 2. A freezes (its thread blocks, keepalive included); its lease expires;
//! 3. owner B takes the lock with a higher token and writes; the layer advances the mark;
//! 4. A wakes up, still believing it holds the lock (it checked just before it froze), and
//!    writes again: the layer answers `409 Conflict` and the handler never runs.
//!
//! Run it with `cargo run --features layer --example lock-http`. It exits 0 only if A's late
//! write was refused. `PALISADE_EXAMPLE_UNFENCED=1` serves the same app without the layer:
//! A's write then lands over B's and the example exits 1.

#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/process.rs"]
mod process;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Instant;

use palisade::{LockService, MemoryProvider, Provider, SessionOptions};

const B_VALUE: &str = "cancelled by B";

fn options() -> SessionOptions {
    SessionOptions::new()
        .with_ttl(process::TTL)
        .with_namespace("/lock-http")
}

async fn owner_a(
    provider: MemoryProvider,
    addr: SocketAddr,
    mut freezer: process::Freezer,
) -> Result<orders::Answer, String> {
    let session = provider
        .session(options())
        .await
        .map_err(|e| e.to_string())?;
    let grant = session.lock("orders").await.map_err(|e| e.to_string())?;
    let token = grant.token();
    let first = orders::send(addr, "A", token, Some("shipped by A")).await?;
    println!(
        "  A: locks \"orders\" with token {token}; PUT {} -> {first}",
        orders::PATH
    );
    let lost = grant.loss_signal().is_lost();
    println!("  A: checks its grant (lost: {lost}), then freezes before its next write");
    freezer.freeze();
    println!("  A: wakes up, still believing it holds the lock; PUT with token {token}");
    orders::send(addr, "A", token, Some("shipped by A (late)")).await
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let fenced = !process::unfenced();
    let service = orders::serve("orders", fenced).await?;
    println!("lock-http: axum service on {}", service.addr);
    if fenced {
        println!("  every request passes FenceLayer (resource \"orders\", marks in memory)\n");
    } else {
        println!("  PALISADE_EXAMPLE_UNFENCED=1: the app is served without FenceLayer\n");
    }
    let provider = MemoryProvider::new();
    // B's session first: the store's lease reaper runs on the runtime of its first lease
    // (see common/process.rs), and this one is never frozen.
    let b = provider.session(options()).await?;
    let mut a = process::spawn("owner-a", {
        let (provider, addr) = (provider.connect(), service.addr);
        move |freezer| owner_a(provider, addr, freezer)
    });
    if !a.frozen().await {
        return Err(format!("A ended before freezing: {:?}", a.join().await.err()).into());
    }
    let waited = Instant::now();
    let grant = b.lock("orders").await?;
    let token = grant.token();
    println!(
        "  B: locks \"orders\" after {:.1} s (A's lease expired) with token {token}",
        waited.elapsed().as_secs_f64()
    );
    let answer = orders::send(service.addr, "B", token, Some(B_VALUE)).await?;
    println!("  B: PUT {} -> {answer}", orders::PATH);
    let late = a.join().await?;
    println!("  A: -> {late}");
    grant.unlock().await?;
    let code = service.ledger.verdict(B_VALUE);
    if fenced && late.status != http::StatusCode::CONFLICT {
        println!("FAIL: A's late write should have been refused with 409");
        return Ok(ExitCode::FAILURE);
    }
    Ok(code)
}
