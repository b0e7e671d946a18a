//! Campaign in an election on etcd, lead while printing the term's token, observe the rest.
//!
//! Start a local etcd first (Debian: `apt-get install etcd-server`):
//!
//! ```sh
//! etcd --data-dir /tmp/etcd-demo --listen-client-urls http://127.0.0.1:2379 \
//!      --advertise-client-urls http://127.0.0.1:2379 &
//! cargo run --features etcd --example election -- --name scheduler --value node-1
//! ```
//!
//! Run several: one leads (`leader token=<t>`), the others wait; kill the leader and another
//! takes over with a higher token once the lease expires.
//!
//! Options: `--endpoint URL` (default http://127.0.0.1:2379), `--name NAME`, `--value VALUE`,
//! `--ttl SECS` (default 5), `--namespace PREFIX` (default /palisade), `--lead-secs N`
//! (default 3600).

use std::io::Write;
use std::time::Duration;

use palisade::client::provider::etcd::EtcdProvider;
use palisade::{Provider, SessionOptions};

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
    let client =
        etcd_client::Client::connect([arg("--endpoint", "http://127.0.0.1:2379")], None).await?;
    let provider = EtcdProvider::new(&client);
    let ttl: u64 = arg("--ttl", "5").parse()?;
    let options = SessionOptions::new()
        .with_ttl(Duration::from_secs(ttl))
        .with_namespace(arg("--namespace", "/palisade"));
    let session = provider.session(options).await?;
    let name = arg("--name", "demo");
    let lead_for = Duration::from_secs(arg("--lead-secs", "3600").parse()?);
    say("campaigning");
    let outcome = session
        .lead(&name, arg("--value", "candidate"), |ctx| async move {
            say(&format!("leader token={}", ctx.token));
            let mut lost = ctx.lost;
            tokio::select! {
                _ = lost.wait() => "lost",
                _ = tokio::time::sleep(lead_for) => "resigned",
            }
        })
        .await?;
    say(outcome);
    Ok(())
}
