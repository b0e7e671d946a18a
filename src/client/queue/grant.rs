//! Grants: what every granted lock, read/write lock and leadership holds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::client::backend::{EventKind, KeyRange, Op, Txn};
use crate::client::error::Error;
use crate::client::owner::Owner;
use crate::client::session::{Claim, Incarnation, LossSignal, Session, SessionState};
use crate::token::FencingToken;

/// What every grant (lock, read/write, leadership) holds.
pub(crate) struct Grant {
    pub(crate) session: Session,
    pub(crate) name: String,
    pub(crate) incarnation: Incarnation,
    pub(crate) token: FencingToken,
    /// The token as resources see it, with their fenced feedback.
    pub(crate) owner: Owner,
    released: AtomicBool,
    claim: std::sync::Mutex<Option<Claim>>,
    /// A key an unanswered put may still recreate once the entry is let go (see
    /// `Pending::late_put`): looked at again after the release, the claim held meanwhile.
    look_again: Option<String>,
    /// Flags the entry's deletion, once the watch that looks for it runs: made with the grant,
    /// so that everyone following the grant sees the same flag.
    entry_deleted: tokio::sync::watch::Sender<bool>,
    entry_watch: std::sync::OnceLock<tokio::task::JoinHandle<()>>,
    /// Tells the grant's metrics how it ended: `Some(deleted)` once released (whether the
    /// release itself deleted the entry); dropped with the grant.
    #[cfg(feature = "metrics")]
    metrics_end: Option<tokio::sync::watch::Sender<Option<bool>>>,
}

impl Grant {
    pub(crate) fn new(
        session: Session,
        name: String,
        incarnation: Incarnation,
        token: FencingToken,
        claim: Option<Claim>,
        look_again: Option<String>,
    ) -> Self {
        let owner = {
            // Weak: an `Owner` kept in a client layer must not keep the session alive.
            let weak = session.downgrade();
            let entry = incarnation.clone();
            Owner::new(name.clone(), token, move || {
                let Some(session) = weak.upgrade() else {
                    return;
                };
                if session.state() != SessionState::Alive {
                    return; // the entry goes with the lease
                }
                let (s, entry) = (session.clone(), entry.clone());
                session.spawn_cleanup(async move { s.release_while_alive(&entry).await });
            })
        };
        let entry_deleted = tokio::sync::watch::channel(false).0;
        #[cfg(feature = "metrics")]
        let metrics_end = claim.as_ref().and_then(|claim| {
            let signal =
                session.loss_signal_with(Some(entry_deleted.subscribe()), Some(owner.subscribe()));
            follow_for_metrics(&name, claim, signal)
        });
        Self {
            session,
            name,
            incarnation,
            token,
            owner,
            released: AtomicBool::new(false),
            claim: std::sync::Mutex::new(claim),
            look_again,
            entry_deleted,
            entry_watch: std::sync::OnceLock::new(),
            #[cfg(feature = "metrics")]
            metrics_end,
        }
    }

    /// The session's signal plus this grant's entry. The entry is watched from the first
    /// call on (no watch costs anything for grants nobody asks about).
    pub(crate) fn loss_signal(&self) -> LossSignal {
        let entry = tokio::runtime::Handle::try_current().ok().map(|rt| {
            self.entry_watch.get_or_init(|| {
                let from = self
                    .incarnation
                    .create_revision
                    .max(self.token.get() as i64)
                    + 1;
                rt.spawn(watch_entry(
                    self.session.clone(),
                    self.incarnation.clone(),
                    from,
                    self.entry_deleted.clone(),
                ))
            });
            self.entry_deleted.subscribe()
        });
        self.session
            .loss_signal_with(entry, Some(self.owner.subscribe()))
    }

    fn stop_watching(&self) {
        if let Some(task) = self.entry_watch.get() {
            task.abort();
        }
    }

    /// Tells the grant's metrics that it was released (`deleted`: by this release).
    fn released_for_metrics(&self, deleted: bool) {
        #[cfg(feature = "metrics")]
        if let Some(end) = &self.metrics_end {
            end.send_replace(Some(deleted));
        }
        #[cfg(not(feature = "metrics"))]
        let _ = deleted;
    }

    /// After a release: when a put of this acquisition's may still land, looks for it (now
    /// and a moment later) with the claim held, so that a new acquisition of the name by this
    /// session waits instead of having its entry taken for the stray one.
    fn look_again(&self, claim: Option<Claim>) {
        let Some(key) = self.look_again.clone() else {
            return;
        };
        if self.session.state() != SessionState::Alive {
            return; // the lease is gone or going: a put on it can no longer land
        }
        if let Some(c) = &claim {
            c.cleaning();
        }
        let session = self.session.clone();
        self.session.spawn_cleanup(async move {
            let _claim = claim;
            session.release_key_while_alive(&key).await;
        });
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Deletes the entry (fenced on its create revision). Local state changes only after the
    /// store answered, so a failed release can be retried.
    ///
    /// When the entry was already gone, ownership had ended before this call (lease lost or
    /// entry deleted): that is [`Error::LostBeforeRelease`] ([`Error::SessionClosed`] after
    /// the owner's own `close`), and the grant counts as released all the same.
    pub(crate) async fn release(&self) -> Result<(), Error> {
        if self.is_released() {
            return Err(Error::Released);
        }
        // Our own delete is not a loss to report.
        self.stop_watching();
        let deleted = self.session.release(&self.incarnation).await?;
        // Whether or not the entry was still there, it is gone, and the session may acquire
        // the primitive again.
        self.released.store(true, Ordering::Release);
        let claim = self.claim.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.look_again(claim);
        if deleted {
            self.released_for_metrics(true);
            return Ok(());
        }
        if self.session.state() == SessionState::Closed {
            self.released_for_metrics(true);
            return Err(Error::SessionClosed);
        }
        // Learns first whether the lease went with the entry, so the metrics say which.
        self.session.confirm_lease().await;
        self.released_for_metrics(false);
        Err(Error::LostBeforeRelease {
            name: self.name.clone(),
        })
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        self.stop_watching();
        let claim = self.claim.lock().unwrap_or_else(|e| e.into_inner()).take();
        if self.is_released() || self.session.state() != SessionState::Alive {
            return;
        }
        if let Some(c) = &claim {
            c.cleaning();
        }
        let session = self.session.clone();
        let incarnation = self.incarnation.clone();
        let look_again = self.look_again.clone();
        self.session.spawn_cleanup(async move {
            let _claim = claim;
            session.release_while_alive(&incarnation).await;
            if let Some(key) = look_again {
                session.release_key_while_alive(&key).await;
            }
        });
    }
}

/// Follows a grant for its metrics (`docs/client.md#owner-metrics`): counts the acquisition,
/// holds its gauges up until the grant ends, then counts the loss with its reason. The reason
/// is the grant's own loss signal's when it fires first (biased: when both are ready the
/// signal explains the end better); otherwise the grant was let go (released, or dropped,
/// which releases), unless a release found the entry already gone with the lease still alive:
/// someone else deleted it. `None` outside a runtime (nothing could follow the grant).
#[cfg(feature = "metrics")]
fn follow_for_metrics(
    name: &str,
    claim: &Claim,
    mut signal: LossSignal,
) -> Option<tokio::sync::watch::Sender<Option<bool>>> {
    use crate::client::metrics::{Kind, Owned, Reason};
    use crate::client::session::{Loss, Role};
    let rt = tokio::runtime::Handle::try_current().ok()?;
    let kind = match claim.role() {
        Role::Lock | Role::Write => Kind::Exclusive,
        Role::Candidate => Kind::Leader,
        Role::Read | Role::Permit => Kind::Shared,
    };
    let owned = Owned::new(name, kind, claim.asked());
    let (end, mut ended) = tokio::sync::watch::channel(None);
    rt.spawn(async move {
        let reason = tokio::select! {
            biased;
            loss = signal.wait() => match loss {
                Loss::SessionLost if signal.revoked() => Reason::Revoked,
                Loss::SessionLost => Reason::Expired,
                Loss::SessionClosed => Reason::Closed,
                Loss::EntryDeleted => Reason::Revoked,
                Loss::Fenced { .. } => Reason::Fenced,
            },
            release = ended.wait_for(Option::is_some) => match release.map(|r| *r) {
                Ok(Some(false)) => Reason::Revoked,
                _ => Reason::Closed,
            },
        };
        owned.end(reason);
    });
    Some(end)
}

/// Flags `deleted` once `entry` stops existing while the session lives. Reads again after any
/// broken watch, so a missed event cannot hide a deletion.
async fn watch_entry(
    session: Session,
    entry: Incarnation,
    mut from: i64,
    deleted: tokio::sync::watch::Sender<bool>,
) {
    loop {
        if session.state() != SessionState::Alive {
            return;
        }
        if let Ok(mut events) = session
            .backend()
            .watch(KeyRange::key(entry.key.clone()), from)
            .await
        {
            while let Some(Ok(batch)) = events.next().await {
                if batch.iter().any(|e| e.kind == EventKind::Delete) {
                    // A revoked lease is a lost session, not only a deleted entry: find out
                    // before reporting, so signals and state() say so at once.
                    session.confirm_lease().await;
                    deleted.send_replace(true);
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let read = Txn {
            when: vec![],
            then: vec![Op::get(entry.key.clone())],
            otherwise: vec![],
        };
        if let Ok(r) = session.backend().txn(read).await {
            if r.range(0).first().map(|kv| kv.create_revision) != Some(entry.create_revision) {
                session.confirm_lease().await;
                deleted.send_replace(true);
                return;
            }
            from = r.revision + 1;
        }
    }
}
