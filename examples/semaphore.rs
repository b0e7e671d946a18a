//! Take one of N permits of a semaphore on etcd, print its slot and fencing token, hold it,
//! and report if the lease is lost.
//!
//! Start a local etcd first (Debian: `apt-get install etcd-server`):
//!
//! ```sh
//! etcd --data-dir /tmp/etcd-demo --listen-client-urls http://127.0.0.1:2379 \
//!      --advertise-client-urls http://127.0.0.1:2379 &
//! cargo run --features etcd --example semaphore -- --name jobs --permits 3 --hold-secs 30
//! ```
//!
//! Run it four times: three hold slots 0, 1 and 2 at once, the fourth waits. Stop one holder
//! with `kill -STOP` for longer than the TTL: the fourth takes over that slot with a higher
//! token while the other two keep theirs; `kill -CONT` the stopped one and it reports that its
//! permit is lost. Send each holder's writes to the resource of its slot (`resource=`): with
//! the `palisade` proxy, one guarded route per slot (`docs/client.md#semaphores`).
//!
//! Options: `--endpoint URL` (default http://127.0.0.1:2379), `--name NAME`, `--permits N`
//! (default 3), `--ttl SECS` (default 5), `--namespace PREFIX` (default /palisade),
//! `--hold-secs N` (default 10). Prints one line per event: `slot=<s> token=<t>
//! resource=<name>/<s>`, `lost`, `released`.

use std::io::Write;
use std::time::Duration;

use palisade::client::provider::etcd::EtcdProvider;
use palisade::{Provider, SemaphoreService, SessionOptions};

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
    let name = arg("--name", "jobs");
    let permits: u32 = arg("--permits", "3").parse()?;
    let ttl: u64 = arg("--ttl", "5").parse()?;
    let hold: u64 = arg("--hold-secs", "10").parse()?;
    let client = etcd_client::Client::connect([endpoint], None).await?;
    let options = SessionOptions::new()
        .with_ttl(Duration::from_secs(ttl))
        .with_namespace(arg("--namespace", "/palisade"));
    let session = EtcdProvider::new(&client).session(options).await?;
    let permit = session.acquire(&name, permits).await?;
    say(&format!(
        "slot={} token={} resource={}",
        permit.slot(),
        permit.token(),
        permit.resource()
    ));
    let mut lost = permit.loss_signal();
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs(hold)) => {
            permit.release().await?;
            say("released");
        }
        _ = lost.wait() => say("lost"),
    }
    Ok(())
}
