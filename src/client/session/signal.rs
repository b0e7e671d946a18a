//! Loss signals: how a holder learns that its ownership ended.

use std::sync::Arc;

use tokio::sync::watch;

use super::liveness::Liveness;
use super::SessionState;

/// Why a [`LossSignal`] fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Loss {
    /// The session's lease is gone (expired, revoked elsewhere, or unconfirmed past its local
    /// deadline).
    SessionLost,
    /// The session was closed by its owner.
    SessionClosed,
    /// The grant's queue entry was deleted while the session's lease lived (by an operator,
    /// by a `Session::release` of that incarnation, or by a session resumed on the same
    /// lease): the grant no longer owns anything.
    EntryDeleted,
    /// A resource refused the grant's token below `mark` ([`crate::client::owner::Owner::fenced`]):
    /// a newer owner exists.
    Fenced {
        /// The mark that refused the token.
        mark: u64,
    },
}

/// Fires when ownership ends: the session is lost or closed, or (for a grant's signal) the
/// grant's queue entry disappears or a resource refused its token as stale. Best effort and possibly late; the fencing token checked
/// at the resource is what keeps data safe.
#[derive(Clone)]
pub struct LossSignal {
    liveness: Arc<Liveness>,
    session: watch::Receiver<SessionState>,
    entry: Option<watch::Receiver<bool>>,
    fenced: Option<watch::Receiver<Option<u64>>>,
}

impl std::fmt::Debug for LossSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LossSignal")
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl LossSignal {
    pub(crate) fn new(
        liveness: Arc<Liveness>,
        entry: Option<watch::Receiver<bool>>,
        fenced: Option<watch::Receiver<Option<u64>>>,
    ) -> Self {
        Self {
            session: liveness.subscribe(),
            liveness,
            entry,
            fenced,
        }
    }

    /// Resolves once ownership has ended, saying why.
    pub async fn wait(&mut self) -> Loss {
        let Self {
            liveness,
            session,
            entry,
            fenced,
        } = self;
        let refused = async {
            match fenced {
                Some(rx) => crate::client::owner::fenced(rx).await,
                None => std::future::pending().await,
            }
        };
        let session_ended = async {
            match session.wait_for(|s| *s != SessionState::Alive).await {
                Ok(s) if *s == SessionState::Closed => Loss::SessionClosed,
                // Lost, or the session and its keepalive are gone entirely.
                _ => Loss::SessionLost,
            }
        };
        let entry_deleted = async {
            if let Some(rx) = entry {
                if rx.wait_for(|deleted| *deleted).await.is_ok() {
                    return;
                }
            }
            // No entry to follow, or its watcher stopped (grant released): never fires.
            std::future::pending().await
        };
        // Biased: when both ended, the session's end is the better explanation (an entry
        // watcher marks the session lost before it reports a deletion caused by that).
        // A refusal is proof of a newer owner, the most precise explanation there is.
        tokio::select! {
            biased;
            mark = refused => Loss::Fenced { mark },
            loss = session_ended => loss,
            () = entry_deleted => match liveness.state() {
                SessionState::Alive => Loss::EntryDeleted,
                SessionState::Closed => Loss::SessionClosed,
                SessionState::Lost => Loss::SessionLost,
            },
        }
    }

    /// Whether the session's lease, if lost, was dropped by the store before it could have
    /// expired: revoked by someone.
    #[cfg(feature = "metrics")]
    pub(crate) fn revoked(&self) -> bool {
        self.liveness.metrics.revoked()
    }

    /// Whether it has fired. Also checks the local lease deadline, so a holder that was
    /// frozen past it reports lost at once, before any background task has run.
    pub fn is_lost(&self) -> bool {
        self.liveness.state() != SessionState::Alive
            || self.entry.as_ref().is_some_and(|e| *e.borrow())
            || self.fenced.as_ref().is_some_and(|f| f.borrow().is_some())
    }
}
