//! The client library's one error type.

use std::time::Duration;

use crate::client::backend::BackendError;

/// Why a session, lock, read/write lock or election operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The session's lease expired or was revoked by someone else: every grant of the session
    /// is gone and the session cannot acquire again. Start a new session.
    #[error("the session's lease is lost")]
    SessionLost,
    /// The session was closed by its owner.
    #[error("the session was closed")]
    SessionClosed,
    /// `try_*`: another owner holds the lock (or, for a reader, a writer holds or waits).
    #[error("{name}: held by another owner")]
    Taken {
        /// The primitive's name.
        name: String,
    },
    /// This session already holds, or is acquiring, the same primitive. A session owns at most
    /// one queue entry per primitive, so re-entrant acquisition is refused instead of silently
    /// sharing one grant between two callers.
    #[error("{name}: this session already holds or is acquiring it")]
    AlreadyHeld {
        /// The primitive's name.
        name: String,
    },
    /// Read-to-write upgrade on one session: refused, because the writer would wait for its own
    /// read entry forever.
    #[error("{name}: cannot upgrade a read lock to a write lock; release the read lock first")]
    UpgradeNotSupported {
        /// The rwlock's name.
        name: String,
    },
    /// `unlock` on a read grant or `runlock` on a write grant. The lock stays held.
    #[error("{name}: this grant is a {held} lock; release it with {release}()")]
    WrongMode {
        /// The rwlock's name.
        name: String,
        /// `read` or `write`.
        held: &'static str,
        /// The method that releases it.
        release: &'static str,
    },
    /// The grant was already released.
    #[error("already released")]
    Released,
    /// `unlock`, `runlock` or `resign` found that ownership had already ended before it:
    /// the lease was lost or the entry deleted, so a later owner may have taken over and work
    /// done under this grant's token since then may have been fenced. The grant is released
    /// locally all the same (calling again says [`Error::Released`]).
    #[error("{name}: ownership had already been lost before this release")]
    LostBeforeRelease {
        /// The primitive's name.
        name: String,
    },
    /// A resource refused this owner's token as stale (its mark is above it): a newer owner
    /// exists. [`crate::client::session::Session::lead`] returns it when its work was cancelled so.
    #[error("{name}: fenced: a resource's mark {mark} is above this owner's token")]
    Fenced {
        /// The primitive's name.
        name: String,
        /// The mark that refused the token.
        mark: u64,
    },
    /// `proclaim` by a candidate that no longer leads.
    #[error("{name}: not the leader")]
    NotLeader {
        /// The election's name.
        name: String,
    },
    /// Names must be 1..=[`crate::client::session::MAX_NAME_BYTES`] bytes. Checked before any
    /// request, so a name the store would refuse never reaches it. Holds the name shortened to
    /// its first 64 bytes and its length, so messages stay short.
    #[error("invalid name {0:?}: must be 1 to {max} bytes", max = crate::client::limits::MAX_NAME_BYTES)]
    InvalidName(String),
    /// A namespace with a `lock`, `rwlock`, `election` or `semaphore` segment could nest inside another
    /// namespace's primitive (`/ns` and `/ns/lock/a/q`) and collide with it. Holds the
    /// namespace, shortened like [`Error::InvalidName`].
    #[error("invalid namespace {0:?}: no segment may be lock, rwlock, election or semaphore")]
    InvalidNamespace(String),
    /// TTLs must be 1 s (etcd counts leases in whole seconds) up to
    /// [`crate::client::session::MAX_TTL`] (etcd's maximum).
    #[error("invalid TTL {0:?}: must be from 1 s to 9000000000 s")]
    InvalidTtl(Duration),
    /// A semaphore needs 1..=[`crate::client::semaphore::MAX_PERMITS`] permits.
    #[error("invalid permit count {0}: must be from 1 to {max}", max = crate::client::limits::MAX_PERMITS)]
    InvalidPermits(u32),
    /// The semaphore was created with another permit count: every contender must ask for
    /// the same number, or more holders than intended could hold it at once.
    #[error("{name}: the semaphore has {stored} permits, not {asked}")]
    PermitsMismatch {
        /// The semaphore's name.
        name: String,
        /// The count stored when the semaphore was first used.
        stored: u32,
        /// The count this call asked for.
        asked: u32,
    },
    /// The provider's store failed.
    #[error("{op}: {source}")]
    Store {
        /// What was being done.
        op: &'static str,
        /// The store's error.
        #[source]
        source: BackendError,
    },
}

impl Error {
    pub(crate) fn store(op: &'static str) -> impl FnOnce(BackendError) -> Error {
        move |source| match source {
            BackendError::Refused(ref e) if e.to_string().contains("lease not found") => {
                Error::SessionLost
            }
            source => Error::Store { op, source },
        }
    }
}
