use super::*;
use crate::fence::marks::MemoryStore;

const D: Duration = Duration::from_secs(2);

fn t(v: u64) -> FencingToken {
    FencingToken::new(v).unwrap()
}

#[tokio::test]
async fn equal_admits_higher_advances_lower_is_stale() {
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let store = Arc::new(MemoryStore::with_marks([("orders".to_owned(), 34)].into()));
    let adm = Admission::open(store.clone(), ["orders"], &metrics)
        .await
        .unwrap();
    let r = adm.resource("orders").unwrap().clone();
    assert_eq!(r.mark(), 34);
    assert_eq!(adm.admit(&r, t(34), D).await.unwrap().0, Admitted::Current);
    assert_eq!(
        adm.admit(&r, t(51), D).await.unwrap().0,
        Admitted::Advanced { from: 34 }
    );
    assert!(matches!(
        adm.admit(&r, t(34), D).await,
        Err(Refused::Stale { mark: 51, .. })
    ));
    assert_eq!(store.load().await.unwrap().get("orders"), Some(&51));
}

/// Many tasks on several threads race random tokens around a rising base. Any admission
/// that starts after another one finished must not admit a lower token, a stale verdict
/// must report a higher mark, and the final mark is the highest admitted token.
#[test]
fn concurrent_admissions_never_admit_below_an_earlier_admission() {
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
        let adm = Arc::new(
            Admission::open(Arc::new(MemoryStore::new()), ["r"], &metrics)
                .await
                .unwrap(),
        );
        let res = adm.resource("r").unwrap().clone();
        let highest = Arc::new(AtomicU64::new(0));
        let base = Arc::new(AtomicU64::new(10));
        let mut tasks = Vec::new();
        for seed in 1..=8u64 {
            let (adm, res, highest, base) =
                (adm.clone(), res.clone(), highest.clone(), base.clone());
            tasks.push(tokio::spawn(async move {
                let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let (mut admitted, mut stale) = (0u64, 0u64);
                for i in 0..20_000u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if i % 64 == 0 {
                        base.fetch_add(1, SeqCst);
                    }
                    let t = t(base.load(SeqCst) + x % 8 - 4);
                    let before = highest.load(SeqCst);
                    match adm.admit(&res, t, D).await {
                        Ok(_) => {
                            assert!(
                                t.get() >= before,
                                "admitted {t} after {before} was admitted"
                            );
                            assert!(res.mark() >= t.get());
                            highest.fetch_max(t.get(), SeqCst);
                            admitted += 1;
                        }
                        Err(Refused::Stale { mark, .. }) => {
                            assert!(mark > t.get());
                            stale += 1;
                        }
                        Err(e) => panic!("{e}"),
                    }
                    if i % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                (admitted, stale)
            }));
        }
        let (mut admitted, mut stale) = (0, 0);
        for task in tasks {
            let (a, s) = task.await.unwrap();
            admitted += a;
            stale += s;
        }
        assert!(
            admitted > 1000 && stale > 1000,
            "admitted {admitted}, stale {stale}"
        );
        assert_eq!(
            res.mark(),
            highest.load(SeqCst),
            "final mark is the highest admitted token"
        );
        assert_eq!(
            adm.store().load().await.unwrap()["r"],
            res.mark(),
            "and it is the stored mark"
        );
    });
}

/// What a reload relies on: a name new to the configuration starts from the store's mark, a
/// known one keeps its very `Resource` (mark, advance lock, requests in flight), and nothing
/// is reset, even while an advance of a known resource is in progress.
#[tokio::test]
async fn open_resources_loads_new_marks_and_never_replaces_a_known_resource() {
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let store = Arc::new(MemoryStore::with_marks(
        [("orders".to_owned(), 34), ("fresh".to_owned(), 100)].into(),
    ));
    let adm = Admission::open(store.clone(), ["orders"], &metrics)
        .await
        .unwrap();
    let orders = adm.resource("orders").unwrap();
    assert!(adm.resource("fresh").is_none(), "not configured yet");
    // An advance of a known resource, in flight while the new names are opened.
    let (admitted, opened) = tokio::join!(
        adm.admit(&orders, t(51), D),
        adm.open_resources(["orders", "fresh", "fresh", "empty"])
    );
    assert_eq!(admitted.unwrap().0, Admitted::Advanced { from: 34 });
    assert_eq!(opened.unwrap(), ["empty", "fresh"], "only the new names");
    assert!(Arc::ptr_eq(&orders, &adm.resource("orders").unwrap()));
    assert_eq!(orders.mark(), 51, "the advance stands");
    assert_eq!(adm.resource("fresh").unwrap().mark(), 100, "from the store");
    assert_eq!(
        adm.resource("empty").unwrap().mark(),
        0,
        "nothing stored yet"
    );
    assert!(matches!(
        adm.admit(&adm.resource("fresh").unwrap(), t(99), D).await,
        Err(Refused::Stale { mark: 100, .. })
    ));
    assert!(adm
        .open_resources(["fresh", "orders"])
        .await
        .unwrap()
        .is_empty());
    assert_eq!(adm.resource("fresh").unwrap().mark(), 100);
}

#[tokio::test]
async fn a_carried_mark_makes_the_new_name_another_name_of_the_same_resource() {
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let store = Arc::new(MemoryStore::with_marks(
        [("warehouse-7".to_owned(), 110), ("wh/7".to_owned(), 90)].into(),
    ));
    let adm = Admission::open(store.clone(), ["warehouse-7"], &metrics)
        .await
        .unwrap();
    assert_eq!(adm.carry("warehouse-7", "wh/7").await.unwrap(), 110);
    let old = adm.resource("warehouse-7").unwrap();
    let new = adm.resource("wh/7").unwrap();
    assert!(Arc::ptr_eq(&old, &new), "one mark, one drain");
    assert_eq!(
        store.load().await.unwrap().get("wh/7"),
        Some(&110),
        "persisted"
    );
    // A request routed by the old table advances: the new name has it too, durably.
    adm.admit(&old, t(120), D).await.unwrap();
    assert_eq!(store.load().await.unwrap().get("wh/7"), Some(&120));
    assert!(matches!(
        adm.admit(&new, t(115), D).await,
        Err(Refused::Stale { mark: 120, .. })
    ));
    // Renamed back: already one resource.
    assert_eq!(adm.carry("wh/7", "warehouse-7").await.unwrap(), 120);
    // The new name had a higher stored mark of its own: both start from it.
    let store = Arc::new(MemoryStore::with_marks(
        [("a".to_owned(), 10), ("b".to_owned(), 30)].into(),
    ));
    let adm = Admission::open(store, ["a"], &metrics_of()).await.unwrap();
    assert_eq!(adm.carry("a", "b").await.unwrap(), 30);
    assert_eq!(adm.resource("a").unwrap().mark(), 30);
}

fn metrics_of() -> Metrics {
    Metrics::new(prometheus::Registry::new()).unwrap()
}

/// A memory store that counts its reads.
#[derive(Default)]
struct Counting {
    inner: MemoryStore,
    reads: std::sync::atomic::AtomicUsize,
    slow: std::sync::atomic::AtomicBool,
}

impl MarkStore for Counting {
    fn kind(&self) -> &'static str {
        "memory"
    }
    fn load(&self) -> crate::fence::marks::BoxFuture<'_, Result<Marks, StoreError>> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            // A slow read when asked, so that first uses really overlap.
            if self.slow.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            self.inner.load().await
        })
    }
    fn persist<'a>(
        &'a self,
        resource: &'a str,
        mark: u64,
    ) -> crate::fence::marks::BoxFuture<'a, Result<u64, StoreError>> {
        self.inner.persist(resource, mark)
    }
    fn ready(&self) -> crate::fence::marks::BoxFuture<'_, Result<(), StoreError>> {
        self.inner.ready()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entities_are_evicted_when_idle_and_read_back_before_their_next_admission() {
    use std::sync::atomic::Ordering::SeqCst;
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let store = Arc::new(Counting::default());
    let adm = Arc::new(
        Admission::open(store.clone(), Vec::<String>::new(), &metrics)
            .await
            .unwrap(),
    );
    adm.set_max_cached(8);
    for i in 0..1000u64 {
        let e = adm.entity(&format!("w/{i}"), "w/{id}").await.unwrap();
        adm.admit(&e, t(100 + i), D).await.unwrap();
    }
    let (cached, loaded, evicted) = adm.entity_counts();
    assert!(cached <= 9, "{cached} in memory");
    assert_eq!(loaded, 1000);
    assert!(evicted >= 991, "{evicted} evicted");
    assert!(adm.resource("w/3").is_none(), "evicted");
    // An evicted entity's zombie: its mark is read back from the store, never guessed.
    let e = adm.entity("w/3", "w/{id}").await.unwrap();
    assert_eq!(e.mark(), 103);
    assert!(matches!(
        adm.admit(&e, t(102), D).await,
        Err(Refused::Stale { mark: 103, .. })
    ));
    // An entity with a request in flight is not evicted under it.
    let held = adm.entity("w/999", "w/{id}").await.unwrap();
    let (_, ticket) = adm.admit(&held, t(1099), D).await.unwrap();
    for i in 1000..1100u64 {
        let _ = adm.entity(&format!("w/{i}"), "w/{id}").await.unwrap();
    }
    assert!(
        Arc::ptr_eq(&adm.resource("w/999").unwrap(), &held),
        "kept while in flight"
    );
    drop(ticket);
    // Concurrent first uses of one entity share one store read.
    store.slow.store(true, SeqCst);
    let before = store.reads.load(SeqCst);
    let firsts: Vec<_> = (0..20)
        .map(|_| {
            let adm = Arc::clone(&adm);
            tokio::spawn(async move { adm.entity("fresh", "w/{id}").await.unwrap() })
        })
        .collect();
    let mut got = Vec::new();
    for f in firsts {
        got.push(f.await.unwrap());
    }
    assert_eq!(
        store.reads.load(SeqCst) - before,
        1,
        "one read for 20 first uses"
    );
    assert!(got.iter().all(|r| Arc::ptr_eq(r, &got[0])), "one resource");
}

#[tokio::test]
async fn a_renamed_resources_first_advance_aborts_the_old_names_requests_in_flight() {
    let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
    let store = Arc::new(MemoryStore::new());
    let adm = Admission::open(store, ["orders"], &metrics).await.unwrap();
    let old = adm.resource("orders").unwrap();
    adm.admit(&old, t(10), D).await.unwrap();
    // A slow write of the old owner, routed by the old table, still in flight.
    let (_, slow) = adm.admit(&old, t(10), D).await.unwrap();
    adm.carry("orders", "orders2").await.unwrap();
    let new = adm.resource("orders2").unwrap();
    // The new owner's first write under the new name drains (here: aborts, after a short
    // drain) the old name's older request before it is admitted.
    adm.admit(&new, t(20), Duration::from_millis(50))
        .await
        .unwrap();
    assert!(
        slow.generation().is_aborted(),
        "the old owner's write still in flight"
    );
    assert_eq!(old.mark(), 20);
}

/// The memory goal of 10^6 entities with 10^5 cached (benches/entities.sh) rests on these
/// sizes: a resource in mimalloc's 128-byte class, a generation with nobody waiting in its
/// 64-byte class (56 until it held its template's abort board; 61.4 MiB measured with it).
#[test]
fn an_entity_stays_small() {
    assert!(std::mem::size_of::<Resource>() <= 112);
    assert_eq!(
        std::mem::size_of::<Drain>(),
        16,
        "the drain's kind folded into its id"
    );
    // A futex mutex (Linux); elsewhere std's mutex is larger.
    #[cfg(target_os = "linux")]
    assert!(std::mem::size_of::<crate::fence::drain::Generation>() <= 48);
}

/// What every admission touches lies in the first cache line of the resource's allocation
/// (after `Arc`'s two counts): see the comment on [`Resource`].
#[test]
#[cfg(target_pointer_width = "64")]
fn what_an_admission_touches_shares_one_cache_line() {
    use std::mem::offset_of;
    let counts = 2 * std::mem::size_of::<usize>();
    let end = |offset: usize, size: usize| counts + offset + size;
    assert!(end(offset_of!(Resource, mark), std::mem::size_of::<Watermark>()) <= 64);
    assert!(end(offset_of!(Resource, drain), std::mem::size_of::<Drain>()) <= 64);
    assert!(end(offset_of!(Resource, touched), 1) <= 64);
}
