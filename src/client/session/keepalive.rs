//! The background task that renews a session's lease.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::liveness::Liveness;
use super::SessionState;
use crate::client::backend::{Backend, LeaseId};

/// Renews the lease every TTL/3. The liveness deadline is when the store forgets the lease if
/// no keepalive lands, measured from when the last acknowledged one was *sent* (conservative).
pub(super) async fn keepalive(
    backend: Arc<dyn Backend>,
    lease: LeaseId,
    ttl: Duration,
    liveness: Arc<Liveness>,
) {
    let interval = ttl / 3;
    let retry = interval.min(Duration::from_millis(200));
    let mut wait = interval;
    loop {
        liveness.pause(wait).await;
        // Also turns Lost when the deadline passed during a freeze (SIGSTOP, VM pause).
        if liveness.state() != SessionState::Alive {
            return;
        }
        let sent = Instant::now();
        let Some(budget) = liveness
            .deadline()
            .checked_duration_since(sent)
            .filter(|b| !b.is_zero())
        else {
            liveness.lost("no keepalive acknowledged within the TTL");
            return;
        };
        match tokio::time::timeout(budget.min(interval), backend.lease_keepalive(lease)).await {
            Ok(Ok(left)) if left > 0 => {
                liveness.extend(sent + Duration::from_secs(left as u64));
                wait = interval;
            }
            Ok(Ok(_)) => {
                #[cfg(feature = "metrics")]
                liveness.metrics.renew_failed();
                liveness.gone_from_store("the store no longer has the lease");
                return;
            }
            Ok(Err(e)) => {
                #[cfg(feature = "metrics")]
                liveness.metrics.renew_failed();
                tracing::debug!(lease = format_args!("{lease:x}"), error = %e, "keepalive failed");
                wait = retry;
            }
            Err(_) => {
                #[cfg(feature = "metrics")]
                liveness.metrics.renew_failed();
                wait = Duration::ZERO;
            }
        }
    }
}
