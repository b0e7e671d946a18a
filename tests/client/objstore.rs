//! Object-store leader election on object_store's `InMemory` store (a real `ObjectStore`
//! with conditional puts), on tokio's paused clock: every duration below is exact.
//! `tests/client/objstore_s3.rs` runs the same election against a real S3-compatible server.

use crate::faulty_store;

use std::sync::Arc;
use std::time::Duration;

use faulty_store::{Fault, Faulty};
use palisade::client::objstore::object_store::memory::InMemory;
use palisade::client::objstore::object_store::path::Path;
use palisade::client::objstore::object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use palisade::client::objstore::{Elector, ElectorOptions, Error, Event, LossReason};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(2);
/// The defaults derived from TTL (ElectorOptions): renew TTL/3, poll TTL/4, margin TTL/10.
const POLL: Duration = Duration::from_millis(500);
const MARGIN: Duration = Duration::from_millis(200);
const RENEW: Duration = Duration::from_nanos(2_000_000_000 / 3);

fn options(holder: &str) -> ElectorOptions {
    ElectorOptions::new()
        .with_prefix("elections")
        .with_ttl(TTL)
        .with_holder(holder)
}

async fn elector(store: &Arc<dyn ObjectStore>, holder: &str) -> Elector {
    Elector::new(store.clone(), options(holder)).await.unwrap()
}

fn memory() -> Arc<dyn ObjectStore> {
    Arc::new(InMemory::new())
}

#[tokio::test(start_paused = true)]
async fn the_first_term_creates_generation_1_and_renewals_extend_it() {
    let store = memory();
    let a = elector(&store, "a").await;
    let mut events = a.events();
    let leadership = a.campaign("job").await.unwrap();
    assert_eq!(leadership.token().get(), 1);
    let token = leadership.token();
    let name = "job".to_owned();
    assert_eq!(
        events.next().await,
        Some(Event::Acquired {
            name: name.clone(),
            token
        })
    );
    let started = Instant::now();
    let lost = leadership.loss_signal();
    let first_deadline = lost.deadline();
    for _ in 0..6 {
        assert_eq!(
            events.next().await,
            Some(Event::Renewed {
                name: name.clone(),
                token
            })
        );
    }
    // Six renewals, one every TTL/3: the term outlived its first deadline.
    assert!(started.elapsed() >= RENEW * 6 && started.elapsed() < TTL * 2 + RENEW);
    assert!(!lost.is_lost());
    assert!(lost.deadline() > first_deadline + RENEW * 5);
    let lease = a.current("job").await.unwrap().unwrap();
    assert_eq!(
        (lease.token, lease.holder.as_str(), lease.released),
        (token, "a", false)
    );
}

#[tokio::test(start_paused = true)]
async fn release_keeps_the_record_and_the_next_term_takes_generation_plus_one() {
    let store = memory();
    let (a, b) = (elector(&store, "a").await, elector(&store, "b").await);
    let mut events = a.events();
    let mut first = a.campaign("job").await.unwrap();
    let mut lost = first.loss_signal();
    first.release().await.unwrap();
    assert_eq!(lost.wait().await, LossReason::Released);
    assert!(matches!(first.release().await, Err(Error::Released)));
    // The record is still there, released, with the same generation.
    let lease = b.current("job").await.unwrap().unwrap();
    assert_eq!((lease.token.get(), lease.released), (1, true));
    // A released record is taken at once (no TTL wait), with generation + 1.
    let asked = Instant::now();
    let mut second = b.campaign("job").await.unwrap();
    assert_eq!(asked.elapsed(), Duration::ZERO);
    assert_eq!(second.token().get(), 2);
    // Re-acquiring after a release goes on counting up.
    let again = tokio::spawn({
        let a = a.clone();
        async move { a.campaign("job").await.map(|l| l.token().get()) }
    });
    tokio::time::sleep(TTL * 3).await;
    assert!(
        !again.is_finished(),
        "a live leader's record was taken over"
    );
    second.release().await.unwrap();
    let released_at = Instant::now();
    assert_eq!(again.await.unwrap().unwrap(), 3);
    assert!(
        released_at.elapsed() <= POLL,
        "took {:?}",
        released_at.elapsed()
    );
    let seen = drain(&mut events).await;
    let released = Event::Released {
        name: "job".into(),
        token: first.token(),
    };
    assert!(seen.contains(&released), "{seen:?}");
}

/// The events already sent.
async fn drain(events: &mut palisade::client::objstore::Events) -> Vec<Event> {
    let mut seen = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::ZERO, events.next()).await {
        seen.push(e);
    }
    seen
}

/// Writes a record as a leader of another process would have, then "crashes" (never writes
/// again). Its content says nothing about time: only watching it tells its age.
async fn crashed_leader(store: &Arc<dyn ObjectStore>, name: &str, generation: u64, ttl_ms: u64) {
    let record = format!(
        r#"{{"generation":{generation},"revision":7,"nonce":"gone","holder":"crashed","ttl_ms":{ttl_ms},"released":false}}"#
    );
    let path = Path::from(format!("elections/{name}"));
    store
        .put(&path, PutPayload::from(record.into_bytes()))
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_follower_takes_over_only_after_watching_one_version_for_a_full_ttl() {
    let store = memory();
    // The leader died long ago; the follower cannot know, so it waits a full TTL from its
    // own first read, and the record's longer TTL (3 s) wins over its own (2 s).
    crashed_leader(&store, "job", 41, 3000).await;
    let b = elector(&store, "b").await;
    let asked = Instant::now();
    let won = b.campaign("job").await.unwrap();
    assert_eq!(asked.elapsed(), Duration::from_secs(3));
    assert_eq!(won.token().get(), 42);

    // With its own TTL the larger one, the follower waits that.
    crashed_leader(&store, "other", 9, 500).await;
    let asked = Instant::now();
    let won = b.campaign("other").await.unwrap();
    assert_eq!((asked.elapsed(), won.token().get()), (TTL, 10));
}

#[tokio::test(start_paused = true)]
async fn a_live_leader_is_never_taken_over() {
    let store = memory();
    let (a, b) = (elector(&store, "a").await, elector(&store, "b").await);
    let leadership = a.campaign("job").await.unwrap();
    let waited = tokio::time::timeout(TTL * 10, b.campaign("job")).await;
    assert!(waited.is_err(), "b took over a renewing leader");
    assert!(!leadership.loss_signal().is_lost());
}

#[tokio::test(start_paused = true)]
async fn a_cut_off_leader_stops_acting_before_anyone_may_take_over() {
    let memory = memory();
    let faulty = Faulty::new(memory.clone());
    let a = elector(&(Arc::new(faulty.clone()) as Arc<dyn ObjectStore>), "a").await;
    let b = elector(&memory, "b").await;
    let mut events = a.events();
    let leadership = a.campaign("job").await.unwrap();
    let mut lost = leadership.loss_signal();
    // The last successful write starts at a renewal; cut the store right after it.
    assert!(matches!(events.next().await, Some(Event::Acquired { .. })));
    assert!(matches!(events.next().await, Some(Event::Renewed { .. })));
    let last_write = Instant::now();
    faulty.set(Fault::Down);
    let follower = tokio::spawn(async move {
        let won = b.campaign("job").await.unwrap();
        (Instant::now(), won.token().get())
    });
    assert_eq!(lost.wait().await, LossReason::Expired);
    let lost_at = Instant::now();
    // The leader stops TTL - margin after the start of its last successful write...
    assert_eq!(lost_at - last_write, TTL - MARGIN);
    let (won_at, token) = follower.await.unwrap();
    // ...and the follower takes over a full TTL after it first saw that write.
    assert_eq!(token, 2);
    assert_eq!(won_at - last_write, TTL);
    assert!(won_at - lost_at >= MARGIN);
    assert!(matches!(
        events.next().await,
        Some(Event::Lost {
            reason: LossReason::Expired,
            ..
        })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_displaced_leader_learns_it_at_its_next_renewal() {
    let store = memory();
    let a = elector(&store, "a").await;
    let mut leadership = a.campaign("job").await.unwrap();
    let mut lost = leadership.loss_signal();
    let overwritten = Instant::now();
    // Someone replaces the record behind the leader's back.
    crashed_leader(&store, "job", 5, 2000).await;
    assert_eq!(lost.wait().await, LossReason::Displaced);
    // tokio's timers round up to whole milliseconds.
    assert!(overwritten.elapsed() <= RENEW + Duration::from_millis(1));
    match leadership.release().await {
        Err(Error::LostBeforeRelease { reason, .. }) => assert_eq!(reason, LossReason::Displaced),
        other => panic!("{other:?}"),
    }
    // The release wrote nothing over the other term's record.
    let lease = a.current("job").await.unwrap().unwrap();
    assert_eq!(
        (lease.token.get(), lease.holder.as_str(), lease.released),
        (5, "crashed", false)
    );
}

#[tokio::test(start_paused = true)]
async fn a_renewal_whose_answer_was_lost_is_recognised_as_the_leader_s_own() {
    let memory = memory();
    let faulty = Faulty::new(memory.clone());
    let a = elector(&(Arc::new(faulty.clone()) as Arc<dyn ObjectStore>), "a").await;
    let b = elector(&memory, "b").await;
    let mut events = a.events();
    let leadership = a.campaign("job").await.unwrap();
    assert!(matches!(events.next().await, Some(Event::Acquired { .. })));
    // The next renewal lands, but the leader gets an error; its following write (on the old
    // ETag) conflicts, and the read shows its own term: it carries on.
    faulty.set(Fault::LoseNextPutAnswer);
    let waited = tokio::time::timeout(TTL * 5, b.campaign("job")).await;
    assert!(waited.is_err(), "b took over");
    assert!(!leadership.loss_signal().is_lost());
    let seen = drain(&mut events).await;
    assert!(
        seen.iter().all(|e| matches!(e, Event::Renewed { .. })),
        "{seen:?}"
    );
    assert!(seen.len() >= 10, "{seen:?}");
}

#[tokio::test(start_paused = true)]
async fn lead_runs_the_work_with_the_token_and_the_next_term_counts_up() {
    let store = memory();
    let (a, b) = (elector(&store, "a").await, elector(&store, "b").await);
    let first = a
        .lead("job", |ctx| async move {
            assert!(!ctx.lost.is_lost());
            ctx.token.get()
        })
        .await
        .unwrap();
    let second = b
        .lead("job", |ctx| async move { ctx.token.get() })
        .await
        .unwrap();
    assert_eq!((first, second), (1, 2));
    let lease = a.current("job").await.unwrap().unwrap();
    assert_eq!((lease.token.get(), lease.released), (2, true));
}

#[tokio::test(start_paused = true)]
async fn a_store_that_ignores_preconditions_is_refused_at_startup() {
    let cases = [
        (Fault::IgnorePreconditions, Some("If-Match")),
        (Fault::IgnoreIfMatch, Some("If-Match")),
        (Fault::IgnoreIfNoneMatch, Some("If-None-Match: *")),
        (Fault::NoConditionalPuts, None),
    ];
    for (fault, ignored) in cases {
        let faulty = Faulty::new(memory());
        faulty.set(fault);
        let got = Elector::new(Arc::new(faulty), options("a")).await;
        match (got, ignored) {
            (Err(Error::PreconditionsIgnored { check }), Some(header)) => assert_eq!(check, header),
            (Err(Error::ConditionalWritesUnsupported { .. }), None) => {}
            (other, _) => panic!("{fault:?}: {other:?}"),
        }
    }
    let faulty = Faulty::new(memory());
    faulty.set(Fault::Down);
    let got = Elector::new(Arc::new(faulty), options("a")).await;
    assert!(matches!(got, Err(Error::Store { .. })), "{got:?}");
}

#[tokio::test(start_paused = true)]
async fn bad_names_options_records_and_double_campaigns_are_typed_errors() {
    let store = memory();
    let a = elector(&store, "a").await;
    for name in ["", ".precondition-probe", "a//b", &"x".repeat(257)] {
        assert!(
            matches!(a.campaign(name).await, Err(Error::InvalidName(_))),
            "{name:?}"
        );
    }
    let bad = [
        options("a").with_ttl(Duration::from_millis(50)),
        options("a").with_margin(TTL),
        options("a").with_renew_every(TTL),
        options("a").with_poll_every(Duration::ZERO),
        options("a").with_prefix(""),
    ];
    for o in bad {
        let got = Elector::new(store.clone(), o.clone()).await;
        assert!(
            matches!(got, Err(Error::InvalidOptions(_))),
            "{o:?}: {got:?}"
        );
    }
    store
        .put(
            &Path::from("elections/junk"),
            PutPayload::from_static(b"not json"),
        )
        .await
        .unwrap();
    assert!(matches!(
        a.campaign("junk").await,
        Err(Error::CorruptRecord { .. })
    ));
    let _held = a.campaign("job").await.unwrap();
    assert!(matches!(
        a.campaign("job").await,
        Err(Error::AlreadyCampaigning { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn the_same_elector_may_campaign_again_as_soon_as_release_returns() {
    let store = memory();
    let a = elector(&store, "a").await;
    for expected in 1..=3 {
        let token = a.lead("job", |ctx| async move { ctx.token.get() }).await;
        assert_eq!(token.unwrap(), expected);
    }
}

/// Owner metrics (feature `metrics`) of object-store terms: a leadership is held and led
/// until it ends, and its end is counted by reason.
#[cfg(feature = "metrics")]
#[test]
fn a_term_is_held_and_led_and_its_end_is_counted_displaced_expired_or_released() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let m = recorder.handle();
    let sample = |series: &str| {
        m.render().lines().find_map(|l| {
            let value = l.strip_prefix(series)?.strip_prefix(' ')?;
            Some(value.trim().parse::<f64>().unwrap())
        })
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    // This thread's recorder: every task of the paused runtime runs on it.
    ::metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let memory = memory();
            let faulty = Faulty::new(memory.clone());
            let a = elector(&(Arc::new(faulty.clone()) as Arc<dyn ObjectStore>), "a").await;
            let losses = |reason: &str| {
                sample(&format!(
                    r#"palisade_owner_losses_total{{name="job",reason="{reason}"}}"#
                ))
            };

            // Someone replaces the record: the term is displaced, `revoked`.
            let mut leadership = a.campaign("job").await.unwrap();
            assert_eq!(sample(r#"palisade_owner_held{name="job"}"#), Some(1.0));
            assert_eq!(sample(r#"palisade_owner_leader{name="job"}"#), Some(1.0));
            crashed_leader(&memory, "job", 5, 2000).await;
            assert_eq!(leadership.loss_signal().wait().await, LossReason::Displaced);
            assert_eq!(losses("revoked"), Some(1.0));
            assert_eq!(sample(r#"palisade_owner_held{name="job"}"#), Some(0.0));
            assert_eq!(sample(r#"palisade_owner_leader{name="job"}"#), Some(0.0));
            // The release of an ended term is no second loss (and gives the name up).
            assert!(leadership.release().await.is_err());

            // Cut off from the store: no renewal lands, `expired`.
            let mut leadership = a.campaign("job").await.unwrap();
            assert_eq!(sample(r#"palisade_owner_held{name="job"}"#), Some(1.0));
            faulty.set(Fault::Down);
            assert_eq!(leadership.loss_signal().wait().await, LossReason::Expired);
            // The signal sees the deadline pass on its own; the term's task counts it then.
            let since = Instant::now();
            while losses("expired") != Some(1.0) {
                assert!(since.elapsed() < TTL, "{:?}", m.render());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(sample(r#"palisade_owner_held{name="job"}"#), Some(0.0));
            faulty.set(Fault::None);
            assert!(leadership.release().await.is_err());

            // Released on purpose: `closed`.
            let mut leadership = a.campaign("job").await.unwrap();
            leadership.release().await.unwrap();
            assert_eq!(losses("closed"), Some(1.0));
            assert_eq!(sample(r#"palisade_owner_held{name="job"}"#), Some(0.0));
            assert_eq!(
                sample(r#"palisade_owner_acquisitions_total{name="job"}"#),
                Some(3.0)
            );
            assert_eq!(losses("fenced"), Some(0.0));
            assert_eq!(losses("error"), Some(0.0));
        })
    });
}
