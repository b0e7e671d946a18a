//! Behaviour of sessions, locks, read/write locks, elections and semaphores: one suite, run
//! against the in-memory provider and against a real etcd process started on free ports. Tests
//! that need a real process crash (SIGSTOP, SIGKILL) run against etcd only.

mod defects;
mod gaps;
mod late;
#[cfg(feature = "metrics")]
mod owner_metrics;
mod semaphore;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{etcd, netcut};
use palisade::client::provider::etcd::EtcdProvider;
use palisade::{
    ElectionService, Error, LockService, Loss, MemoryProvider, Mode, Observation, Provider,
    RwLockService, SemaphoreService, Session, SessionOptions, SessionState,
};

const NS: &str = "/t";
const TTL: Duration = Duration::from_secs(2);

/// A provider under test, plus what the suite needs to inspect and break it.
enum Fx {
    Memory(MemoryProvider),
    Etcd(etcd::Etcd, EtcdProvider),
}

/// Cuts one session's connection to the store.
enum Cutter {
    Memory(MemoryProvider),
    Net(netcut::Cut),
}

impl Cutter {
    fn cut(&self) {
        match self {
            Cutter::Memory(m) => m.set_partitioned(true),
            Cutter::Net(n) => n.cut(),
        }
    }

    fn heal(&self) {
        match self {
            Cutter::Memory(m) => m.set_partitioned(false),
            Cutter::Net(n) => n.heal(),
        }
    }
}

impl Fx {
    async fn memory() -> Fx {
        Fx::Memory(MemoryProvider::new())
    }

    async fn etcd() -> Fx {
        let e = etcd::Etcd::single().await;
        let client = e.client().await;
        let p = EtcdProvider::new(&client);
        Fx::Etcd(e, p)
    }

    fn options(ttl: Duration) -> SessionOptions {
        SessionOptions::new().with_ttl(ttl).with_namespace(NS)
    }

    async fn session_ttl(&self, ttl: Duration) -> Session {
        match self {
            Fx::Memory(m) => m.connect().session(Self::options(ttl)).await.unwrap(),
            Fx::Etcd(_, p) => p.session(Self::options(ttl)).await.unwrap(),
        }
    }

    async fn session(&self) -> Session {
        self.session_ttl(TTL).await
    }

    async fn session_with(&self, options: SessionOptions) -> Result<Session, Error> {
        match self {
            Fx::Memory(m) => m.connect().session(options).await,
            Fx::Etcd(_, p) => p.session(options).await,
        }
    }

    async fn session_in(&self, namespace: &str) -> Result<Session, Error> {
        self.session_with(Self::options(TTL).with_namespace(namespace))
            .await
    }

    /// A session resumed on the lease `id`.
    async fn resume(&self, id: i64) -> Result<Session, Error> {
        self.session_with(Self::options(TTL).with_lease(id)).await
    }

    /// A session whose link to the store the test can cut.
    async fn cuttable(&self) -> (Session, Cutter) {
        self.cuttable_ttl(TTL).await
    }

    /// [`Fx::cuttable`] with lease TTL `ttl`.
    async fn cuttable_ttl(&self, ttl: Duration) -> (Session, Cutter) {
        match self {
            Fx::Memory(m) => {
                let c = m.connect();
                (
                    c.session(Self::options(ttl)).await.unwrap(),
                    Cutter::Memory(c),
                )
            }
            Fx::Etcd(e, _) => {
                let cut = netcut::Cut::new(&e.endpoint()).await;
                let client = etcd::Etcd::client_at(&cut.url()).await;
                let p = EtcdProvider::new(&client).with_request_timeout(Duration::from_millis(500));
                (
                    p.session(Self::options(ttl)).await.unwrap(),
                    Cutter::Net(cut),
                )
            }
        }
    }

    async fn keys(&self, prefix: &str) -> Vec<String> {
        match self {
            Fx::Memory(m) => m.keys(prefix),
            Fx::Etcd(e, _) => e.keys(prefix).await,
        }
    }

    /// Waits (bounded) until no key under `prefix` has `needle` in it.
    async fn wait_gone(&self, prefix: &str, needle: &str) {
        let started = Instant::now();
        while self.keys(prefix).await.iter().any(|k| k.contains(needle)) {
            assert!(started.elapsed() < TTL * 4, "{needle} still under {prefix}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn lease_hex(s: &Session) -> String {
    format!("{:016x}", s.lease_id())
}

mod suite {
    use super::*;

    pub(crate) use super::defects::{
        a_lease_revoked_elsewhere_is_a_lost_session_at_once,
        a_re_campaign_never_shows_the_ended_term_with_the_new_value,
        a_resumed_session_never_adopts_the_running_sessions_entry, an_absurd_ttl_is_an_error,
        nested_namespaces_do_not_collide,
        oversized_names_are_refused_up_front_with_a_short_message,
        retrying_right_after_a_cancel_or_a_drop_takes_the_name_again,
    };
    pub(crate) use super::gaps::{
        a_restarted_leader_resumes_its_term_with_its_token, terms_carry_the_leaders_identity,
    };
    pub(crate) use super::semaphore::{
        a_cancelled_acquire_leaves_no_key_and_can_queue_again,
        an_expired_holder_frees_only_its_slot_and_the_next_holder_outranks_it,
        at_most_n_holders_each_slot_with_strictly_increasing_tokens,
        permit_counts_must_agree_and_bad_input_is_an_error,
        release_is_fenced_and_a_deleted_slot_fires_the_loss_signal,
        try_acquire_takes_free_slots_and_leaves_nothing_when_it_fails,
    };

    pub(crate) async fn mutual_exclusion_with_tokens_in_acquisition_order(fx: &Fx) {
        let inside = Arc::new(AtomicBool::new(false));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let s = fx.session().await;
            let (inside, order) = (inside.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..25 {
                    let g = s.lock("shared").await.unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                    order.lock().unwrap().push(g.token().get());
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    g.unlock().await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap();
        assert_eq!(order.len(), 200);
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "tokens not strictly increasing: {order:?}"
        );
    }

    pub(crate) async fn tokens_increase_across_unlock_and_lease_expiry(fx: &Fx) {
        let a = fx.session().await;
        let t1 = a.lock("x").await.unwrap();
        let first = t1.token();
        t1.unlock().await.unwrap();
        let t2 = a.lock("x").await.unwrap();
        assert!(t2.token() > first, "unlock -> lock");
        t2.unlock().await.unwrap();

        let (holder, cutter) = fx.cuttable().await;
        let held = holder.lock("x").await.unwrap();
        assert!(held.token() > t2.token());
        let b = fx.session().await;
        let waiter = tokio::spawn(async move { (b.lock("x").await.unwrap(), b) });
        cutter.cut();
        let (next, _b) = waiter.await.unwrap();
        assert!(
            next.token() > held.token(),
            "expiry -> waiter: {} after {}",
            next.token(),
            held.token()
        );
    }

    pub(crate) async fn expired_holder_is_signalled_within_ttl_plus_2s_and_gets_no_more_tokens(
        fx: &Fx,
    ) {
        let (holder, cutter) = fx.cuttable().await;
        let g = holder.lock("x").await.unwrap();
        let mut lost = g.loss_signal();
        let cut_at = Instant::now();
        cutter.cut();
        let state = tokio::time::timeout(TTL + Duration::from_secs(2), lost.wait())
            .await
            .expect("loss signal in time");
        assert_eq!(state, Loss::SessionLost);
        assert!(cut_at.elapsed() <= TTL + Duration::from_secs(2));
        assert_eq!(holder.state(), SessionState::Lost);
        assert!(matches!(holder.lock("y").await, Err(Error::SessionLost)));
        assert!(matches!(
            holder.try_lock("y").await,
            Err(Error::SessionLost)
        ));
        assert!(matches!(
            holder.campaign("e", "v").await,
            Err(Error::SessionLost)
        ));
    }

    pub(crate) async fn try_lock_race_has_one_winner_and_losers_leave_no_key(fx: &Fx) {
        let sessions = futures_join(5, || fx.session()).await;
        let results = futures_all(
            sessions
                .iter()
                .cloned()
                .map(|s| async move { s.try_lock("race").await }),
        )
        .await;
        let winners: Vec<_> = results.iter().filter(|r| r.is_ok()).collect();
        assert_eq!(winners.len(), 1, "{results:?}");
        for r in &results {
            if let Err(e) = r {
                assert!(matches!(e, Error::Taken { .. }), "{e}");
            }
        }
        let keys = fx.keys(&format!("{NS}/lock/race/q/")).await;
        assert_eq!(keys.len(), 1, "only the winner's entry: {keys:?}");
        // A loser can try again once the winner is gone, and is not behind a phantom entry.
        let winner_idx = results.iter().position(|r| r.is_ok()).unwrap();
        results[winner_idx]
            .as_ref()
            .unwrap()
            .unlock()
            .await
            .unwrap();
        let loser = &sessions[(winner_idx + 1) % 5];
        assert!(loser.try_lock("race").await.is_ok());
    }

    pub(crate) async fn cancelled_lock_and_campaign_leave_no_key(fx: &Fx) {
        let holder = fx.session().await;
        let _g = holder.lock("c").await.unwrap();
        let _l = holder.campaign("c", "leader").await.unwrap();
        let waiter = fx.session().await;
        assert!(
            tokio::time::timeout(Duration::from_millis(200), waiter.lock("c"))
                .await
                .is_err()
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(200), waiter.campaign("c", "w"))
                .await
                .is_err()
        );
        waiter.settle().await;
        let me = lease_hex(&waiter);
        for prefix in [format!("{NS}/lock/c/q/"), format!("{NS}/election/c/q/")] {
            let keys = fx.keys(&prefix).await;
            assert_eq!(keys.len(), 1, "{prefix}: {keys:?}");
            assert!(!keys[0].contains(&me));
        }
        // And the session can queue again afterwards.
        let again = tokio::spawn(async move { waiter.lock("c").await.map(|g| g.token()) });
        drop(_g);
        assert!(again.await.unwrap().is_ok());
    }

    pub(crate) async fn waiter_never_acquires_while_the_holder_holds(fx: &Fx) {
        let holder = fx.session().await;
        let g = holder.lock("w").await.unwrap();
        let (middle, cutter) = fx.cuttable().await;
        let middle_hex = lease_hex(&middle);
        let middle_task = tokio::spawn(async move { middle.lock("w").await.map(|g| g.token()) });
        fx.wait_present(&format!("{NS}/lock/w/q/"), &middle_hex)
            .await;
        let last = fx.session().await;
        let last_hex = lease_hex(&last);
        let last_task = tokio::spawn(async move { last.lock("w").await.map(|g| (g.token(), g)) });
        fx.wait_present(&format!("{NS}/lock/w/q/"), &last_hex).await;
        cutter.cut();
        fx.wait_gone(&format!("{NS}/lock/w/q/"), &middle_hex).await;
        // The entry in front of `last` is gone but the holder is alive: `last` keeps waiting.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !last_task.is_finished(),
            "a waiter acquired while the holder held"
        );
        assert!(
            middle_task.await.unwrap().is_err(),
            "the expired waiter gets no token"
        );
        let held = g.token();
        g.unlock().await.unwrap();
        let (t, _g) = last_task.await.unwrap().unwrap();
        assert!(t > held);
    }

    pub(crate) async fn a_stale_release_cannot_delete_a_newer_incarnation(fx: &Fx) {
        let s = fx.session().await;
        let g1 = s.lock("i").await.unwrap();
        let old = g1.incarnation().clone();
        g1.unlock().await.unwrap();
        assert!(
            matches!(g1.unlock().await, Err(Error::Released)),
            "double unlock is defined"
        );
        let g2 = s.lock("i").await.unwrap();
        assert_eq!(
            g2.incarnation().key(),
            old.key(),
            "same key, new incarnation"
        );
        assert!(g2.incarnation().create_revision() > old.create_revision());
        assert!(
            !s.release(&old).await.unwrap(),
            "the retried release deleted nothing"
        );
        let other = fx.session().await;
        assert!(
            matches!(other.try_lock("i").await, Err(Error::Taken { .. })),
            "g2 still holds"
        );

        let l1 = s.campaign("i", "a").await.unwrap();
        let old = l1.incarnation().clone();
        l1.resign().await.unwrap();
        let l2 = s.campaign("i", "b").await.unwrap();
        assert!(!s.release(&old).await.unwrap());
        assert_eq!(
            s.leader("i").await.unwrap().unwrap().token,
            l2.token(),
            "l2 still leads"
        );
        drop(g2);
    }

    pub(crate) async fn reentrant_acquisition_and_bad_input_are_errors(fx: &Fx) {
        let s = fx.session().await;
        let _g = s.lock("r").await.unwrap();
        assert!(matches!(s.lock("r").await, Err(Error::AlreadyHeld { .. })));
        assert!(matches!(
            s.try_lock("r").await,
            Err(Error::AlreadyHeld { .. })
        ));
        assert!(matches!(s.lock("").await, Err(Error::InvalidName(_))));
        // Names are escaped: "a" and "a/q" never share a queue.
        let _a = s.lock("a").await.unwrap();
        let _aq = s.try_lock("a/q").await.unwrap();
        let bad = match fx {
            Fx::Memory(m) => {
                m.session(SessionOptions::new().with_ttl(Duration::from_millis(500)))
                    .await
            }
            Fx::Etcd(_, p) => {
                p.session(SessionOptions::new().with_ttl(Duration::from_millis(500)))
                    .await
            }
        };
        assert!(matches!(bad, Err(Error::InvalidTtl(_))));
        let fractional = fx.session_ttl(Duration::from_millis(1500)).await;
        assert_eq!(
            fractional.ttl(),
            Duration::from_secs(2),
            "rounded up to whole seconds"
        );
    }

    pub(crate) async fn close_is_distinct_from_loss_and_revokes_everything(fx: &Fx) {
        let s = fx.session().await;
        let _g = s.lock("k").await.unwrap();
        let mut signal = s.loss_signal();
        s.close().await.unwrap();
        assert_eq!(signal.wait().await, Loss::SessionClosed);
        assert!(matches!(s.lock("k2").await, Err(Error::SessionClosed)));
        assert!(
            fx.keys(&format!("{NS}/lock/k/q/")).await.is_empty(),
            "revoke deleted the entry"
        );
        let other = fx.session().await;
        assert!(other.try_lock("k").await.is_ok());
    }

    pub(crate) async fn readers_share_a_phase_token_and_writers_exclude(fx: &Fx) {
        let (r1, r2, w) = (fx.session().await, fx.session().await, fx.session().await);
        let a = r1.read_lock("rw").await.unwrap();
        let b = r2.read_lock("rw").await.unwrap();
        assert_eq!(a.mode(), Mode::Read);
        assert_eq!(a.token(), b.token(), "one read phase, one token");
        assert!(matches!(
            w.try_write_lock("rw").await,
            Err(Error::Taken { .. })
        ));
        assert!(
            fx.keys(&format!("{NS}/rwlock/rw/q/w/")).await.is_empty(),
            "failed try leaves no key"
        );

        // The writer waits for every earlier reader.
        let writer = tokio::spawn(async move { (w.write_lock("rw").await.unwrap(), w) });
        fx.wait_present(&format!("{NS}/rwlock/rw/q/w/"), "").await;
        // A reader arriving after the writer queues behind it; try_read refuses.
        let r3 = fx.session().await;
        assert!(matches!(
            r3.try_read_lock("rw").await,
            Err(Error::Taken { .. })
        ));
        a.runlock().await.unwrap();
        assert!(
            !writer.is_finished(),
            "writer must wait for the second reader"
        );
        b.runlock().await.unwrap();
        let (wg, w) = writer.await.unwrap();
        assert!(
            wg.token() > a.token(),
            "writer token above the read phase before it"
        );
        assert!(
            matches!(r1.try_read_lock("rw").await, Err(Error::Taken { .. })),
            "writer excludes readers"
        );

        // Wrong-role release is refused and the lock stays held.
        assert!(matches!(
            wg.runlock().await,
            Err(Error::WrongMode { held: "write", .. })
        ));
        assert!(matches!(
            r1.try_read_lock("rw").await,
            Err(Error::Taken { .. })
        ));
        wg.unlock().await.unwrap();

        let next = r1.read_lock("rw").await.unwrap();
        assert!(
            next.token() > wg.token(),
            "the next read phase is above the writer"
        );
        assert!(matches!(
            next.unlock().await,
            Err(Error::WrongMode { held: "read", .. })
        ));
        assert!(
            matches!(w.try_write_lock("rw").await, Err(Error::Taken { .. })),
            "read lock still held"
        );
        // Upgrade on one session is refused at once instead of deadlocking.
        let up = tokio::time::timeout(Duration::from_secs(5), r1.write_lock("rw"))
            .await
            .expect("no deadlock");
        assert!(matches!(up, Err(Error::UpgradeNotSupported { .. })));
        let also = r2.try_read_lock("rw").await.unwrap();
        assert_eq!(also.token(), next.token());
        next.runlock().await.unwrap();
        also.runlock().await.unwrap();
        let tw = w.try_write_lock("rw").await.unwrap();
        assert!(tw.token() > next.token());
    }

    pub(crate) async fn campaign_returns_the_token_and_resign_hands_over_promptly(fx: &Fx) {
        let (a, b) = (fx.session().await, fx.session().await);
        let la = a.campaign("e", "a").await.unwrap();
        let term = a.leader("e").await.unwrap().unwrap();
        assert_eq!(term.token, la.token());
        assert_eq!(term.value, b"a");
        let b_hex = lease_hex(&b);
        let follower = tokio::spawn(async move { (b.campaign("e", "b").await.unwrap(), b) });
        fx.wait_present(&format!("{NS}/election/e/q/"), &b_hex)
            .await;
        let resigned = Instant::now();
        la.resign().await.unwrap();
        let (lb, _b) = follower.await.unwrap();
        assert!(
            resigned.elapsed() < Duration::from_secs(1),
            "handover took {:?}",
            resigned.elapsed()
        );
        assert!(lb.token() > la.token());
        assert!(matches!(la.proclaim("late").await, Err(Error::Released)));
    }

    pub(crate) async fn observers_see_terms_in_order_proclamations_and_no_leader(fx: &Fx) {
        let watcher = fx.session().await;
        let mut obs = watcher.observe("o").await.unwrap();
        assert_eq!(next(&mut obs).await, Observation::NoLeader);
        let a = fx.session().await;
        let la = a.campaign("o", "a1").await.unwrap();
        let Observation::Leader(t1) = next(&mut obs).await else {
            panic!("expected a leader")
        };
        assert_eq!((t1.token, t1.value.as_slice()), (la.token(), &b"a1"[..]));
        la.proclaim("a2").await.unwrap();
        let Observation::Leader(t2) = next(&mut obs).await else {
            panic!("expected a proclamation")
        };
        assert_eq!((t2.token, t2.value.as_slice()), (la.token(), &b"a2"[..]));
        let b = fx.session().await;
        // Wait for b's own entry (an empty needle would match a's entry at once).
        let b_hex = lease_hex(&b);
        let follower = tokio::spawn(async move { (b.campaign("o", "b1").await.unwrap(), b) });
        fx.wait_present(&format!("{NS}/election/o/q/"), &b_hex)
            .await;
        la.resign().await.unwrap();
        let (lb, _b) = follower.await.unwrap();
        let Observation::Leader(t3) = next(&mut obs).await else {
            panic!("expected the next term")
        };
        assert!(t3.token > t2.token);
        assert_eq!((t3.token, t3.value.as_slice()), (lb.token(), &b"b1"[..]));
        lb.resign().await.unwrap();
        assert_eq!(next(&mut obs).await, Observation::NoLeader);
    }

    pub(crate) async fn a_candidate_whose_session_expires_never_leads(fx: &Fx) {
        let leader = fx.session().await;
        let l = leader.campaign("x", "l").await.unwrap();
        let (cand, cutter) = fx.cuttable().await;
        let hex = lease_hex(&cand);
        let attempt = tokio::spawn(async move { cand.campaign("x", "c").await.map(|l| l.token()) });
        fx.wait_present(&format!("{NS}/election/x/q/"), &hex).await;
        cutter.cut();
        let r = tokio::time::timeout(TTL + Duration::from_secs(2), attempt)
            .await
            .expect("returns promptly")
            .unwrap();
        assert!(matches!(r, Err(Error::SessionLost)), "{r:?}");
        l.resign().await.unwrap();
        assert!(leader.leader("x").await.unwrap().is_none());
    }

    pub(crate) async fn lead_cancels_the_work_when_leadership_is_lost(fx: &Fx) {
        let (s, cutter) = fx.cuttable().await;
        let started = Arc::new(tokio::sync::Notify::new());
        let st = started.clone();
        let run = tokio::spawn(async move {
            s.lead("lead", "me", |ctx| async move {
                st.notify_one();
                let mut lost = ctx.lost;
                lost.wait().await;
                ctx.token
            })
            .await
        });
        started.notified().await;
        let cut = Instant::now();
        cutter.cut();
        let token = tokio::time::timeout(TTL + Duration::from_secs(2), run)
            .await
            .expect("signal fired")
            .unwrap()
            .unwrap();
        assert!(cut.elapsed() <= TTL + Duration::from_secs(2));
        let other = fx.session().await;
        let next = other.campaign("lead", "next").await.unwrap();
        assert!(next.token() > token);
    }

    pub(crate) async fn a_waiter_survives_a_short_disconnect(fx: &Fx) {
        let holder = fx.session().await;
        let g = holder.lock("d").await.unwrap();
        let (waiter, cutter) = fx.cuttable().await;
        let hex = lease_hex(&waiter);
        let task = tokio::spawn(async move { waiter.lock("d").await.map(|g| (g.token(), g)) });
        fx.wait_present(&format!("{NS}/lock/d/q/"), &hex).await;
        // Shorter than the TTL: the lease survives, the waiter's watch breaks and is re-created.
        cutter.cut();
        tokio::time::sleep(TTL / 4).await;
        cutter.heal();
        let held = g.token();
        g.unlock().await.unwrap();
        let (t, _g) = tokio::time::timeout(TTL * 2, task)
            .await
            .expect("the waiter acquires")
            .unwrap()
            .unwrap();
        assert!(t > held);
    }

    /// CI once saw `lock` fail with "register: transport error" when the waiter's connection
    /// broke while its entry was being written: a blocking acquisition rides out a short
    /// outage at every step, entering the queue included.
    pub(crate) async fn an_acquisition_begun_during_a_short_outage_waits_for_the_store(fx: &Fx) {
        let holder = fx.session().await;
        let g = holder.lock("o").await.unwrap();
        let (waiter, cutter) = fx.cuttable().await;
        cutter.cut();
        let w = waiter.clone();
        let lock = tokio::spawn(async move { w.lock("o").await.map(|g| (g.token(), g)) });
        let w = waiter.clone();
        let read = tokio::spawn(async move { w.read_lock("o").await.map(|g| g.token()) });
        let w = waiter.clone();
        let permit = tokio::spawn(async move { w.acquire("o", 2).await.map(|p| p.token()) });
        let campaign = tokio::spawn(async move { waiter.campaign("o", "v").await });
        tokio::time::sleep(TTL / 4).await;
        assert!(!permit.is_finished(), "the semaphore waits for the store");
        assert!(
            !lock.is_finished(),
            "the lock waits for the store instead of failing"
        );
        assert!(!read.is_finished(), "the read lock waits for the store");
        assert!(!campaign.is_finished(), "the campaign waits for the store");
        cutter.heal();
        tokio::time::timeout(TTL * 2, read)
            .await
            .expect("the read lock ends")
            .unwrap()
            .expect("the read lock is taken once the store is back");
        tokio::time::timeout(TTL * 2, permit)
            .await
            .expect("the acquire ends")
            .unwrap()
            .expect("a permit is taken once the store is back");
        let leader = tokio::time::timeout(TTL * 2, campaign)
            .await
            .expect("the campaign ends")
            .unwrap()
            .expect("the campaign wins once the store is back");
        let held = g.token();
        g.unlock().await.unwrap();
        let (t, _g) = tokio::time::timeout(TTL * 2, lock)
            .await
            .expect("the waiter acquires")
            .unwrap()
            .unwrap();
        assert!(t > held);
        assert!(leader.token() > held);
    }

    pub(crate) async fn a_session_resumes_its_lease_but_not_a_revoked_one(fx: &Fx) {
        let first = fx.session().await;
        let id = first.lease_id();
        let resume = |id| async move {
            match fx {
                Fx::Memory(m) => m.session(Fx::options(TTL).with_lease(id)).await,
                Fx::Etcd(_, p) => p.session(Fx::options(TTL).with_lease(id)).await,
            }
        };
        let again = resume(id).await.unwrap();
        assert_eq!(again.lease_id(), id);
        let g = again.lock("resume").await.unwrap();
        assert!(fx.keys(&format!("{NS}/lock/resume/q/")).await[0].ends_with(&lease_hex(&first)));
        drop(g);
        again.close().await.unwrap();
        assert!(
            matches!(resume(id).await, Err(Error::SessionLost)),
            "a revoked lease cannot be resumed"
        );
    }

    pub(crate) async fn a_deleted_entry_fires_the_grants_loss_signal_but_a_release_does_not(
        fx: &Fx,
    ) {
        let s = fx.session().await;
        let leader = s.campaign("gone", "v").await.unwrap();
        let mut signal = leader.loss_signal();
        assert!(!signal.is_lost());
        // Someone deletes the entry behind the holder's back (here: a release of that exact
        // incarnation); the session itself stays alive.
        assert!(s.release(leader.incarnation()).await.unwrap());
        let loss = tokio::time::timeout(Duration::from_secs(2), signal.wait())
            .await
            .expect("fires");
        assert_eq!(loss, Loss::EntryDeleted);
        assert_eq!(s.state(), SessionState::Alive);
        assert!(matches!(
            leader.proclaim("x").await,
            Err(Error::NotLeader { .. })
        ));

        let g = s.lock("gone").await.unwrap();
        let mut signal = g.loss_signal();
        g.unlock().await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), signal.wait())
                .await
                .is_err(),
            "own unlock is no loss"
        );
    }

    async fn next(obs: &mut palisade::client::election::Observer) -> Observation {
        tokio::time::timeout(Duration::from_secs(5), obs.next())
            .await
            .expect("an observation")
            .unwrap()
            .unwrap()
    }

    async fn futures_join<F, Fut>(n: usize, f: F) -> Vec<Session>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Session>,
    {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(f().await);
        }
        out
    }

    async fn futures_all<T, Fut>(futs: impl Iterator<Item = Fut>) -> Vec<T>
    where
        Fut: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        // Start every racer before awaiting any.
        let handles: Vec<_> = futs.map(tokio::spawn).collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.unwrap());
        }
        out
    }
}

impl Fx {
    /// Waits (bounded) until a key under `prefix` contains `needle`.
    async fn wait_present(&self, prefix: &str, needle: &str) {
        let started = Instant::now();
        while !self.keys(prefix).await.iter().any(|k| k.contains(needle)) {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{needle} never appeared under {prefix}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

macro_rules! both_providers {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::suite::$name(&super::Fx::memory().await).await;
                }
            )*
        }
        mod on_etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::suite::$name(&super::Fx::etcd().await).await;
                }
            )*
        }
    };
}

both_providers!(
    mutual_exclusion_with_tokens_in_acquisition_order,
    tokens_increase_across_unlock_and_lease_expiry,
    expired_holder_is_signalled_within_ttl_plus_2s_and_gets_no_more_tokens,
    try_lock_race_has_one_winner_and_losers_leave_no_key,
    cancelled_lock_and_campaign_leave_no_key,
    waiter_never_acquires_while_the_holder_holds,
    a_stale_release_cannot_delete_a_newer_incarnation,
    reentrant_acquisition_and_bad_input_are_errors,
    close_is_distinct_from_loss_and_revokes_everything,
    readers_share_a_phase_token_and_writers_exclude,
    campaign_returns_the_token_and_resign_hands_over_promptly,
    observers_see_terms_in_order_proclamations_and_no_leader,
    a_candidate_whose_session_expires_never_leads,
    lead_cancels_the_work_when_leadership_is_lost,
    a_waiter_survives_a_short_disconnect,
    an_acquisition_begun_during_a_short_outage_waits_for_the_store,
    a_session_resumes_its_lease_but_not_a_revoked_one,
    a_deleted_entry_fires_the_grants_loss_signal_but_a_release_does_not,
    a_re_campaign_never_shows_the_ended_term_with_the_new_value,
    oversized_names_are_refused_up_front_with_a_short_message,
    retrying_right_after_a_cancel_or_a_drop_takes_the_name_again,
    a_resumed_session_never_adopts_the_running_sessions_entry,
    nested_namespaces_do_not_collide,
    an_absurd_ttl_is_an_error,
    a_lease_revoked_elsewhere_is_a_lost_session_at_once,
    terms_carry_the_leaders_identity,
    a_restarted_leader_resumes_its_term_with_its_token,
    at_most_n_holders_each_slot_with_strictly_increasing_tokens,
    an_expired_holder_frees_only_its_slot_and_the_next_holder_outranks_it,
    try_acquire_takes_free_slots_and_leaves_nothing_when_it_fails,
    a_cancelled_acquire_leaves_no_key_and_can_queue_again,
    permit_counts_must_agree_and_bad_input_is_an_error,
    release_is_fenced_and_a_deleted_slot_fires_the_loss_signal,
);

/// Real process crashes, against etcd only: the holder is `examples/lock.rs` or
/// `examples/election.rs` running as a child process.
mod processes;
