//! Counting semaphores with fencing: N holders at once, each in one of N slots, each slot with
//! its own strictly increasing token.
//!
//! A semaphore `P` with N permits keeps:
//!
//! - `P/permits`: N, written by the first acquisition; every later one must ask for the same N
//!   ([`Error::PermitsMismatch`]), or two contenders could count different slots;
//! - `P/q/<entry>`: the waiting line, one entry per waiting session (on its lease), in create
//!   revision order, exactly like a lock's queue;
//! - `P/s/<slot>`: a slot's holder (on its lease), for slots `0..N`;
//! - `P/epoch/<slot>`: the slot's epoch key, value `S:<holder's entry>`.
//!
//! The oldest waiter takes a free slot in one transaction,
//! `If(CreateRevision(own entry) == own_rev && CreateRevision(P/s/<slot>) == 0)
//! Then Delete(own entry), Put(P/s/<slot>), Put(P/epoch/<slot>)`: its revision is the token
//! (the slot key's create revision and the epoch key's mod revision), so successive holders of
//! one slot get strictly increasing tokens, and a zombie whose entry expired gets none. A slot
//! key is created only where none exists, so there are never more than N holders; a holder's
//! slot key goes with its lease, so a holder that stops keepalives frees its slot within the
//! TTL while the other N-1 keep theirs.
//!
//! Tokens are store revisions, shared by every slot and primitive: compare a permit's token
//! only with the marks of its own slot's resource, named by [`Permit::resource`].
//! `docs/client.md#semaphores` explains why, and what a client that names another slot can and
//! cannot do.
//!
//! ```no_run
//! # async fn demo(session: palisade::Session) -> Result<(), palisade::Error> {
//! use palisade::SemaphoreService;
//! let permit = session.acquire("jobs", 3).await?;
//! let (slot, token) = (permit.slot(), permit.token()); // send to resource "jobs/<slot>"
//! permit.release().await?;
//! # Ok(()) }
//! ```

mod slots;

use std::future::Future;

use slots::{check_permits, epoch_key, epoch_value, free_slot, slot_key, slots, take_slot};

use crate::client::backend::{Compare, KeyRange, Op, Txn};
use crate::client::error::Error;
use crate::client::queue::{token, Grant, Pending, Primitive};
use crate::client::session::{Incarnation, LossSignal, Role, Session};
use crate::token::FencingToken;

pub use crate::client::limits::MAX_PERMITS;

/// Semaphore operations: implemented by [`Session`].
pub trait SemaphoreService {
    /// Waits in line until a slot of the `permits`-slot semaphore `name` is free, takes it and
    /// returns its permit.
    ///
    /// Cancel-safe: dropping the future deletes the waiting entry (and a slot taken by a
    /// request whose answer was lost) in the background.
    ///
    /// # Errors
    /// [`Error::InvalidPermits`], [`Error::PermitsMismatch`], and as
    /// [`crate::LockService::lock`].
    fn acquire(
        &self,
        name: &str,
        permits: u32,
    ) -> impl Future<Output = Result<Permit, Error>> + Send;

    /// Takes a slot only if one is free and nobody waits, in one transaction that leaves no
    /// key behind when it fails.
    ///
    /// # Errors
    /// [`Error::Taken`] when every slot is held or someone waits, and as
    /// [`SemaphoreService::acquire`].
    fn try_acquire(
        &self,
        name: &str,
        permits: u32,
    ) -> impl Future<Output = Result<Permit, Error>> + Send;
}

/// One held slot of a semaphore. Dropping it releases the slot in the background; prefer
/// [`Permit::release`], which reports errors.
pub struct Permit {
    grant: Grant,
    slot: u32,
    permits: u32,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("name", &self.grant.name)
            .field("slot", &self.slot)
            .field("token", &self.grant.token)
            .finish()
    }
}

impl Permit {
    /// The fencing token: strictly increasing among the holders of this slot.
    pub fn token(&self) -> FencingToken {
        self.grant.token
    }

    /// The slot, `0..permits`.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The semaphore's permit count.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.grant.name
    }

    /// The resource this permit's token fences: `<name>/<slot>`. Route requests by it (one
    /// proxy route or layer resource per slot); never send the token to another slot's.
    pub fn resource(&self) -> String {
        format!("{}/{}", self.grant.name, self.slot)
    }

    /// The slot key this permit owns (its create revision is the token).
    pub fn incarnation(&self) -> &Incarnation {
        &self.grant.incarnation
    }

    /// The token with its way back: give it to [`crate::client::transport`]'s helpers or client
    /// layer, or call [`crate::client::owner::Owner::fenced`] when a resource refuses the token, and
    /// this ownership counts as lost at once.
    pub fn owner(&self) -> crate::client::owner::Owner {
        self.grant.owner.clone()
    }

    /// Fires when the session is lost or closed, or the slot key disappears.
    pub fn loss_signal(&self) -> LossSignal {
        self.grant.loss_signal()
    }

    /// Frees the slot. Only this permit's slot key is deleted, so a retry after a timeout
    /// cannot free a later holder's slot.
    ///
    /// # Errors
    /// As [`crate::LockGrant::unlock`].
    pub async fn release(&self) -> Result<(), Error> {
        self.grant.release().await
    }
}

const KIND: &str = crate::client::session::EpochOf::Semaphore.as_str();

impl SemaphoreService for Session {
    async fn acquire(&self, name: &str, permits: u32) -> Result<Permit, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Permit).await?;
        check_permits(self, &p, permits, true).await?;
        let mut pending = Pending::new(self, p.entry(self, ""), claim);
        pending.register(b"").await?;
        // First in line: holders have left the queue for their slots, so only waiters block.
        pending.wait_turn(&p, |_| true).await?;
        let (slot, token) = take_slot(self, &mut pending, &p, permits).await?;
        Ok(Permit {
            grant: pending.finish(&p, token)?,
            slot,
            permits,
        })
    }

    async fn try_acquire(&self, name: &str, permits: u32) -> Result<Permit, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Permit).await?;
        check_permits(self, &p, permits, false).await?;
        let entry = p.entry(self, "");
        let mut pending = Pending::new(self, entry.clone(), claim);
        let taken = || Error::Taken {
            name: name.to_owned(),
        };
        // Each failed round means another holder took a slot; bounded all the same.
        for _ in 0..=2 * permits {
            let r = self
                .backend()
                .txn(Txn {
                    when: vec![],
                    then: vec![Op::Range {
                        range: slots(&p),
                        sort: None,
                        limit: 0,
                        max_create_revision: 0,
                    }],
                    otherwise: vec![],
                })
                .await
                .map_err(Error::store("read slots"))?;
            let Some(slot) = free_slot(&p, &r, 0, permits) else {
                break;
            };
            let key = slot_key(&p, slot);
            pending.also_clean(key.clone(), entry.clone().into_bytes());
            let t = self
                .backend()
                .txn(Txn {
                    // Nobody waits (no queue jumping), and the slot is free.
                    when: vec![
                        Compare::CreateRevisionEq(KeyRange::prefix(p.queue()), 0),
                        Compare::CreateRevisionEq(KeyRange::key(key.clone()), 0),
                    ],
                    then: vec![
                        Op::Put {
                            key: key.clone(),
                            value: entry.clone().into_bytes(),
                            lease: self.lease(),
                        },
                        Op::Put {
                            key: epoch_key(&p, slot),
                            value: epoch_value(&entry),
                            lease: 0,
                        },
                    ],
                    otherwise: vec![Op::Range {
                        range: KeyRange::prefix(p.queue()),
                        sort: None,
                        limit: 1,
                        max_create_revision: 0,
                    }],
                })
                .await
                .map_err(Error::store("try acquire"))?;
            if t.succeeded {
                pending.moved(Incarnation {
                    key,
                    create_revision: t.revision,
                });
                return Ok(Permit {
                    grant: pending.finish(&p, token(t.revision))?,
                    slot,
                    permits,
                });
            }
            if !t.range(0).is_empty() {
                break;
            }
        }
        pending.discard();
        Err(taken())
    }
}
