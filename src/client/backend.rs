//! The small key-value model both providers speak (revisions, leases, transactions,
//! watches: the part of etcd's API the primitives need), so that sessions and the primitives
//! are written once against [`Backend`] and behave the same on etcd and in memory.

use std::future::Future;
use std::pin::Pin;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store revision (etcd's `int64` revisions; tokens are their positive values).
pub(crate) type Revision = i64;
/// A lease identifier.
pub(crate) type LeaseId = i64;

/// One stored key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kv {
    pub(crate) key: String,
    pub(crate) value: Vec<u8>,
    pub(crate) create_revision: Revision,
    pub(crate) mod_revision: Revision,
    pub(crate) lease: LeaseId,
}

/// `[start, end)`; `end == None` is the single key `start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyRange {
    pub(crate) start: String,
    pub(crate) end: Option<String>,
}

impl KeyRange {
    pub(crate) fn key(k: impl Into<String>) -> Self {
        Self {
            start: k.into(),
            end: None,
        }
    }

    pub(crate) fn prefix(p: impl Into<String>) -> Self {
        let start = p.into();
        let end = prefix_end(&start);
        Self {
            start,
            end: Some(end),
        }
    }

    pub(crate) fn contains(&self, k: &str) -> bool {
        match &self.end {
            None => k == self.start,
            Some(end) => k >= self.start.as_str() && k < end.as_str(),
        }
    }
}

/// The smallest key greater than every key starting with `prefix` (prefixes are ASCII here).
fn prefix_end(prefix: &str) -> String {
    let mut bytes = prefix.as_bytes().to_vec();
    while let Some(last) = bytes.pop() {
        if last < 0x7f {
            bytes.push(last + 1);
            return String::from_utf8(bytes).expect("ASCII stays ASCII");
        }
    }
    "\u{7f}".to_owned()
}

/// A transaction guard. Range compares hold when every key in the range satisfies them; an
/// empty range compares as a key with create revision 0 (etcd's rule), so
/// `CreateRevision(prefix) == 0` means "no key under the prefix".
#[derive(Debug, Clone)]
pub(crate) enum Compare {
    CreateRevisionEq(KeyRange, Revision),
    /// Fails when the key is missing (etcd's rule for value compares).
    ValueEq(String, Vec<u8>),
    /// The key's mod revision is above the revision; a missing key has mod revision 0.
    ModRevisionGreater(String, Revision),
    /// The key's mod revision is the revision (0: the key is missing).
    ModRevisionEq(String, Revision),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SortByCreate {
    Ascending,
    Descending,
}

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: LeaseId,
    },
    Range {
        range: KeyRange,
        sort: Option<SortByCreate>,
        limit: i64,
        max_create_revision: Revision,
    },
    Delete {
        key: String,
    },
    Txn(Txn),
}

impl Op {
    pub(crate) fn get(key: impl Into<String>) -> Self {
        Op::Range {
            range: KeyRange::key(key),
            sort: None,
            limit: 0,
            max_create_revision: 0,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Txn {
    pub(crate) when: Vec<Compare>,
    pub(crate) then: Vec<Op>,
    pub(crate) otherwise: Vec<Op>,
}

#[derive(Debug, Clone)]
pub(crate) enum OpResponse {
    Put,
    Range(Vec<Kv>),
    Delete,
    Txn(TxnResponse),
}

#[derive(Debug, Clone)]
pub(crate) struct TxnResponse {
    pub(crate) succeeded: bool,
    /// The store's revision after the transaction (the revision of its writes, if any).
    pub(crate) revision: Revision,
    pub(crate) responses: Vec<OpResponse>,
}

impl TxnResponse {
    pub(crate) fn range(&self, i: usize) -> &[Kv] {
        match self.responses.get(i) {
            Some(OpResponse::Range(kvs)) => kvs,
            _ => &[],
        }
    }

    pub(crate) fn txn(&self, i: usize) -> Option<&TxnResponse> {
        match self.responses.get(i) {
            Some(OpResponse::Txn(t)) => Some(t),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    Put,
    Delete,
}

#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) kind: EventKind,
    pub(crate) kv: Kv,
}

/// The events of one watch, batch by batch. `None` when the watch ended.
pub(crate) trait Events: Send {
    fn next(&mut self) -> BoxFuture<'_, Option<Result<Vec<Event>, BackendError>>>;
}

/// A lease as the store sees it.
#[derive(Debug, Clone, Default)]
pub(crate) struct LeaseInfo {
    /// Seconds left; 0 when the lease no longer exists.
    pub(crate) remaining: i64,
    /// The TTL it was granted with.
    pub(crate) granted: i64,
    /// The keys attached to it.
    pub(crate) keys: Vec<String>,
}

/// What a provider's store can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The store could not be reached, or the request failed in transit.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// No answer within the request timeout.
    #[error("no answer within {0:?}")]
    Timeout(std::time::Duration),
    /// A watch asked for history that was compacted away.
    #[error("revision {0} was compacted")]
    Compacted(Revision),
    /// The store refused the request.
    #[error("store refused the request: {0}")]
    Refused(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl BackendError {
    /// Whether repeating an idempotent request may succeed.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self,
            BackendError::Unavailable(_) | BackendError::Timeout(_)
        )
    }
}

/// The operations the primitives need from a store.
pub(crate) trait Backend: Send + Sync + 'static {
    fn txn(&self, txn: Txn) -> BoxFuture<'_, Result<TxnResponse, BackendError>>;
    /// Events on `range` from revision `from` (inclusive) on.
    fn watch(
        &self,
        range: KeyRange,
        from: Revision,
    ) -> BoxFuture<'_, Result<Box<dyn Events>, BackendError>>;
    fn lease_grant(&self, ttl_secs: i64) -> BoxFuture<'_, Result<(LeaseId, i64), BackendError>>;
    /// Renews the lease; the remaining TTL in seconds, 0 when the lease no longer exists.
    fn lease_keepalive(&self, lease: LeaseId) -> BoxFuture<'_, Result<i64, BackendError>>;
    fn lease_revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), BackendError>>;
    /// What the store knows of a lease (used to resume); `remaining == 0` when it is gone.
    fn lease_ttl(&self, lease: LeaseId) -> BoxFuture<'_, Result<LeaseInfo, BackendError>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_cover_exactly_the_prefix() {
        let r = KeyRange::prefix("/p/lock/a/q/");
        assert!(r.contains("/p/lock/a/q/0001"));
        assert!(!r.contains("/p/lock/a/q"));
        assert!(!r.contains("/p/lock/a/epoch"));
        assert!(!r.contains("/p/lock/a/r/"));
        assert_eq!(prefix_end("ab"), "ac");
    }
}
