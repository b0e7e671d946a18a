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
//! use palisade::client::fenced_txn::{commit_fenced, Stm, TxnError};
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

mod stm;

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, TxnOpResponse, TxnResponse};

use crate::client::election::Leadership;
use crate::client::lock::LockGrant;
use crate::client::rwlock::RwGrant;
use crate::client::session::Incarnation;
pub use stm::{Stm, StmTx};

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
    inner_response(owner.incarnation(), r)
}

/// The nested transaction's response from `If(owner) Then(Txn(inner)) Else()`, or
/// [`TxnError::NotOwner`] when the ownership compare failed.
fn inner_response(owner: &Incarnation, r: TxnResponse) -> Result<TxnResponse, TxnError> {
    if !r.succeeded() {
        return Err(TxnError::NotOwner {
            key: owner.key().to_owned(),
        });
    }
    match r.op_responses().into_iter().next() {
        Some(TxnOpResponse::Txn(inner)) => Ok(inner),
        // The outer success branch holds exactly one op, the nested transaction, and etcd
        // answers every op of a branch in order.
        _ => unreachable!("etcd answers a nested transaction with its response"),
    }
}
