//! A request in flight, as a body carries it: the drain ticket that keeps the request counted,
//! and the abort that fails the body at once. One implementation for the proxy's bodies and
//! the layer's (see [`crate::fence::drain`]).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};

use crate::fence::drain::{AbortWait, Ticket};

/// The error of a fenced body: the inner body's, or [`Aborted`].
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// Why a fenced body failed on its own: a newer owner's drain aborted its request.
#[derive(Debug, thiserror::Error)]
#[error(
    "aborted: a newer owner's token advanced the mark and this request outlasted the drain time"
)]
pub struct Aborted;

/// A drain ticket and its abort signal, carried by a body.
pub struct Flight {
    ticket: Ticket,
    abort: AbortWait,
}

impl std::fmt::Debug for Flight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flight").finish_non_exhaustive()
    }
}

impl Flight {
    /// The flight of `ticket`, if the request has one (guarded and admitted).
    pub fn of(ticket: Option<Ticket>) -> Option<Self> {
        ticket.map(|ticket| Self {
            ticket,
            abort: AbortWait::default(),
        })
    }

    /// Whether a newer owner's drain aborted the request.
    pub fn is_aborted(&self) -> bool {
        self.ticket.generation().is_aborted()
    }
}

/// Polls `inner`, failing with [`Aborted`] once the flight's generation is aborted: a body
/// that waits on its peer (a frozen client mid-body) is woken by the abort itself. The
/// ticket is given back as soon as the body ends.
pub fn poll_fenced<B>(
    inner: Pin<&mut B>,
    flight: &mut Option<Flight>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BodyError>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BodyError>,
{
    if flight
        .as_ref()
        .is_some_and(|f| f.ticket.generation().is_aborted())
    {
        return Poll::Ready(Some(Err(Box::new(Aborted))));
    }
    match inner.poll_frame(cx) {
        Poll::Ready(r) => {
            if r.is_none() {
                // The body is over: this half of the exchange no longer counts.
                *flight = None;
            }
            Poll::Ready(r.map(|r| r.map_err(Into::into)))
        }
        Poll::Pending => {
            if flight
                .as_mut()
                .is_some_and(|f| f.abort.poll(f.ticket.generation(), cx).is_ready())
            {
                return Poll::Ready(Some(Err(Box::new(Aborted))));
            }
            Poll::Pending
        }
    }
}
