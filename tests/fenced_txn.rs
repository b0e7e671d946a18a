//! Fenced etcd transactions (issue 11, item 3), against real etcd processes: a zombie's
//! writes to etcd fail like its HTTP writes do, and the STM helper is serializable.

#[path = "support/etcd.rs"]
mod etcd;
#[path = "support/netcut.rs"]
mod netcut;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use palisade::fenced_txn::{commit_fenced, IsOwner, Stm, TxnError};
use palisade::provider::etcd::EtcdProvider;
use palisade::{ElectionService, LockService, Provider, RwLockService, Session, SessionOptions};

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

async fn revision(c: &Client) -> i64 {
    let r = c.clone().get("/none", None).await.unwrap();
    r.header().unwrap().revision()
}

fn put(key: &str, v: &str) -> Txn {
    Txn::new().and_then([TxnOp::put(key, v, None)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_txn_from_a_lock_whose_session_expired_fails_and_writes_nothing() {
    let etcd = etcd::Etcd::single().await;
    let data = etcd.client().await;
    // The zombie's session reaches etcd through a forwarder we can cut (a partition); its
    // data writes go straight to etcd, as a zombie's would once the partition heals.
    let cut = netcut::Cut::new(&etcd.endpoint()).await;
    let zombie_client = etcd::Etcd::client_at(&cut.url()).await;
    let zombie = session(&zombie_client, "/ft1").await;
    let a = zombie.lock("orders").await.unwrap();
    let r = commit_fenced(&data, &a, put("/data/orders", "A1"))
        .await
        .unwrap();
    assert!(r.succeeded());
    assert_eq!(value(&data, "/data/orders").await.as_deref(), Some("A1"));

    cut.cut();
    // etcd expires the lease on its own clock: wait until it has.
    let lease = zombie.lease_id();
    let started = Instant::now();
    loop {
        let ttl = data
            .clone()
            .lease_time_to_live(lease, None)
            .await
            .unwrap()
            .ttl();
        if ttl <= 0 {
            break;
        }
        assert!(started.elapsed() < TTL * 5, "the lease never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let owner = session(&data, "/ft1").await;
    let b = owner.lock("orders").await.unwrap();
    assert!(b.token() > a.token());
    commit_fenced(&data, &b, put("/data/orders", "B1"))
        .await
        .unwrap();

    let before = revision(&data).await;
    // 1. The helper: refused as not the owner.
    let e = commit_fenced(&data, &a, put("/data/orders", "A2"))
        .await
        .unwrap_err();
    assert!(matches!(e, TxnError::NotOwner { .. }), "{e:?}");
    // 2. The bare compare in a transaction of one's own: etcd takes the else branch.
    let raw = data
        .clone()
        .txn(
            Txn::new()
                .when([a.is_owner()])
                .and_then([TxnOp::put("/data/orders", "A3", None)]),
        )
        .await
        .unwrap();
    assert!(!raw.succeeded());
    // 3. The STM helper fenced by the zombie's grant.
    let e = Stm::new(&data)
        .fenced(&a)
        .run(|tx| async move {
            let v = tx.get("/data/orders").await?;
            assert_eq!(v.as_deref(), Some(&b"B1"[..]));
            tx.put("/data/orders", "A4");
            tx.put("/data/zombie-was-here", "yes");
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(matches!(e, TxnError::NotOwner { .. }), "{e:?}");

    assert_eq!(value(&data, "/data/orders").await.as_deref(), Some("B1"));
    assert_eq!(value(&data, "/data/zombie-was-here").await, None);
    assert_eq!(
        revision(&data).await,
        before,
        "the zombie's transactions wrote nothing at all"
    );
    // The live owner's STM commits.
    Stm::new(&data)
        .fenced(&b)
        .run(|tx| async move {
            tx.put("/data/orders", "B2");
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(value(&data, "/data/orders").await.as_deref(), Some("B2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_fenced_tells_a_lost_ownership_from_a_failed_inner_compare() {
    let etcd = etcd::Etcd::single().await;
    let data = etcd.client().await;
    let s = session(&data, "/ft2").await;
    let leader = s.campaign("sched", "n1").await.unwrap();
    // The inner transaction's own compare fails: Ok, with its else branch's response.
    let inner = Txn::new()
        .when([Compare::value("/cfg/v", CompareOp::Equal, "1")])
        .and_then([TxnOp::put("/cfg/v", "2", None)])
        .or_else([TxnOp::get("/cfg/v", None)]);
    let r = commit_fenced(&data, &leader, inner).await.unwrap();
    assert!(!r.succeeded());
    assert_eq!(r.op_responses().len(), 1);
    // After resigning, the same leadership is no longer the owner.
    leader.resign().await.unwrap();
    let e = commit_fenced(&data, &leader, put("/cfg/v", "3"))
        .await
        .unwrap_err();
    assert!(matches!(e, TxnError::NotOwner { ref key } if key == leader.incarnation().key()));
    assert_eq!(value(&data, "/cfg/v").await, None);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fenced_txn_example_refuses_the_zombie_and_conserves_the_total() {
    let etcd = etcd::Etcd::single().await;
    // Examples are built next to the test binary: target/<profile>/examples/<name>.
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("fenced-txn");
    assert!(
        path.exists(),
        "{} is not built (cargo test --all-features builds it)",
        path.display()
    );
    let out = std::process::Command::new(path)
        .args(["--endpoint", &etcd.endpoint()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("refused, not the owner"), "{stdout}");
    assert!(stdout.contains("alice 120, bob 80, total 200"), "{stdout}");
}
