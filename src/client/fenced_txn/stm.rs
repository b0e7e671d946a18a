//! [`Stm`]: a read-modify-write closure run as one serializable etcd transaction, retried on
//! conflict, optionally fenced by a grant.

use std::collections::BTreeMap;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp};

use super::{
    bounded, inner_response, IsOwner, TxnError, DEFAULT_MAX_ATTEMPTS, DEFAULT_REQUEST_TIMEOUT,
};
use crate::client::session::Incarnation;

/// Software transactional memory on etcd: a closure that reads and writes keys runs as one
/// serializable transaction, optionally fenced by a grant.
///
/// Every run of the closure reads at one snapshot (the revision of its first read), buffers
/// its writes (and reads its own writes), then commits them in one transaction that holds
/// only if every key it read still has the mod revision it was read at (0 for a key that
/// did not exist) and, with [`Stm::fenced`], the grant still owns. When a key read has
/// changed the closure runs again, after a randomised backoff that doubles up to 1 s.
/// The closure may therefore run several times: it should have no effect outside `tx`.
/// A run that wrote nothing is not checked (its reads are one consistent snapshot): it never
/// conflicts, and it is serializable at its snapshot's revision rather than at commit.
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
        // A run that wrote nothing and read everything at one revision saw a consistent cut
        // of the store: it is serializable at that revision with nothing to check (checking
        // would only make readers retry, even starve, behind busy writers). Fenced, the
        // ownership compare is still made.
        let read_only = state.writes.is_empty() && !state.off_snapshot;
        if read_only && self.owner.is_none() {
            return Ok(true);
        }
        let reads: Vec<Compare> = if read_only {
            Vec::new()
        } else {
            state
                .reads
                .iter()
                .map(|(k, rev)| Compare::mod_revision(k.as_bytes(), CompareOp::Equal, *rev))
                .collect()
        };
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
        Ok(inner_response(owner, r)?.succeeded())
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
    /// Some read was not made at `snapshot`.
    off_snapshot: bool,
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
        let read_at = if snapshot > 0 {
            snapshot
        } else {
            r.header().map_or(0, |h| h.revision())
        };
        let mut s = lock(&self.state);
        if s.snapshot == 0 {
            // The first read fixes the snapshot for the rest of the attempt.
            s.snapshot = read_at;
        }
        if read_at == 0 || read_at != s.snapshot {
            // Two first reads raced on clones of one `tx` and read "now" at different
            // revisions (or etcd sent no header): the reads are no single snapshot, so the
            // commit must check them even if nothing was written.
            s.off_snapshot = true;
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
