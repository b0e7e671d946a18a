//! warehouses: one legacy inventory API, 50 warehouses, one lock (and one mark) per warehouse.
//!
//! Tokens are revisions of one coordination store, global to it, so the tokens of the 50
//! locks interleave: with one mark for the whole route, warehouse 8's owner would be refused
//! as soon as warehouse 7's owner advanced that mark past its token. The route here takes its
//! resource from the path (`path_pattern = "/warehouses/{id}/stock"`, `resource =
//! "warehouse/{id}"`), so each warehouse's token is judged against its own mark:
//!
//! 1. 50 owners, one per warehouse (in-memory coordination store), each lock their warehouse
//!    and write through palisade: all 50 writes are applied, whatever order the tokens came in;
//! 2. warehouse 7's owner A loses its lock (its session ends, as a frozen process's lease
//!    runs out), B takes it with a newer token and writes;
//! 3. A, still holding its old token, writes again: `409 Conflict`, never applied, while the
//!    other warehouses' owners go on writing with their own (older) tokens.
//!
//! Run it with `cargo run --example warehouses`. It exits 0 only if A's late write was refused
//! and no owner was refused falsely. `PALISADE_EXAMPLE_UNFENCED=1` makes the route unguarded:
//! A's write then lands after B's and the example exits 1.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use palisade::{LockService, MemoryProvider, Provider, SessionOptions};
use tokio::net::TcpListener;

const WAREHOUSES: u64 = 50;

type Http = Client<HttpConnector, Full<Bytes>>;

/// Writes `body` to warehouse `id`'s stock with `token`; the status that came back.
async fn write(
    http: &Http,
    proxy: std::net::SocketAddr,
    id: u64,
    token: u64,
    body: &str,
) -> StatusCode {
    let req = Request::post(format!("http://{proxy}/warehouses/{id}/stock"))
        .header("x-fencing-token", token)
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("a valid request");
    match http.request(req).await {
        Ok(resp) => {
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            status
        }
        Err(e) => {
            println!("   request failed: {e}");
            StatusCode::BAD_GATEWAY
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The legacy inventory service: applies every write it gets, knows nothing of fencing.
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let legacy = TcpListener::bind("127.0.0.1:0").await?;
    let legacy_addr = legacy.local_addr()?;
    let log = Arc::clone(&applied);
    tokio::spawn(palisade::proxy::server::serve(
        legacy,
        move |req: Request<hyper::body::Incoming>, _| {
            let log = Arc::clone(&log);
            async move {
                let path = req.uri().path().to_owned();
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                log.lock()
                    .unwrap()
                    .push(format!("{path} {}", String::from_utf8_lossy(&body)));
                Response::new(Full::new(Bytes::from_static(b"applied\n")))
            }
        },
        std::future::pending::<()>(),
        Duration::from_secs(1),
    ));

    let guard = std::env::var_os("PALISADE_EXAMPLE_UNFENCED").is_none_or(|v| v != "1");
    if !guard {
        println!("PALISADE_EXAMPLE_UNFENCED=1: the route forwards without checking tokens");
    }
    let dir = tempfile::tempdir()?;
    let config = format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
[marks]
store = "file"
path = "marks.db"
[[upstream]]
name = "inventory"
url = "http://{legacy_addr}"
[[route]]
name = "stock"
upstream = "inventory"
path_pattern = "/warehouses/{{id}}/stock"
resource = "warehouse/{{id}}"
guard = {guard}
"#
    );
    let config = palisade::Config::parse(&config, &dir.path().join("palisade.toml"))?;
    let listeners = palisade::Listeners {
        proxy: TcpListener::bind("127.0.0.1:0").await?,
        admin: None,
    };
    let proxy = listeners.proxy.local_addr()?;
    tokio::spawn(palisade::run(
        config,
        listeners,
        std::future::pending::<()>(),
    ));
    let http: Http = Client::builder(TokioExecutor::new()).build(HttpConnector::new());

    let provider = MemoryProvider::new();
    let options = || {
        SessionOptions::new()
            .with_ttl(Duration::from_secs(5))
            .with_namespace("/warehouses")
    };
    println!("-- 50 owners, one lock per warehouse, write through palisade on {proxy}");
    let mut owners = Vec::new();
    for id in 1..=WAREHOUSES {
        let session = provider.session(options()).await?;
        let grant = session.lock(&format!("warehouse/{id}")).await?;
        owners.push((id, session, grant));
    }
    // Newest lock first: every later write carries an older token than the one before it.
    let mut false_rejections = 0;
    for (id, _, grant) in owners.iter().rev() {
        let status = write(&http, proxy, *id, grant.token().get(), "count=10").await;
        if status != StatusCode::OK {
            false_rejections += 1;
            println!("   warehouse {id} token {} -> {status}", grant.token());
        }
    }
    println!(
        "   50 writes, tokens {}..{} in falling order: {false_rejections} refused",
        owners[0].2.token(),
        owners[49].2.token()
    );

    println!("-- warehouse 7: owner A's lease is gone, B locks it and writes");
    let (_, a_session, a_grant) = owners.remove(6);
    let a_token = a_grant.token().get();
    drop(a_grant);
    a_session.close().await?;
    let b_session = provider.session(options()).await?;
    let b_grant = b_session.lock("warehouse/7").await?;
    let b = write(&http, proxy, 7, b_grant.token().get(), "count=3 (B)").await;
    println!("   B token {} -> {b}", b_grant.token());

    println!("-- A wakes up and writes with its old token {a_token}; the other owners write too");
    let a = write(&http, proxy, 7, a_token, "count=99 (A, stale)").await;
    println!("   A token {a_token} -> {a}");
    for (id, _, grant) in &owners {
        if write(&http, proxy, *id, grant.token().get(), "count=11").await != StatusCode::OK {
            false_rejections += 1;
        }
    }
    let applied = applied.lock().unwrap();
    let last_7 = applied
        .iter()
        .rfind(|w| w.starts_with("/warehouses/7/"))
        .cloned();
    println!(
        "\nlast write the inventory applied to warehouse 7: {}",
        last_7.as_deref().unwrap_or("none")
    );
    println!("owners refused although they held their warehouse's lock: {false_rejections}");
    if a == StatusCode::CONFLICT
        && false_rejections == 0
        && last_7.as_deref() == Some("/warehouses/7/stock count=3 (B)")
    {
        println!("\nOK: the zombie was refused, and no other warehouse's owner was.");
        Ok(())
    } else {
        println!("\nFAIL: a stale write got through (or an owner was refused falsely)");
        Err("a stale write got through".into())
    }
}
