//! election-failover: a leader with `Session::lead(..)`, failover after it freezes, and the
//! old leader's write refused.
//!
//! The resource is the axum service of `lock-http` (order 42 behind `FenceLayer`).
//!
//! 1. A campaigns with `lead("scheduler", ..)` and leads: it writes with its term's token;
//! 2. A checks `term.lost` (not lost), then freezes; its lease expires;
//! 3. B, campaigning meanwhile, becomes leader with a higher token and writes;
//! 4. A wakes up inside its `lead` closure, still believing it leads, and writes: refused
//!    with 409, while B leads.
//!
//! (`examples/election.rs` is a different program: the etcd command-line candidate the crash
//! tests run.) Run it with `cargo run --features layer --example election-failover`. It exits
//! 0 only if the old leader's write was refused. `PALISADE_EXAMPLE_UNFENCED=1` serves without
//! the layer: A's write then lands over B's and the example exits 1.

#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/process.rs"]
mod process;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Instant;

use palisade::{ElectionService, MemoryProvider, Provider, Session, SessionOptions};

const B_VALUE: &str = "plan by B";

fn options() -> SessionOptions {
    SessionOptions::new()
        .with_ttl(process::TTL)
        .with_namespace("/election-failover")
}

async fn leader_a(
    provider: MemoryProvider,
    addr: SocketAddr,
    mut freezer: process::Freezer,
) -> Result<orders::Answer, String> {
    let session = provider
        .session(options())
        .await
        .map_err(|e| e.to_string())?;
    session
        .lead("scheduler", "A", |term| async move {
            let token = term.token;
            let first = orders::send(addr, "A", token, Some("plan by A")).await?;
            println!("  A: leads \"scheduler\" with token {token}; PUT -> {first}");
            let lost = term.lost.is_lost();
            println!("  A: checks term.lost (lost: {lost}), then freezes before its next write");
            freezer.freeze();
            println!("  A: wakes up in its lead closure, still believing it leads; PUT with token {token}");
            orders::send(addr, "A", token, Some("plan by A (late)")).await
        })
        .await
        .map_err(|e| e.to_string())?
}

async fn who_leads(session: &Session) -> Result<String, palisade::Error> {
    Ok(match session.leader("scheduler").await? {
        Some(term) => format!(
            "{} (token {})",
            String::from_utf8_lossy(&term.value),
            term.token
        ),
        None => "nobody".to_owned(),
    })
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let fenced = !process::unfenced();
    let service = orders::serve("orders", fenced).await?;
    let addr = service.addr;
    println!("election-failover: axum service on {addr}");
    if fenced {
        println!("  every request passes FenceLayer (resource \"orders\", marks in memory)\n");
    } else {
        println!("  PALISADE_EXAMPLE_UNFENCED=1: the app is served without FenceLayer\n");
    }
    let provider = MemoryProvider::new();
    // B's session first: the store's lease reaper runs on the runtime of its first lease
    // (see common/process.rs), and this one is never frozen.
    let b = provider.session(options()).await?;
    let mut a = process::spawn("leader-a", {
        let provider = provider.connect();
        move |freezer| leader_a(provider, addr, freezer)
    });
    if !a.frozen().await {
        return Err(format!("A ended before freezing: {:?}", a.join().await.err()).into());
    }
    println!("  leader now: {}", who_leads(&b).await?);

    let waited = Instant::now();
    println!("  B: campaigns with lead(\"scheduler\", ..)");
    let observer = &b;
    let late = b
        .lead("scheduler", "B", |term| async move {
            println!(
                "  B: leads after {:.1} s (A's lease expired) with token {}",
                waited.elapsed().as_secs_f64(),
                term.token
            );
            let answer = orders::send(addr, "B", term.token, Some(B_VALUE)).await?;
            println!("  B: PUT -> {answer}");
            let leader = who_leads(observer).await.map_err(|e| e.to_string())?;
            println!("  leader now: {leader}");
            // A wakes while B leads.
            a.join().await
        })
        .await??;
    println!("  A: -> {late}");

    let code = service.ledger.verdict(B_VALUE);
    if fenced && late.status != http::StatusCode::CONFLICT {
        println!("FAIL: the old leader's write should have been refused with 409");
        return Ok(ExitCode::FAILURE);
    }
    Ok(code)
}
