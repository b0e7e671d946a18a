//! objstore-election: leader election on an object store (no etcd), failover after the
//! leader freezes, and the old leader's write refused.
//!
//! The election is `palisade::client::objstore` on object_store's in-memory store (or, built with
//! `object-store-aws`, on an S3-compatible server: `-- --endpoint URL --bucket NAME`). The
//! resource is the axum service of `lock-http` (order 42 behind `FenceLayer`).
//!
//! 1. A leads "scheduler" with `lead(..)`: the record's generation (1) is its token; it
//!    writes;
//! 2. A checks `ctx.lost` (not lost), then freezes (its thread and runtime, renewals
//!    included, as `kill -STOP` would);
//! 3. B, campaigning meanwhile, sees the record's version unchanged for a full TTL on its
//!    own clock, takes it over with `If-Match` as generation 2, and writes;
//! 4. A wakes inside its closure, still believing it leads, and writes with token 1:
//!    refused with 409. Then it checks `ctx.lost`: lost, "not renewed in time";
//! 5. B releases: the record stays (released, generation 2), and A's next campaign gets
//!    generation 3: tokens never go backwards.
//!
//! Run it with `cargo run --features layer,object-store --example objstore-election`. It
//! exits 0 only if the old leader's write was refused. `PALISADE_EXAMPLE_UNFENCED=1` serves
//! without the layer: A's write then lands over B's and the example exits 1.

#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/orders.rs"]
mod orders;
#[path = "common/process.rs"]
mod process;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use palisade::client::objstore::object_store::memory::InMemory;
use palisade::client::objstore::object_store::ObjectStore;
use palisade::client::objstore::{Elector, ElectorOptions};

const B_VALUE: &str = "plan by B";

fn options(holder: &str) -> ElectorOptions {
    ElectorOptions::new()
        .with_prefix("examples/elections")
        .with_ttl(process::TTL)
        .with_holder(holder)
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

/// The in-memory store, or an S3-compatible server with `--endpoint` and `--bucket`.
fn store() -> Result<Arc<dyn ObjectStore>, Box<dyn std::error::Error>> {
    let Some(endpoint) = arg("--endpoint") else {
        println!("  election records in object_store's InMemory store");
        return Ok(Arc::new(InMemory::new()));
    };
    s3(
        &endpoint,
        &arg("--bucket").unwrap_or_else(|| "palisade".to_owned()),
    )
}

#[cfg(feature = "object-store-aws")]
fn s3(endpoint: &str, bucket: &str) -> Result<Arc<dyn ObjectStore>, Box<dyn std::error::Error>> {
    use palisade::client::objstore::object_store::aws::{AmazonS3Builder, S3ConditionalPut};
    use palisade::client::objstore::object_store::{ClientOptions, RetryConfig};
    println!("  election records in s3://{bucket} at {endpoint}");
    // Credentials and region from the usual AWS_* variables; a local test server (moto,
    // minio) takes any. The election bounds each request itself: keep the client's own
    // retries and timeout below the TTL.
    let store = AmazonS3Builder::from_env()
        .with_endpoint(endpoint)
        .with_bucket_name(bucket)
        .with_conditional_put(S3ConditionalPut::ETagMatch)
        .with_retry(RetryConfig {
            max_retries: 1,
            ..RetryConfig::default()
        })
        .with_client_options(
            ClientOptions::new()
                .with_allow_http(endpoint.starts_with("http://"))
                .with_timeout(process::TTL / 4),
        )
        .build()?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "object-store-aws"))]
fn s3(_: &str, _: &str) -> Result<Arc<dyn ObjectStore>, Box<dyn std::error::Error>> {
    Err("--endpoint needs the S3 client: build with --features layer,object-store-aws".into())
}

async fn leader_a(
    elector: Elector,
    addr: SocketAddr,
    mut freezer: process::Freezer,
) -> Result<orders::Answer, String> {
    elector
        .lead("scheduler", |ctx| async move {
            let token = ctx.token;
            let first = orders::send(addr, "A", token, Some("plan by A")).await?;
            println!("  A: leads \"scheduler\" with token {token} (the record's generation); PUT -> {first}");
            let lost = ctx.lost.is_lost();
            println!("  A: checks ctx.lost (lost: {lost}), then freezes before its next write");
            freezer.freeze();
            println!("  A: wakes up in its lead closure, still believing it leads; PUT with token {token}");
            let late = orders::send(addr, "A", token, Some("plan by A (late)")).await;
            let mut lost = ctx.lost;
            println!("  A: then checks ctx.lost: lost ({})", lost.wait().await);
            late
        })
        .await
        .map_err(|e| e.to_string())?
}

async fn who_leads(elector: &Elector) -> Result<String, palisade::client::objstore::Error> {
    Ok(match elector.current("scheduler").await? {
        Some(lease) if lease.released => format!("nobody (generation {} released)", lease.token),
        Some(lease) => format!("{} (generation {})", lease.holder, lease.token),
        None => "nobody (no record)".to_owned(),
    })
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let fenced = !process::unfenced();
    let service = orders::serve("orders", fenced).await?;
    let addr = service.addr;
    println!("objstore-election: axum service on {addr}");
    if fenced {
        println!("  every request passes FenceLayer (resource \"orders\", marks in memory)");
    } else {
        println!("  PALISADE_EXAMPLE_UNFENCED=1: the app is served without FenceLayer");
    }
    let store = store()?;
    // Each elector checks first that the store honours If-Match and If-None-Match.
    let a = Elector::new(store.clone(), options("A")).await?;
    let b = Elector::new(store, options("B")).await?;
    println!("  both electors checked that the store honours If-Match and If-None-Match\n");
    let mut leader = process::spawn("leader-a", {
        let a = a.clone();
        move |freezer| leader_a(a, addr, freezer)
    });
    if !leader.frozen().await {
        return Err(format!("A ended before freezing: {:?}", leader.join().await.err()).into());
    }
    println!("  record now: {}", who_leads(&b).await?);

    let waited = Instant::now();
    println!("  B: campaigns with campaign(\"scheduler\")");
    let mut term = b.campaign("scheduler").await?;
    println!(
        "  B: leads after {:.1} s (A's record unchanged for a TTL) with token {}",
        waited.elapsed().as_secs_f64(),
        term.token()
    );
    let answer = orders::send(addr, "B", term.token(), Some(B_VALUE)).await?;
    println!("  B: PUT -> {answer}");
    println!("  record now: {}", who_leads(&b).await?);
    // A wakes while B leads.
    let late = leader.join().await?;
    println!("  A: -> {late}");
    term.release().await?;
    println!("  B: releases; record now: {}", who_leads(&b).await?);
    let mut again = a.campaign("scheduler").await?;
    println!(
        "  A: campaigns again and leads with token {}",
        again.token()
    );
    again.release().await?;

    let code = service.ledger.verdict(B_VALUE);
    if fenced && late.status != http::StatusCode::CONFLICT {
        println!("FAIL: the old leader's write should have been refused with 409");
        return Ok(ExitCode::FAILURE);
    }
    Ok(code)
}
