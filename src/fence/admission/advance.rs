//! The slow paths of admission: making an advance durable and draining older requests, and
//! learning advances made by other replicas.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Admitted, Refused, Resource, PERSIST_TIMEOUT};
use crate::fence::drain::Ticket;
use crate::fence::guard::Verdict;
use crate::fence::marks::{MarkStore, StoreError};
use crate::fence::metrics::StoreMetrics;
use crate::token::FencingToken;

/// The advance path: `Ok(None)` when the token turned out equal to the mark by the time the
/// lock was taken (the caller then enters the normal way).
pub(super) async fn advance(
    res: Arc<Resource>,
    store: Arc<dyn MarkStore>,
    metrics: StoreMetrics,
    token: FencingToken,
    drain_timeout: Duration,
) -> Result<Option<(Admitted, Ticket)>, Refused> {
    let serialized = res.advancing.lock().await;
    // Another advance may have won while this one waited for the lock.
    let from = match res.mark.check(token) {
        Verdict::Admit => return Ok(None),
        Verdict::Stale { mark } => return Err(Refused::Stale { token, mark }),
        Verdict::Advance { from } => from,
    };
    // A new entity's first mark adds one to what its template stores: within its budget.
    let limited = res.limited.load(std::sync::atomic::Ordering::Relaxed);
    let quota = res.shared.quota.get().filter(|_| from == 0 && limited);
    if let Some(q) = quota {
        if !q.take() {
            return Err(Refused::Full {
                token,
                limit: q.limit(),
            });
        }
    }
    let started = Instant::now();
    // A hung write (stalled disk, unreachable store) must fail closed, not stall every
    // advance of the resource behind the lock. A write that lands late only raises the
    // stored mark, which is safe.
    let persisted =
        match tokio::time::timeout(PERSIST_TIMEOUT, store.persist(&res.name, token.get())).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(PERSIST_TIMEOUT)),
        };
    metrics.duration.observe(started.elapsed().as_secs_f64());
    // The names a reload gave this resource are persisted too (what a restart loads them
    // from), before the mark is published.
    let aliases = res.aliases();
    let persisted = match persisted {
        Ok(stored) => {
            let mut all = Ok(stored);
            for alias in &aliases {
                let again =
                    tokio::time::timeout(PERSIST_TIMEOUT, store.persist(alias, token.get())).await;
                match again {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => all = Err(e),
                    Err(_) => all = Err(StoreError::Timeout(PERSIST_TIMEOUT)),
                }
            }
            all
        }
        e => e,
    };
    let stored = match persisted {
        Ok(stored) => stored,
        Err(source) => {
            metrics.errors.inc();
            if let Some(q) = quota {
                q.give_back();
            }
            return Err(Refused::Unavailable {
                token,
                step: crate::fence::reject::StoreStep::Persist { token: token.get() },
                source,
            });
        }
    };
    if stored > token.get() {
        // Another replica advanced further first: take its mark, and this request is stale.
        publish_learned(&res, stored).await;
        return Err(Refused::Stale {
            token,
            mark: stored,
        });
    }
    // The new generation goes in before the mark is published, so that no request admitted
    // under the new mark can be counted in the old generation.
    let (ticket, old) = res.drain.install(token.get());
    let now = res.mark.publish(token);
    if let Some(g) = &res.metrics().mark {
        g.set(now as i64);
    }
    res.metrics().advances.inc();
    tracing::info!(resource = %res.name, from, to = now, "mark advanced");
    let drained = res.drain.finish(&ticket, &old, drain_timeout).await;
    res.metrics()
        .drain_duration
        .observe(drained.waited.as_secs_f64());
    if drained.aborted > 0 {
        res.metrics().drain_timeouts.inc();
        res.metrics().drain_aborted.inc_by(drained.aborted);
        tracing::warn!(
            resource = %res.name,
            mark = now,
            aborted = drained.aborted,
            ?drain_timeout,
            "requests of older owners still in flight after the drain time were aborted"
        );
    }
    drop(serialized);
    Ok(Some((Admitted::Advanced { from }, ticket)))
}

/// Applies a mark advanced by another replica (cancel-safe: runs in its own task).
pub(super) async fn learn(res: Arc<Resource>, mark: u64) {
    let task = tokio::spawn(async move {
        let _serialized = res.advancing.lock().await;
        publish_learned(&res, mark).await;
    });
    let _ = task.await;
}

/// With the advance lock held: publishes `mark` if it is higher and aborts this replica's
/// requests under older marks at once (their new owner is already writing elsewhere).
async fn publish_learned(res: &Resource, mark: u64) {
    let Some(token) = FencingToken::new(mark) else {
        return;
    };
    let from = match res.mark.check(token) {
        Verdict::Advance { from } => from,
        Verdict::Admit | Verdict::Stale { .. } => return,
    };
    let (ticket, old) = res.drain.install(mark);
    let now = res.mark.publish(token);
    if let Some(g) = &res.metrics().mark {
        g.set(now as i64);
    }
    res.metrics().advances.inc();
    tracing::info!(resource = %res.name, from, to = now, "mark advanced by another replica");
    let drained = res.drain.finish(&ticket, &old, Duration::ZERO).await;
    drop(ticket);
    if drained.aborted > 0 {
        res.metrics().drain_timeouts.inc();
        res.metrics().drain_aborted.inc_by(drained.aborted);
        tracing::warn!(
            resource = %res.name,
            mark = now,
            aborted = drained.aborted,
            "requests under older marks aborted: another replica admitted a newer owner"
        );
    }
}
