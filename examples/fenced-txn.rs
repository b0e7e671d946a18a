//! Fenced etcd transactions: a zombie's writes to etcd itself fail like its HTTP writes do.
//!
//! Start a local etcd first (Debian: `apt-get install etcd-server`):
//!
//! ```sh
//! etcd --data-dir /tmp/etcd-demo --listen-client-urls http://127.0.0.1:2379 \
//!      --advertise-client-urls http://127.0.0.1:2379 &
//! cargo run --features etcd --example fenced-txn
//! ```
//!
//! A takes the lock `accounts` and moves money between two accounts with the STM helper,
//! fenced by its grant. Then A's lease ends behind its back (revoked here from another
//! client, as etcd does when a frozen owner's TTL runs out), B takes over and moves money
//! too, and A, still holding its old grant, tries again: its transaction fails with
//! `NotOwner` and writes nothing. Exits 0 only if the zombie's write was refused and the total
//! is conserved.
//!
//! Options: `--endpoint URL` (default http://127.0.0.1:2379), `--namespace PREFIX` (default
//! /palisade-example; the example's data lives under `<prefix>/data/`).

use std::time::Duration;

use palisade::client::fenced_txn::{Stm, TxnError};
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

fn parse(v: Option<Vec<u8>>) -> Result<u64, TxnError> {
    let v = v.ok_or_else(|| TxnError::abort("no such account"))?;
    String::from_utf8_lossy(&v)
        .parse()
        .map_err(|e| TxnError::abort(format!("not a balance: {e}")))
}

/// Moves `amount` from `from` to `to` in one serializable transaction fenced by `stm`'s grant.
async fn transfer(stm: &Stm, from: &str, to: &str, amount: u64) -> Result<(), TxnError> {
    stm.run(|tx| async move {
        let a = parse(tx.get(from).await?)?;
        let b = parse(tx.get(to).await?)?;
        if a < amount {
            return Err(TxnError::abort("insufficient funds"));
        }
        tx.put(from, (a - amount).to_string());
        tx.put(to, (b + amount).to_string());
        Ok(())
    })
    .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = arg("--endpoint", "http://127.0.0.1:2379");
    let ns = arg("--namespace", "/palisade-example");
    let client = etcd_client::Client::connect([endpoint], None).await?;
    let (alice, bob) = (format!("{ns}/data/alice"), format!("{ns}/data/bob"));
    let mut c = client.clone();
    c.put(alice.as_str(), "100", None).await?;
    c.put(bob.as_str(), "100", None).await?;
    let provider = EtcdProvider::new(&client);
    let options = SessionOptions::new()
        .with_ttl(Duration::from_secs(5))
        .with_namespace(ns.clone());

    let a_session = provider.session(options.clone()).await?;
    let a = a_session.lock("accounts").await?;
    println!("A holds the lock, token {}", a.token());
    let a_stm = Stm::new(&client).fenced(&a);
    transfer(&a_stm, &alice, &bob, 30).await?;
    println!("A moved 30 from alice to bob");

    // A freezes; its lease ends in etcd (revoked here so the example need not wait a TTL).
    c.lease_revoke(a_session.lease_id()).await?;
    let b_session = provider.session(options).await?;
    let b = b_session.lock("accounts").await?;
    println!("A's lease is gone; B holds the lock, token {}", b.token());
    transfer(&Stm::new(&client).fenced(&b), &bob, &alice, 50).await?;
    println!("B moved 50 from bob to alice");

    // A wakes up and carries on with its old grant.
    let refused = match transfer(&a_stm, &alice, &bob, 70).await {
        Err(TxnError::NotOwner { key }) => {
            println!("A (zombie) tried to move 70: refused, not the owner of {key}");
            true
        }
        Ok(()) => {
            println!("A (zombie) moved 70: the zombie's write went through!");
            false
        }
        Err(e) => return Err(e.into()),
    };
    let balance = |k: String| {
        let mut c = client.clone();
        async move {
            let r = c.get(k, None).await?;
            let v = r.kvs().first().map(|kv| kv.value().to_vec());
            Ok::<u64, Box<dyn std::error::Error>>(parse(v)?)
        }
    };
    let (x, y) = (balance(alice).await?, balance(bob).await?);
    println!("alice {x}, bob {y}, total {}", x + y);
    b.unlock().await?;
    b_session.close().await?;
    if refused && x == 120 && y == 80 {
        Ok(())
    } else {
        Err("the zombie's write was not refused".into())
    }
}
