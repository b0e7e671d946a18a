//! Take a lock on etcd, print its fencing token, hold it, and report if the lease is lost.
//!
//! Start a local etcd first (Debian: `apt-get install etcd-server`):
//!
//! ```sh
//! etcd --data-dir /tmp/etcd-demo --listen-client-urls http://127.0.0.1:2379 \
//!      --advertise-client-urls http://127.0.0.1:2379 &
//! cargo run --features etcd --example lock -- --name orders --hold-secs 30
//! ```
//!
//! Run it twice: the second waits for the first, then prints a higher token. Stop the first
//! with `kill -STOP` for longer than the TTL and the second takes over; `kill -CONT` the first
//! and it reports that its lease is lost and that it can no longer get a token.
//!
//! Options: `--endpoint URL` (default http://127.0.0.1:2379), `--name NAME`, `--ttl SECS`
//! (default 5), `--namespace PREFIX` (default /palisade), `--hold-secs N` (default 10).
//! Prints one line per event: `token=<t>`, `lost`, `relock=<error>`, `released`.

use std::io::Write;
use std::time::Duration;

use palisade::client::provider::etcd::EtcdProvider;
use palisade::{LockService, Provider, SessionOptions};

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = arg("--endpoint", "http://127.0.0.1:2379");
    let name = arg("--name", "demo");
    let ttl: u64 = arg("--ttl", "5").parse()?;
    let hold: u64 = arg("--hold-secs", "10").parse()?;
    let client = etcd_client::Client::connect([endpoint], None).await?;
    let provider = EtcdProvider::new(&client);
    let options = SessionOptions::new()
        .with_ttl(Duration::from_secs(ttl))
        .with_namespace(arg("--namespace", "/palisade"));
    let session = provider.session(options).await?;
    let grant = session.lock(&name).await?;
    say(&format!("token={}", grant.token()));
    let mut lost = grant.loss_signal();
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs(hold)) => {
            grant.unlock().await?;
            say("released");
        }
        _ = lost.wait() => {
            say("lost");
            // A lost session cannot mint another token: the lease that owned the queue entry is gone.
            match session.lock(&name).await {
                Ok(g) => say(&format!("relock-token={}", g.token())),
                Err(e) => say(&format!("relock={e}")),
            }
        }
    }
    Ok(())
}
