//! Coordination providers: where sessions, queues and epochs live.
//!
//! Both providers speak the same small key-value model (revisions, leases, transactions,
//! watches: the part of etcd's API the primitives need), so [`lock`](crate::client::lock),
//! [`rwlock`](crate::client::rwlock) and [`election`](crate::client::election) are written once and behave the
//! same on either:
//!
//! - [`etcd`] (feature `etcd`): a caller-owned `etcd_client::Client`, with request timeouts,
//!   retries of idempotent reads, and watches re-created after a disconnect;
//! - [`memory`]: an in-process store with its own monotonic revision counter, for tests and
//!   single-process use.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod memory;

use std::future::Future;

use crate::client::error::Error;
use crate::client::session::{Session, SessionOptions};

/// A source of [`Session`]s: implemented by every provider.
pub trait Provider: Send + Sync {
    /// Grants (or, with [`SessionOptions::with_lease`], resumes) a lease and keeps it alive.
    ///
    /// # Errors
    /// [`Error::InvalidTtl`], or the provider's error when the lease cannot be granted.
    fn session(
        &self,
        options: SessionOptions,
    ) -> impl Future<Output = Result<Session, Error>> + Send;
}

pub use crate::client::backend::BackendError;
