//! Lock handoff latency on a real etcd: from `unlock` returning to the next waiter's `lock`
//! returning, palisade's lock beside etcd's own v3lock service (etcd-client `lock`/`unlock`),
//! in the same run on the same etcd. Also election handoff after `resign`, beside v3election.
//!
//! Method: a holder holds; a waiter starts acquiring; once the waiter's queue key exists, the
//! bench waits 20 ms so the waiter is parked in its watch, then the holder releases. Each
//! sample is one handoff; N samples per variant (default 300, `HANDOFFS=N` to change).
//!
//! Run: `cargo bench --features etcd --bench handoff` (needs Debian's etcd-server).

#![allow(missing_docs)]

#[path = "../tests/support/etcd.rs"]
mod etcd;

use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, LockOptions, ResignOptions};
use palisade::client::provider::etcd::EtcdProvider;
use palisade::{ElectionService, LockService, Provider, SessionOptions};

const PARK: Duration = Duration::from_millis(20);

async fn wait_for_keys(client: &mut Client, prefix: &str, n: usize) {
    loop {
        let r = client
            .get(
                prefix,
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .unwrap();
        if r.kvs().len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn stats(name: &str, mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    let (median, p99) = (pick(0.5), pick(0.99));
    println!(
        "{name:<28} n={:<4} median {:>9.3} ms   p99 {:>9.3} ms",
        samples.len(),
        ms(median),
        ms(p99)
    );
    median
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn palisade_lock(client: &Client, n: usize) -> Vec<Duration> {
    let p = EtcdProvider::new(client);
    let opts = || {
        SessionOptions::new()
            .with_namespace("/bench")
            .with_ttl(Duration::from_secs(10))
    };
    let (a, b) = (
        p.session(opts()).await.unwrap(),
        p.session(opts()).await.unwrap(),
    );
    let mut raw = client.clone();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let held = a.lock("handoff").await.unwrap();
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move {
                let g = b.lock("handoff").await.unwrap();
                (Instant::now(), g)
            })
        };
        wait_for_keys(&mut raw, "/bench/lock/handoff/q/", 2).await;
        tokio::time::sleep(PARK).await;
        held.unlock().await.unwrap();
        let released = Instant::now();
        let (acquired, g) = waiter.await.unwrap();
        out.push(acquired.saturating_duration_since(released));
        g.unlock().await.unwrap();
    }
    out
}

async fn v3lock(client: &Client, n: usize) -> Vec<Duration> {
    let mut c = client.clone();
    let la = c.lease_grant(600, None).await.unwrap().id();
    let lb = c.lease_grant(600, None).await.unwrap().id();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let key = c
            .lock("/v3lock/handoff", Some(LockOptions::new().with_lease(la)))
            .await
            .unwrap()
            .key()
            .to_vec();
        let waiter = {
            let mut c = client.clone();
            tokio::spawn(async move {
                let k = c
                    .lock("/v3lock/handoff", Some(LockOptions::new().with_lease(lb)))
                    .await
                    .unwrap()
                    .key()
                    .to_vec();
                (Instant::now(), k)
            })
        };
        wait_for_keys(&mut c, "/v3lock/handoff", 2).await;
        tokio::time::sleep(PARK).await;
        c.unlock(key).await.unwrap();
        let released = Instant::now();
        let (acquired, k) = waiter.await.unwrap();
        out.push(acquired.saturating_duration_since(released));
        c.unlock(k).await.unwrap();
    }
    c.lease_revoke(la).await.ok();
    c.lease_revoke(lb).await.ok();
    out
}

async fn palisade_election(client: &Client, n: usize) -> Vec<Duration> {
    let p = EtcdProvider::new(client);
    let opts = || {
        SessionOptions::new()
            .with_namespace("/bench")
            .with_ttl(Duration::from_secs(10))
    };
    let (a, b) = (
        p.session(opts()).await.unwrap(),
        p.session(opts()).await.unwrap(),
    );
    let mut raw = client.clone();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let leader = a.campaign("handoff", "a").await.unwrap();
        let follower = {
            let b = b.clone();
            tokio::spawn(async move {
                let l = b.campaign("handoff", "b").await.unwrap();
                (Instant::now(), l)
            })
        };
        wait_for_keys(&mut raw, "/bench/election/handoff/q/", 2).await;
        tokio::time::sleep(PARK).await;
        leader.resign().await.unwrap();
        let resigned = Instant::now();
        let (led, l) = follower.await.unwrap();
        out.push(led.saturating_duration_since(resigned));
        l.resign().await.unwrap();
    }
    out
}

async fn v3election(client: &Client, n: usize) -> Vec<Duration> {
    let mut c = client.clone();
    let la = c.lease_grant(600, None).await.unwrap().id();
    let lb = c.lease_grant(600, None).await.unwrap().id();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let key = c
            .campaign("/v3election/handoff", "a", la)
            .await
            .unwrap()
            .take_leader()
            .unwrap();
        let follower = {
            let mut c = client.clone();
            tokio::spawn(async move {
                let k = c
                    .campaign("/v3election/handoff", "b", lb)
                    .await
                    .unwrap()
                    .take_leader()
                    .unwrap();
                (Instant::now(), k)
            })
        };
        wait_for_keys(&mut c, "/v3election/handoff", 2).await;
        tokio::time::sleep(PARK).await;
        c.resign(Some(ResignOptions::new().with_leader(key)))
            .await
            .unwrap();
        let resigned = Instant::now();
        let (led, k) = follower.await.unwrap();
        out.push(led.saturating_duration_since(resigned));
        c.resign(Some(ResignOptions::new().with_leader(k)))
            .await
            .unwrap();
    }
    c.lease_revoke(la).await.ok();
    c.lease_revoke(lb).await.ok();
    out
}

#[tokio::main]
async fn main() {
    // `cargo test --all-targets` runs benches as tests; a handoff run is too long for that.
    if std::env::args().any(|a| a == "--test") || !std::env::args().any(|a| a == "--bench") {
        println!("handoff: run with `cargo bench --features etcd --bench handoff`");
        return;
    }
    let n: usize = std::env::var("HANDOFFS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let etcd = etcd::Etcd::single().await;
    let client = etcd.client().await;
    println!("handoff latency on one local etcd node, {n} handoffs each (unlock/resign returned -> next owner's call returned)");
    let pl = stats("palisade lock", palisade_lock(&client, n).await);
    let vl = stats("etcd v3lock", v3lock(&client, n).await);
    println!(
        "  -> palisade lock is {:.1}x faster (median)",
        vl.as_secs_f64() / pl.as_secs_f64().max(1e-9)
    );
    let pe = stats("palisade election", palisade_election(&client, n).await);
    let ve = stats("etcd v3election", v3election(&client, n).await);
    println!(
        "  -> palisade election is {:.1}x faster (median)",
        ve.as_secs_f64() / pe.as_secs_f64().max(1e-9)
    );
}
