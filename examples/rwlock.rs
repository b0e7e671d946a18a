//! rwlock: readers sharing one phase token, an exclusive writer, and a zombie writer fenced
//! by the readers' phase.
//!
//! The resource is the axum service of `lock-http` (order 42 behind `FenceLayer`); reads carry
//! tokens too, so a read phase advances the mark like a write does.
//!
//! 1. writer A takes the write lock `doc` and writes; then it freezes and its lease expires;
//! 2. readers R1 and R2 ask for the read lock at the same time: both are granted once A's lease
//!    is gone, with one shared phase token, and read concurrently (equal tokens pass);
//! 3. writer B asks for the write lock and waits: it excludes the readers;
//! 4. A wakes up and writes with its old token: refused with 409, fenced by the readers' phase
//!    token (no writer has written since A);
//! 5. the readers release, B gets a higher token and writes.
//!
//! Run it with `cargo run --features layer --example rwlock`. It exits 0 only if A's late write
//! was refused. `PALISADE_EXAMPLE_UNFENCED=1` serves without the layer: A's write then lands
//! and the example exits 1.

#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/process.rs"]
mod process;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use palisade::{MemoryProvider, Provider, RwLockService, SessionOptions};

const B_VALUE: &str = "v3 by B";

fn options() -> SessionOptions {
    SessionOptions::new()
        .with_ttl(process::TTL)
        .with_namespace("/rw-example")
}

async fn writer_a(
    provider: MemoryProvider,
    addr: SocketAddr,
    mut freezer: process::Freezer,
) -> Result<orders::Answer, String> {
    let session = provider
        .session(options())
        .await
        .map_err(|e| e.to_string())?;
    let grant = session.write_lock("doc").await.map_err(|e| e.to_string())?;
    let token = grant.token();
    let first = orders::send(addr, "A", token, Some("v1 by A")).await?;
    println!("  A: write-locks \"doc\" with token {token}; PUT -> {first}");
    println!("  A: freezes before its next write; its lease expires");
    freezer.freeze();
    println!("  A: wakes up, still believing it holds the write lock; PUT with token {token}");
    orders::send(addr, "A", token, Some("v2 by A (late)")).await
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let fenced = !process::unfenced();
    let service = orders::serve("doc", fenced).await?;
    let addr = service.addr;
    println!("rwlock: axum service on {addr}");
    if fenced {
        println!("  every request, reads included, passes FenceLayer (resource \"doc\")\n");
    } else {
        println!("  PALISADE_EXAMPLE_UNFENCED=1: the app is served without FenceLayer\n");
    }
    let provider = MemoryProvider::new();
    // The main runtime's sessions first: the store's lease reaper runs on the runtime of its
    // first lease (see common/process.rs), and this one is never frozen.
    let (r1, r2, b) = (
        provider.session(options()).await?,
        provider.session(options()).await?,
        provider.session(options()).await?,
    );
    let mut a = process::spawn("writer-a", {
        let provider = provider.connect();
        move |freezer| writer_a(provider, addr, freezer)
    });
    if !a.frozen().await {
        return Err(format!("A ended before freezing: {:?}", a.join().await.err()).into());
    }

    let waited = Instant::now();
    let (g1, g2) = tokio::try_join!(r1.read_lock("doc"), r2.read_lock("doc"))?;
    let phase = g1.token();
    println!(
        "  R1, R2: read-lock together after {:.1} s (A's lease expired): tokens {} and {}",
        waited.elapsed().as_secs_f64(),
        g1.token(),
        g2.token()
    );
    let (read1, read2) = tokio::try_join!(
        orders::send(addr, "R1", g1.token(), None),
        orders::send(addr, "R2", g2.token(), None)
    )?;
    println!("  R1: GET -> {read1}\n  R2: GET -> {read2}");

    let mut writer_b = tokio::spawn(async move {
        let grant = b.write_lock("doc").await;
        (b, grant)
    });
    let early = tokio::time::timeout(Duration::from_millis(200), &mut writer_b).await;
    println!(
        "  B: asks for the write lock; {}",
        if early.is_err() {
            "waits while the readers hold it"
        } else {
            "granted while the readers hold it (!)"
        }
    );

    let late = a.join().await?;
    println!("  A: -> {late}");

    g1.runlock().await?;
    g2.runlock().await?;
    println!("  R1, R2: release the read lock");
    let (_b, grant) = writer_b.await?;
    let grant = grant?;
    let token = grant.token();
    let answer = orders::send(addr, "B", token, Some(B_VALUE)).await?;
    println!("  B: write-locks \"doc\" with token {token}; PUT -> {answer}");
    grant.unlock().await?;

    let code = service.ledger.verdict(B_VALUE);
    let mut failed = false;
    if g2.token() != phase {
        println!("FAIL: the readers should share one phase token");
        failed = true;
    }
    if early.is_ok() {
        println!("FAIL: B's write lock should wait for the readers");
        failed = true;
    }
    if fenced && late.status != http::StatusCode::CONFLICT {
        println!("FAIL: A's late write should have been refused with 409");
        failed = true;
    }
    Ok(if failed { ExitCode::FAILURE } else { code })
}
