//! What an elector reports: the event stream and the reasons a term ends.

use tokio::sync::broadcast;

use crate::token::FencingToken;

/// Why a term ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReason {
    /// Another candidate replaced the record: a renewal's `If-Match` failed and the record no
    /// longer names this term. A newer term (with a higher token) exists or is about to.
    Displaced,
    /// No renewal succeeded within `ttl - margin` of the start of the last successful write:
    /// the store was unreachable or slow, or this process was paused (the monotonic clock
    /// runs on through `SIGSTOP`, a suspended VM or a long GC pause). Followers may take
    /// over from `ttl` on.
    Expired,
    /// The leader released the term itself.
    Released,
}

impl std::fmt::Display for LossReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LossReason::Displaced => "displaced by another candidate",
            LossReason::Expired => "not renewed in time",
            LossReason::Released => "released",
        })
    }
}

/// One thing that happened to one of this elector's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// This elector won `name` with `token` (the record's generation).
    Acquired {
        /// The election's name.
        name: String,
        /// The term's token.
        token: FencingToken,
    },
    /// The leader rewrote its record; it may act until `ttl - margin` after this write began.
    Renewed {
        /// The election's name.
        name: String,
        /// The term's token.
        token: FencingToken,
    },
    /// The term ended without being released (see [`LossReason`]).
    Lost {
        /// The election's name.
        name: String,
        /// The term's token.
        token: FencingToken,
        /// Why it ended.
        reason: LossReason,
    },
    /// The leader released the term: the record stays, marked released with the same
    /// generation, and the next leader takes generation + 1.
    Released {
        /// The election's name.
        name: String,
        /// The term's token.
        token: FencingToken,
    },
    /// This subscriber read too slowly and `missed` older events were dropped. Terms still
    /// end through their [`LossSignal`](super::LossSignal), which never drops anything.
    Lagged {
        /// How many events were dropped.
        missed: u64,
    },
}

/// The events of one [`Elector`](super::Elector) (all its names), from the moment of
/// [`Elector::events`](super::Elector::events) on.
#[derive(Debug)]
pub struct Events(pub(super) broadcast::Receiver<Event>);

impl Events {
    /// The next event; `None` once the elector (every clone of it and every term it started)
    /// is gone.
    pub async fn next(&mut self) -> Option<Event> {
        match self.0.recv().await {
            Ok(event) => Some(event),
            Err(broadcast::error::RecvError::Lagged(missed)) => Some(Event::Lagged { missed }),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}
