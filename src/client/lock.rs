//! Exclusive locks with fencing tokens.
//!
//! The token of a [`LockGrant`] is the revision at which its owner bumped the lock's epoch on
//! acquisition, so successive owners get strictly increasing tokens whatever happened in
//! between (unlock, lease expiry, a crashed holder).
//!
//! Cancelling [`LockService::lock`] (dropping its future, for example in
//! `tokio::time::timeout`) or dropping a [`LockGrant`] deletes the queue entry in the
//! background. Calling `lock` again on the same session right after either is fine: it waits
//! for that cleanup (one round trip), then queues. A session holds at most one acquisition
//! per name (see [`crate::client::session`] for why, and how to run several local contenders).
//!
//! ```no_run
//! # async fn demo(session: palisade::Session) -> Result<(), palisade::Error> {
//! use palisade::LockService;
//! let grant = session.lock("orders").await?;
//! let token = grant.token(); // attach to every request to the resource
//! grant.unlock().await?;
//! # Ok(()) }
//! ```

use std::future::Future;

use crate::client::error::Error;
use crate::client::queue::{try_exclusive, Grant, Pending, Primitive};
use crate::client::session::{Incarnation, LossSignal, Role, Session};
use crate::token::FencingToken;

/// Lock operations: implemented by [`Session`].
pub trait LockService {
    /// Waits until the lock is free, takes it and returns its grant.
    ///
    /// Cancel-safe: dropping the future deletes the queue entry in the background.
    ///
    /// # Errors
    /// [`Error::SessionLost`] if the lease goes while waiting, [`Error::AlreadyHeld`] if this
    /// session already holds or awaits it, or a store error.
    fn lock(&self, name: &str) -> impl Future<Output = Result<LockGrant, Error>> + Send;

    /// Takes the lock only if nobody holds or awaits it, in one transaction that leaves no
    /// entry behind when it fails.
    ///
    /// # Errors
    /// [`Error::Taken`] when it is held, and the errors of [`LockService::lock`].
    fn try_lock(&self, name: &str) -> impl Future<Output = Result<LockGrant, Error>> + Send;
}

/// Ownership of a lock. Dropping it releases the lock in the background; prefer
/// [`LockGrant::unlock`], which reports errors.
pub struct LockGrant(Grant);

impl std::fmt::Debug for LockGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGrant")
            .field("name", &self.0.name)
            .field("token", &self.0.token)
            .finish()
    }
}

impl LockGrant {
    /// The fencing token of this ownership.
    pub fn token(&self) -> FencingToken {
        self.0.token
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The queue entry this grant owns.
    pub fn incarnation(&self) -> &Incarnation {
        &self.0.incarnation
    }

    /// The token with its way back: give it to [`crate::client::transport`]'s helpers or client
    /// layer, or call [`crate::client::owner::Owner::fenced`] when a resource refuses the token, and
    /// this ownership counts as lost at once.
    pub fn owner(&self) -> crate::client::owner::Owner {
        self.0.owner.clone()
    }

    /// Fires when the session, and so this ownership, is lost or closed.
    pub fn loss_signal(&self) -> LossSignal {
        self.0.loss_signal()
    }

    /// Releases the lock. Only this incarnation's entry is deleted, so a retry after a timeout
    /// cannot delete a later acquisition's entry.
    ///
    /// # Errors
    /// [`Error::Released`] when already released; [`Error::LostBeforeRelease`] when ownership
    /// had already ended (the grant is released locally all the same); a store error leaves
    /// the grant held so the call can be retried.
    pub async fn unlock(&self) -> Result<(), Error> {
        self.0.release().await
    }
}

const KIND: &str = crate::client::session::EpochOf::Lock.as_str();

const EPOCH_PREFIX: &str = "L:";

fn epoch_value(key: &str) -> Vec<u8> {
    format!("{EPOCH_PREFIX}{key}").into_bytes()
}

impl LockService for Session {
    async fn lock(&self, name: &str) -> Result<LockGrant, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Lock).await?;
        let mut pending = Pending::new(self, p.entry(self, ""), claim);
        pending.register(b"").await?;
        pending.wait_turn(&p, |_| true).await?;
        let token = pending
            .confirm(&p, &epoch_value(&pending.incarnation().key))
            .await?;
        Ok(LockGrant(pending.finish(&p, token)?))
    }

    async fn try_lock(&self, name: &str) -> Result<LockGrant, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Lock).await?;
        Ok(LockGrant(
            try_exclusive(self, &p, "", claim, EPOCH_PREFIX).await?,
        ))
    }
}
