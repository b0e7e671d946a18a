//! A replica's start in front of many entities' marks in etcd: how long connecting and
//! opening the guard take with MARKS (default 10^6) marks under the prefix, and what the
//! first use of an entity and of its template cost then.
//!
//! Method: one real etcd (Debian's etcd-server, on free ports, data in a temp directory);
//! MARKS keys `<prefix>w/<n>` written in transactions of 128 puts, 16 at a time. Then,
//! five times: `EtcdStore::connect` plus `Admission::open` with one fixed resource (what
//! `palisade run` does before it listens); the first `entity_within` of a template with
//! `max_marks` (one count of the template's stored marks, then the entity's linearizable
//! read); a second entity of the same template (the read only). Medians are printed.
//!
//! Run: `cargo bench --features etcd --bench etcd_marks` (`MARKS=100000` to change).
//! `cargo test --benches` runs it once with 1000 marks so that it keeps working.

#![allow(missing_docs)]

#[path = "../tests/support/etcd.rs"]
mod etcd;

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Txn, TxnOp};
use palisade::fence::admission::Admission;
use palisade::fence::marks::etcd::EtcdStore;
use palisade::fence::marks::settings::EtcdSettings;
use palisade::fence::template::{PathPattern, ResourceTemplate};

const PREFIX: &str = "/bench/marks/";

async fn fill(client: &Client, marks: u64) {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (mut kv, next) = (client.kv_client(), next.clone());
            tokio::spawn(async move {
                loop {
                    let from = next.fetch_add(128, std::sync::atomic::Ordering::Relaxed);
                    if from >= marks {
                        return;
                    }
                    let ops: Vec<TxnOp> = (from..(from + 128).min(marks))
                        .map(|i| {
                            let key = format!("{PREFIX}w/{i}");
                            TxnOp::put(key, (100 + i).to_be_bytes().to_vec(), None)
                        })
                        .collect();
                    kv.txn(Txn::new().and_then(ops)).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let marks: u64 = if bench {
        std::env::var("MARKS")
            .ok()
            .and_then(|m| m.parse().ok())
            .unwrap_or(1_000_000)
    } else {
        1000
    };
    let etcd = etcd::Etcd::single().await;
    let client = Client::connect(etcd.endpoints(), None).await.unwrap();
    let filled = Instant::now();
    fill(&client, marks).await;
    println!(
        "etcd marks: {marks} marks written in {:.1} s",
        filled.elapsed().as_secs_f64()
    );
    let settings = EtcdSettings {
        endpoints: etcd.endpoints(),
        prefix: PREFIX.to_owned(),
        consistency: palisade::fence::marks::Consistency::Linearizable,
        dial_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(10),
        username: None,
        password: None,
        tls: None,
    };
    let pattern = PathPattern::parse("/w/{id}").unwrap();
    let template = ResourceTemplate::parse("w/{id}", pattern.names()).unwrap();
    let (mut start, mut first, mut second) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..5u64 {
        let t = Instant::now();
        let store = Arc::new(EtcdStore::connect(&settings).await.unwrap());
        let metrics = palisade::Metrics::new(prometheus::Registry::new()).unwrap();
        let admission = Admission::open(store, ["orders"], &metrics).await.unwrap();
        start.push(t.elapsed());

        let name = format!("w/{}", (round * 7919) % marks);
        let t = Instant::now();
        let e = admission
            .entity_within(&name, &template, Some(2 * marks))
            .await
            .unwrap();
        first.push(t.elapsed());
        assert!(e.mark() >= 100, "{name} read from etcd: {}", e.mark());

        let name = format!("w/{}", (round * 104_729 + 1) % marks);
        let t = Instant::now();
        admission
            .entity_within(&name, &template, Some(2 * marks))
            .await
            .unwrap();
        second.push(t.elapsed());
    }
    println!(
        "start (connect + open): {}; first entity of a template (count + read): {}; \
         another entity (read): {}  (medians of 5)",
        ms(median(start)),
        ms(median(first)),
        ms(median(second))
    );
}
