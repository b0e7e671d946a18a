//! Semaphores with fencing, on both providers. N holders at once, one per slot, each
//! slot with its own strictly increasing token; contention, expiry, cancellation and `try_*`
//! behave as the lock's do.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;

use palisade::SemaphoreService;

use super::*;

fn queue_of(name: &str) -> String {
    format!("{NS}/semaphore/{name}/q/")
}

fn slots_of(name: &str) -> String {
    format!("{NS}/semaphore/{name}/s/")
}

pub(crate) async fn at_most_n_holders_each_slot_with_strictly_increasing_tokens(fx: &Fx) {
    const PERMITS: u32 = 3;
    let holders = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let busy: Arc<Vec<AtomicBool>> =
        Arc::new((0..PERMITS).map(|_| AtomicBool::new(false)).collect());
    let order = Arc::new(Mutex::new(HashMap::<u32, Vec<u64>>::new()));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let s = fx.session().await;
        let (holders, peak, busy, order) =
            (holders.clone(), peak.clone(), busy.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..12 {
                let p = s.acquire("n", PERMITS).await.unwrap();
                assert!(p.slot() < PERMITS);
                assert!(
                    !busy[p.slot() as usize].swap(true, Ordering::SeqCst),
                    "two holders in one slot"
                );
                let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                assert!(now <= PERMITS as usize, "{now} holders at once");
                peak.fetch_max(now, Ordering::SeqCst);
                order
                    .lock()
                    .unwrap()
                    .entry(p.slot())
                    .or_default()
                    .push(p.token().get());
                // Longer than a handoff, so that all slots are busy at once.
                tokio::time::sleep(Duration::from_millis(40)).await;
                holders.fetch_sub(1, Ordering::SeqCst);
                busy[p.slot() as usize].store(false, Ordering::SeqCst);
                p.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        peak.load(Ordering::SeqCst),
        PERMITS as usize,
        "all slots were used at once"
    );
    let order = order.lock().unwrap().clone();
    assert_eq!(order.values().map(Vec::len).sum::<usize>(), 96);
    let mut all: Vec<u64> = order.values().flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 96, "every permit has its own token");
    for (slot, tokens) in order.iter() {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "slot {slot}: {tokens:?}"
        );
    }
    assert!(fx.keys(&queue_of("n")).await.is_empty());
    assert!(fx.keys(&slots_of("n")).await.is_empty());
}

pub(crate) async fn an_expired_holder_frees_only_its_slot_and_the_next_holder_outranks_it(fx: &Fx) {
    let (zombie, cutter) = fx.cuttable().await;
    let z = zombie.acquire("e", 2).await.unwrap();
    let mut z_lost = z.loss_signal();
    let other = fx.session().await;
    let o = other.acquire("e", 2).await.unwrap();
    let mut o_lost = o.loss_signal();
    assert_ne!(z.slot(), o.slot());
    let waiter = fx.session().await;
    let hex = lease_hex(&waiter);
    let w = waiter.clone();
    let next = tokio::spawn(async move { w.acquire("e", 2).await.unwrap() });
    fx.wait_present(&queue_of("e"), &hex).await;
    cutter.cut();
    let next = tokio::time::timeout(TTL * 3, next)
        .await
        .expect("the waiter takes the freed slot")
        .unwrap();
    assert_eq!(
        next.slot(),
        z.slot(),
        "the expired holder's slot, not the live one's"
    );
    assert!(
        next.token() > z.token(),
        "{} after {}",
        next.token(),
        z.token()
    );
    assert_eq!(
        tokio::time::timeout(TTL + Duration::from_secs(2), z_lost.wait())
            .await
            .expect("fires"),
        Loss::SessionLost
    );
    assert!(!o_lost.is_lost(), "the other holder keeps its slot");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), o_lost.wait())
            .await
            .is_err()
    );
    assert!(matches!(
        zombie.acquire("e", 2).await,
        Err(Error::SessionLost)
    ));
    assert_eq!(fx.keys(&slots_of("e")).await.len(), 2);
    o.release().await.unwrap();
    next.release().await.unwrap();
}

pub(crate) async fn try_acquire_takes_free_slots_and_leaves_nothing_when_it_fails(fx: &Fx) {
    let mut sessions = Vec::new();
    for _ in 0..5 {
        sessions.push(fx.session().await);
    }
    let mut results = Vec::new();
    let handles: Vec<_> = sessions
        .iter()
        .cloned()
        .map(|s| tokio::spawn(async move { s.try_acquire("t", 2).await }))
        .collect();
    for h in handles {
        results.push(h.await.unwrap());
    }
    let won: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(won.len(), 2, "{results:?}");
    assert_ne!(won[0].slot(), won[1].slot());
    for r in &results {
        if let Err(e) = r {
            assert!(matches!(e, Error::Taken { .. }), "{e}");
        }
    }
    assert!(
        fx.keys(&queue_of("t")).await.is_empty(),
        "no waiting entries"
    );
    assert_eq!(fx.keys(&slots_of("t")).await.len(), 2, "only the two slots");
    // Someone waits: try_acquire does not jump the line, even when a slot frees.
    let waiter = fx.session().await;
    let hex = lease_hex(&waiter);
    let w = waiter.clone();
    let queued = tokio::spawn(async move { w.acquire("t", 2).await.unwrap() });
    fx.wait_present(&queue_of("t"), &hex).await;
    let loser = results.iter().position(|r| r.is_err()).unwrap();
    assert!(matches!(
        sessions[loser].try_acquire("t", 2).await,
        Err(Error::Taken { .. })
    ));
    assert_eq!(
        fx.keys(&queue_of("t")).await.len(),
        1,
        "only the waiter's entry"
    );
    let freed = won[0].slot();
    won[0].release().await.unwrap();
    let got = queued.await.unwrap();
    assert_eq!(got.slot(), freed);
    assert!(matches!(
        sessions[loser].try_acquire("t", 2).await,
        Err(Error::Taken { .. })
    ));
    got.release().await.unwrap();
    let again = sessions[loser].try_acquire("t", 2).await.unwrap();
    assert!(again.token() > got.token());
}

pub(crate) async fn a_cancelled_acquire_leaves_no_key_and_can_queue_again(fx: &Fx) {
    let holder = fx.session().await;
    let p = holder.acquire("c", 1).await.unwrap();
    let waiter = fx.session().await;
    assert!(
        tokio::time::timeout(Duration::from_millis(200), waiter.acquire("c", 1))
            .await
            .is_err()
    );
    waiter.settle().await;
    assert!(
        fx.keys(&queue_of("c")).await.is_empty(),
        "the cancelled entry is gone"
    );
    assert_eq!(fx.keys(&slots_of("c")).await.len(), 1);
    let w = waiter.clone();
    let again =
        tokio::spawn(async move { w.acquire("c", 1).await.map(|p| (p.slot(), p.token(), p)) });
    fx.wait_present(&queue_of("c"), &lease_hex(&waiter)).await;
    p.release().await.unwrap();
    let (slot, token, _p) = tokio::time::timeout(Duration::from_secs(5), again)
        .await
        .expect("in time")
        .unwrap()
        .unwrap();
    assert_eq!(slot, 0);
    assert!(token > p.token());
}

pub(crate) async fn permit_counts_must_agree_and_bad_input_is_an_error(fx: &Fx) {
    let (a, b) = (fx.session().await, fx.session().await);
    let p = a.acquire("m", 2).await.unwrap();
    assert_eq!(
        (p.permits(), p.name(), p.resource()),
        (2, "m", format!("m/{}", p.slot()))
    );
    assert!(matches!(
        b.acquire("m", 3).await,
        Err(Error::PermitsMismatch {
            stored: 2,
            asked: 3,
            ..
        })
    ));
    assert!(matches!(
        b.try_acquire("m", 1).await,
        Err(Error::PermitsMismatch { .. })
    ));
    assert!(matches!(
        b.acquire("z", 0).await,
        Err(Error::InvalidPermits(0))
    ));
    assert!(matches!(
        a.acquire("m", 2).await,
        Err(Error::AlreadyHeld { .. })
    ));
    assert!(matches!(
        a.try_acquire("m", 2).await,
        Err(Error::AlreadyHeld { .. })
    ));
    assert!(matches!(a.acquire("", 2).await, Err(Error::InvalidName(_))));
    assert!(b.acquire("m", 2).await.is_ok());
}

pub(crate) async fn release_is_fenced_and_a_deleted_slot_fires_the_loss_signal(fx: &Fx) {
    let s1 = fx.session().await;
    let p1 = s1.acquire("r", 1).await.unwrap();
    let old = p1.incarnation().clone();
    assert_eq!(
        old.create_revision(),
        p1.token().get() as i64,
        "the token is the slot's creation"
    );
    p1.release().await.unwrap();
    assert!(matches!(p1.release().await, Err(Error::Released)));
    let p2 = s1.acquire("r", 1).await.unwrap();
    assert_eq!(
        p2.incarnation().key(),
        old.key(),
        "same slot key, new incarnation"
    );
    assert!(
        !s1.release(&old).await.unwrap(),
        "a stale release deletes nothing"
    );
    let other = fx.session().await;
    assert!(matches!(
        other.try_acquire("r", 1).await,
        Err(Error::Taken { .. })
    ));
    let mut signal = p2.loss_signal();
    assert!(s1.release(p2.incarnation()).await.unwrap());
    let loss = tokio::time::timeout(Duration::from_secs(2), signal.wait())
        .await
        .expect("fires");
    assert_eq!(loss, Loss::EntryDeleted);
    assert!(matches!(
        p2.release().await,
        Err(Error::LostBeforeRelease { .. })
    ));
    // A dropped permit frees its slot in the background.
    let p3 = other.try_acquire("r", 1).await.unwrap();
    drop(p3);
    other.settle().await;
    assert!(s1.try_acquire("r", 1).await.is_ok());
}
