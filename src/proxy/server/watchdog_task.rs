//! The watchdog of a connection served by a first handler (the fast path), in a task of its
//! own.
//!
//! Why a task of its own: a watchdog polled in the connection's task ([`Watch::drive`]) is
//! reached on every wake-up of that task, two or more per request, and each such poll touches
//! its state, its timer and its wake-up flag: cold memory when hundreds of connections take
//! turns (measured: 4-5 % of the proxy's throughput at 256 connections). The watchdog_task sleeps
//! instead, and wakes only when its timer fires (about once per `idle_timeout`) or the server
//! stops. The connection does not poll it at all: the two share only [`State`]'s phase and
//! stop flags, which the connection writes on the line it updates for each request anyway.
//!
//! The rules are [`Watch::drive`]'s (`header_read_timeout`, `idle_timeout`, a graceful stop
//! bounded by `grace`). Closing is aborting the connection's task, which the watchdog_task does only
//! after taking the connection from a waiting phase to closing (see [`State`]'s phases): a
//! request whose head is complete is never cut, and a connection asked to stop while it
//! serves one (or has part of its head) finishes it, then ends by itself ([`State::end`]).

use tokio::sync::oneshot;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::conn::Watch;
use super::state::{Reason, State};

impl Watch {
    /// Watches the first handler's connection whose task is `conn` until it ends or goes to
    /// hyper (`ended` resolves: its sender was dropped), closing it when a limit passes or the
    /// server stops.
    pub(super) async fn watchdog_task(mut self, conn: AbortHandle, ended: oneshot::Receiver<()>) {
        let state = std::sync::Arc::clone(&self.state);
        let first = state
            .deadline(&self.limits)
            .map_or_else(|| Instant::now() + self.limits.idle_timeout, |(at, _)| at);
        let timer = tokio::time::sleep_until(first);
        tokio::pin!(timer, ended);
        // Set once the server stopped while a request was being served: the connection is
        // dropped at this instant if it has not ended by itself.
        let mut hard_stop: Option<Instant> = None;
        loop {
            tokio::select! {
                biased;
                _ = &mut ended => return,
                changed = self.stopping.changed(), if hard_stop.is_none() => {
                    if changed.is_ok() && !*self.stopping.borrow() {
                        continue;
                    }
                    if state.stop_or_close() {
                        conn.abort();
                        return;
                    }
                    let at = Instant::now() + self.limits.grace;
                    hard_stop = Some(at);
                    timer.as_mut().reset(at);
                }
                () = &mut timer => {
                    let now = Instant::now();
                    if let Some(at) = hard_stop {
                        if now >= at {
                            conn.abort(); // the graceful stop took too long
                            return;
                        }
                        timer.as_mut().reset(at);
                        continue;
                    }
                    match state.deadline(&self.limits) {
                        None => timer.as_mut().reset(now + self.limits.idle_timeout),
                        Some((at, _)) if at > now => timer.as_mut().reset(at),
                        Some((_, why)) => {
                            if !close(&state, &conn, why, &self, now) {
                                // A request began in the meantime.
                                timer.as_mut().reset(now + self.limits.idle_timeout);
                                continue;
                            }
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// Closes the waiting connection for `why` (its deadline passed at `now`), counted; `false`
/// when it is not waiting, or has just served a request.
fn close(state: &State, conn: &AbortHandle, why: Reason, watch: &Watch, now: Instant) -> bool {
    let Some(was) = state.try_close() else {
        return false;
    };
    // A whole request may have begun and ended since the deadline was read: the swap read
    // the phase that request's end wrote, so its new idle time is seen here, and the
    // connection is given back rather than closed for idling. (A request that comes in the
    // short while it is taken finds it closing, and is not served: the race of any close.)
    if matches!(state.deadline(&watch.limits), Some((at, _)) if at > now) && state.reopen(was) {
        return false;
    }
    match why {
        Reason::HeaderRead => {
            if let Some(m) = &watch.metrics {
                m.header_timeout.inc();
            }
            tracing::debug!(peer = %watch.peer, "no complete request head in time; closing");
        }
        Reason::Idle => {
            if let Some(m) = &watch.metrics {
                m.idle_timeout.inc();
            }
            tracing::debug!(peer = %watch.peer, "connection idle; closing");
        }
    }
    conn.abort();
    true
}
