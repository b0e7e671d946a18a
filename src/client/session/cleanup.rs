//! Claims (one acquisition per name and session) and the cleanup of entries nobody owns any
//! more: cancelled or failed acquisitions, dropped grants.
//!
//! Store errors are classified: transient ones (unreachable, timeout) are retried for as long
//! as the lease lives, because an entry left on a live lease would block the primitive for
//! everyone; permanent ones (the store refused the request) are logged and given up, because
//! repeating them cannot help and the lease's end deletes the entry anyway.

use std::time::Duration;

use super::{lock, Role, Session, SessionState, Slot};
use crate::client::backend::{Compare, KeyRange, Op, Txn};
use crate::client::error::Error;

/// An entry in a primitive's queue: its key and the revision that created it. A later entry
/// under the same key (the same session acquiring again) is a different incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incarnation {
    pub(crate) key: String,
    pub(crate) create_revision: i64,
}

impl Incarnation {
    /// The queue key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The revision that created it (its place in the queue).
    pub fn create_revision(&self) -> i64 {
        self.create_revision
    }
}

/// The session's record that it is acquiring or holding a primitive; dropping the last clone
/// forgets it and wakes acquisitions waiting for this one's cleanup. Cloned when a cleanup
/// must run while the grant still holds the primitive (a semaphore's old queue key): the
/// primitive is free again for this session only once both are done.
#[derive(Clone)]
pub(crate) struct Claim(std::sync::Arc<ClaimOf>);

struct ClaimOf {
    session: Session,
    path: String,
    /// What the acquisition asked for, and when it started: for the grant's metrics.
    #[cfg(feature = "metrics")]
    role: Role,
    #[cfg(feature = "metrics")]
    asked: tokio::time::Instant,
}

impl Claim {
    /// The kind of entry claimed.
    #[cfg(feature = "metrics")]
    pub(crate) fn role(&self) -> Role {
        self.0.role
    }

    /// When the acquisition started (the call to `lock`, `campaign`, ...).
    #[cfg(feature = "metrics")]
    pub(crate) fn asked(&self) -> tokio::time::Instant {
        self.0.asked
    }

    /// The acquisition is over and only its cleanup is left: a new acquisition of the same
    /// primitive waits for it instead of failing with `AlreadyHeld`.
    pub(crate) fn cleaning(&self) {
        if let Some(slot) = lock(&self.0.session.inner.held).get_mut(&self.0.path) {
            slot.cleaning = true;
        }
    }
}

impl Drop for ClaimOf {
    fn drop(&mut self) {
        lock(&self.session.inner.held).remove(&self.path);
        self.session.inner.released.notify_waiters();
    }
}

impl Session {
    /// Records that this session is acquiring (then holding) `path` in `role`. When an earlier
    /// acquisition of `path` by this session is still being cleaned up, waits for that
    /// cleanup first (it ends within the lease's life, see the module docs).
    pub(crate) async fn claim(&self, path: &str, name: &str, role: Role) -> Result<Claim, Error> {
        #[cfg(feature = "metrics")]
        let asked = tokio::time::Instant::now();
        loop {
            self.ensure_alive()?;
            let released = self.inner.released.notified();
            tokio::pin!(released);
            {
                let mut held = lock(&self.inner.held);
                match held.get(path) {
                    None => {
                        held.insert(
                            path.to_owned(),
                            Slot {
                                role,
                                cleaning: false,
                            },
                        );
                        return Ok(Claim(std::sync::Arc::new(ClaimOf {
                            session: self.clone(),
                            path: path.to_owned(),
                            #[cfg(feature = "metrics")]
                            role,
                            #[cfg(feature = "metrics")]
                            asked,
                        })));
                    }
                    // Registered while the map is locked, so the wake-up cannot be missed.
                    Some(slot) if slot.cleaning => {
                        released.as_mut().enable();
                    }
                    Some(slot) => {
                        return Err(if slot.role == Role::Read && role == Role::Write {
                            Error::UpgradeNotSupported {
                                name: name.to_owned(),
                            }
                        } else {
                            Error::AlreadyHeld {
                                name: name.to_owned(),
                            }
                        })
                    }
                }
            }
            let mut loss = self.loss_signal();
            tokio::select! {
                () = &mut released => {}
                _ = loss.wait() => {}
            }
        }
    }

    /// Runs `task` in the background and remembers it for [`Session::settle`] and
    /// [`Session::close`].
    pub(crate) fn spawn_cleanup(
        &self,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no runtime to clean up a queue entry; it goes when the lease does");
            return;
        };
        let handle = rt.spawn(task);
        let mut cleanups = lock(&self.inner.cleanups);
        cleanups.retain(|h| !h.is_finished());
        cleanups.push(handle);
    }

    /// Background cleanup: [`Session::release`], retried with backoff on transient errors for
    /// as long as the session is alive, given up (and logged) on permanent ones.
    pub(crate) async fn release_while_alive(&self, incarnation: &Incarnation) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.release(incarnation).await {
                Ok(_) => return,
                Err(Error::Store { source, .. })
                    if source.is_transient() && self.state() == SessionState::Alive =>
                {
                    tracing::debug!(key = %incarnation.key, error = %source, "cleanup failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    if self.state() == SessionState::Alive {
                        tracing::warn!(
                            key = %super::naming::shorten(&incarnation.key),
                            error = %e,
                            "cleanup gave up; the entry goes when the lease does"
                        );
                    }
                    return;
                }
            }
        }
    }

    /// Background cleanup of an acquisition cancelled while registering: the put may have
    /// landed, or may still land (a request already on the wire). Looks now, and once more a
    /// moment later, and releases what it finds.
    pub(crate) async fn release_key_while_alive(&self, key: &str) {
        for wait in [Duration::ZERO, Duration::from_secs(1)] {
            tokio::time::sleep(wait).await;
            let read = Txn {
                when: vec![],
                then: vec![Op::get(key.to_owned())],
                otherwise: vec![],
            };
            let found = loop {
                match self.backend().txn(read.clone()).await {
                    Ok(r) => break r.range(0).first().map(|kv| kv.create_revision),
                    Err(e) if e.is_transient() && self.state() == SessionState::Alive => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => {
                        tracing::warn!(key = %super::naming::shorten(key), error = %e, "cleanup gave up");
                        return;
                    }
                }
            };
            if let Some(create_revision) = found {
                let incarnation = Incarnation {
                    key: key.to_owned(),
                    create_revision,
                };
                self.release_while_alive(&incarnation).await;
            }
        }
    }

    /// Background cleanup of a key written on this session's behalf (a semaphore slot): deleted
    /// only while it still holds `value`, which names this session's entry, so a key taken
    /// since by someone else is left alone. Retried like [`Session::release_while_alive`].
    pub(crate) async fn release_value_while_alive(&self, key: &str, value: &[u8]) {
        let txn = Txn {
            when: vec![Compare::ValueEq(key.to_owned(), value.to_vec())],
            then: vec![Op::Delete {
                key: key.to_owned(),
            }],
            otherwise: vec![],
        };
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.backend().txn(txn.clone()).await {
                Ok(_) => return,
                Err(e) if e.is_transient() && self.state() == SessionState::Alive => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    tracing::warn!(key = %super::naming::shorten(key), error = %e, "cleanup gave up");
                    return;
                }
            }
        }
    }

    /// Deletes the entry `incarnation` if, and only if, that exact incarnation still exists:
    /// safe to repeat, and never deletes a newer entry under the same key.
    ///
    /// Returns whether this call is known to have deleted it: after an unanswered attempt, a
    /// repeat that finds the entry gone says `false` (that attempt's delete and someone
    /// else's look the same). Grants call this on release; it is public so a caller that lost
    /// track of an acquisition (a crashed task) can clean up precisely.
    ///
    /// # Errors
    /// The store's error after retries of transient failures.
    pub async fn release(&self, incarnation: &Incarnation) -> Result<bool, Error> {
        let txn = Txn {
            when: vec![Compare::CreateRevisionEq(
                KeyRange::key(incarnation.key.clone()),
                incarnation.create_revision,
            )],
            then: vec![Op::Delete {
                key: incarnation.key.clone(),
            }],
            otherwise: vec![],
        };
        let mut attempt = 0;
        loop {
            // The compare makes this delete idempotent, so unlike other writes it is retried.
            match self.backend().txn(txn.clone()).await {
                // A repeat that finds the entry gone after an unanswered attempt cannot tell
                // that attempt's delete from someone else's (a `with_lease` successor's, while
                // another owner came and went): it says "not deleted", and a grant's release
                // reports `LostBeforeRelease`, the answer that cannot hide an overlap.
                Ok(r) => return Ok(r.succeeded),
                Err(e) if e.is_transient() && attempt < 3 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                }
                Err(e) => return Err(Error::store("release")(e)),
            }
        }
    }

    /// Asks the store whether the lease still exists, and marks the session lost if not. Used
    /// when an entry of this session disappeared: a lease revoked elsewhere is reported as a
    /// lost session at once, not only at the next keepalive.
    pub(crate) async fn confirm_lease(&self) {
        if let Ok(info) = self.backend().lease_ttl(self.lease()).await {
            if info.remaining <= 0 {
                self.inner
                    .liveness
                    .gone_from_store("the lease was revoked or expired in the store");
            }
        }
    }
}
