//! Blocking acquisitions ride out store outages by repeating unanswered transactions; an
//! unanswered one may still be applied later, after its repeat. Found by an outside review of
//! the first ride-out change: each test here failed on it.
//!
//! `Trap` is a loopback forwarder that models a request that reached the store side but is
//! applied late: once armed with a marker, the first client->server chunk containing it is
//! held (not forwarded), the client's connection is closed (the client sees a transport
//! error, a transient one, and retries on a new connection), and the server side of the old
//! connection is kept open; `flush` then delivers the held bytes, so etcd applies the first
//! attempt after the retry. A lost answer cannot be told apart from this by the client.

use super::*;

use std::sync::{Arc, Mutex};

use palisade::Term;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

#[derive(Default)]
struct TrapState {
    marker: Option<Vec<u8>>,
    held: Option<Vec<u8>>,
    sprung: bool,
}

struct Trap {
    addr: std::net::SocketAddr,
    state: Arc<Mutex<TrapState>>,
    flush: Arc<Notify>,
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

impl Trap {
    async fn new(target: &str) -> Trap {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(TrapState::default()));
        let flush = Arc::new(Notify::new());
        let target = target.trim_start_matches("http://").to_owned();
        let (st, fl) = (Arc::clone(&state), Arc::clone(&flush));
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                tokio::spawn(conn(
                    inbound,
                    target.clone(),
                    Arc::clone(&st),
                    Arc::clone(&fl),
                ));
            }
        });
        Trap { addr, state, flush }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn arm(&self, marker: &str) {
        self.state.lock().unwrap().marker = Some(marker.as_bytes().to_vec());
    }

    fn sprung(&self) -> bool {
        self.state.lock().unwrap().sprung
    }

    fn flush(&self) {
        self.flush.notify_one();
    }
}

async fn conn(inbound: TcpStream, target: String, st: Arc<Mutex<TrapState>>, fl: Arc<Notify>) {
    let Ok(outbound) = TcpStream::connect(&target).await else {
        return;
    };
    let (mut ri, mut wi) = inbound.into_split();
    let (mut ro, mut wo) = outbound.into_split();
    let mut cbuf = vec![0u8; 256 * 1024];
    let mut sbuf = vec![0u8; 256 * 1024];
    let mut tail: Vec<u8> = Vec::new();
    let held: Vec<u8> = loop {
        tokio::select! {
            n = ri.read(&mut cbuf) => {
                let n = match n { Ok(0) | Err(_) => return, Ok(n) => n };
                let chunk = &cbuf[..n];
                let mut window = tail.clone();
                window.extend_from_slice(chunk);
                {
                    let mut s = st.lock().unwrap();
                    if s.marker.as_ref().is_some_and(|m| contains(&window, m)) {
                        s.marker = None;
                        s.sprung = true;
                        break chunk.to_vec();
                    }
                }
                if wo.write_all(chunk).await.is_err() {
                    return;
                }
                tail = window[window.len().saturating_sub(256)..].to_vec();
            }
            n = ro.read(&mut sbuf) => {
                let n = match n { Ok(0) | Err(_) => return, Ok(n) => n };
                if wi.write_all(&sbuf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    // The client's connection breaks; the store's side stays open with the request unsent.
    drop(ri);
    drop(wi);
    tokio::spawn(async move {
        let mut b = vec![0u8; 64 * 1024];
        while let Ok(n) = ro.read(&mut b).await {
            if n == 0 {
                break;
            }
        }
    });
    fl.notified().await;
    st.lock().unwrap().held = Some(held.clone());
    let _ = wo.write_all(&held).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
}

async fn etcd_pair(e: &etcd::Etcd) -> (Session, Trap, Session) {
    let direct = EtcdProvider::new(&e.client().await);
    let a = direct.session(Fx::options(TTL)).await.unwrap();
    let trap = Trap::new(&e.endpoint()).await;
    let client = etcd::Etcd::client_at(&trap.url()).await;
    let b = EtcdProvider::new(&client)
        .with_request_timeout(Duration::from_millis(500))
        .session(Fx::options(TTL))
        .await
        .unwrap();
    (a, trap, b)
}

async fn mod_revision(e: &etcd::Etcd, key: &str) -> i64 {
    let mut c = e.client().await;
    let r = c.get(key, None).await.unwrap();
    r.kvs().first().map_or(0, |kv| kv.mod_revision())
}

async fn wait_keys(e: &etcd::Etcd, prefix: &str, needle: &str) {
    let started = Instant::now();
    while !e.keys(prefix).await.iter().any(|k| k.contains(needle)) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{needle} never under {prefix}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Delivers the request `trap` holds, gives it time to land (it must change nothing), and
/// returns the term `observer` then sees for election `name`.
async fn term_after_the_late_copy(trap: &Trap, observer: &Session, name: &str) -> Term {
    trap.flush();
    tokio::time::sleep(Duration::from_millis(700)).await;
    observer.leader(name).await.unwrap().expect("a leader")
}

/// A confirm whose first attempt is applied after its repeat's: the repeat's token is handed
/// out, and the late first attempt must not bump the epoch again (the epoch is "the current
/// valid token" of `docs/design.md#token-derivation`; it moved past the holder's token before
/// the fix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_confirm_leaves_the_epoch_at_the_handed_out_token_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    let g = a.lock("trap").await.unwrap();
    let bs = b.clone();
    let task = tokio::spawn(async move { bs.lock("trap").await });
    wait_keys(&e, &format!("{NS}/lock/trap/q/"), &lease_hex(&b)).await;
    trap.arm(&format!("{NS}/lock/trap/epoch"));
    g.unlock().await.unwrap();
    let gb = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the waiter ends")
        .unwrap()
        .expect("the waiter acquires after one retry of confirm");
    assert!(trap.sprung(), "the first confirm was held");
    let handed = gb.token().get();
    assert_eq!(
        mod_revision(&e, &format!("{NS}/lock/trap/epoch")).await as u64,
        handed
    );
    trap.flush();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let epoch = mod_revision(&e, &format!("{NS}/lock/trap/epoch")).await as u64;
    assert_eq!(
        epoch, handed,
        "the epoch moved past the holder's token while it still holds the lock"
    );
}

/// The same on an election: observers were told of a term (token) the leader did not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_confirm_shows_the_leaders_own_term_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    let la = a.campaign("trap", "a").await.unwrap();
    let bs = b.clone();
    let task = tokio::spawn(async move { bs.campaign("trap", "b").await });
    wait_keys(&e, &format!("{NS}/election/trap/q/"), &lease_hex(&b)).await;
    trap.arm(&format!("{NS}/election/trap/epoch"));
    la.resign().await.unwrap();
    let lb = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the candidate ends")
        .unwrap()
        .expect("the candidate wins after one retry of confirm");
    assert!(trap.sprung());
    let seen = term_after_the_late_copy(&trap, &a, "trap").await;
    assert_eq!(
        seen.token,
        lb.token(),
        "leader() reports a term nobody holds"
    );
}

/// A register whose first attempt is applied after the acquisition (granted through the
/// repeat) was unlocked: the late put recreates the entry on the live lease. Before the fix
/// nobody deleted it and the lock was blocked for everyone until the session ended; now the
/// release looks for it once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_register_is_cleaned_up_after_the_unlock_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    trap.arm(&format!("{NS}/lock/leak/q/"));
    let g = tokio::time::timeout(Duration::from_secs(10), b.lock("leak"))
        .await
        .expect("the lock ends")
        .expect("the lock is taken after one retry of register");
    assert!(trap.sprung(), "the first register was held");
    g.unlock().await.unwrap();
    assert!(e.keys(&format!("{NS}/lock/leak/q/")).await.is_empty());
    trap.flush();
    tokio::time::sleep(Duration::from_secs(1)).await;
    b.settle().await;
    let left = e.keys(&format!("{NS}/lock/leak/q/")).await;
    let other = a.try_lock("leak").await;
    assert!(
        left.is_empty(),
        "a queue entry leaked on a live lease: {left:?}"
    );
    assert!(other.is_ok(), "another session is blocked: {other:?}");
}

/// Liveness: while every write's answer is lost (on etcd: writes slower than the request
/// timeout, while keepalives still succeed), `confirm` never ended before the fix and bumped
/// the epoch on every round; now its repeat finds its own write and ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_ends_while_write_answers_are_lost_memory() {
    let store = MemoryProvider::new();
    let c = store.connect();
    let s = c.session(Fx::options(TTL)).await.unwrap();
    let before = store.revision();
    c.lose_write_answers(u32::MAX);
    let r = tokio::time::timeout(Duration::from_secs(3), s.lock("x")).await;
    let after = store.revision();
    c.lose_write_answers(0);
    let g = r
        .unwrap_or_else(|_| panic!("lock never ended; {} epoch bumps", after - before))
        .expect("the lock is taken");
    assert_eq!(
        i64::try_from(g.token().get()).unwrap(),
        after,
        "the one epoch write"
    );
    assert!(
        after - before <= 2,
        "one entry and one epoch write: {before} -> {after}"
    );
}

/// A session closed during a ride-out ends it with SessionClosed at once; `try_*` still fail
/// at once with a store error; a lost answer followed by lease expiry hands out nothing and
/// leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_try_and_expiry_during_an_outage_memory() {
    let store = MemoryProvider::new();
    let c = store.connect();
    let s = c.session(Fx::options(TTL)).await.unwrap();
    c.set_partitioned(true);
    let t0 = Instant::now();
    let tries = [
        s.try_lock("t").await.err(),
        s.try_read_lock("t2").await.err(),
        s.try_write_lock("t3").await.err(),
        s.try_acquire("t4", 2).await.err(),
    ];
    for e in &tries {
        assert!(matches!(e, Some(Error::Store { .. })), "{e:?}");
    }
    assert!(t0.elapsed() < Duration::from_millis(200));
    let s2 = s.clone();
    let task = tokio::spawn(async move { s2.lock("c").await.map(|g| g.token()) });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = s.close().await;
    let r = tokio::time::timeout(Duration::from_millis(500), task)
        .await
        .expect("a closed session ends the ride-out")
        .unwrap();
    assert!(matches!(r, Err(Error::SessionClosed)), "{r:?}");

    // Lost answer to register, then the link is cut until the lease expires.
    let c = store.connect();
    let s = c.session(Fx::options(TTL)).await.unwrap();
    let holder = store.connect().session(Fx::options(TTL)).await.unwrap();
    let g = holder.lock("z").await.unwrap();
    c.lose_write_answers(1);
    let s2 = s.clone();
    let task = tokio::spawn(async move { s2.lock("z").await.map(|g| g.token()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    c.set_partitioned(true);
    let r = tokio::time::timeout(TTL * 3, task)
        .await
        .expect("ends")
        .unwrap();
    assert!(matches!(r, Err(Error::SessionLost)), "{r:?}");
    c.set_partitioned(false);
    tokio::time::sleep(TTL).await;
    assert_eq!(
        store.keys(&format!("{NS}/lock/z/q/")).len(),
        1,
        "only the holder's entry"
    );
    drop(g);
}

/// Semaphore: the take deletes the queue entry, so a late register put can land while the
/// permit is held. The stray entry blocked every later waiter (and try_acquire) although slots
/// were free, until the holder let go; now it is looked for as soon as the slot is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_semaphore_register_during_the_hold_is_cleaned_up_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    trap.arm(&format!("{NS}/semaphore/sem/q/"));
    let pb = tokio::time::timeout(Duration::from_secs(10), b.acquire("sem", 2))
        .await
        .expect("ends")
        .expect("b takes a permit after one retry of register");
    assert!(trap.sprung(), "the first register was held");
    trap.flush();
    // The stray entry is looked for at the take and 1 s later: a waiter gets the free slot
    // within about that (before the fix: not while b held its permit).
    let w = tokio::time::timeout(Duration::from_secs(3), a.acquire("sem", 2)).await;
    let stray = e.keys(&format!("{NS}/semaphore/sem/q/")).await;
    assert!(
        matches!(w, Ok(Ok(_))) && stray.is_empty(),
        "acquire with a free slot (3 s): {w:?}; stray waiter while b holds: {stray:?}"
    );
    assert!(pb.token() < w.unwrap().unwrap().token());
}

/// Election: a late register put that lands after the 1 s look (a leak, as `docs/client.md#guarantees` says)
/// is adopted by the session's next campaign with the *old* value: leader()/observers report
/// a value that campaign never asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_late_campaign_entry_takes_the_new_value_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    trap.arm(&format!("{NS}/election/val/q/"));
    let l = tokio::time::timeout(Duration::from_secs(10), b.campaign("val", "old"))
        .await
        .expect("ends")
        .expect("leads after one retry of register");
    assert!(trap.sprung());
    l.resign().await.unwrap();
    b.settle().await; // the look-again (now and 1 s later) is over
    trap.flush();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let l2 = tokio::time::timeout(Duration::from_secs(5), b.campaign("val", "new"))
        .await
        .expect("ends")
        .expect("leads");
    let seen = a.leader("val").await.unwrap().expect("a leader");
    assert_eq!(seen.token, l2.token());
    assert_eq!(
        String::from_utf8_lossy(&seen.value),
        "new",
        "campaign(\"new\") leads with the value of an earlier campaign"
    );
}

/// Look-again vs. a re-acquire by the same session: the new lock waits for the claim, the
/// stray put lands meanwhile and is removed, the new lock is granted with a higher token, and
/// nothing is left after its unlock (unlock, drop, and cancel variants).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reacquire_during_the_look_again_waits_and_is_not_deleted_on_etcd() {
    let e = etcd::Etcd::single().await;
    for variant in ["unlock", "drop", "cancel"] {
        let name = format!("re-{variant}");
        let (a, trap, b) = etcd_pair(&e).await;
        let holder = if variant == "cancel" {
            Some(a.lock(&name).await.unwrap())
        } else {
            None
        };
        trap.arm(&format!("{NS}/lock/{name}/q/"));
        let bs = b.clone();
        let n2 = name.clone();
        let first = tokio::spawn(async move { bs.lock(&n2).await });
        let old = match variant {
            "cancel" => {
                wait_keys(&e, &format!("{NS}/lock/{name}/q/"), &lease_hex(&b)).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                assert!(trap.sprung(), "{variant}: the first register was held");
                first.abort();
                // The lock's future is dropped once the abort is done (its cleanup starts).
                assert!(first.await.unwrap_err().is_cancelled());
                0
            }
            _ => {
                let g = tokio::time::timeout(Duration::from_secs(10), first)
                    .await
                    .expect("ends")
                    .unwrap()
                    .expect("granted");
                assert!(trap.sprung(), "{variant}: the first register was held");
                let t = g.token().get();
                if variant == "unlock" {
                    g.unlock().await.unwrap();
                } else {
                    drop(g);
                }
                t
            }
        };
        let bs = b.clone();
        let n2 = name.clone();
        let again = tokio::spawn(async move { bs.lock(&n2).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        trap.flush();
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(holder);
        let g2 = tokio::time::timeout(Duration::from_secs(10), again)
            .await
            .unwrap_or_else(|_| panic!("{variant}: the re-acquire never ended"))
            .unwrap()
            .unwrap_or_else(|err| panic!("{variant}: re-acquire failed: {err:?}"));
        assert!(g2.token().get() > old, "{variant}");
        // Still held: its entry must exist and be the one the grant names.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let keys = e.keys(&format!("{NS}/lock/{name}/q/")).await;
        assert_eq!(keys.len(), 1, "{variant}: the live grant's entry: {keys:?}");
        let other = a.try_lock(&name).await;
        assert!(
            matches!(other, Err(Error::Taken { .. })),
            "{variant}: {other:?}"
        );
        g2.unlock().await.unwrap();
        b.settle().await;
        let left = e.keys(&format!("{NS}/lock/{name}/q/")).await;
        assert!(left.is_empty(), "{variant}: left {left:?}");
    }
}

/// An unlock whose delete is applied but whose answer is lost: the repeat finds no entry and
/// cannot tell its own delete from someone else's, so it reports `LostBeforeRelease` (see
/// `an_unlock_after_a_successor_deleted_the_entry_is_lost_before_release_memory` for why it
/// must not say Ok); the lock is free all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlock_whose_answer_was_lost_is_lost_before_release_and_frees_the_lock_memory() {
    let store = MemoryProvider::new();
    let c = store.connect();
    let s = c.session(Fx::options(TTL)).await.unwrap();
    let g = s.lock("u").await.unwrap();
    c.lose_write_answers(1);
    let r = g.unlock().await;
    assert!(matches!(r, Err(Error::LostBeforeRelease { .. })), "{r:?}");
    let other = store.connect().session(Fx::options(TTL)).await.unwrap();
    other.try_lock("u").await.expect("the lock is free");
    assert!(
        s.lock("u").await.unwrap().token().get() > 0,
        "and free for this session"
    );
}

/// A late first register of the *current* campaign lands after the leader proclaimed: it
/// must write nothing (a first fix for stale adopted values wrote the campaign's value back
/// over the proclaimed one, under the same term).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_register_does_not_undo_a_proclaim_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    trap.arm(&format!("{NS}/election/pro/q/"));
    let l = tokio::time::timeout(Duration::from_secs(10), b.campaign("pro", "v1"))
        .await
        .expect("ends")
        .expect("leads after one retry of register");
    assert!(trap.sprung());
    l.proclaim("v2").await.unwrap();
    let before = a.leader("pro").await.unwrap().expect("a leader");
    assert_eq!(String::from_utf8_lossy(&before.value), "v2");
    let seen = term_after_the_late_copy(&trap, &a, "pro").await;
    assert_eq!(seen.token, l.token(), "same term");
    assert_eq!(
        String::from_utf8_lossy(&seen.value),
        "v2",
        "the late register put the campaign's value back over the leader's proclaim"
    );
}

/// Release after an unanswered attempt: the entry had been deleted by someone else (a
/// `with_lease` successor clears the lease's entries at start) and another session held the
/// lock meanwhile, so the unlock must say LostBeforeRelease although the repeat finds the
/// entry gone with the lease alive (the successor keeps it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlock_after_a_successor_deleted_the_entry_is_lost_before_release_memory() {
    let store = MemoryProvider::new();
    let c = store.connect();
    let p = c.session(Fx::options(TTL)).await.unwrap();
    let g = p.lock("succ").await.unwrap();
    let n = store
        .connect()
        .session(Fx::options(TTL).with_lease(p.lease_id()))
        .await
        .unwrap();
    let other = store.connect().session(Fx::options(TTL)).await.unwrap();
    let og = other.try_lock("succ").await.expect("the entry was cleared");
    assert!(og.token() > g.token());
    og.unlock().await.unwrap();
    c.set_partitioned(true);
    let c2 = c.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(60)).await;
        c2.set_partitioned(false);
    });
    let r = g.unlock().await;
    drop(n);
    assert!(
        matches!(r, Err(Error::LostBeforeRelease { .. })),
        "another session held the lock before this unlock, yet: {r:?}"
    );
}

/// The Arc'd claim: a look-again (unanswered register, then unlock) holds a clone; close()
/// must abandon it, settle() must end, and later acquisitions say SessionClosed at once. A
/// session lost (partitioned past its TTL) during the look must also end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_again_claim_does_not_outlive_close_or_loss_memory() {
    let store = MemoryProvider::new();
    let c = store.connect();
    let s = c.session(Fx::options(TTL)).await.unwrap();
    c.lose_write_answers(1);
    let g = s.lock("cl").await.unwrap();
    g.unlock().await.unwrap();
    // The look-again holds the claim (cleaning): a re-lock waits for it, then succeeds.
    let t0 = Instant::now();
    let g2 = tokio::time::timeout(Duration::from_secs(3), s.lock("cl"))
        .await
        .expect("the re-lock waits for the look, not forever")
        .unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    drop(g2);
    let t0 = Instant::now();
    s.close().await.unwrap();
    tokio::time::timeout(Duration::from_millis(500), s.settle())
        .await
        .expect("settle after close");
    let r = tokio::time::timeout(Duration::from_millis(500), s.lock("cl"))
        .await
        .expect("a lock on a closed session ends at once");
    assert!(matches!(r, Err(Error::SessionClosed)), "{r:?}");
    assert!(t0.elapsed() < Duration::from_millis(800));

    let c = store.connect();
    let s = c.session(Fx::options(TTL)).await.unwrap();
    c.lose_write_answers(1);
    let g = s.lock("cl2").await.unwrap();
    g.unlock().await.unwrap();
    c.set_partitioned(true);
    let r = tokio::time::timeout(TTL * 3, s.lock("cl2"))
        .await
        .expect("a lock behind a look on a lost session ends");
    assert!(matches!(r, Err(Error::SessionLost)), "{r:?}");
    tokio::time::timeout(TTL, s.settle())
        .await
        .expect("settle ends on a lost session");
    c.set_partitioned(false);
    let other = store.connect().session(Fx::options(TTL)).await.unwrap();
    tokio::time::sleep(TTL).await;
    let o = other.try_lock("cl2").await;
    assert!(o.is_ok(), "{o:?}");
}

/// Puts a stray entry (value `stale`) under `b`'s key of election `name`, on `b`'s lease, as
/// a late put of an earlier campaign that landed after both looks would; returns the key.
async fn stray_entry(e: &etcd::Etcd, b: &Session, name: &str) -> String {
    let l = b.campaign(name, "v0").await.unwrap();
    let key = b.leader(name).await.unwrap().expect("leads").key;
    l.resign().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut c = e.client().await;
    c.put(
        key.as_str(),
        "stale",
        Some(etcd_client::PutOptions::new().with_lease(b.lease_id())),
    )
    .await
    .unwrap();
    key
}

/// Bytes of an etcd `Compare` on `key`'s mod revision (target MOD = 2, result EQUAL omitted):
/// only `adopt_value` sends one on a queue key.
fn mod_compare_marker(key: &str) -> String {
    assert!(key.len() < 128);
    let mut m = String::from("\u{10}\u{2}\u{1a}");
    m.push(char::from(u8::try_from(key.len()).unwrap()));
    m.push_str(key);
    m
}

/// adopt_value's first attempt is held and lands after the leader proclaimed: it must write
/// nothing (its compare names the version read), the term keeps its token and the proclaimed
/// value, and the new term's token is above the earlier term's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_adopt_of_a_stray_value_does_not_undo_a_proclaim_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    let l0 = b.campaign("ad0", "x").await.unwrap();
    let before = l0.token();
    l0.resign().await.unwrap();
    let key = stray_entry(&e, &b, "ad").await;
    trap.arm(&mod_compare_marker(&key));
    let l = tokio::time::timeout(Duration::from_secs(10), b.campaign("ad", "v1"))
        .await
        .expect("ends")
        .expect("leads after one retry of adopt_value");
    assert!(trap.sprung(), "adopt_value's first attempt was held");
    assert!(l.token() > before);
    let t = a.leader("ad").await.unwrap().expect("a leader");
    assert_eq!(String::from_utf8_lossy(&t.value), "v1", "adopted value");
    l.proclaim("v2").await.unwrap();
    let seen = term_after_the_late_copy(&trap, &a, "ad").await;
    assert_eq!(seen.token, l.token(), "same term");
    assert_eq!(
        String::from_utf8_lossy(&seen.value),
        "v2",
        "late adopt undid proclaim"
    );
}

/// adopt_value's first attempt is applied before its repeat (answer lost): the repeat finds a
/// newer version holding this campaign's value and must lead, not fail with SessionLost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopt_applied_before_its_repeat_still_leads_on_etcd() {
    let e = etcd::Etcd::single().await;
    let (a, trap, b) = etcd_pair(&e).await;
    let key = stray_entry(&e, &b, "ad2").await;
    trap.arm(&mod_compare_marker(&key));
    let bs = b.clone();
    let task = tokio::spawn(async move { bs.campaign("ad2", "v1").await });
    let t0 = Instant::now();
    while !trap.sprung() {
        assert!(t0.elapsed() < Duration::from_secs(5), "never sprung");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    trap.flush();
    let r = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("ends")
        .unwrap();
    let l = r.expect("leads although its repeat found the version moved");
    let t = a.leader("ad2").await.unwrap().expect("a leader");
    assert_eq!(t.token, l.token());
    assert_eq!(String::from_utf8_lossy(&t.value), "v1");
    assert_eq!(b.state(), SessionState::Alive);
}

/// Lost answers on 1..4 successive writes of each campaign (register, confirm, resign) on
/// the memory provider, a new value each time: every campaign leads with its own value and a
/// higher token, none fails with SessionLost or hangs (the memory provider cannot land a
/// write late, so it cannot make a stray with another value: see the etcd probes above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_on_every_campaign_step_still_lead_with_its_own_value_memory() {
    let store = MemoryProvider::new();
    let c = store.connect();
    let s = c.session(Fx::options(TTL)).await.unwrap();
    let mut last = 0;
    for i in 0..4u32 {
        c.lose_write_answers(i + 1);
        let l = tokio::time::timeout(Duration::from_secs(5), s.campaign("m", format!("v{i}")))
            .await
            .expect("ends")
            .expect("leads");
        assert!(l.token().get() > last);
        last = l.token().get();
        let t = s.leader("m").await.unwrap().expect("leader");
        assert_eq!(t.value, format!("v{i}").into_bytes());
        let _ = l.resign().await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
}
