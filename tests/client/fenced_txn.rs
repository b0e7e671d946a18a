//! Fenced etcd transactions, against real etcd processes: a zombie's writes to etcd fail like
//! its HTTP writes do. The STM helper's own tests are in `tests/client/stm.rs`.

use crate::etcd;
use crate::netcut;

use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, EventType, Txn, TxnOp};
use palisade::client::fenced_txn::{commit_fenced, IsOwner, Stm, TxnError};
use palisade::client::provider::etcd::EtcdProvider;
use palisade::{ElectionService, LockService, Provider, Session, SessionOptions};

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

    // etcd expires the lease on its own clock and deletes the entry with it: wait for that
    // deletion (`lease_time_to_live` would not do: it rounds down, 0 s while 0.9 s remain).
    let mut events = data
        .clone()
        .watch(a.incarnation().key(), None)
        .await
        .unwrap();
    cut.cut();
    let started = Instant::now();
    let deleted = async {
        while let Some(r) = events.message().await.unwrap() {
            if r.events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                return;
            }
        }
        panic!("the watch ended");
    };
    tokio::time::timeout(TTL * 5, deleted)
        .await
        .expect("etcd expired the lease");
    let expired_after = started.elapsed();
    let gone = data
        .clone()
        .lease_time_to_live(zombie.lease_id(), None)
        .await;
    assert_eq!(gone.unwrap().ttl(), -1, "the zombie's lease is gone");
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
    eprintln!(
        "zombie: lease gone in etcd {expired_after:?} after the cut (TTL {TTL:?}); tokens {} \
         then {}; 3 fenced writes refused, revision stayed at {before}",
        a.token(),
        b.token()
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
async fn the_fenced_txn_example_refuses_the_zombie_and_conserves_the_total() {
    let etcd = etcd::Etcd::single().await;
    // Examples are built next to the test binary: target/<profile>/examples/<name>.
    let path = std::env::current_exe()
        .unwrap()
        .with_file_name("../examples/fenced-txn");
    let build = "cargo test --all-features builds it; else cargo build --all-features --examples";
    assert!(path.exists(), "{} is not built: {build}", path.display());
    let out = std::process::Command::new(path)
        .args(["--endpoint", &etcd.endpoint()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("refused, not the owner"), "{stdout}");
    assert!(stdout.contains("alice 120, bob 80, total 200"), "{stdout}");
}
