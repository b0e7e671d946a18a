//! Leader election with fencing tokens.
//!
//! Candidates queue under `P/q/`; the oldest entry leads once it has bumped the election's
//! epoch (value `E:<its key>`), and [`ElectionService::campaign`] returns the [`Leadership`]
//! *with* the token of the term it won. (Looking the token up afterwards would be wrong: by
//! then `leader()` may already show the next term.)
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

use std::future::Future;

use tokio::sync::mpsc;

use crate::error::Error;
use crate::provider::{Compare, KeyRange, Op, SortByCreate, Txn};
use crate::queue::{token, Grant, Pending, Primitive};
use crate::session::{Incarnation, LossSignal, Role, Session};
use crate::token::FencingToken;

/// Election operations (disco's `election.Service`): implemented by [`Session`].
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

    /// Follows the election: every new term (in increasing token order), every proclaimed
    /// value, and "no leader" when the last candidate leaves.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; failures while observing arrive through the [`Observer`].
    fn observe(&self, name: &str) -> impl Future<Output = Result<Observer, Error>> + Send;
}

/// One term of leadership as seen by anyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    /// The term's fencing token.
    pub token: FencingToken,
    /// The leader's current value (as proclaimed).
    pub value: Vec<u8>,
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

    /// Fires when the session, and so the leadership, is lost or closed.
    pub fn loss_signal(&self) -> LossSignal {
        self.0.loss_signal()
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
    /// [`Error::Released`] when already resigned, or a store error (retry).
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
}

impl Session {
    /// Campaigns, runs `work` while leading, waits for it to finish, then resigns
    /// (hoplock's `Elector.Lead`). `work` learns of a lost leadership through
    /// [`LeaderContext::lost`]; resignation waits for `work` to return, so work guarded by the
    /// leadership never overlaps the next leader's because of this helper.
    ///
    /// # Errors
    /// The campaign's errors; a failed resignation is logged (the lease ends it anyway).
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
        let out = work(LeaderContext {
            token: leadership.token(),
            lost: leadership.loss_signal(),
        })
        .await;
        if let Err(e) = leadership.resign().await {
            tracing::debug!(election = name, error = %e, "resign after lead failed");
        }
        Ok(out)
    }
}

/// A stream of [`Observation`]s; stops its background watch when dropped.
pub struct Observer {
    rx: mpsc::Receiver<Result<Observation, Error>>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").finish_non_exhaustive()
    }
}

impl Observer {
    /// The next observation; `None` once observing stopped after an error it reported.
    pub async fn next(&mut self) -> Option<Result<Observation, Error>> {
        self.rx.recv().await
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const KIND: &str = "election";

fn epoch_value(key: &str) -> Vec<u8> {
    format!("E:{key}").into_bytes()
}

fn current(p: &Primitive) -> Txn {
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

/// `None`: a candidate is first in line but has not confirmed yet.
fn read_term(r: &crate::provider::TxnResponse) -> Option<Observation> {
    let Some(first) = r.range(0).first() else {
        return Some(Observation::NoLeader);
    };
    let epoch = r.range(1).first()?;
    (epoch.value == epoch_value(&first.key)).then(|| {
        Observation::Leader(Term {
            token: token(epoch.mod_revision),
            value: first.value.clone(),
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
        let claim = self.claim(&p.path, name, Role::Candidate)?;
        let mut pending = Pending::new(self, p.entry(self, ""), claim);
        pending.register(&value.into()).await?;
        pending.wait_turn(&p, |_| true).await?;
        let token = pending
            .confirm(&p, &epoch_value(&pending.incarnation().key))
            .await?;
        Ok(Leadership(pending.finish(&p, token)))
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
        let (tx, rx) = mpsc::channel(16);
        let session = self.clone();
        let task = tokio::spawn(async move {
            let mut last: Option<Observation> = None;
            let mut highest = 0u64;
            loop {
                let r = match session.backend().txn(current(&p)).await {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = tx.send(Err(Error::store("observe")(e))).await;
                        return;
                    }
                };
                if let Some(obs) = read_term(&r) {
                    let fresh = match &obs {
                        // Terms only move forward; a proclaim keeps the token and changes the value.
                        Observation::Leader(t) => {
                            t.token.get() > highest
                                || (t.token.get() == highest && last.as_ref() != Some(&obs))
                        }
                        Observation::NoLeader => {
                            last.as_ref().is_some_and(|l| *l != Observation::NoLeader)
                                || last.is_none()
                        }
                    };
                    if fresh {
                        if let Observation::Leader(t) = &obs {
                            highest = t.token.get();
                        }
                        if tx.send(Ok(obs.clone())).await.is_err() {
                            return;
                        }
                        last = Some(obs);
                    }
                }
                let mut events = match session
                    .backend()
                    .watch(KeyRange::prefix(format!("{}/", p.path)), r.revision + 1)
                    .await
                {
                    Ok(ev) => ev,
                    Err(_) => {
                        // Re-created after a pause; every read above starts from the present.
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                };
                // Any change under the election (or a broken watch) means: read again.
                let _ = events.next().await;
            }
        });
        Ok(Observer { rx, task })
    }
}
