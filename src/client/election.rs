//! Leader election with fencing tokens.
//!
//! Candidates queue under `P/q/`; the oldest entry leads once it has bumped the election's
//! epoch (value `E:<its key>`), and [`ElectionService::campaign`] returns the [`Leadership`]
//! *with* the token of the term it won. (Looking the token up afterwards would be wrong: by
//! then `leader()` may already show the next term.)
//!
//! A term is reported (by [`ElectionService::leader`] and observers) only once it is
//! confirmed: the first entry of the queue is the one the epoch names, *and* the epoch was
//! written at or after that entry's creation. The second half matters when one session
//! resigns and campaigns again: its new entry has the same key as the ended term's, and
//! until the new campaign confirms, the epoch still names that key with the old term's token.
//!
//! A leader that restarts within its lease's TTL can take its term over, token included,
//! with [`Leadership::leader_key`], [`SessionOptions::resuming`](crate::SessionOptions::resuming)
//! and [`ElectionService::resume`] (etcd's `ResumeElection`).
//!
//! ```no_run
//! # async fn demo(session: palisade::Session) -> Result<(), palisade::Error> {
//! use palisade::ElectionService;
//! let result = session
//!     .lead("scheduler", "node-1", |term| async move {
//!         // Lead until the work is done or `term.lost` fires; stamp requests with term.token.
//!         let mut lost = term.lost;
//!         tokio::select! {
//!             _ = lost.wait() => "lost leadership",
//!             _ = tokio::time::sleep(std::time::Duration::from_secs(60)) => "done",
//!         }
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

mod observe;

use std::future::Future;

pub use observe::Observer;

use crate::client::backend::{Compare, KeyRange, Op, SortByCreate, Txn};
use crate::client::error::Error;
use crate::client::queue::{token, Grant, Pending, Primitive};
use crate::client::session::{naming, Incarnation, LossSignal, Role, Session};
use crate::token::FencingToken;

/// Election operations: implemented by [`Session`].
pub trait ElectionService {
    /// Joins the election with `value` and waits until this candidate leads.
    ///
    /// Cancel-safe: dropping the future withdraws the candidacy in the background.
    ///
    /// # Errors
    /// [`Error::SessionLost`] if the lease goes while waiting (the candidate never reports
    /// leadership then), [`Error::AlreadyHeld`] if this session already campaigns.
    fn campaign(
        &self,
        name: &str,
        value: impl Into<Vec<u8>> + Send,
    ) -> impl Future<Output = Result<Leadership, Error>> + Send;

    /// The confirmed leader now, if any.
    ///
    /// # Errors
    /// A store error.
    fn leader(&self, name: &str) -> impl Future<Output = Result<Option<Term>, Error>> + Send;

    /// Follows the election: every new term (in increasing token order, each once), every
    /// proclaimed value, and "no leader" when the last candidate leaves. Survives
    /// disconnects and store restarts (see [`Observer`]).
    ///
    /// # Errors
    /// [`Error::InvalidName`]; failures while observing arrive through the [`Observer`].
    fn observe(&self, name: &str) -> impl Future<Output = Result<Observer, Error>> + Send;

    /// Takes over the term `leader` names, keeping its token: for a leader restarted within
    /// its lease's TTL, on a session started with
    /// [`SessionOptions::resuming`](crate::SessionOptions::resuming)`(leader)`. Succeeds only
    /// if the term is still current: the entry exists with the same create revision on this
    /// session's lease, leads the queue, and the epoch still carries the token.
    ///
    /// # Errors
    /// [`Error::NotLeader`] when the term is over (or never was), [`Error::AlreadyHeld`] when
    /// this session already campaigns, or a store error.
    fn resume(&self, leader: &LeaderKey) -> impl Future<Output = Result<Leadership, Error>> + Send;
}

/// What a leader keeps (for example in a file) to resume its term after a restart: see
/// [`ElectionService::resume`]. Plain data, so it can be stored and rebuilt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderKey {
    /// The election's name.
    pub name: String,
    /// The leader's queue key.
    pub key: String,
    /// The revision that created that key.
    pub create_revision: i64,
    /// The lease the key is attached to.
    pub lease: i64,
    /// The term's token.
    pub token: FencingToken,
}

/// One term of leadership as seen by anyone: its token, value, and who leads.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Term {
    /// The term's fencing token.
    pub token: FencingToken,
    /// The leader's current value (as proclaimed).
    pub value: Vec<u8>,
    /// The leader's queue key.
    pub key: String,
    /// The leader's lease.
    pub lease: i64,
    /// The leader session's owner id ([`Session::owner_id`]); 0 for a key of another form.
    pub owner: u64,
}

/// What an [`Observer`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// A leader, or a new value proclaimed by the current one.
    Leader(Term),
    /// Nobody campaigns.
    NoLeader,
}

/// Being the leader. Dropping it resigns in the background.
pub struct Leadership(Grant);

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("name", &self.0.name)
            .field("token", &self.0.token)
            .finish()
    }
}

impl Leadership {
    /// The token of the term this candidate won.
    pub fn token(&self) -> FencingToken {
        self.0.token
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The candidate's entry.
    pub fn incarnation(&self) -> &Incarnation {
        &self.0.incarnation
    }

    /// The token with its way back: give it to [`crate::client::transport`]'s helpers or client
    /// layer, or call [`crate::client::owner::Owner::fenced`] when a resource refuses the token, and
    /// this ownership counts as lost at once.
    pub fn owner(&self) -> crate::client::owner::Owner {
        self.0.owner.clone()
    }

    /// Fires when the session, and so the leadership, is lost or closed.
    pub fn loss_signal(&self) -> LossSignal {
        self.0.loss_signal()
    }

    /// What to keep to resume this term after a restart (see [`ElectionService::resume`]).
    pub fn leader_key(&self) -> LeaderKey {
        LeaderKey {
            name: self.0.name.clone(),
            key: self.0.incarnation.key.clone(),
            create_revision: self.0.incarnation.create_revision,
            lease: self.0.session.lease(),
            token: self.0.token,
        }
    }

    /// Publishes a new value to observers, if this candidate still leads.
    ///
    /// # Errors
    /// [`Error::NotLeader`] when the entry is gone, [`Error::Released`] after resigning.
    pub async fn proclaim(&self, value: impl Into<Vec<u8>>) -> Result<(), Error> {
        if self.0.is_released() {
            return Err(Error::Released);
        }
        let me = &self.0.incarnation;
        let r = self
            .0
            .session
            .backend()
            .txn(Txn {
                when: vec![Compare::CreateRevisionEq(
                    KeyRange::key(me.key.clone()),
                    me.create_revision,
                )],
                then: vec![Op::Put {
                    key: me.key.clone(),
                    value: value.into(),
                    lease: self.0.session.lease(),
                }],
                otherwise: vec![],
            })
            .await
            .map_err(Error::store("proclaim"))?;
        if r.succeeded {
            Ok(())
        } else {
            Err(Error::NotLeader {
                name: self.0.name.clone(),
            })
        }
    }

    /// Steps down; the next candidate leads with a higher token. Fenced on this term's entry,
    /// so a retried resign cannot remove a later candidacy.
    ///
    /// # Errors
    /// [`Error::Released`] when already resigned, [`Error::LostBeforeRelease`] when the term
    /// had already ended (lease lost, entry deleted), or a store error (retry).
    pub async fn resign(&self) -> Result<(), Error> {
        self.0.release().await
    }
}

/// What the closure of [`Session::lead`] receives.
#[derive(Debug, Clone)]
pub struct LeaderContext {
    /// The term's token: stamp it on every request.
    pub token: FencingToken,
    /// Fires when leadership is lost; the closure should stop promptly.
    pub lost: LossSignal,
    /// The token with its fenced feedback: a resource's stale refusal reported here (by
    /// [`crate::client::transport`]'s helpers or client layer) cancels the work at once.
    pub owner: crate::client::owner::Owner,
}

impl Session {
    /// Campaigns, runs `work` while leading, waits for it to finish, then resigns
    /// (hoplock's `Elector.Lead`). `work` learns of a lost leadership through
    /// [`LeaderContext::lost`]; resignation waits for `work` to return, so work guarded by the
    /// leadership never overlaps the next leader's because of this helper.
    ///
    /// A resource that refuses the term's token as stale, reported through
    /// [`LeaderContext::owner`], proves a newer leader: `work` is dropped (cancelled) at once
    /// and `lead` returns [`Error::Fenced`].
    ///
    /// # Errors
    /// The campaign's errors, or [`Error::Fenced`]; a failed resignation is logged (the lease
    /// ends it anyway).
    pub async fn lead<F, Fut, T>(
        &self,
        name: &str,
        value: impl Into<Vec<u8>> + Send,
        work: F,
    ) -> Result<T, Error>
    where
        F: FnOnce(LeaderContext) -> Fut,
        Fut: Future<Output = T>,
    {
        let leadership = self.campaign(name, value).await?;
        let owner = leadership.owner();
        let mut fenced = owner.subscribe();
        let work = work(LeaderContext {
            token: leadership.token(),
            lost: leadership.loss_signal(),
            owner,
        });
        let out = tokio::select! {
            biased;
            mark = crate::client::owner::fenced(&mut fenced) => Err(Error::Fenced {
                name: name.to_owned(),
                mark,
            }),
            out = work => Ok(out),
        };
        if let Err(e) = leadership.resign().await {
            tracing::debug!(election = name, error = %e, "resign after lead failed");
        }
        out
    }
}

pub(crate) const KIND: &str = crate::client::session::EpochOf::Election.as_str();

fn epoch_value(key: &str) -> Vec<u8> {
    format!("E:{key}").into_bytes()
}

pub(crate) fn current(p: &Primitive) -> Txn {
    Txn {
        when: vec![],
        then: vec![
            Op::Range {
                range: KeyRange::prefix(p.queue()),
                sort: Some(SortByCreate::Ascending),
                limit: 1,
                max_create_revision: 0,
            },
            Op::get(p.epoch()),
        ],
        otherwise: vec![],
    }
}

/// `None`: a candidate is first in line but has not confirmed yet. Confirmed means: the epoch
/// names the first entry's key and was written at or after that entry's creation (an epoch
/// written before it belongs to an ended term of the same key).
pub(crate) fn read_term(r: &crate::client::backend::TxnResponse) -> Option<Observation> {
    let Some(first) = r.range(0).first() else {
        return Some(Observation::NoLeader);
    };
    let epoch = r.range(1).first()?;
    let confirmed =
        epoch.value == epoch_value(&first.key) && epoch.mod_revision >= first.create_revision;
    confirmed.then(|| {
        Observation::Leader(Term {
            token: token(epoch.mod_revision),
            value: first.value.clone(),
            key: first.key.clone(),
            lease: first.lease,
            owner: naming::owner_of(&first.key),
        })
    })
}

impl ElectionService for Session {
    async fn campaign(
        &self,
        name: &str,
        value: impl Into<Vec<u8>> + Send,
    ) -> Result<Leadership, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let claim = self.claim(&p.path, name, Role::Candidate).await?;
        let mut pending = Pending::new(self, p.entry(self, ""), claim);
        pending.register(&value.into()).await?;
        pending.wait_turn(&p, |_| true).await?;
        let token = pending
            .confirm(&p, &epoch_value(&pending.incarnation().key))
            .await?;
        Ok(Leadership(pending.finish(&p, token)?))
    }

    async fn leader(&self, name: &str) -> Result<Option<Term>, Error> {
        let p = Primitive::new(self, KIND, name)?;
        let r = self
            .backend()
            .txn(current(&p))
            .await
            .map_err(Error::store("read leader"))?;
        Ok(match read_term(&r) {
            Some(Observation::Leader(t)) => Some(t),
            _ => None,
        })
    }

    async fn observe(&self, name: &str) -> Result<Observer, Error> {
        let p = Primitive::new(self, KIND, name)?;
        Ok(Observer::start(self.clone(), p))
    }

    async fn resume(&self, leader: &LeaderKey) -> Result<Leadership, Error> {
        let p = Primitive::new(self, KIND, &leader.name)?;
        let not_leader = || Error::NotLeader {
            name: leader.name.clone(),
        };
        if !leader.key.starts_with(&p.queue()) || leader.lease != self.lease() {
            return Err(not_leader());
        }
        let claim = self.claim(&p.path, &leader.name, Role::Candidate).await?;
        let mut read = current(&p);
        read.when = vec![Compare::CreateRevisionEq(
            KeyRange::key(leader.key.clone()),
            leader.create_revision,
        )];
        read.then.push(Op::get(leader.key.clone()));
        let r = self
            .backend()
            .txn(read)
            .await
            .map_err(Error::store("resume leadership"))?;
        let current = match read_term(&r) {
            Some(Observation::Leader(t)) => t,
            _ => return Err(not_leader()),
        };
        let mine = r
            .range(2)
            .first()
            .is_some_and(|kv| kv.lease == self.lease());
        if !r.succeeded || !mine || current.key != leader.key || current.token != leader.token {
            return Err(not_leader());
        }
        let mut pending = Pending::new(self, leader.key.clone(), claim);
        pending.registered(leader.create_revision);
        Ok(Leadership(pending.finish(&p, leader.token)?))
    }
}

// Here rather than in `session`: a session knows nothing of elections.
impl crate::client::session::SessionOptions {
    /// Resumes the lease of `leader` and keeps its candidacy entry, so that
    /// [`crate::ElectionService::resume`] can take the term over with its token (etcd's
    /// `ResumeElection`). Only for a predecessor that is dead: a still-running one keeps
    /// believing it leads, with the same token, and the resource cannot tell them apart.
    pub fn resuming(mut self, leader: &LeaderKey) -> Self {
        self.lease = Some(leader.lease);
        self.keep = Some(leader.key.clone());
        self
    }
}
