//! Sessions: one lease per service instance, kept alive in the background.
//!
//! Every queue entry a session creates is attached to its lease, so when the process dies or
//! is cut off, the store deletes them all once the lease expires, and the next owner's
//! acquisition bumps the epoch past every token this session held.
//!
//! The session watches its own lease: [`Session::done`] resolves when the lease is
//! [`SessionState::Lost`] (expired or revoked by someone else, or past its local deadline: the
//! time the last acknowledged keepalive was sent plus the granted TTL) or
//! [`SessionState::Closed`] by [`Session::close`]. Local detection can only lag the store; a
//! session that is not yet `Lost` is not proof of ownership. The fencing token checked at the
//! resource is what keeps the data safe.
//!
//! # One acquisition per name
//!
//! A session holds at most one acquisition (waiting or granted) of each primitive: a second
//! `lock("x")` on the same session while the first waits or holds fails with
//! [`Error::AlreadyHeld`]. etcd's `Mutex` lets two callers on one session share a key and
//! both "hold" the lock, with one token for two owners and one `Unlock` releasing both; here
//! every grant has exactly one owner. To run several contenders in one process (workers,
//! tests), give each its own session: a session is one lease and one keepalive, cheap to have
//! a few of. A new acquisition right after a cancelled one or a dropped grant of the same name
//! waits for that entry's cleanup (one round trip, bounded by the lease's life) and then
//! proceeds; it never fails because of it.
//!
//! # Sessions and their entries
//!
//! Every queue entry's key names its session: `<owner id>-<lease id>`, where the owner id is
//! fresh for each session. Two sessions on one lease ([`SessionOptions::with_lease`]) therefore
//! never share an entry: they queue against each other like any two sessions, and neither can
//! release the other's grant.

mod cleanup;
mod keepalive;
mod liveness;
pub(crate) mod naming;
mod signal;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub(crate) use cleanup::Claim;
pub use cleanup::Incarnation;
use liveness::Liveness;
pub(crate) use naming::epoch_of;
pub use naming::{epoch_key, slot_epoch_key, EpochOf, MAX_NAME_BYTES, MAX_TTL};
pub use signal::{Loss, LossSignal};

use crate::client::backend::{Backend, LeaseId, Op, Txn};
use crate::client::error::Error;

/// Default lease TTL.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Default key namespace.
pub const DEFAULT_NAMESPACE: &str = "/palisade";

/// How a session is set up. Builder style: `SessionOptions::new().with_ttl(..)`.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    ttl: Duration,
    namespace: String,
    pub(crate) lease: Option<i64>,
    pub(crate) keep: Option<String>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl SessionOptions {
    /// TTL 10 s, namespace `/palisade`, a fresh lease.
    pub fn new() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            namespace: DEFAULT_NAMESPACE.to_owned(),
            lease: None,
            keep: None,
        }
    }

    /// Lease TTL: how long the store keeps the session's entries after the last keepalive.
    /// 1 s ..= [`MAX_TTL`] (else [`Error::InvalidTtl`] when the session starts); fractions
    /// are rounded up to whole seconds (etcd's unit).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Key prefix of every primitive; separate applications (and tests) use separate ones.
    /// No segment of it may be `lock`, `rwlock`, `election` or `semaphore` (else
    /// [`Error::InvalidNamespace`] when the session starts): such a namespace could nest
    /// inside another one's primitive and be read as its queue.
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into().trim_end_matches('/').to_owned();
        self
    }

    /// Resumes an existing lease (a restart within its TTL) instead of granting a new one.
    ///
    /// What it promises: the new session keeps the lease alive, with the TTL the lease was
    /// granted with, under a new owner identity. It never adopts an entry it did not create:
    /// at start it deletes the entries the lease holds under this namespace (nobody could
    /// release them otherwise; a predecessor that is in fact still running sees its grants'
    /// loss signals fire with [`crate::Loss::EntryDeleted`], and the next owner's token is
    /// higher than theirs), and entries created afterwards by another session on the same
    /// lease are that session's, queued against this one like anyone else's. The one
    /// exception is a leadership named with [`SessionOptions::resuming`].
    pub fn with_lease(mut self, lease_id: i64) -> Self {
        self.lease = Some(lease_id);
        self
    }
}

/// Whether a session's lease is still in force, as far as this process can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// Keepalives are acknowledged.
    Alive,
    /// The lease expired or was revoked elsewhere, or no keepalive was acknowledged within the
    /// TTL. Its entries are (or will shortly be) deleted by the store.
    Lost,
    /// [`Session::close`] was called.
    Closed,
}

/// What kind of entry a session has in a primitive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Lock,
    Read,
    Write,
    Candidate,
    Permit,
}

/// A claim in [`Inner::held`].
struct Slot {
    role: Role,
    /// Only the cleanup of an ended acquisition is left.
    cleaning: bool,
}

/// One lease with its keepalive, shared by clones.
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("lease", &format_args!("{:x}", self.inner.lease))
            .field("owner", &format_args!("{:x}", self.inner.owner))
            .field("ttl", &self.inner.ttl)
            .field("namespace", &self.inner.namespace)
            .field("state", &self.state())
            .finish()
    }
}

pub(crate) struct Inner {
    pub(crate) backend: Arc<dyn Backend>,
    lease: LeaseId,
    owner: u64,
    ttl: Duration,
    namespace: String,
    liveness: Arc<Liveness>,
    keepalive: JoinHandle<()>,
    held: Mutex<HashMap<String, Slot>>,
    /// Notified whenever a claim ends.
    released: Notify,
    cleanups: Mutex<Vec<JoinHandle<()>>>,
}

/// A session handle that does not keep the session (and its keepalive) alive.
#[derive(Clone)]
pub(crate) struct WeakSession(std::sync::Weak<Inner>);

impl WeakSession {
    pub(crate) fn upgrade(&self) -> Option<Session> {
        self.0.upgrade().map(|inner| Session { inner })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Dropping the last handle stops the keepalive; the lease then expires by its TTL.
        self.keepalive.abort();
        // Let go on purpose, like a close: no lease is kept any more (a lost one stays lost).
        #[cfg(feature = "metrics")]
        self.liveness.metrics.closed();
    }
}

impl Session {
    pub(crate) async fn start(
        backend: Arc<dyn Backend>,
        options: SessionOptions,
    ) -> Result<Self, Error> {
        let ttl_secs = naming::check_ttl(options.ttl)?;
        naming::check_namespace(&options.namespace)?;
        // The local deadline counts from before the request: the store's counts from later.
        let sent = Instant::now();
        let (lease, remaining, ttl_secs) = match options.lease {
            Some(id) => {
                let info = backend
                    .lease_ttl(id)
                    .await
                    .map_err(Error::store("lease time-to-live"))?;
                if info.remaining <= 0 {
                    return Err(Error::SessionLost);
                }
                // The previous owner's queue entries would otherwise stay alive on the resumed
                // lease without anyone to acquire or release them, blocking those primitives.
                let mine = format!("{}/", options.namespace);
                let stale = info
                    .keys
                    .into_iter()
                    .filter(|k| k.starts_with(&mine) && Some(k) != options.keep.as_ref());
                for key in stale {
                    let delete = Txn {
                        when: vec![],
                        then: vec![Op::Delete { key }],
                        otherwise: vec![],
                    };
                    backend
                        .txn(delete)
                        .await
                        .map_err(Error::store("clear resumed entries"))?;
                }
                // Keepalives follow the TTL the lease was granted with, not the options'.
                (id, info.remaining, info.granted.max(1) as u64)
            }
            None => {
                let (id, granted) = backend
                    .lease_grant(ttl_secs as i64)
                    .await
                    .map_err(Error::store("lease grant"))?;
                (id, granted, ttl_secs)
            }
        };
        let ttl = Duration::from_secs(ttl_secs);
        let liveness = Arc::new(Liveness::new(
            lease,
            sent + Duration::from_secs(remaining.max(1) as u64),
        ));
        let keepalive = tokio::spawn(keepalive::keepalive(
            Arc::clone(&backend),
            lease,
            ttl,
            Arc::clone(&liveness),
        ));
        let owner = naming::new_owner();
        tracing::debug!(
            lease = format_args!("{lease:x}"),
            owner = format_args!("{owner:x}"),
            ?ttl,
            "session started"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                backend,
                lease,
                owner,
                ttl,
                namespace: options.namespace,
                liveness,
                keepalive,
                held: Mutex::default(),
                released: Notify::new(),
                cleanups: Mutex::default(),
            }),
        })
    }

    /// The lease ID (to resume the session with [`SessionOptions::with_lease`]).
    ///
    /// Not a fencing token: lease IDs are not monotonic.
    pub fn lease_id(&self) -> i64 {
        self.inner.lease
    }

    /// This session's owner identity: fresh for every session, also for sessions resumed on
    /// the same lease, and part of every queue key it writes (see the module docs).
    pub fn owner_id(&self) -> u64 {
        self.inner.owner
    }

    /// The lease TTL.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// The state now. `Lost` as soon as the local lease deadline has passed, even before the
    /// keepalive task has run.
    pub fn state(&self) -> SessionState {
        self.inner.liveness.state()
    }

    /// Resolves once the session is no longer [`SessionState::Alive`], with the new state.
    pub async fn done(&self) -> SessionState {
        if self.state() != SessionState::Alive {
            return self.state();
        }
        let mut rx = self.inner.liveness.subscribe();
        let state = match rx.wait_for(|s| *s != SessionState::Alive).await {
            Ok(s) => *s,
            Err(_) => SessionState::Lost,
        };
        state
    }

    /// A cloneable signal that fires when the session is lost or closed.
    pub fn loss_signal(&self) -> LossSignal {
        LossSignal::new(Arc::clone(&self.inner.liveness), None, None)
    }

    pub(crate) fn downgrade(&self) -> WeakSession {
        WeakSession(Arc::downgrade(&self.inner))
    }

    pub(crate) fn loss_signal_with(
        &self,
        entry: Option<tokio::sync::watch::Receiver<bool>>,
        fenced: Option<tokio::sync::watch::Receiver<Option<u64>>>,
    ) -> LossSignal {
        LossSignal::new(Arc::clone(&self.inner.liveness), entry, fenced)
    }

    /// Waits for background cleanups (entries of cancelled or failed acquisitions, dropped
    /// grants) to finish, so that the store reflects every release made so far.
    pub async fn settle(&self) {
        loop {
            let pending: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(&self.inner.cleanups));
            if pending.is_empty() {
                return;
            }
            for h in pending {
                let _ = h.await;
            }
        }
    }

    /// Stops the keepalive and revokes the lease, deleting every entry of the session at once.
    ///
    /// Bounded: pending cleanups are abandoned (the revoke deletes their entries too), so
    /// this takes one revoke request at most, within the provider's request timeout.
    ///
    /// # Errors
    /// The store's error when the revoke fails; the session is closed regardless and the lease
    /// expires by its TTL.
    pub async fn close(&self) -> Result<(), Error> {
        self.inner.liveness.close();
        self.inner.keepalive.abort();
        for h in std::mem::take(&mut *lock(&self.inner.cleanups)) {
            h.abort();
        }
        self.inner
            .backend
            .lease_revoke(self.inner.lease)
            .await
            .map_err(Error::store("lease revoke"))
    }

    /// Fails unless the session is alive.
    pub(crate) fn ensure_alive(&self) -> Result<(), Error> {
        match self.state() {
            SessionState::Alive => Ok(()),
            SessionState::Lost => Err(Error::SessionLost),
            SessionState::Closed => Err(Error::SessionClosed),
        }
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.inner.backend
    }

    pub(crate) fn lease(&self) -> LeaseId {
        self.inner.lease
    }

    /// The key prefix of primitive `name` of `kind` (`lock`, `rwlock`, `election`).
    pub(crate) fn path(&self, kind: &str, name: &str) -> Result<String, Error> {
        naming::path(&self.inner.namespace, kind, name)
    }

    /// The last segment of this session's queue keys.
    pub(crate) fn entry_suffix(&self) -> String {
        naming::entry_suffix(self.inner.owner, self.inner.lease)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
