//! Whether a session's lease is still in force, as far as this process can tell: the state
//! shared by the session, its keepalive task and every loss signal.
//!
//! Besides the keepalive's verdicts it keeps a **local lease deadline**: when the last
//! acknowledged keepalive's request was *sent*, plus the TTL the store granted, on the
//! monotonic clock. The store cannot keep the lease longer than that without another
//! keepalive, so once the deadline has passed the session is lost, even if no background task
//! has run since (a process frozen by SIGSTOP or a VM pause learns it the moment it wakes).

use std::sync::Mutex;

use tokio::sync::watch;
use tokio::time::Instant;

use super::SessionState;
use crate::client::backend::LeaseId;

pub(crate) struct Liveness {
    state: watch::Sender<SessionState>,
    deadline: Mutex<Instant>,
    lease: LeaseId,
    #[cfg(feature = "metrics")]
    pub(crate) metrics: crate::client::metrics::SessionMetrics,
}

impl Liveness {
    pub(crate) fn new(lease: LeaseId, deadline: Instant) -> Self {
        Self {
            state: watch::channel(SessionState::Alive).0,
            deadline: Mutex::new(deadline),
            lease,
            #[cfg(feature = "metrics")]
            metrics: crate::client::metrics::SessionMetrics::new(deadline),
        }
    }

    /// The state now, the local deadline included.
    pub(crate) fn state(&self) -> SessionState {
        let s = *self.state.borrow();
        if s == SessionState::Alive && self.expired() {
            self.lost("the local lease deadline passed");
            return SessionState::Lost;
        }
        s
    }

    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn expired(&self) -> bool {
        Instant::now() >= self.deadline()
    }

    /// A keepalive sent at `sent` was acknowledged with `ttl` left.
    pub(crate) fn extend(&self, to: Instant) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = to;
        #[cfg(feature = "metrics")]
        self.metrics.lease_until(to);
    }

    /// Waits `wait` (between keepalives); with metrics, counts the lease gauge down meanwhile.
    pub(crate) async fn pause(&self, wait: std::time::Duration) {
        #[cfg(feature = "metrics")]
        self.metrics.count_down(wait, || self.deadline()).await;
        #[cfg(not(feature = "metrics"))]
        tokio::time::sleep(wait).await;
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<SessionState> {
        self.state.subscribe()
    }

    /// Alive -> Lost (never from Closed): the lease expired, as far as this process can tell.
    pub(crate) fn lost(&self, why: &str) {
        self.lose(why, false);
    }

    /// Alive -> Lost: the store says the lease is gone. Before the local deadline that is a
    /// revoke (the store keeps a lease at least that long: its count starts later than
    /// ours), after it an expiry.
    pub(crate) fn gone_from_store(&self, why: &str) {
        let revoked = !self.expired();
        self.lose(why, revoked);
    }

    fn lose(&self, why: &str, revoked: bool) {
        if self.leave_alive(SessionState::Lost, revoked) {
            tracing::warn!(
                lease = format_args!("{:x}", self.lease),
                why,
                revoked,
                "session lost"
            );
        }
    }

    /// Alive -> Closed.
    pub(crate) fn close(&self) {
        self.leave_alive(SessionState::Closed, false);
    }

    fn leave_alive(&self, to: SessionState, revoked: bool) -> bool {
        self.state.send_if_modified(|s| {
            let alive = *s == SessionState::Alive;
            if alive {
                *s = to;
                // Recorded before the change is seen: a loss signal woken by it finds the
                // lease gauge and the revoke already set.
                #[cfg(feature = "metrics")]
                match to {
                    SessionState::Lost => self.metrics.lost(revoked),
                    _ => self.metrics.closed(),
                }
            }
            #[cfg(not(feature = "metrics"))]
            let _ = revoked;
            alive
        })
    }
}
