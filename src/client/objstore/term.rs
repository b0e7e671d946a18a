//! A won term: its loss signal, its renewals and its release.
//!
//! One task per term owns the record's current version. Renewals, the release and the
//! recognition of our own lost-answer writes all go through it, so no two of our writes race
//! each other on the record.

use std::sync::Arc;

use object_store::path::Path;
use object_store::ObjectStore;
use tokio::sync::{broadcast, oneshot, watch};
use tokio::time::Instant;

use super::error::Error;
use super::events::{Event, LossReason};
use super::options::Timing;
use super::record::{self, timed, Stored, Write};
use super::Claim;
use crate::token::FencingToken;

/// What every term of one election shares with its elector.
pub(super) struct Shared {
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) path: Path,
    pub(super) name: String,
    pub(super) timing: Timing,
    pub(super) events: broadcast::Sender<Event>,
    /// When the campaign started, for the time to acquire.
    #[cfg(feature = "metrics")]
    pub(super) asked: Instant,
}

impl Shared {
    fn emit(&self, event: Event) {
        // No subscriber is fine.
        let _ = self.events.send(event);
    }
}

/// A write that won the record, and when it was sent.
pub(super) struct Won {
    pub(super) stored: Stored,
    pub(super) token: FencingToken,
    /// Taken just before the winning write was sent: the term's clock starts here.
    pub(super) sent: Instant,
}

#[derive(Debug, Clone, Copy)]
struct TermState {
    /// Act only before this: `ttl - margin` after the start of the last successful write.
    deadline: Instant,
    /// Set once, never cleared.
    ended: Option<LossReason>,
}

/// Fires when a term ends; cheap to clone and to check.
///
/// It does not depend on the renewal task being scheduled: [`LossSignal::is_lost`] and
/// [`LossSignal::wait`] also compare the deadline with the monotonic clock, so a process
/// that wakes from a pause longer than the TTL sees the loss before it does anything else.
/// Best effort all the same: the fencing token checked at the resource is what keeps data
/// safe from a leader that acts after its term.
#[derive(Debug, Clone)]
pub struct LossSignal(watch::Receiver<TermState>);

impl LossSignal {
    /// Resolves when the term has ended, saying why.
    pub async fn wait(&mut self) -> LossReason {
        loop {
            let s = *self.0.borrow_and_update();
            if let Some(reason) = s.ended {
                return reason;
            }
            if Instant::now() >= s.deadline {
                return LossReason::Expired;
            }
            tokio::select! {
                changed = self.0.changed() => if changed.is_err() {
                    // The task is gone (its runtime stopped): nothing renews any more.
                    tokio::time::sleep_until(s.deadline).await;
                    return self.0.borrow().ended.unwrap_or(LossReason::Expired);
                },
                () = tokio::time::sleep_until(s.deadline) => return LossReason::Expired,
            }
        }
    }

    /// Whether the term has ended (including: its deadline has passed right now).
    pub fn is_lost(&self) -> bool {
        let s = *self.0.borrow();
        s.ended.is_some() || Instant::now() >= s.deadline
    }

    /// The instant the leader must stop acting by unless a renewal succeeds first. Useful as
    /// a deadline for requests made under the term's token.
    pub fn deadline(&self) -> Instant {
        self.0.borrow().deadline
    }
}

/// What the closure of [`Elector::lead`](super::Elector::lead) receives.
#[derive(Debug, Clone)]
pub struct LeaderContext {
    /// The term's token (the record's generation): stamp it on every request.
    pub token: FencingToken,
    /// Fires when the term ends; the closure should stop promptly.
    pub lost: LossSignal,
}

type Reply = oneshot::Sender<Result<(), Error>>;

/// Leading one election. Dropping it releases the term in the background (prefer
/// [`Leadership::release`], which reports the outcome).
#[derive(Debug)]
pub struct Leadership {
    name: String,
    token: FencingToken,
    lost: LossSignal,
    release: Option<oneshot::Sender<Reply>>,
}

impl Leadership {
    /// The term's token: the record's generation, higher than every earlier term's.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Fires when the term ends.
    pub fn loss_signal(&self) -> LossSignal {
        self.lost.clone()
    }

    /// The token and the loss signal, as [`Elector::lead`](super::Elector::lead) hands them.
    pub fn context(&self) -> LeaderContext {
        LeaderContext {
            token: self.token,
            lost: self.lost.clone(),
        }
    }

    /// Ends the term: stops acting at once, then rewrites the record as released (same
    /// generation, conditional on the term's version), so a follower may take over without
    /// waiting for the TTL.
    ///
    /// # Errors
    /// [`Error::Released`] when called twice; [`Error::LostBeforeRelease`] when the term had
    /// already ended (the record is still marked released if it names this term); a store
    /// error or timeout when the release write failed (followers then take over after the TTL).
    pub async fn release(&mut self) -> Result<(), Error> {
        let Some(tx) = self.release.take() else {
            return Err(Error::Released);
        };
        let (reply, answer) = oneshot::channel();
        if tx.send(reply).is_err() {
            return Err(Error::Released);
        }
        answer.await.unwrap_or(Err(Error::Released))
    }
}

/// Starts the renewal task of a term just won.
pub(super) fn start(shared: Arc<Shared>, won: Won, claim: Claim) -> Leadership {
    let t = shared.timing;
    let state = TermState {
        deadline: won.sent + t.acting(),
        ended: None,
    };
    let (state_tx, state_rx) = watch::channel(state);
    let (release_tx, release_rx) = oneshot::channel();
    shared.emit(Event::Acquired {
        name: shared.name.clone(),
        token: won.token,
    });
    let leadership = Leadership {
        name: shared.name.clone(),
        token: won.token,
        lost: LossSignal(state_rx),
        release: Some(release_tx),
    };
    #[cfg(feature = "metrics")]
    crate::client::metrics::describe();
    #[cfg(feature = "metrics")]
    let metrics = Some(crate::client::metrics::Owned::new(
        &shared.name,
        crate::client::metrics::Kind::Leader,
        shared.asked,
    ));
    let term = Term {
        shared,
        token: won.token,
        held: won.stored,
        state: state_tx,
        claim: Some(claim),
        #[cfg(feature = "metrics")]
        metrics,
    };
    tokio::spawn(term.run(won.sent, release_rx));
    leadership
}

struct Term {
    shared: Arc<Shared>,
    token: FencingToken,
    /// The record as we last wrote it, and its version.
    held: Stored,
    state: watch::Sender<TermState>,
    /// This elector's candidacy for the name: given up before `release` returns, so the
    /// caller may campaign again at once.
    claim: Option<Claim>,
    /// The term's metrics, ended with the term (dropped unended: reason `error`).
    #[cfg(feature = "metrics")]
    metrics: Option<crate::client::metrics::Owned>,
}

/// How a renewal attempt went.
enum Renewal {
    Renewed,
    /// The record names another term.
    Displaced,
    /// Unknown (store error, timeout): try again.
    Failed,
}

impl Term {
    fn deadline(&self) -> Instant {
        self.state.borrow().deadline
    }

    /// The term's end, for its metrics: displaced means another candidate took the record.
    fn ended_for_metrics(&mut self, reason: LossReason) {
        #[cfg(feature = "metrics")]
        if let Some(m) = self.metrics.take() {
            use crate::client::metrics::Reason;
            m.end(match reason {
                LossReason::Expired => Reason::Expired,
                LossReason::Displaced => Reason::Revoked,
                LossReason::Released => Reason::Closed,
            });
        }
        #[cfg(not(feature = "metrics"))]
        let _ = reason;
    }

    async fn run(mut self, mut last_sent: Instant, mut release: oneshot::Receiver<Reply>) {
        let t = self.shared.timing;
        let mut next = last_sent + t.renew_every;
        let reason = loop {
            let deadline = self.deadline();
            tokio::select! {
                biased;
                asked = &mut release => return self.finish(asked.ok(), None).await,
                () = tokio::time::sleep_until(next.min(deadline)) => {}
            }
            let sent = Instant::now();
            if sent >= deadline {
                break LossReason::Expired;
            }
            let outcome = self.renew(deadline - sent).await;
            // An answer that comes after the deadline does not revive the term: whoever
            // watched the signal has already stopped.
            if Instant::now() >= deadline {
                break LossReason::Expired;
            }
            match outcome {
                Renewal::Renewed => {
                    last_sent = sent;
                    self.state.send_modify(|s| s.deadline = sent + t.acting());
                    self.shared.emit(Event::Renewed {
                        name: self.shared.name.clone(),
                        token: self.token,
                    });
                    next = last_sent + t.renew_every;
                }
                Renewal::Displaced => break LossReason::Displaced,
                // Retry soon, but not in a tight loop against a failing store.
                Renewal::Failed => next = Instant::now() + (t.renew_every / 4).min(t.poll_every),
            }
        };
        self.state.send_modify(|s| s.ended = Some(reason));
        self.ended_for_metrics(reason);
        self.shared.emit(Event::Lost {
            name: self.shared.name.clone(),
            token: self.token,
            reason,
        });
        // Wait for the release (or the drop) of the leadership, then mark the record
        // released if it still names this term.
        let asked = release.await.ok();
        self.finish(asked, Some(reason)).await;
    }

    /// One conditional rewrite of our record, bounded by `left`.
    async fn renew(&mut self, left: std::time::Duration) -> Renewal {
        let within = self.shared.timing.request_timeout.min(left);
        match self.write(false, within).await {
            Ok(true) => Renewal::Renewed,
            Ok(false) => Renewal::Displaced,
            Err(e) => {
                tracing::debug!(election = %self.shared.name, error = %e, "renewal failed");
                Renewal::Failed
            }
        }
    }

    /// Rewrites our record (`released` or not) on the version we hold. `Ok(false)`: the
    /// record names another term. A conflict is checked with a read first: when an earlier
    /// write of ours landed but its answer was lost, the record still names our term, and we
    /// adopt its version (without extending the deadline: we do not know when that write
    /// started) and write again.
    async fn write(&mut self, released: bool, within: std::time::Duration) -> Result<bool, Error> {
        let s = &self.shared;
        for _ in 0..2 {
            let record = self.held.record.rewrite(released);
            let op = "rewrite the lease record";
            let put = record::replace(&*s.store, &s.path, &record, &self.held.version);
            match timed(op, within, put).await? {
                Write::Done(version) => {
                    self.held = Stored { record, version };
                    return Ok(true);
                }
                Write::Conflict => {
                    let read = timed(op, within, record::read(&*s.store, &s.path)).await?;
                    match read {
                        Some(now) if self.is_ours(&now) => self.held = now,
                        _ => return Ok(false),
                    }
                }
            }
        }
        Ok(false)
    }

    fn is_ours(&self, stored: &Stored) -> bool {
        let (r, mine) = (&stored.record, &self.held.record);
        r.nonce == mine.nonce && r.generation == mine.generation && !r.released
    }

    /// Ends the term (`ended`: how it already ended, if it did) and answers `asked`.
    async fn finish(mut self, asked: Option<Reply>, ended: Option<LossReason>) {
        if ended.is_none() {
            // Stop acting before the release write is even sent.
            self.state
                .send_modify(|s| s.ended = Some(LossReason::Released));
            self.ended_for_metrics(LossReason::Released);
        }
        let name = self.shared.name.clone();
        let within = self.shared.timing.request_timeout;
        let result = match ended {
            // The record names another term: nothing of ours to release.
            Some(LossReason::Displaced) => Ok(false),
            _ => self.write(true, within).await,
        };
        let answer = match (ended, result) {
            (Some(reason), _) => Err(Error::LostBeforeRelease { name, reason }),
            (None, Ok(true)) => {
                self.shared.emit(Event::Released {
                    name,
                    token: self.token,
                });
                Ok(())
            }
            (None, Ok(false)) => Err(Error::LostBeforeRelease {
                name,
                reason: LossReason::Displaced,
            }),
            (None, Err(e)) => Err(e),
        };
        drop(self.claim.take());
        match asked {
            Some(reply) => {
                let _ = reply.send(answer);
            }
            None => {
                if let Err(e) = answer {
                    tracing::debug!(election = %self.shared.name, error = %e, "release on drop");
                }
            }
        }
    }
}
