//! The zombie story, end to end, on the embedded default (file marks, no etcd).
//!
//! Starts a tiny "legacy" HTTP service that appends every write it receives to a log, puts
//! palisade in front of it, and replays what happens when a lock holder freezes:
//!
//! 1. owner A holds the lock with token 34 and writes;
//! 2. A freezes, its lease expires, owner B takes the lock with token 51 and writes;
//! 3. A wakes up, still believing it owns the lock, and writes with token 34.
//!
//! Run it with `cargo run --release --example proxy-legacy` (or `--example demo`, the same
//! program). `PALISADE_EXAMPLE_UNFENCED=1` turns the route's guard off (`guard = false`): the
//! zombie's write then reaches the service and the example exits non-zero.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

#[tokio::main]
pub(crate) async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // palisade's own decision log (mark advances, refusals) on stderr; RUST_LOG overrides.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("palisade=info")),
        )
        .with_target(false)
        // Colours only on a terminal: `demo > out.txt` gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .compact()
        .init();
    // The legacy service: knows nothing about fencing, just applies writes.
    let applied: Arc<Mutex<Vec<String>>> = Arc::default();
    let legacy = TcpListener::bind("127.0.0.1:0").await?;
    let legacy_addr = legacy.local_addr()?;
    let log = applied.clone();
    tokio::spawn(palisade::proxy::server::serve(
        legacy,
        move |req: Request<hyper::body::Incoming>, _| {
            let log = log.clone();
            async move {
                let who = req
                    .headers()
                    .get("x-owner")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("?")
                    .to_owned();
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                log.lock()
                    .unwrap()
                    .push(format!("{who}: {}", String::from_utf8_lossy(&body)));
                Response::new(Full::new(Bytes::from_static(b"applied\n")))
            }
        },
        std::future::pending::<()>(),
        Duration::from_secs(1),
    ));

    let dir = tempfile::tempdir()?;
    // The switch tests/examples/main.rs uses to show that the fence is what refuses the zombie.
    let guard = std::env::var_os("PALISADE_EXAMPLE_UNFENCED").is_none_or(|v| v != "1");
    if !guard {
        println!("PALISADE_EXAMPLE_UNFENCED=1: the route forwards without checking tokens");
    }
    let config_text = format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[marks]
store = "file"
path = "marks.db"
[[upstream]]
name = "legacy"
url = "http://{legacy_addr}"
[[route]]
name = "orders-write"
upstream = "legacy"
path_prefix = "/orders"
methods = ["POST"]
resource = "orders"
guard = {guard}
"#
    );
    let config = palisade::Config::parse(&config_text, &dir.path().join("palisade.toml"))?;
    let listeners = palisade::Listeners {
        proxy: TcpListener::bind("127.0.0.1:0").await?,
        admin: Some(TcpListener::bind("127.0.0.1:0").await?),
    };
    let proxy = listeners.proxy.local_addr()?;
    let admin = listeners
        .admin
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?
        .expect("admin bound");
    tokio::spawn(palisade::run(
        config,
        listeners,
        std::future::pending::<()>(),
    ));
    println!("legacy service on {legacy_addr}, palisade on {proxy}, admin on {admin}");
    println!("marks file: {}", dir.path().join("marks.db").display());

    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    // Ready once the admin endpoint answers, so palisade's startup log comes first.
    let livez = Request::get(format!("http://{admin}/livez")).body(Full::default())?;
    client.request(livez).await?;
    println!();
    let steps = [
        (
            "A",
            34,
            "set order 7 to 'shipped'",
            "owner A holds the lock (token 34) and writes",
        ),
        (
            "B",
            51,
            "set order 7 to 'cancelled'",
            "A freezes, its lease expires; owner B locks (token 51) and writes",
        ),
        (
            "A",
            34,
            "set order 7 to 'shipped'",
            "A wakes up, still believes it owns the lock, writes again",
        ),
    ];
    for (who, token, write, story) in steps {
        println!("-- {story}");
        let req = Request::post(format!("http://{proxy}/orders/7"))
            .header("x-fencing-token", token)
            .header("x-owner", who)
            .body(Full::new(Bytes::from(write)))?;
        let resp = client.request(req).await?;
        let status = resp.status();
        let mark = resp
            .headers()
            .get("x-fencing-mark")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = resp.into_body().collect().await?.to_bytes();
        print!("   POST /orders/7 token={token} -> {status}");
        match mark {
            Some(m) => println!(
                " (x-fencing-mark: {m})\n   {}",
                String::from_utf8_lossy(&body)
            ),
            None => println!(),
        }
    }

    println!("\nwrites the legacy service applied:");
    for w in applied.lock().unwrap().iter() {
        println!("   {w}");
    }
    let metrics = client
        .request(Request::get(format!("http://{admin}/metrics")).body(Full::default())?)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    println!("\nfrom http://{admin}/metrics:");
    for line in String::from_utf8_lossy(&metrics).lines() {
        if line.starts_with("palisade_stale_rejections_total") || line.starts_with("palisade_mark{")
        {
            println!("   {line}");
        }
    }
    let applied = applied.lock().unwrap();
    if applied.len() == 2 && applied[1].starts_with("B:") {
        println!("\nOK: the zombie was refused: the legacy service never saw its write.");
        Ok(())
    } else {
        println!(
            "\nFAIL: a stale write got through: the zombie's write reached the legacy service"
        );
        Err("the zombie's write reached the legacy service".into())
    }
}
