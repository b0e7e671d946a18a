//! Read/write locks with phase tokens.
//!
//! Writers exclude everyone and wait for every earlier entry; readers wait only for earlier
//! writers. A writer's token is the epoch bump of its acquisition. Readers of one read phase
//! share one token: the first reader after a writer bumps the epoch to `R`, later readers take
//! the epoch's revision while it still says `R`, all decided in one nested transaction so two
//! racing readers cannot mint two tokens. A zombie writer is fenced by the readers' phase
//! token, zombie readers by the next writer's.
//!
//! Readers queue under `P/q/r/`, writers under `P/q/w/`, so a `try_*` can check "no writer"
//! (or "nobody") with one range compare and leave nothing behind when it fails.

use std::future::Future;

use crate::client::backend::{Compare, KeyRange, Op, Txn, TxnResponse};
use crate::client::error::Error;
use crate::client::queue::{token, try_exclusive, txn_riding_out, Grant, Pending, Primitive};
use crate::client::session::{Incarnation, LossSignal, Role, Session};
use crate::token::FencingToken;

/// Read/write lock operations: implemented by [`Session`].
pub trait RwLockService {
    /// Waits for every earlier writer, then shares the lock with other readers.
    ///
    /// # Errors
    /// As [`crate::LockService::lock`].
    fn read_lock(&self, name: &str) -> impl Future<Output = Result<RwGrant, Error>> + Send;
    /// Reads only if no writer holds or awaits the lock; leaves no entry when it fails.
    ///
    /// # Errors
    /// [`Error::Taken`], and as [`RwLockService::read_lock`].
    fn try_read_lock(&self, name: &str) -> impl Future<Output = Result<RwGrant, Error>> + Send;
    /// Waits for every earlier reader and writer, then holds the lock alone.
    ///
    /// # Errors
    /// [`Error::UpgradeNotSupported`] while this session holds a read lock on it, and as
    /// [`crate::LockService::lock`].
    fn write_lock(&self, name: &str) -> impl Future<Output = Result<RwGrant, Error>> + Send;
    /// Writes only if nobody holds or awaits the lock; leaves no entry when it fails.
    ///
    /// # Errors
    /// [`Error::Taken`], and as [`RwLockService::write_lock`].
    fn try_write_lock(&self, name: &str) -> impl Future<Output = Result<RwGrant, Error>> + Send;
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Shared with other readers.
    Read,
    /// Exclusive.
    Write,
}

/// Ownership of a read or write lock. Dropping it releases the lock in the background.
pub struct RwGrant {
    grant: Grant,
    mode: Mode,
}

impl std::fmt::Debug for RwGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RwGrant")
            .field("name", &self.grant.name)
            .field("mode", &self.mode)
            .field("token", &self.grant.token)
            .finish()
    }
}

impl RwGrant {
    /// The fencing token: the phase token for readers, the acquisition's for a writer.
    pub fn token(&self) -> FencingToken {
        self.grant.token
    }

    /// Read or write.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The queue entry this grant owns.
    pub fn incarnation(&self) -> &Incarnation {
        &self.grant.incarnation
    }

    /// The token with its way back: give it to [`crate::client::transport`]'s helpers or client
    /// layer, or call [`crate::client::owner::Owner::fenced`] when a resource refuses the token, and
    /// this ownership counts as lost at once.
    pub fn owner(&self) -> crate::client::owner::Owner {
        self.grant.owner.clone()
    }

    /// Fires when the session is lost or closed.
    pub fn loss_signal(&self) -> LossSignal {
        self.grant.loss_signal()
    }

    /// Releases a write lock.
    ///
    /// # Errors
    /// [`Error::WrongMode`] on a read grant (which stays held), [`Error::Released`],
    /// [`Error::LostBeforeRelease`] when ownership had already ended, or a store error (the
    /// grant stays held; retry).
    pub async fn unlock(&self) -> Result<(), Error> {
        self.release(Mode::Write).await
    }

    /// Releases a read lock.
    ///
    /// # Errors
    /// [`Error::WrongMode`] on a write grant (which stays held), and as [`RwGrant::unlock`].
    pub async fn runlock(&self) -> Result<(), Error> {
        self.release(Mode::Read).await
    }

    async fn release(&self, mode: Mode) -> Result<(), Error> {
        if self.mode != mode {
            let (held, release) = match self.mode {
                Mode::Read => ("read", "runlock"),
                Mode::Write => ("write", "unlock"),
            };
            return Err(Error::WrongMode {
                name: self.grant.name.clone(),
                held,
                release,
            });
        }
        self.grant.release().await
    }
}

const KIND: &str = crate::client::session::EpochOf::RwLock.as_str();
const READ_PHASE: &[u8] = b"R";

const WRITER_EPOCH_PREFIX: &str = "W:";

fn writer_epoch(key: &str) -> Vec<u8> {
    format!("{WRITER_EPOCH_PREFIX}{key}").into_bytes()
}

fn writers(p: &Primitive) -> KeyRange {
    KeyRange::prefix(format!("{}w/", p.queue()))
}

/// Joins (or opens) the read phase: `Txn(If epoch == "R" Then Get(epoch) Else Put(epoch, "R"),
/// Get(epoch))`. The token is the epoch's mod revision afterwards.
fn read_phase(p: &Primitive) -> Txn {
    Txn {
        when: vec![Compare::ValueEq(p.epoch(), READ_PHASE.to_vec())],
        then: vec![Op::get(p.epoch())],
        otherwise: vec![
            Op::Put {
                key: p.epoch(),
                value: READ_PHASE.to_vec(),
                lease: 0,
            },
            Op::get(p.epoch()),
        ],
    }
}

fn phase_token(r: &TxnResponse, at: usize) -> Option<FencingToken> {
    let inner = r.txn(at)?;
    let kv = inner.range(inner.responses.len() - 1).first()?;
    Some(token(kv.mod_revision))
}

impl RwLockService for Session {
    async fn read_lock(&self, name: &str) -> Result<RwGrant, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Read).await?;
        let mut pending = Pending::new(self, p.entry(self, "r/"), claim);
        pending.register(b"").await?;
        let writer_prefix = format!("{}w/", p.queue());
        pending
            .wait_turn(&p, |kv| kv.key.starts_with(&writer_prefix))
            .await?;
        let me = pending.incarnation().clone();
        // Safe to repeat: a lost answer's phase is joined again, still only with our entry.
        let r = txn_riding_out(self, "join read phase", || Txn {
            when: vec![Compare::CreateRevisionEq(
                KeyRange::key(me.key.clone()),
                me.create_revision,
            )],
            then: vec![Op::Txn(read_phase(&p))],
            otherwise: vec![],
        })
        .await?;
        let token = match (r.succeeded, phase_token(&r, 0)) {
            (true, Some(t)) => t,
            _ => return Err(Error::SessionLost),
        };
        Ok(RwGrant {
            grant: pending.finish(&p, token)?,
            mode: Mode::Read,
        })
    }

    async fn try_read_lock(&self, name: &str) -> Result<RwGrant, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Read).await?;
        let key = p.entry(self, "r/");
        let pending = Pending::new(self, key.clone(), claim);
        let r = self
            .backend()
            .txn(Txn {
                when: vec![Compare::CreateRevisionEq(writers(&p), 0)],
                then: vec![
                    Op::Put {
                        key: key.clone(),
                        value: Vec::new(),
                        lease: self.lease(),
                    },
                    Op::Txn(read_phase(&p)),
                    // A put keeps an existing key's create revision: read the real one.
                    Op::get(key.clone()),
                ],
                otherwise: vec![],
            })
            .await
            .map_err(Error::store("try read lock"))?;
        if !r.succeeded {
            pending.discard();
            return Err(Error::Taken {
                name: name.to_owned(),
            });
        }
        let token = phase_token(&r, 1).ok_or(Error::SessionLost)?;
        let create_revision = r
            .range(2)
            .first()
            .map_or(r.revision, |kv| kv.create_revision);
        let mut pending = pending;
        pending.registered(create_revision);
        Ok(RwGrant {
            grant: pending.finish(&p, token)?,
            mode: Mode::Read,
        })
    }

    async fn write_lock(&self, name: &str) -> Result<RwGrant, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Write).await?;
        let mut pending = Pending::new(self, p.entry(self, "w/"), claim);
        pending.register(b"").await?;
        pending.wait_turn(&p, |_| true).await?;
        let token = pending
            .confirm(&p, &writer_epoch(&pending.incarnation().key))
            .await?;
        Ok(RwGrant {
            grant: pending.finish(&p, token)?,
            mode: Mode::Write,
        })
    }

    async fn try_write_lock(&self, name: &str) -> Result<RwGrant, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Write).await?;
        let grant = try_exclusive(self, &p, "w/", claim, WRITER_EPOCH_PREFIX).await?;
        Ok(RwGrant {
            grant,
            mode: Mode::Write,
        })
    }
}
