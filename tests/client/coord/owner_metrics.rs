//! Owner-side metrics (feature `metrics`) against a real etcd: what a process holds, how each
//! grant ended, its session's renewals and lease. Each test records into its own
//! `metrics-exporter-prometheus` recorder, installed for its thread only around a
//! current-thread runtime (every task of the test runs on that thread), and reads the
//! Prometheus text that recorder renders.

use std::future::Future;
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use palisade::client::provider::etcd::EtcdProvider;
use palisade::{
    ElectionService, LockService, Loss, Provider, RwLockService, SemaphoreService, Session,
    SessionOptions, SessionState,
};

use super::etcd;

/// Runs `test` on a current-thread runtime with a fresh recorder as this thread's, and hands
/// it the recorder's handle.
fn with_recorder<F, Fut>(test: F)
where
    F: FnOnce(PrometheusHandle) -> Fut,
    Fut: Future<Output = ()>,
{
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    ::metrics::with_local_recorder(&recorder, || rt.block_on(test(handle)));
}

/// The value of `series` (name and labels exactly as rendered) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let value = l.strip_prefix(series)?.strip_prefix(' ')?;
        Some(value.trim().parse().unwrap())
    })
}

/// Polls `series` until `ok` holds for its value (`None`: no such series), within `within`.
async fn until(
    handle: &PrometheusHandle,
    series: &str,
    ok: impl Fn(Option<f64>) -> bool,
    within: Duration,
) -> Option<f64> {
    let started = Instant::now();
    loop {
        let text = handle.render();
        let v = sample(&text, series);
        if ok(v) {
            return v;
        }
        assert!(
            started.elapsed() < within,
            "{series} never as expected within {within:?} (last {v:?}):\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn eq(want: f64) -> impl Fn(Option<f64>) -> bool {
    move |v| v == Some(want)
}

async fn session(p: &EtcdProvider, ns: &str, ttl: Duration) -> Session {
    let options = SessionOptions::new().with_ttl(ttl).with_namespace(ns);
    p.session(options).await.unwrap()
}

#[test]
fn a_lock_is_held_then_a_revoked_lease_is_a_revoked_loss_and_the_lease_gauge_counts_down() {
    with_recorder(|m| async move {
        let etcd = etcd::Etcd::single().await;
        let mut client = etcd.client().await;
        let p = EtcdProvider::new(&client);
        let ttl = Duration::from_secs(6);
        let s = session(&p, "/om-revoke", ttl).await;
        let left = sample(&m.render(), "palisade_session_lease_remaining_seconds").unwrap();
        assert!(
            left > 4.0 && left <= 6.0,
            "a fresh lease has its TTL: {left}"
        );

        let grant = s.lock("orders").await.unwrap();
        let text = m.render();
        assert_eq!(
            sample(&text, r#"palisade_owner_held{name="orders"}"#),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, r#"palisade_owner_acquisitions_total{name="orders"}"#),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &text,
                r#"palisade_owner_acquire_seconds_count{name="orders"}"#
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, r#"palisade_owner_leader{name="orders"}"#),
            None
        );
        for reason in ["expired", "fenced", "revoked", "closed", "error"] {
            let series =
                format!(r#"palisade_owner_losses_total{{name="orders",reason="{reason}"}}"#);
            assert_eq!(sample(&text, &series), Some(0.0), "{series} exists at 0");
        }
        assert_eq!(
            sample(&text, "palisade_session_renew_failures_total"),
            Some(0.0)
        );
        // Between two renewals (every TTL/3 = 2 s) the gauge counts down by the second.
        until(
            &m,
            "palisade_session_lease_remaining_seconds",
            |v| v.is_some_and(|v| v > 0.0 && v <= 5.2),
            ttl,
        )
        .await;

        // Someone revokes the session's lease: the store drops it long before it could have
        // expired, so the loss says `revoked`.
        client.lease_revoke(s.lease_id()).await.unwrap();
        until(
            &m,
            r#"palisade_owner_losses_total{name="orders",reason="revoked"}"#,
            eq(1.0),
            ttl,
        )
        .await;
        let text = m.render();
        assert_eq!(
            sample(&text, r#"palisade_owner_held{name="orders"}"#),
            Some(0.0)
        );
        for reason in ["expired", "fenced", "closed", "error"] {
            let series =
                format!(r#"palisade_owner_losses_total{{name="orders",reason="{reason}"}}"#);
            assert_eq!(sample(&text, &series), Some(0.0), "{series}");
        }
        assert_eq!(
            sample(&text, "palisade_session_lease_remaining_seconds"),
            Some(0.0)
        );
        assert_eq!(s.state(), SessionState::Lost);
        assert_eq!(grant.loss_signal().wait().await, Loss::SessionLost);
        // The release that follows a loss is no second loss.
        assert!(grant.unlock().await.is_err());
        drop(grant);
        tokio::task::yield_now().await;
        let text = m.render();
        assert_eq!(
            sample(
                &text,
                r#"palisade_owner_losses_total{name="orders",reason="closed"}"#
            ),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, r#"palisade_owner_held{name="orders"}"#),
            Some(0.0)
        );
    });
}

#[test]
fn a_leader_whose_etcd_stops_counts_renew_failures_then_an_expired_loss() {
    with_recorder(|m| async move {
        let mut etcd = etcd::Etcd::single().await;
        let client = etcd.client().await;
        let p = EtcdProvider::new(&client).with_request_timeout(Duration::from_millis(500));
        let ttl = Duration::from_secs(2);
        let s = session(&p, "/om-expire", ttl).await;
        let leadership = s.campaign("scheduler", "node-1").await.unwrap();
        let text = m.render();
        assert_eq!(
            sample(&text, r#"palisade_owner_held{name="scheduler"}"#),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, r#"palisade_owner_leader{name="scheduler"}"#),
            Some(1.0)
        );

        etcd.stop();
        until(
            &m,
            "palisade_session_renew_failures_total",
            |v| v.is_some_and(|v| v >= 1.0),
            ttl * 2,
        )
        .await;
        // No keepalive lands: the lease runs out past the local deadline, `expired`.
        until(
            &m,
            r#"palisade_owner_losses_total{name="scheduler",reason="expired"}"#,
            eq(1.0),
            ttl * 3,
        )
        .await;
        let text = m.render();
        assert_eq!(
            sample(&text, r#"palisade_owner_held{name="scheduler"}"#),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, r#"palisade_owner_leader{name="scheduler"}"#),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, "palisade_session_lease_remaining_seconds"),
            Some(0.0),
            "an expired lease has nothing left"
        );
        assert_eq!(
            sample(
                &text,
                r#"palisade_owner_losses_total{name="scheduler",reason="revoked"}"#
            ),
            Some(0.0)
        );
        drop(leadership);
    });
}

#[test]
fn shared_holds_are_never_held_a_release_is_closed_a_refusal_is_fenced_and_a_close_hides_the_lease()
{
    with_recorder(|m| async move {
        let etcd = etcd::Etcd::single().await;
        let client = etcd.client().await;
        let p = EtcdProvider::new(&client);
        let s = session(&p, "/om-kinds", Duration::from_secs(10)).await;

        let grant = s.lock("x").await.unwrap();
        grant.unlock().await.unwrap();
        let closed = r#"palisade_owner_losses_total{name="x",reason="closed"}"#;
        until(&m, closed, eq(1.0), Duration::from_secs(5)).await;
        assert_eq!(
            sample(&m.render(), r#"palisade_owner_held{name="x"}"#),
            Some(0.0)
        );

        // A resource refuses the second grant's token: the loss is `fenced`.
        let grant = s.lock("x").await.unwrap();
        assert_eq!(
            sample(&m.render(), r#"palisade_owner_held{name="x"}"#),
            Some(1.0)
        );
        assert!(grant.owner().fenced(grant.token().get() + 1));
        let fenced = r#"palisade_owner_losses_total{name="x",reason="fenced"}"#;
        until(&m, fenced, eq(1.0), Duration::from_secs(5)).await;
        let text = m.render();
        assert_eq!(sample(&text, r#"palisade_owner_held{name="x"}"#), Some(0.0));
        assert_eq!(
            sample(&text, r#"palisade_owner_acquisitions_total{name="x"}"#),
            Some(2.0)
        );
        assert_eq!(sample(&text, closed), Some(1.0));
        drop(grant);

        // Read locks and permits are shared: counted apart, never as held.
        let other = session(&p, "/om-kinds", Duration::from_secs(10)).await;
        let r1 = s.read_lock("rw").await.unwrap();
        let r2 = other.read_lock("rw").await.unwrap();
        let permit = s.acquire("sem", 2).await.unwrap();
        let text = m.render();
        assert_eq!(
            sample(&text, r#"palisade_owner_shared_held{name="rw"}"#),
            Some(2.0)
        );
        assert_eq!(
            sample(&text, r#"palisade_owner_shared_held{name="sem"}"#),
            Some(1.0)
        );
        assert_eq!(sample(&text, r#"palisade_owner_held{name="rw"}"#), None);
        assert_eq!(sample(&text, r#"palisade_owner_held{name="sem"}"#), None);
        r2.runlock().await.unwrap();
        drop(permit);
        until(
            &m,
            r#"palisade_owner_shared_held{name="sem"}"#,
            eq(0.0),
            Duration::from_secs(5),
        )
        .await;

        // A write lock is exclusive again; closing the session ends what it holds as
        // `closed`, and the lease gauge says NaN (no lease kept), which no alert fires on.
        drop(r1);
        let w = other.write_lock("rw").await.unwrap();
        assert_eq!(
            sample(&m.render(), r#"palisade_owner_held{name="rw"}"#),
            Some(1.0)
        );
        s.close().await.unwrap();
        other.close().await.unwrap();
        until(
            &m,
            r#"palisade_owner_held{name="rw"}"#,
            eq(0.0),
            Duration::from_secs(5),
        )
        .await;
        let text = m.render();
        assert_eq!(
            sample(
                &text,
                r#"palisade_owner_losses_total{name="rw",reason="closed"}"#
            ),
            Some(3.0),
            "two read locks and the write lock, all let go"
        );
        let left = sample(&text, "palisade_session_lease_remaining_seconds").unwrap();
        assert!(left.is_nan(), "closed on purpose: {left}");
        drop(w);
    });
}
