//! The STM helper of `palisade::client::fenced_txn`, against real etcd processes:
//! it reruns on conflicts, reads one snapshot, and 8 concurrent writers stay serializable.

use crate::etcd;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::Client;
use palisade::client::fenced_txn::{Stm, TxnError};
use palisade::client::provider::etcd::EtcdProvider;
use palisade::{Provider, RwLockService, Session, SessionOptions};

const TTL: Duration = Duration::from_secs(2);

async fn session(client: &Client, ns: &str) -> Session {
    EtcdProvider::new(client)
        .with_request_timeout(Duration::from_secs(1))
        .session(SessionOptions::new().with_ttl(TTL).with_namespace(ns))
        .await
        .unwrap()
}

async fn value(c: &Client, key: &str) -> Option<String> {
    let r = c.clone().get(key, None).await.unwrap();
    r.kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stm_reruns_the_closure_when_a_key_it_read_changed_and_gives_up_after_max_attempts() {
    let etcd = etcd::Etcd::single().await;
    let data = etcd.client().await;
    data.clone().put("/c/n", "1", None).await.unwrap();
    let runs = Arc::new(AtomicU64::new(0));
    // Someone else writes between our read and our commit, on the first run only.
    let r = Stm::new(&data)
        .run(|tx| {
            let runs = Arc::clone(&runs);
            let other = data.clone();
            async move {
                let n: u64 = String::from_utf8(tx.get("/c/n").await?.unwrap())
                    .unwrap()
                    .parse()
                    .unwrap();
                if runs.fetch_add(1, Relaxed) == 0 {
                    other.clone().put("/c/n", "10", None).await.unwrap();
                }
                tx.put("/c/n", (n + 1).to_string());
                // Reads its own write.
                assert_eq!(
                    tx.get("/c/n").await?,
                    Some((n + 1).to_string().into_bytes())
                );
                Ok(n + 1)
            }
        })
        .await
        .unwrap();
    assert_eq!(r, 11, "the second run saw the other write");
    assert_eq!(runs.load(Relaxed), 2);
    assert_eq!(value(&data, "/c/n").await.as_deref(), Some("11"));

    // With one attempt allowed, the same interference is a conflict, and nothing is written.
    let e = Stm::new(&data)
        .with_max_attempts(1)
        .run(|tx| {
            let other = data.clone();
            async move {
                tx.get("/c/n").await?;
                other.clone().put("/c/n", "20", None).await.unwrap();
                tx.put("/c/n", "never");
                tx.delete("/c/other");
                Ok(())
            }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, TxnError::Conflict { attempts: 1 }), "{e:?}");
    assert_eq!(value(&data, "/c/n").await.as_deref(), Some("20"));

    // A key read as missing that someone creates is a conflict too.
    let e = Stm::new(&data)
        .with_max_attempts(1)
        .run(|tx| {
            let other = data.clone();
            async move {
                assert_eq!(tx.get("/c/new").await?, None);
                other.clone().put("/c/new", "x", None).await.unwrap();
                tx.put("/c/new", "mine");
                Ok(())
            }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, TxnError::Conflict { .. }), "{e:?}");
    // An abort ends the run at once.
    let e = Stm::new(&data)
        .run(|_tx| async move { Err::<(), _>(TxnError::abort("no")) })
        .await
        .unwrap_err();
    assert!(matches!(e, TxnError::Aborted(_)), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_stm_run_reads_one_snapshot_and_does_not_conflict() {
    let etcd = etcd::Etcd::single().await;
    let data = etcd.client().await;
    data.clone().put("/c/n", "20", None).await.unwrap();
    data.clone().put("/c/new", "x", None).await.unwrap();
    // Another writer changes both keys between the first read and the second: the second
    // read is still at the first read's revision, and one attempt is enough.
    let seen = Stm::new(&data)
        .with_max_attempts(1)
        .run(|tx| {
            let other = data.clone();
            async move {
                let n = tx.get("/c/n").await?;
                other.clone().put("/c/n", "30", None).await.unwrap();
                other.clone().put("/c/new", "y", None).await.unwrap();
                Ok((n, tx.get("/c/new").await?))
            }
        })
        .await
        .unwrap();
    assert_eq!(seen, (Some(b"20".to_vec()), Some(b"x".to_vec())));
    assert_eq!(value(&data, "/c/new").await.as_deref(), Some("y"));
}

const ACCOUNTS: usize = 10;
const START: u64 = 100;
const WRITERS: usize = 8;
const TRANSFERS: usize = 30;

fn account(i: usize) -> String {
    format!("/bank/acct/{i:02}")
}

fn num(v: Option<Vec<u8>>) -> u64 {
    String::from_utf8(v.expect("the key exists"))
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stm_bank_transfers_by_8_concurrent_fenced_writers_conserve_the_total() {
    let etcd = etcd::Etcd::single().await;
    let data = etcd.client().await;
    for i in 0..ACCOUNTS {
        data.clone()
            .put(account(i), START.to_string(), None)
            .await
            .unwrap();
    }
    data.clone().put("/bank/count", "0", None).await.unwrap();
    let total = START * ACCOUNTS as u64;
    let runs = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..WRITERS {
        let data = data.clone();
        let runs = Arc::clone(&runs);
        writers.spawn(async move {
            // Writers share a read lock (so they run concurrently) and every commit is
            // fenced by their own read grant.
            let s = session(&data, "/ft-bank").await;
            let grant = s.read_lock("bank").await.unwrap();
            let stm = Stm::new(&data).fenced(&grant);
            let mut rng =
                0x9e37_79b9_7f4a_7c15_u64 ^ (w as u64 + 1).wrapping_mul(0x1234_5678_9abc_def1);
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let (mut done, mut declined) = (0u64, 0u64);
            for _ in 0..TRANSFERS {
                let from = next(ACCOUNTS as u64) as usize;
                let to = (from + 1 + next(ACCOUNTS as u64 - 1) as usize) % ACCOUNTS;
                let amount = 1 + next(40);
                let runs = Arc::clone(&runs);
                let r = stm
                    .run(|tx| {
                        runs.fetch_add(1, Relaxed);
                        async move {
                            let a = num(tx.get(&account(from)).await?);
                            let b = num(tx.get(&account(to)).await?);
                            if a < amount {
                                return Err(TxnError::abort("insufficient funds"));
                            }
                            tx.put(account(from), (a - amount).to_string());
                            tx.put(account(to), (b + amount).to_string());
                            // A hot counter in every transaction: a lost update would show.
                            let n = num(tx.get("/bank/count").await?);
                            tx.put("/bank/count", (n + 1).to_string());
                            Ok(())
                        }
                    })
                    .await;
                match r {
                    Ok(()) => done += 1,
                    Err(TxnError::Aborted(_)) => declined += 1,
                    Err(e) => panic!("writer {w}: {e}"),
                }
            }
            grant.runlock().await.unwrap();
            s.close().await.unwrap();
            (done, declined)
        });
    }
    // Meanwhile, read-only STM transactions always see a consistent total.
    let mut audits = 0;
    let audit = Stm::new(&data);
    let mut committed = 0;
    let mut declined = 0;
    loop {
        let sum = audit
            .run(|tx| async move {
                let mut sum = 0;
                for i in 0..ACCOUNTS {
                    sum += num(tx.get(&account(i)).await?);
                }
                Ok(sum)
            })
            .await
            .unwrap();
        assert_eq!(sum, total, "a snapshot saw money appear or vanish");
        audits += 1;
        while let Some(r) = writers.try_join_next() {
            let (d, x) = r.unwrap();
            committed += d;
            declined += x;
        }
        if writers.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut sum = 0;
    for i in 0..ACCOUNTS {
        sum += value(&data, &account(i))
            .await
            .unwrap()
            .parse::<u64>()
            .unwrap();
    }
    assert_eq!(sum, total, "the total is conserved");
    let count: u64 = value(&data, "/bank/count").await.unwrap().parse().unwrap();
    assert_eq!(
        count, committed,
        "every committed transfer counted exactly once"
    );
    assert_eq!(committed + declined, (WRITERS * TRANSFERS) as u64);
    eprintln!(
        "bank: {WRITERS} writers, {committed} transfers committed, {declined} declined, {} \
         closure runs ({} reruns after conflicts), {audits} consistent audits, {:?}",
        runs.load(Relaxed),
        runs.load(Relaxed) - committed - declined,
        started.elapsed()
    );
}
