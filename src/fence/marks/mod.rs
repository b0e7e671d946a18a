//! Mark stores: where high-water marks live so that they survive restarts
//! (`docs/design.md#durability`).
//!
//! A store is asked for two things: the marks of the resources a guard opens
//! ([`MarkStore::load_named`], at start and as entities are first used), and to make one
//! advance durable before the guard publishes it ([`MarkStore::persist`]). A store that cannot
//! persist returns an error and the request is refused with 503: a mark that only lived in
//! memory would let a zombie in after a restart.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod file;
pub mod memory;
pub mod settings;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;

pub use file::FileStore;
pub use memory::MemoryStore;

/// Resource name -> highest accepted token.
pub type Marks = BTreeMap<String, u64>;

/// A boxed future, so stores can be used behind `dyn MarkStore`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Durable storage for high-water marks.
///
/// Implementations must never report success for a write that is not durable, and must never
/// lower a mark: `persist(r, m)` with a mark below the stored one succeeds without writing.
pub trait MarkStore: Send + Sync + 'static {
    /// A short name for logs and metric labels: `memory`, `file`, `etcd`.
    fn kind(&self) -> &'static str;

    /// Every mark the store holds (for tools and tests: guards read marks by name).
    fn load(&self) -> BoxFuture<'_, Result<Marks, StoreError>>;

    /// Makes `mark` durable for `resource` unless the store already holds a higher one, and
    /// returns the stored mark afterwards: `mark` itself, or the higher mark that won (another
    /// proxy sharing the store advanced further). Resolves only once the result is durable.
    fn persist<'a>(
        &'a self,
        resource: &'a str,
        mark: u64,
    ) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// The stored marks of `names` only (absent ones are left out). A shared store reads
    /// just those, so that a replica in front of millions of entities starts at once; its
    /// watch ([`MarkStore::subscribe`]) then starts from that read.
    fn load_named<'a>(&'a self, names: &'a [String]) -> BoxFuture<'a, Result<Marks, StoreError>> {
        Box::pin(async move {
            let all = self.load().await?;
            Ok(names
                .iter()
                .filter_map(|n| all.get(n).map(|m| (n.clone(), *m)))
                .collect())
        })
    }

    /// How many stored marks there are of resources whose names start with `prefix`.
    fn count<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            Ok(self
                .load()
                .await?
                .keys()
                .filter(|n| n.starts_with(prefix))
                .count() as u64)
        })
    }

    /// At most `limit` stored marks of resources whose names start with `prefix`, in name
    /// order (for `/marks?prefix=` and `palisade marks list --prefix`).
    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Marks, StoreError>> {
        Box::pin(async move {
            Ok(self
                .load()
                .await?
                .into_iter()
                .filter(|(n, _)| n.starts_with(prefix))
                .take(limit)
                .collect())
        })
    }

    /// How long one of this store's requests may take in all (`request_timeout_ms` for etcd),
    /// if it bounds them: a request waiting on a confirmation round is answered within it
    /// from its own arrival, whatever the read before its round is doing.
    fn request_timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// How admissions must treat this store's marks: [`Consistency::Local`] for a store only
    /// this process writes (its in-memory mark is the truth), or one of the shared modes.
    fn consistency(&self) -> Consistency {
        Consistency::Local
    }

    /// The stored mark of `resource` (0 when none) and, for a resource fed by a lock, the
    /// mod revision of the lock's `epoch` key, read together so that the read starts after
    /// the call and sees every write acknowledged before it (a linearizable read). Only
    /// called for [`Consistency::Linearizable`] stores.
    fn confirm<'a>(
        &'a self,
        resource: &'a str,
        epoch: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Confirmed, StoreError>> {
        let _ = resource;
        Box::pin(async move {
            Ok(Confirmed {
                mark: 0,
                // A store that cannot read epochs never vouches for one: fail closed.
                epoch: epoch.map(|_| Epoch::Missing),
            })
        })
    }

    /// Advances made by other processes sharing the store, as `(resource, mark)`, for as long
    /// as the receiver is kept. `None` for stores no other process writes.
    fn subscribe(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<(String, u64)>> {
        None
    }

    /// Changes of the epoch keys under `prefix` (outside the marks: the keys of locks that
    /// feed resources) as `(key, mod revision)` of each write (0 for a delete), for as long
    /// as the receiver is kept; `("", 0)` whenever changes may have been missed (the watch
    /// started, broke, or fell behind a compaction), so that every followed key is read
    /// afresh.
    /// `None` for stores that cannot watch.
    fn watch_keys(
        &self,
        prefix: &str,
    ) -> Option<tokio::sync::mpsc::UnboundedReceiver<(String, u64)>> {
        let _ = prefix;
        None
    }

    /// Whether the store can currently take writes (for `/readyz`): a real write where the
    /// store has one, its result reused briefly so that polling stays cheap.
    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>>;
}

/// What a confirmation read found ([`MarkStore::confirm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Confirmed {
    /// The stored mark (0: none).
    pub mark: u64,
    /// The feeding primitive's epoch, for a resource that has one.
    pub epoch: Option<Epoch>,
}

/// A lock's epoch key as a confirmation read found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epoch {
    /// The key does not exist: the primitive was never acquired, or the key was deleted.
    Missing,
    /// Its mod revision: the current owner's token.
    At(u64),
}

/// How proxies sharing a store agree on marks (`[marks.etcd] consistency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Consistency {
    /// One process owns the store: its own mark is authoritative.
    Local,
    /// Every admission, equal tokens included, is confirmed by a read of the store that
    /// started after the request arrived (concurrent admissions share one read).
    Linearizable,
    /// Equal and lower tokens are judged on a local copy that a watch keeps fresh; advances
    /// still go through the store. A zombie can get through for as long as the watch lags.
    Cached,
}

/// Why a mark store could not load or persist.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Reading or writing the marks file (or its directory) failed.
    #[error("marks file {path}: {op} failed: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// What was being done: `read`, `write`, `fsync`, `rename`, ...
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The marks file exists but is not a complete, valid marks file. Never treated as empty:
    /// starting from 0 would re-admit every zombie.
    #[error(
        "marks file {path} is corrupt or truncated at line {line}, column {column}: {source}; \
         refusing to start (restore it from a backup, or delete it only if every resource's \
         owner has been re-elected since)"
    )]
    Corrupt {
        /// The marks file.
        path: PathBuf,
        /// 1-based line of the first problem.
        line: usize,
        /// 1-based column of the first problem.
        column: usize,
        /// What the JSON parser found.
        #[source]
        source: serde_json::Error,
    },
    /// The marks database could not be opened, read or committed to.
    #[error("marks file {path}: {op} failed: {source}")]
    Database {
        /// The marks file.
        path: PathBuf,
        /// What was being done: `open`, `read`, `commit`, ...
        op: &'static str,
        /// SQLite's error (boxed: every admission future has room for a `StoreError`).
        #[source]
        source: Box<rusqlite::Error>,
    },
    /// The marks file is a damaged database, or a database that is not palisade's. Never
    /// treated as empty.
    #[error(
        "marks file {path} is corrupt: {problem}; refusing to start (restore it from a \
         backup, or delete it, with its -wal and -shm files, only if every resource's owner \
         has been re-elected since)"
    )]
    CorruptDatabase {
        /// The marks file.
        path: PathBuf,
        /// What SQLite or the format check found.
        problem: String,
    },
    /// Another process holds the marks file: a running proxy, or `palisade marks set`. Two
    /// writers would each keep their own copy of the map and overwrite the other's advances.
    #[error(
        "a palisade process holds {path} (advisory lock on {lock}; `fuser -v {lock}` names \
         it); stop it first: only one process may use a marks file at a time"
    )]
    Locked {
        /// The marks file.
        path: PathBuf,
        /// The lock file beside it.
        lock: PathBuf,
    },
    /// The etcd store failed (connect, request, or an unreadable value).
    #[error("etcd mark store: {0}")]
    Etcd(String),
    /// The epoch key of the lock that feeds a resource does not exist: the lock was never
    /// acquired, or the key was deleted. No token can be vouched for.
    #[error(
        "the feeding lock's epoch key {key} does not exist (never acquired, or deleted); \
         refusing rather than judging without it"
    )]
    EpochMissing {
        /// The epoch key.
        key: String,
    },
    /// The epoch key's revision is below one read before: etcd was restored from an older
    /// snapshot, or the key was deleted and written again.
    #[error(
        "the feeding lock's epoch key {key} went back from revision {seen} to {now} (etcd \
         restored from an older snapshot?); refusing: an older epoch could admit an older \
         owner"
    )]
    EpochRewound {
        /// The epoch key.
        key: String,
        /// The highest revision read before.
        seen: u64,
        /// The revision read now.
        now: u64,
    },
    /// A failure shared by every request of one confirmation round.
    #[error(transparent)]
    Shared(std::sync::Arc<StoreError>),
    /// The store did not answer in time.
    #[error("mark store did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The persisting task was lost (runtime shutting down).
    #[error("mark store task ended before the write finished")]
    TaskLost(#[source] tokio::task::JoinError),
}
