//! Owner-side metrics (feature `metrics`), through the [`metrics`](::metrics) facade: the
//! library user installs the recorder and exporter of their choice, and without one every
//! call here is a no-op. Palisade keeps no registry of its own.
//!
//! Handles are registered with the recorder in force when a session starts and when a grant
//! (or an object-store term) is won, and kept by them: install the recorder before.
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `palisade_owner_held` | gauge | `name` | exclusive ownerships held: a lock, a write lock, a leadership |
//! | `palisade_owner_leader` | gauge | `name` | leaderships held (etcd or object-store elections) |
//! | `palisade_owner_shared_held` | gauge | `name` | shared holds: read locks, semaphore permits |
//! | `palisade_owner_acquisitions_total` | counter | `name` | grants won, of every primitive |
//! | `palisade_owner_losses_total` | counter | `name`, `reason` | grants ended: [`Reason`] |
//! | `palisade_owner_acquire_seconds` | histogram | `name` | from asking to holding |
//! | `palisade_session_renew_failures_total` | counter | | keepalives that failed or went unanswered |
//! | `palisade_session_lease_remaining_seconds` | gauge | | the session's lease left as last known, counting down; 0 once lost, NaN once closed |
//!
//! Shared holds stay out of `palisade_owner_held`: `sum by (name) (palisade_owner_held) > 1`
//! means two processes believe they own a name alone. The gauges count (they go up and down)
//! rather than being set, so two sessions of one process that hold the same name one after
//! the other never hide each other.

use std::sync::Mutex;
use std::time::Duration;

use ::metrics::{counter, gauge, histogram, Counter, Gauge, Unit};
use tokio::time::Instant;

/// Why an ownership ended: the `reason` label of `palisade_owner_losses_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The lease ran out: renewals failed or the process stalled past its TTL.
    Expired,
    /// A resource refused the token as stale: a newer owner exists.
    Fenced,
    /// Someone else removed it: the lease was revoked, the entry deleted, the record taken.
    Revoked,
    /// Let go on purpose: released, resigned, dropped, or the session closed.
    Closed,
    /// Ended without this process learning how (its runtime stopped under it).
    Error,
}

impl Reason {
    const ALL: [Reason; 5] = [
        Reason::Expired,
        Reason::Fenced,
        Reason::Revoked,
        Reason::Closed,
        Reason::Error,
    ];

    fn label(self) -> &'static str {
        match self {
            Reason::Expired => "expired",
            Reason::Fenced => "fenced",
            Reason::Revoked => "revoked",
            Reason::Closed => "closed",
            Reason::Error => "error",
        }
    }
}

/// What a grant holds, for its gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A lock or a write lock.
    Exclusive,
    /// An election's leadership (exclusive too).
    Leader,
    /// A read lock or a semaphore permit.
    Shared,
}

/// One ownership's metrics from its grant to its end. Ended by [`Owned::end`]; dropped
/// without that, it ends with [`Reason::Error`].
pub(crate) struct Owned {
    gauges: Vec<Gauge>,
    /// One per [`Reason::ALL`], registered at the grant so that each series exists (at 0)
    /// before its first loss: `increase()` cannot see a counter's first sample.
    losses: [Counter; 5],
    ended: bool,
}

impl Owned {
    /// A grant of `name` was won; `asked` is when the acquisition started.
    pub(crate) fn new(name: &str, kind: Kind, asked: Instant) -> Self {
        let name = name.to_owned();
        counter!("palisade_owner_acquisitions_total", "name" => name.clone()).increment(1);
        histogram!("palisade_owner_acquire_seconds", "name" => name.clone())
            .record(asked.elapsed().as_secs_f64());
        let gauges = match kind {
            Kind::Exclusive => vec![gauge!("palisade_owner_held", "name" => name.clone())],
            Kind::Leader => vec![
                gauge!("palisade_owner_held", "name" => name.clone()),
                gauge!("palisade_owner_leader", "name" => name.clone()),
            ],
            Kind::Shared => vec![gauge!("palisade_owner_shared_held", "name" => name.clone())],
        };
        for g in &gauges {
            g.increment(1.0);
        }
        let losses = Reason::ALL.map(|r| {
            counter!("palisade_owner_losses_total", "name" => name.clone(), "reason" => r.label())
        });
        Self {
            gauges,
            losses,
            ended: false,
        }
    }

    /// The ownership ended.
    pub(crate) fn end(mut self, reason: Reason) {
        self.record(reason);
    }

    fn record(&mut self, reason: Reason) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        for g in &self.gauges {
            g.decrement(1.0);
        }
        // `ALL` lists the reasons in declaration order.
        self.losses[reason as usize].increment(1);
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.record(Reason::Error);
    }
}

/// Where a session's lease stands, for its gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lease {
    Alive,
    Lost { revoked: bool },
    Closed,
}

/// A session's metrics: its renewal failures and the time its lease has left.
pub(crate) struct SessionMetrics {
    renew_failures: Counter,
    remaining: Gauge,
    /// The gauge is set under this lock, so a count-down tick never overwrites the 0 (or NaN)
    /// of a loss (or close) that came meanwhile.
    lease: Mutex<Lease>,
}

/// How often the lease gauge counts down between renewals.
const TICK: Duration = Duration::from_secs(1);

impl SessionMetrics {
    /// A session started; its lease lasts until `deadline`.
    pub(crate) fn new(deadline: Instant) -> Self {
        describe();
        let m = Self {
            renew_failures: counter!("palisade_session_renew_failures_total"),
            remaining: gauge!("palisade_session_lease_remaining_seconds"),
            lease: Mutex::new(Lease::Alive),
        };
        m.lease_until(deadline);
        m
    }

    fn lease(&self) -> std::sync::MutexGuard<'_, Lease> {
        self.lease.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lease lasts until `deadline` as far as this process knows.
    pub(crate) fn lease_until(&self, deadline: Instant) {
        let lease = self.lease();
        if *lease == Lease::Alive {
            let left = deadline.saturating_duration_since(Instant::now());
            self.remaining.set(left.as_secs_f64());
        }
    }

    /// Waits `wait`, counting the lease gauge down every [`TICK`] meanwhile.
    pub(crate) async fn count_down(&self, wait: Duration, deadline: impl Fn() -> Instant) {
        let until = Instant::now() + wait;
        loop {
            self.lease_until(deadline());
            let now = Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep((until - now).min(TICK)).await;
        }
    }

    /// A keepalive failed, went unanswered, or found the lease gone.
    pub(crate) fn renew_failed(&self) {
        self.renew_failures.increment(1);
    }

    /// The lease is gone: `revoked` when the store dropped it before it could have expired.
    pub(crate) fn lost(&self, revoked: bool) {
        let mut lease = self.lease();
        if *lease == Lease::Alive {
            *lease = Lease::Lost { revoked };
            self.remaining.set(0.0);
        }
    }

    /// Closed (or dropped) on purpose: no lease is kept any more. NaN rather than 0, so that
    /// an alert on a lease close to expiry (`<= 0`, `< x`) stays silent: every comparison
    /// with NaN is false, and Prometheus' `max_over_time` and `min` skip it.
    pub(crate) fn closed(&self) {
        let mut lease = self.lease();
        if *lease == Lease::Alive {
            *lease = Lease::Closed;
            self.remaining.set(f64::NAN);
        }
    }

    /// Whether the lease was lost because the store dropped it early (revoked).
    pub(crate) fn revoked(&self) -> bool {
        matches!(*self.lease(), Lease::Lost { revoked: true })
    }
}

/// Describes every family to the recorder (units and help texts): once per session or
/// object-store term, not per grant (a recorder may queue each description until it renders).
pub(crate) fn describe() {
    use ::metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        "palisade_owner_held",
        "Exclusive ownerships of the name this process holds: locks, write locks, leaderships."
    );
    describe_gauge!(
        "palisade_owner_leader",
        "Leaderships of the election this process holds."
    );
    describe_gauge!(
        "palisade_owner_shared_held",
        "Shared holds of the name: read locks and semaphore permits."
    );
    describe_counter!(
        "palisade_owner_acquisitions_total",
        "Grants won: locks, read/write locks, leaderships, permits."
    );
    describe_counter!(
        "palisade_owner_losses_total",
        "Grants ended, by reason: expired, fenced, revoked, closed (let go on purpose), error."
    );
    describe_histogram!(
        "palisade_owner_acquire_seconds",
        Unit::Seconds,
        "Time from asking for the name to holding it."
    );
    describe_counter!(
        "palisade_session_renew_failures_total",
        "Session keepalives that failed, went unanswered, or found the lease gone."
    );
    describe_gauge!(
        "palisade_session_lease_remaining_seconds",
        Unit::Seconds,
        "Seconds until the session's lease expires as last known; 0 once lost, NaN once closed."
    );
}
