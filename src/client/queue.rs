//! The queue every primitive is built on (`docs/design.md#token-derivation`), written once for
//! all providers.
//!
//! A primitive `P` keeps one entry per session under `P/q/` (attached to the session's lease,
//! ordered by create revision) and an epoch key `P/epoch`. An entry owns the primitive when no
//! entry that blocks it was created before it; ownership is then confirmed by the transaction
//! `If(CreateRevision(own) == own_rev) Then Put(P/epoch, ...)`, whose revision is the fencing
//! token. A zombie whose entry expired fails that compare and gets no token.

mod grant;
mod ride_out;
mod wait;

pub(crate) use grant::Grant;
pub(crate) use ride_out::{pause, txn_riding_out};

use crate::client::backend::{Compare, KeyRange, LeaseId, Op, Txn, TxnResponse};
use crate::client::error::Error;
use crate::client::session::{Claim, Incarnation, Session, SessionState};
use crate::token::FencingToken;

/// One primitive's keys.
pub(crate) struct Primitive {
    pub(crate) name: String,
    pub(crate) path: String,
}

impl Primitive {
    pub(crate) fn new(session: &Session, kind: &str, name: &str) -> Result<Self, Error> {
        Ok(Self {
            name: name.to_owned(),
            path: session.path(kind, name)?,
        })
    }

    pub(crate) fn queue(&self) -> String {
        format!("{}/q/", self.path)
    }

    pub(crate) fn epoch(&self) -> String {
        crate::client::session::epoch_of(&self.path)
    }

    /// This session's entry; `sub` separates entry kinds (`r/`, `w/` for rwlocks). The key
    /// names the session (owner id and lease), so two sessions on one lease never share one.
    pub(crate) fn entry(&self, session: &Session, sub: &str) -> String {
        format!("{}/q/{sub}{}", self.path, session.entry_suffix())
    }
}

pub(crate) fn token(revision: i64) -> FencingToken {
    FencingToken::new(u64::try_from(revision).unwrap_or(0))
        .expect("store revisions of writes are positive")
}

async fn txn(session: &Session, op: &'static str, t: Txn) -> Result<TxnResponse, Error> {
    session.backend().txn(t).await.map_err(Error::store(op))
}

/// Takes `p` exclusively if its queue is empty, in one transaction: put our entry and bump the
/// epoch to `epoch_prefix` + our key, or write nothing at all. Used by `try_lock` and
/// `try_write_lock`.
pub(crate) async fn try_exclusive(
    session: &Session,
    p: &Primitive,
    sub: &str,
    claim: Claim,
    epoch_prefix: &str,
) -> Result<Grant, Error> {
    let key = p.entry(session, sub);
    // Armed before the request: if it lands but the answer is lost (timeout, cancel), the
    // entry is still removed.
    let mut pending = Pending::new(session, key.clone(), claim);
    let r = txn(
        session,
        "try lock",
        Txn {
            when: vec![Compare::CreateRevisionEq(KeyRange::prefix(p.queue()), 0)],
            then: vec![
                Op::Put {
                    key: key.clone(),
                    value: Vec::new(),
                    lease: session.lease(),
                },
                Op::Put {
                    key: p.epoch(),
                    value: format!("{epoch_prefix}{key}").into_bytes(),
                    lease: 0,
                },
            ],
            otherwise: vec![],
        },
    )
    .await?;
    if !r.succeeded {
        pending.discard();
        return Err(Error::Taken {
            name: p.name.clone(),
        });
    }
    pending.registered(r.revision);
    pending.finish(p, token(r.revision))
}

/// An acquisition in progress. Dropped before [`Pending::finish`] (cancelled, or failed), it
/// deletes its entry in the background with a fresh context and keeps the session's claim
/// (marked as cleaning) until that is done, so a new acquisition of the same primitive waits
/// for the cleanup instead of racing it.
pub(crate) struct Pending {
    session: Session,
    key: String,
    incarnation: Option<Incarnation>,
    claim: Option<Claim>,
    /// Keys this acquisition may have written besides its entry (semaphore slots it tried to
    /// take) and the value that marks them as ours: cleaned up with the entry.
    also: Vec<(String, Vec<u8>)>,
    /// An attempt to enter the queue went unanswered: its put may still land, whenever our key
    /// is absent (after a release too), so the key is looked at again once this acquisition
    /// lets it go ([`Session::release_key_while_alive`]).
    late_put: bool,
}

impl Pending {
    pub(crate) fn new(session: &Session, key: String, claim: Claim) -> Self {
        Self {
            session: session.clone(),
            key,
            incarnation: None,
            claim: Some(claim),
            also: Vec::new(),
            late_put: false,
        }
    }

    /// Arms the cleanup of `key` (deleted only while it still holds `value`) before a request
    /// that may write it is sent: if the answer is lost, the key is still removed.
    pub(crate) fn also_clean(&mut self, key: String, value: Vec<u8>) {
        if !self.also.iter().any(|(k, _)| *k == key) {
            self.also.push((key, value));
        }
    }

    /// The acquisition's entry is now `to` (a semaphore's waiter moved into its slot): the
    /// grant owns `to`, and a cleanup deletes `to` instead of the old entry.
    ///
    /// After an unanswered attempt to enter the queue, the old entry's key is not ours to hold
    /// any more but a late put may still recreate it, where it would stand in line in front of
    /// later waiters while slots are free: it is looked for now and a moment later, the claim
    /// held by that look too.
    pub(crate) fn moved(&mut self, to: Incarnation) {
        self.incarnation = Some(to);
        self.also.clear();
        if let (true, Some(claim)) = (self.late_put, self.claim.clone()) {
            let session = self.session.clone();
            let key = self.key.clone();
            self.session.spawn_cleanup(async move {
                let _claim = claim;
                session.release_key_while_alive(&key).await;
            });
        }
    }

    pub(crate) fn incarnation(&self) -> &Incarnation {
        self.incarnation.as_ref().expect("registered")
    }

    /// Puts the entry into the queue (or adopts this session's existing one) with `value`.
    pub(crate) async fn register(&mut self, value: &[u8]) -> Result<(), Error> {
        let (key, lease) = (self.key.clone(), self.session.lease());
        // Already there: an earlier attempt of this registration whose answer was lost, or
        // the late put of this session's own earlier one. The key names this session, and the
        // claim waited for earlier cleanups: nobody else will delete it, so it is ours to
        // adopt. Read only: a late copy of this transaction must never write over what the
        // entry became since (a leader's `proclaim`).
        let absent = Compare::CreateRevisionEq(KeyRange::key(key.clone()), 0);
        let r = ride_out::txn_noting(&self.session, "register", &mut self.late_put, || {
            put_or_read(&key, lease, &absent, value)
        })
        .await?;
        let create_revision = if r.succeeded {
            r.revision
        } else {
            let Some(kv) = r.range(0).first() else {
                return Err(lost_error(&self.session)); // gone with the lease
            };
            if kv.value != value {
                // An earlier acquisition's entry: it takes this one's value, only over the
                // version just read, so a late copy of this put writes nothing either.
                self.adopt_value(kv.mod_revision, value).await?;
            }
            kv.create_revision
        };
        self.incarnation = Some(Incarnation {
            key,
            create_revision,
        });
        Ok(())
    }

    /// Puts `value` into the adopted entry if it is still the version `seen` (mod revision).
    async fn adopt_value(&mut self, seen: i64, value: &[u8]) -> Result<(), Error> {
        let (key, lease) = (self.key.clone(), self.session.lease());
        let unchanged = Compare::ModRevisionEq(key.clone(), seen);
        let r = ride_out::txn_noting(&self.session, "register", &mut self.late_put, || {
            put_or_read(&key, lease, &unchanged, value)
        })
        .await?;
        // Not the version seen: an unanswered attempt of this put landed (the value is ours),
        // or the entry went with the lease.
        match r.range(0).first() {
            _ if r.succeeded => Ok(()),
            Some(kv) if kv.value == value => Ok(()),
            _ => Err(lost_error(&self.session)),
        }
    }

    /// A `try_*` that found the primitive taken wrote nothing: forget without cleaning up.
    pub(crate) fn discard(mut self) {
        self.claim.take();
    }

    /// Records an entry created by a one-transaction `try_*`.
    pub(crate) fn registered(&mut self, create_revision: i64) {
        self.incarnation = Some(Incarnation {
            key: self.key.clone(),
            create_revision,
        });
    }

    /// Bumps the epoch if our entry still exists: the revision of that write is the token.
    ///
    /// Written so that it can be sent again when an answer was lost, or arrive late after
    /// its repeat: when the epoch already names our entry, written after our entry was created
    /// (only this acquisition's confirm writes that), the transaction writes nothing and the
    /// token is that write's revision. A repeat never moves the epoch past the token handed
    /// out, so the epoch stays "the current valid token" (`docs/design.md#token-derivation`).
    pub(crate) async fn confirm(
        &self,
        p: &Primitive,
        epoch_value: &[u8],
    ) -> Result<FencingToken, Error> {
        let me = self.incarnation();
        let epoch = p.epoch();
        let r = txn_riding_out(&self.session, "confirm ownership", || Txn {
            when: vec![Compare::CreateRevisionEq(
                KeyRange::key(me.key.clone()),
                me.create_revision,
            )],
            then: vec![Op::Txn(Txn {
                when: vec![
                    Compare::ValueEq(epoch.clone(), epoch_value.to_vec()),
                    Compare::ModRevisionGreater(epoch.clone(), me.create_revision),
                ],
                then: vec![Op::get(epoch.clone())],
                otherwise: vec![
                    Op::Put {
                        key: epoch.clone(),
                        value: epoch_value.to_vec(),
                        lease: 0,
                    },
                    Op::get(epoch.clone()),
                ],
            })],
            otherwise: vec![],
        })
        .await?;
        let written = r
            .txn(0)
            .and_then(|inner| inner.range(inner.responses.len() - 1).first());
        match (r.succeeded, written) {
            (true, Some(kv)) => Ok(token(kv.mod_revision)),
            _ => {
                self.session.confirm_lease().await;
                Err(lost_error(&self.session))
            }
        }
    }

    /// Hands the entry and the claim over to a grant, unless the session is no longer alive
    /// (its local lease deadline included): a token is never handed out past the deadline,
    /// and the entry is then cleaned up like a failed acquisition's.
    pub(crate) fn finish(mut self, p: &Primitive, token: FencingToken) -> Result<Grant, Error> {
        self.session.ensure_alive()?;
        let incarnation = self.incarnation.take().expect("registered");
        Ok(Grant::new(
            self.session.clone(),
            p.name.clone(),
            incarnation,
            token,
            self.claim.take(),
            self.late_put.then(|| self.key.clone()),
        ))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        claim.cleaning();
        let session = self.session.clone();
        let key = self.key.clone();
        let incarnation = self.incarnation.take();
        let also = std::mem::take(&mut self.also);
        let late_put = self.late_put;
        self.session.spawn_cleanup(async move {
            let _claim = claim;
            if let Some(i) = &incarnation {
                session.release_while_alive(i).await;
            }
            if incarnation.is_none() || late_put {
                session.release_key_while_alive(&key).await;
            }
            // After the entry: once it is gone, a transaction conditioned on it can no longer
            // write these keys; an unconditioned one (`try_acquire`) was sent at least the
            // second look of `release_key_while_alive` (1 s) ago.
            for (key, value) in also {
                session.release_value_while_alive(&key, &value).await;
            }
        });
    }
}

/// Puts `value` at `key` on `lease` if `when` holds; reads `key` otherwise.
fn put_or_read(key: &str, lease: LeaseId, when: &Compare, value: &[u8]) -> Txn {
    Txn {
        when: vec![when.clone()],
        then: vec![Op::Put {
            key: key.to_owned(),
            value: value.to_vec(),
            lease,
        }],
        otherwise: vec![Op::get(key.to_owned())],
    }
}

pub(crate) fn lost_error(session: &Session) -> Error {
    match session.state() {
        SessionState::Closed => Error::SessionClosed,
        _ => Error::SessionLost,
    }
}
