//! The client library's one error type.

use std::time::Duration;

use crate::provider::BackendError;

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
    /// `proclaim` by a candidate that no longer leads.
    #[error("{name}: not the leader")]
    NotLeader {
        /// The election's name.
        name: String,
    },
    /// Names must be non-empty.
    #[error("invalid name {0:?}: must not be empty")]
    InvalidName(String),
    /// TTLs must be at least one second (etcd counts leases in whole seconds).
    #[error("invalid TTL {0:?}: must be at least 1 s")]
    InvalidTtl(Duration),
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
