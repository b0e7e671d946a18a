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
use crate::provider::LeaseId;

pub(crate) struct Liveness {
    state: watch::Sender<SessionState>,
    deadline: Mutex<Instant>,
    lease: LeaseId,
}

impl Liveness {
    pub(crate) fn new(lease: LeaseId, deadline: Instant) -> Self {
        Self {
            state: watch::channel(SessionState::Alive).0,
            deadline: Mutex::new(deadline),
            lease,
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
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<SessionState> {
        self.state.subscribe()
    }

    /// Alive -> Lost (never from Closed).
    pub(crate) fn lost(&self, why: &str) {
        if self.leave_alive(SessionState::Lost) {
            tracing::warn!(
                lease = format_args!("{:x}", self.lease),
                why,
                "session lost"
            );
        }
    }

    /// Alive -> Closed.
    pub(crate) fn close(&self) {
        self.leave_alive(SessionState::Closed);
    }

    fn leave_alive(&self, to: SessionState) -> bool {
        self.state.send_if_modified(|s| {
            let alive = *s == SessionState::Alive;
            if alive {
                *s = to;
            }
            alive
        })
    }
}
