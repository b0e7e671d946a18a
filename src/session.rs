//! Sessions: one lease per service instance, kept alive in the background.
//!
//! Every queue entry a session creates is attached to its lease, so when the process dies or
//! is cut off, the store deletes them all once the lease expires, and the next owner's
//! acquisition bumps the epoch past every token this session held.
//!
//! The session watches its own lease: [`Session::done`] resolves when the lease is
//! [`SessionState::Lost`] (expired or revoked by someone else, or no keepalive acknowledged
//! for a whole TTL) or [`SessionState::Closed`] by [`Session::close`]. Local detection can only
//! lag the store; a session that is not yet `Lost` is not proof of ownership. The fencing token
//! checked at the resource is what keeps the data safe.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::Error;
use crate::provider::{Backend, Compare, LeaseId, Op, Txn};

/// Default lease TTL.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Default key namespace.
pub const DEFAULT_NAMESPACE: &str = "/palisade";

/// How a session is set up. Builder style: `SessionOptions::new().with_ttl(..)`.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    ttl: Duration,
    namespace: String,
    lease: Option<i64>,
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
        }
    }

    /// Lease TTL: how long the store keeps the session's entries after the last keepalive.
    /// At least 1 s; fractions are rounded up to whole seconds (etcd's unit).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Key prefix of every primitive; separate applications (and tests) use separate ones.
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into().trim_end_matches('/').to_owned();
        self
    }

    /// Resumes an existing lease (for example after a restart within its TTL) instead of
    /// granting a new one. Grants are not recovered: the entries the lease still holds under
    /// this namespace are deleted (nobody could release them otherwise), and the TTL is the
    /// one the lease was granted with.
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
            .field("ttl", &self.inner.ttl)
            .field("namespace", &self.inner.namespace)
            .field("state", &self.state())
            .finish()
    }
}

pub(crate) struct Inner {
    pub(crate) backend: Arc<dyn Backend>,
    lease: LeaseId,
    ttl: Duration,
    namespace: String,
    state: Arc<watch::Sender<SessionState>>,
    keepalive: JoinHandle<()>,
    held: Mutex<HashMap<String, Role>>,
    cleanups: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Dropping the last handle stops the keepalive; the lease then expires by its TTL.
        self.keepalive.abort();
    }
}

impl Session {
    pub(crate) async fn start(
        backend: Arc<dyn Backend>,
        options: SessionOptions,
    ) -> Result<Self, Error> {
        if options.ttl < Duration::from_secs(1) {
            return Err(Error::InvalidTtl(options.ttl));
        }
        let ttl_secs = options.ttl.as_secs() + u64::from(options.ttl.subsec_nanos() > 0);
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
                for key in info.keys.into_iter().filter(|k| k.starts_with(&mine)) {
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
        let granted = remaining;
        let (state, _) = watch::channel(SessionState::Alive);
        let state = Arc::new(state);
        let deadline = Instant::now() + Duration::from_secs(granted.max(1) as u64);
        let keepalive = tokio::spawn(keepalive(
            Arc::clone(&backend),
            lease,
            ttl,
            deadline,
            Arc::clone(&state),
        ));
        tracing::debug!(lease = format_args!("{lease:x}"), ?ttl, "session started");
        Ok(Self {
            inner: Arc::new(Inner {
                backend,
                lease,
                ttl,
                namespace: options.namespace,
                state,
                keepalive,
                held: Mutex::default(),
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

    /// The lease TTL.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// The state now.
    pub fn state(&self) -> SessionState {
        *self.inner.state.borrow()
    }

    /// Resolves once the session is no longer [`SessionState::Alive`], with the new state.
    pub async fn done(&self) -> SessionState {
        let mut rx = self.inner.state.subscribe();
        let state = match rx.wait_for(|s| *s != SessionState::Alive).await {
            Ok(s) => *s,
            Err(_) => SessionState::Lost,
        };
        state
    }

    /// A cloneable signal that fires when the session is lost or closed.
    pub fn loss_signal(&self) -> LossSignal {
        LossSignal::new(self.inner.state.subscribe(), None)
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
    /// # Errors
    /// The store's error when the revoke fails; the session is closed regardless and the lease
    /// expires by its TTL.
    pub async fn close(&self) -> Result<(), Error> {
        self.settle().await;
        self.inner.state.send_if_modified(|s| {
            let changed = *s == SessionState::Alive;
            if changed {
                *s = SessionState::Closed;
            }
            changed
        });
        self.inner.keepalive.abort();
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
        if name.is_empty() {
            return Err(Error::InvalidName(name.to_owned()));
        }
        // '/' and '%' are escaped so that no name's keys fall under another name's prefix.
        const ESCAPE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'/').add(b'%');
        let encoded = percent_encoding::utf8_percent_encode(name, ESCAPE);
        Ok(format!("{}/{kind}/{encoded}", self.inner.namespace))
    }

    /// Records that this session is acquiring (then holding) `path` in `role`.
    pub(crate) fn claim(&self, path: &str, name: &str, role: Role) -> Result<Claim, Error> {
        self.ensure_alive()?;
        let mut held = lock(&self.inner.held);
        if let Some(existing) = held.get(path) {
            return Err(if *existing == Role::Read && role == Role::Write {
                Error::UpgradeNotSupported {
                    name: name.to_owned(),
                }
            } else {
                Error::AlreadyHeld {
                    name: name.to_owned(),
                }
            });
        }
        held.insert(path.to_owned(), role);
        Ok(Claim {
            session: self.clone(),
            path: path.to_owned(),
        })
    }

    /// Runs `task` in the background and remembers it for [`Session::settle`].
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

    /// Background cleanup: retries [`Session::release`] with backoff for as long as the
    /// session is alive. An entry left behind on a live lease would block the primitive for
    /// everyone; once the lease is gone, the store deletes the entry itself.
    pub(crate) async fn release_while_alive(&self, incarnation: &Incarnation) {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.release(incarnation).await {
                Ok(_) => return,
                Err(e) if self.state() == SessionState::Alive => {
                    tracing::debug!(key = %incarnation.key, error = %e, "cleanup failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(_) => return,
            }
        }
    }

    /// Deletes the entry `incarnation` if, and only if, that exact incarnation still exists:
    /// safe to repeat, and never deletes a newer entry under the same key.
    ///
    /// Returns whether something was deleted. Grants call this on release; it is public so a
    /// caller that lost track of an acquisition (a crashed task) can clean up precisely.
    ///
    /// # Errors
    /// The store's error after retries.
    pub async fn release(&self, incarnation: &Incarnation) -> Result<bool, Error> {
        let txn = Txn {
            when: vec![Compare::CreateRevisionEq(
                crate::provider::KeyRange::key(incarnation.key.clone()),
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
                Ok(r) => return Ok(r.succeeded),
                Err(e) if e.is_transient() && attempt < 3 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                }
                Err(e) => return Err(Error::store("release")(e)),
            }
        }
    }
}

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

/// The session's record that it is acquiring or holding a primitive; dropping it forgets.
pub(crate) struct Claim {
    session: Session,
    path: String,
}

impl Drop for Claim {
    fn drop(&mut self) {
        lock(&self.session.inner.held).remove(&self.path);
    }
}

/// Why a [`LossSignal`] fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// The session's lease is gone (expired, revoked elsewhere, or unconfirmed for a TTL).
    SessionLost,
    /// The session was closed by its owner.
    SessionClosed,
    /// The grant's queue entry was deleted while the session lived (by an operator, or by a
    /// `Session::release` of that incarnation): the grant no longer owns anything.
    EntryDeleted,
}

/// Fires when ownership ends: the session is lost or closed, or (for a grant's signal) the
/// grant's queue entry disappears. Best effort and possibly late; the fencing token checked
/// at the resource is what keeps data safe.
#[derive(Debug, Clone)]
pub struct LossSignal {
    session: watch::Receiver<SessionState>,
    entry: Option<watch::Receiver<bool>>,
}

impl LossSignal {
    pub(crate) fn new(
        session: watch::Receiver<SessionState>,
        entry: Option<watch::Receiver<bool>>,
    ) -> Self {
        Self { session, entry }
    }

    /// Resolves once ownership has ended, saying why.
    pub async fn wait(&mut self) -> Loss {
        let Self { session, entry } = self;
        let session_ended = async {
            match session.wait_for(|s| *s != SessionState::Alive).await {
                Ok(s) if *s == SessionState::Closed => Loss::SessionClosed,
                // Lost, or the session and its keepalive are gone entirely.
                _ => Loss::SessionLost,
            }
        };
        let entry_deleted = async {
            if let Some(rx) = entry {
                if rx.wait_for(|deleted| *deleted).await.is_ok() {
                    return Loss::EntryDeleted;
                }
            }
            // No entry to follow, or its watcher stopped (grant released): never fires.
            std::future::pending().await
        };
        tokio::select! {
            loss = session_ended => loss,
            loss = entry_deleted => loss,
        }
    }

    pub(crate) fn with_entry(self, entry: Option<watch::Receiver<bool>>) -> Self {
        Self { entry, ..self }
    }

    /// Whether it has fired.
    pub fn is_lost(&self) -> bool {
        *self.session.borrow() != SessionState::Alive
            || self.entry.as_ref().is_some_and(|e| *e.borrow())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Renews the lease every TTL/3. `deadline` is when the store forgets the lease if no
/// keepalive lands, measured from when the last acknowledged one was *sent* (conservative).
async fn keepalive(
    backend: Arc<dyn Backend>,
    lease: LeaseId,
    ttl: Duration,
    mut deadline: Instant,
    state: Arc<watch::Sender<SessionState>>,
) {
    let interval = ttl / 3;
    let retry = interval.min(Duration::from_millis(200));
    let mut wait = interval;
    loop {
        tokio::time::sleep(wait).await;
        if *state.borrow() != SessionState::Alive {
            return;
        }
        let sent = Instant::now();
        // After a freeze (SIGSTOP, VM pause) the deadline may already be behind us.
        let Some(budget) = deadline
            .checked_duration_since(sent)
            .filter(|b| !b.is_zero())
        else {
            lost(&state, lease, "no keepalive acknowledged within the TTL");
            return;
        };
        match tokio::time::timeout(budget.min(interval), backend.lease_keepalive(lease)).await {
            Ok(Ok(left)) if left > 0 => {
                deadline = sent + Duration::from_secs(left as u64);
                wait = interval;
            }
            Ok(Ok(_)) => {
                lost(&state, lease, "the store no longer has the lease");
                return;
            }
            Ok(Err(e)) => {
                tracing::debug!(lease = format_args!("{lease:x}"), error = %e, "keepalive failed");
                wait = retry;
            }
            Err(_) => wait = Duration::ZERO,
        }
    }
}

fn lost(state: &watch::Sender<SessionState>, lease: LeaseId, why: &str) {
    let changed = state.send_if_modified(|s| {
        let alive = *s == SessionState::Alive;
        if alive {
            *s = SessionState::Lost;
        }
        alive
    });
    if changed {
        tracing::warn!(lease = format_args!("{lease:x}"), why, "session lost");
    }
}
