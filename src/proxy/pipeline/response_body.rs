//! The upstream's response body on its way back to the client.

use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use prometheus::IntGauge;

use super::request_body::Delivered;
use super::upstream::http1::Held;
use crate::fence::flight::{poll_fenced, BodyError, Flight};

/// Counts a request in `palisade_inflight_requests` until dropped.
pub(super) struct InflightCount(IntGauge);

impl InflightCount {
    pub(super) fn new(g: &IntGauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for InflightCount {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The upstream's response body, streamed frame by frame (trailers included), which keeps the
/// request counted as in flight until it ends or the client goes away.
///
/// From an HTTP/1.1 upstream it also drives the upstream connection the body arrives on
/// (`Held`), and gives that connection back for the next request once the body is over.
pub(crate) struct ResponseBody {
    pub(super) inner: Incoming,
    pub(super) _inflight: InflightCount,
    pub(super) flight: Option<Flight>,
    pub(super) held: Option<Held>,
    /// Whether the request went upstream whole (see [`Delivered`]).
    pub(super) delivered: Option<Delivered>,
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // hyper stops polling a body whose `is_end_stream` is true (a Content-Length body
        // whose last byte arrived, an empty body): it is over all the same.
        if self.inner.is_end_stream() {
            if let Some(h) = &mut self.held {
                h.release();
            }
        }
    }
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        // A request that went upstream whole was not cut when the drain aborted it (the
        // upstream may have applied it): its answer is relayed in full, and its ticket given
        // back at once, since the upstream has answered.
        if this.flight.as_ref().is_some_and(Flight::is_aborted)
            && this.delivered.as_ref().is_some_and(Delivered::is_whole)
        {
            this.flight = None;
        }
        let mut r = poll_fenced(Pin::new(&mut this.inner), &mut this.flight, cx);
        if let Some(held) = &mut this.held {
            if r.is_pending() {
                // The body's bytes arrive through the connection's I/O, driven here.
                held.drive(cx);
                r = poll_fenced(Pin::new(&mut this.inner), &mut this.flight, cx);
            }
            match &r {
                Poll::Ready(None) => held.release(),
                // Failed, or aborted by a drain: the connection is closed, never reused.
                Poll::Ready(Some(Err(_))) => this.held = None,
                _ => {}
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
