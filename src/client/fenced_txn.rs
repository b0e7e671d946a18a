//! Fenced etcd transactions (feature `etcd`): for data that lives in etcd itself, writes that
//! commit only while their writer still owns its lock, election or read/write lock.
//!
//! A zombie's HTTP writes are refused by the resource because its token is below the mark.
//! When the resource *is* etcd, the same guarantee comes from a compare in the transaction:
//! the grant's queue entry must still exist with the create revision it had when ownership
//! was confirmed (etcd's `Mutex.IsOwner()`). The entry is attached to the session's lease, so
//! the compare fails from the moment etcd expires or revokes that lease, or anyone deletes
//! the entry, whatever the zombie's own clock says. It is judged by etcd, inside the
//! transaction, so there is no window between "check" and "write".
//!
//! Two ways to use it:
//!
//! - [`IsOwner::is_owner`] gives the `etcd_client::Compare` to add to a transaction of your
//!   own; [`commit_fenced`] wraps any `etcd_client::Txn` so that it runs only while the grant
//!   owns, and tells "not the owner any more" ([`TxnError::NotOwner`]) apart from the
//!   transaction's own compares failing;
//! - [`Stm`] runs a read-modify-write closure as a serializable transaction (etcd's `concurrency.STM`
//!   idea): every key read is checked by its mod revision at commit, the closure is run again
//!   (with backoff) when one changed, and with [`Stm::fenced`] the ownership compare is part
//!   of the same commit.
//!
//! ```no_run
//! # async fn demo(client: etcd_client::Client, session: palisade::Session) -> Result<(), Box<dyn std::error::Error>> {
//! use palisade::fenced_txn::{commit_fenced, Stm, TxnError};
//! use palisade::LockService;
//!
//! let grant = session.lock("accounts").await?;
//! // One write, only while `grant` owns the lock:
//! let txn = etcd_client::Txn::new().and_then([etcd_client::TxnOp::put("/accounts/owner", "me", None)]);
//! match commit_fenced(&client, &grant, txn).await {
//!     Ok(_) => {}
//!     Err(TxnError::NotOwner { .. }) => { /* a zombie: nothing was written */ }
//!     Err(e) => return Err(e.into()),
//! }
//! // A read-modify-write, serializable and fenced:
//! Stm::new(&client)
//!     .fenced(&grant)
//!     .run(|tx| async move {
//!         let n = tx.get("/accounts/counter").await?.map_or(0, |v| v[0]);
//!         tx.put("/accounts/counter", vec![n + 1]);
//!         Ok(())
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! Writes are never repeated after an error of the request itself (a timeout may hide a
//! commit): only a commit that etcd answered with "a key read has changed" is retried.

use std::collections::BTreeMap;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};

use crate::election::Leadership;
use crate::lock::LockGrant;
use crate::rwlock::RwGrant;
use crate::session::Incarnation;

/// Default bound on each etcd request made here.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Default number of attempts of an [`Stm`] transaction before [`TxnError::Conflict`].
pub const DEFAULT_MAX_ATTEMPTS: u32 = 64;

/// Why a fenced transaction or an [`Stm`] run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TxnError {
    /// The grant no longer owns: its queue entry is gone (lease expired or revoked, entry
    /// deleted) or belongs to a later incarnation. Nothing was written.
    #[error("{key}: not the owner any more; nothing was written")]
    NotOwner {
        /// The grant's queue key.
        key: String,
    },
    /// [`Stm`]: the keys read kept changing under the transaction for
    /// [`Stm::with_max_attempts`] attempts. Nothing was written.
    #[error("the keys read kept changing: gave up after {attempts} attempts")]
    Conflict {
        /// How many times the closure ran.
        attempts: u32,
    },
    /// No answer within the request timeout. A commit that timed out may or may not have
    /// been applied.
    #[error("no answer from etcd within {0:?}")]
    Timeout(Duration),
    /// etcd refused or failed the request. For a commit, as for a timeout, it may or may not
    /// have been applied when the error came from the transport.
    #[error("etcd: {0}")]
    Etcd(#[source] etcd_client::Error),
    /// [`Stm`]: the closure gave up (returned [`TxnError::abort`]). Nothing was written.
    #[error("aborted: {0}")]
    Aborted(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl TxnError {
    /// An error for an [`Stm`] closure to give up with (insufficient funds, invalid input):
    /// the run ends at once with [`TxnError::Aborted`], writing nothing.
    pub fn abort(reason: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        TxnError::Aborted(reason.into())
    }
}

/// A grant whose ownership etcd can check inside a transaction: [`LockGrant`],
/// [`Leadership`], [`RwGrant`] and the bare [`Incarnation`] (queue key and create revision).
pub trait IsOwner {
    /// The queue entry that proves ownership while it exists.
    fn incarnation(&self) -> &Incarnation;

    /// The compare that holds only while the grant owns: `CreateRevision(entry) ==
    /// entry's create revision` (etcd's `Mutex.IsOwner()`). Add it to any `etcd_client::Txn`;
    /// when it fails the transaction runs its `or_else` branch and writes nothing of
    /// `and_then`.
    fn is_owner(&self) -> Compare {
        let i = self.incarnation();
        Compare::create_revision(i.key(), CompareOp::Equal, i.create_revision())
    }
}

impl IsOwner for Incarnation {
    fn incarnation(&self) -> &Incarnation {
        self
    }
}

impl IsOwner for LockGrant {
    fn incarnation(&self) -> &Incarnation {
        LockGrant::incarnation(self)
    }
}

impl IsOwner for Leadership {
    fn incarnation(&self) -> &Incarnation {
        Leadership::incarnation(self)
    }
}

impl IsOwner for RwGrant {
    fn incarnation(&self) -> &Incarnation {
        RwGrant::incarnation(self)
    }
}

async fn bounded<T>(
    timeout: Duration,
    f: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, TxnError> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(TxnError::Etcd),
        Err(_) => Err(TxnError::Timeout(timeout)),
    }
}

/// Commits `txn` only while `owner` owns, in one etcd transaction, and returns `txn`'s own
/// response (its `succeeded()` says whether *its* compares held).
///
/// The request is `If(owner.is_owner()) Then(Txn(txn)) Else()`: `txn` runs nested, so its
/// compares and branches work as usual. Bounded by [`DEFAULT_REQUEST_TIMEOUT`]; never
/// retried.
///
/// # Errors
/// [`TxnError::NotOwner`] when the ownership compare failed (nothing written);
/// [`TxnError::Timeout`] or [`TxnError::Etcd`] when the request failed.
pub async fn commit_fenced(
    client: &Client,
    owner: &impl IsOwner,
    txn: Txn,
) -> Result<TxnResponse, TxnError> {
    let fenced = Txn::new()
        .when([owner.is_owner()])
        .and_then([TxnOp::txn(txn)]);
    let mut client = client.clone();
    let r = bounded(DEFAULT_REQUEST_TIMEOUT, client.txn(fenced)).await?;
    if !r.succeeded() {
        return Err(TxnError::NotOwner {
            key: owner.incarnation().key().to_owned(),
        });
    }
    match r.op_responses().into_iter().next() {
        Some(TxnOpResponse::Txn(inner)) => Ok(inner),
        _ => unreachable!("etcd answers a nested transaction with its response"),
    }
}

/// Software transactional memory on etcd: a closure that reads and writes keys runs as one
/// serializable transaction, optionally fenced by a grant.
///
/// Every run of the closure reads at one snapshot (the revision of its first read), buffers
/// its writes (and reads its own writes), then commits them in one transaction that holds
/// only if every key it read still has the mod revision it was read at (0 for a key that
/// did not exist) and, with [`Stm::fenced`], the grant still owns. When a key read has
/// changed the closure runs again, after a randomised backoff that doubles up to 1 s.
/// The closure may therefore run several times: it should have no effect outside `tx`.
#[derive(Clone)]
pub struct Stm {
    client: Client,
    owner: Option<Incarnation>,
    max_attempts: u32,
    timeout: Duration,
}

impl std::fmt::Debug for Stm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stm")
            .field("owner", &self.owner)
            .field("max_attempts", &self.max_attempts)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Stm {
    /// Transactions on `client` (cloned; the caller keeps owning it), not fenced.
    pub fn new(client: &Client) -> Self {
        Self {
            client: client.clone(),
            owner: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// Commits only while `owner` owns (its [`IsOwner::is_owner`] compare is part of every
    /// commit); otherwise [`Stm::run`] fails with [`TxnError::NotOwner`].
    pub fn fenced(mut self, owner: &impl IsOwner) -> Self {
        self.owner = Some(owner.incarnation().clone());
        self
    }

    /// How many times the closure may run before [`TxnError::Conflict`] (default
    /// [`DEFAULT_MAX_ATTEMPTS`], at least 1).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Bounds each etcd request (default [`DEFAULT_REQUEST_TIMEOUT`]).
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs `f` until it commits, and returns its value.
    ///
    /// `f` gets a fresh [`StmTx`] on every attempt; errors of `tx.get` should be passed on
    /// with `?`, and [`TxnError::abort`] ends the run without writing.
    ///
    /// # Errors
    /// [`TxnError::NotOwner`] (fenced, ownership lost: nothing written),
    /// [`TxnError::Conflict`] after too many attempts, [`TxnError::Aborted`] from `f`,
    /// [`TxnError::Timeout`] or [`TxnError::Etcd`] when a request failed (a failed commit is
    /// not retried: it may have been applied).
    pub async fn run<F, Fut, T>(&self, mut f: F) -> Result<T, TxnError>
    where
        F: FnMut(StmTx) -> Fut,
        Fut: Future<Output = Result<T, TxnError>>,
    {
        let mut backoff = Duration::from_millis(2);
        for attempt in 1..=self.max_attempts {
            let tx = StmTx {
                client: self.client.clone(),
                timeout: self.timeout,
                state: Arc::new(Mutex::new(State::default())),
            };
            let value = match f(tx.clone()).await {
                Ok(v) => v,
                // A read failed because the snapshot was compacted: start over on a new one.
                Err(TxnError::Etcd(e)) if is_compacted(&e) => {
                    backoff = sleep_jittered(backoff).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let state = std::mem::take(&mut *lock(&tx.state));
            if self.commit(state).await? {
                return Ok(value);
            }
            if attempt < self.max_attempts {
                backoff = sleep_jittered(backoff).await;
            }
        }
        Err(TxnError::Conflict {
            attempts: self.max_attempts,
        })
    }

    /// `Ok(false)`: a key read had changed (retry). With an owner, the request is
    /// `If(owner) Then(Txn(If(reads) Then(writes))) Else()`, so a lost ownership and a
    /// conflict are told apart.
    async fn commit(&self, state: State) -> Result<bool, TxnError> {
        let reads: Vec<Compare> = state
            .reads
            .iter()
            .map(|(k, rev)| Compare::mod_revision(k.as_bytes(), CompareOp::Equal, *rev))
            .collect();
        let writes: Vec<TxnOp> = state
            .writes
            .into_iter()
            .map(|(k, v)| match v {
                Some(value) => TxnOp::put(k, value, None),
                None => TxnOp::delete(k, None),
            })
            .collect();
        let inner = Txn::new().when(reads).and_then(writes);
        let mut client = self.client.clone();
        let Some(owner) = &self.owner else {
            let r = bounded(self.timeout, client.txn(inner)).await?;
            return Ok(r.succeeded());
        };
        let fenced = Txn::new()
            .when([owner.is_owner()])
            .and_then([TxnOp::txn(inner)]);
        let r = bounded(self.timeout, client.txn(fenced)).await?;
        if !r.succeeded() {
            return Err(TxnError::NotOwner {
                key: owner.key().to_owned(),
            });
        }
        match r.op_responses().into_iter().next() {
            Some(TxnOpResponse::Txn(inner)) => Ok(inner.succeeded()),
            _ => unreachable!("etcd answers a nested transaction with its response"),
        }
    }
}

/// One attempt's view of etcd inside [`Stm::run`]: reads at one snapshot, buffered writes.
/// A cheap handle (clones share the attempt); it is only valid during its attempt.
#[derive(Clone)]
pub struct StmTx {
    client: Client,
    timeout: Duration,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for StmTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = lock(&self.state);
        f.debug_struct("StmTx")
            .field("snapshot", &s.snapshot)
            .field("reads", &s.reads.len())
            .field("writes", &s.writes.len())
            .finish()
    }
}

#[derive(Default)]
struct State {
    /// The revision every read of this attempt is made at (0 until the first read).
    snapshot: i64,
    /// Key -> mod revision seen (0: the key did not exist).
    reads: BTreeMap<String, i64>,
    /// Values read, so a key is fetched once per attempt.
    values: BTreeMap<String, Option<Vec<u8>>>,
    /// Key -> new value (`None`: delete).
    writes: BTreeMap<String, Option<Vec<u8>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StmTx {
    /// The value of `key`: this attempt's own write if it made one, else the value at the
    /// attempt's snapshot. The key joins the read set checked at commit.
    ///
    /// # Errors
    /// [`TxnError::Timeout`] or [`TxnError::Etcd`] (a compacted snapshot makes
    /// [`Stm::run`] start the attempt over).
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TxnError> {
        let snapshot = {
            let s = lock(&self.state);
            if let Some(w) = s.writes.get(key) {
                return Ok(w.clone());
            }
            if let Some(v) = s.values.get(key) {
                return Ok(v.clone());
            }
            s.snapshot
        };
        let mut opts = GetOptions::new();
        if snapshot > 0 {
            opts = opts.with_revision(snapshot);
        }
        let mut client = self.client.clone();
        let r = bounded(self.timeout, client.get(key, Some(opts))).await?;
        let kv = r.kvs().first();
        let value = kv.map(|kv| kv.value().to_vec());
        let mut s = lock(&self.state);
        if s.snapshot == 0 {
            // The first read fixes the snapshot for the rest of the attempt. (Two first
            // reads racing on clones of one `tx` both read "now"; the earlier header wins,
            // and the later read is still checked by its mod revision at commit.)
            s.snapshot = r.header().map_or(0, |h| h.revision());
        }
        s.reads
            .insert(key.to_owned(), kv.map_or(0, |kv| kv.mod_revision()));
        s.values.insert(key.to_owned(), value.clone());
        Ok(value)
    }

    /// Buffers a put of `key`, applied at commit.
    pub fn put(&self, key: impl Into<String>, value: impl Into<Vec<u8>>) {
        lock(&self.state)
            .writes
            .insert(key.into(), Some(value.into()));
    }

    /// Buffers a delete of `key`, applied at commit.
    pub fn delete(&self, key: impl Into<String>) {
        lock(&self.state).writes.insert(key.into(), None);
    }
}

fn is_compacted(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("compacted"))
}

/// Sleeps a random time in `[backoff/2, backoff]` and returns the next backoff (doubled, at
/// most 1 s). Random so that writers that collided do not collide again in step.
async fn sleep_jittered(backoff: Duration) -> Duration {
    // A fresh `RandomState` is seeded from the OS once per thread and then varied per call:
    // enough randomness for jitter without a dependency.
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let half = backoff / 2;
    let jitter = half.mul_f64((r >> 11) as f64 / (1u64 << 53) as f64);
    tokio::time::sleep(half + jitter).await;
    (backoff * 2).min(Duration::from_secs(1))
}
