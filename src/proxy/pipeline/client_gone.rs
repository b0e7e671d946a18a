//! What becomes of a request's upstream exchange when its client hangs up.
//!
//! Why: hyper drops a request's future when its client connection goes away (or an HTTP/2
//! client resets its stream). Two kinds of exchange must outlive that:
//! - one whose request went to the upstream whole: dropping it would also give back its drain
//!   ticket while the upstream may still be applying the request. A zombie that sends its
//!   write and hangs up at once would escape a newer owner's drain, whose write could then
//!   reach the upstream before the zombie's was applied. It lives on with its ticket and ends
//!   as any other: when the upstream answers (or its response timeout runs out; at most
//!   [`ABORT_HOLD`]).
//! - one on an HTTP/2 upstream whose body is still streaming: dropped, hyper resets the
//!   upstream stream with `CANCEL`, which a tonic upstream reads as the clean end of a client
//!   stream (it would apply the partial stream). Kept, its body fails (the client is gone) and
//!   hyper resets the stream with `INTERNAL_ERROR` (see `body::BodyFailed`), as for a drain's
//!   abort; at most [`ABORT_HOLD`] if the upstream never lets the body be polled again.
//!
//! An HTTP/1.1 exchange whose body is still streaming is dropped: its upstream connection
//! closes before the body's end, and the upstream never sees a complete request. So is an
//! unguarded request the upstream has whole: nothing waits for it, and the reset cancels the
//! upstream's work for a client that is gone. The HTTP/1.1 fast path follows the same rules
//! in the connection's own task (`fast::send`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::forward::ABORT_HOLD;
use super::request_body::Delivered;
use super::response_body::InflightCount;
use crate::fence::drain::Ticket;

/// The exchange's future, with what must live as long as it does once the request went out
/// whole: the response half of its drain ticket and its in-flight count.
pub(super) struct Outliving<F: Future<Output: Send> + Send + 'static> {
    call: Option<Pin<Box<F>>>,
    delivered: Option<Delivered>,
    /// HTTP/2 upstream: kept until its body failed even if it did not go out whole.
    multiplexed: bool,
    kept: Option<(Option<Ticket>, InflightCount)>,
}

impl<F: Future<Output: Send> + Send + 'static> Outliving<F> {
    /// `delivered`: whether the request went out whole (tracked for guarded requests and
    /// HTTP/2 upstreams). `multiplexed`: the upstream is HTTP/2.
    pub(super) fn new(
        call: Pin<Box<F>>,
        delivered: Option<Delivered>,
        multiplexed: bool,
        ticket: Option<Ticket>,
        inflight: InflightCount,
    ) -> Self {
        Self {
            call: Some(call),
            delivered,
            multiplexed,
            kept: Some((ticket, inflight)),
        }
    }

    /// The ticket and in-flight count back, once the exchange ended.
    pub(super) fn into_kept(mut self) -> (Option<Ticket>, InflightCount) {
        self.kept
            .take()
            .expect("an exchange keeps its ticket until it is taken")
    }
}

impl<F: Future<Output: Send> + Send + 'static> Future for Outliving<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let call = this
            .call
            .as_mut()
            .expect("an exchange is not polled after it ended");
        let out = std::task::ready!(call.as_mut().poll(cx));
        this.call = None;
        Poll::Ready(out)
    }
}

impl<F: Future<Output: Send> + Send + 'static> Drop for Outliving<F> {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return; // it ended
        };
        let whole = self.delivered.as_ref().is_some_and(Delivered::is_whole);
        let guarded = self
            .kept
            .as_ref()
            .is_some_and(|(ticket, _)| ticket.is_some());
        // Kept: a guarded request the upstream has whole (a drain must wait for its answer),
        // and an HTTP/2 body still streaming (so that it fails, never cancels). Dropped: an
        // HTTP/1.1 body still streaming (its connection closes before the body's end), and
        // an unguarded request the upstream has whole (the reset cancels the upstream's
        // work, as the client asked).
        if !(whole && guarded || !whole && self.multiplexed) {
            return;
        }
        // No runtime: the process is stopping, and nothing waits for the ticket any more.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let kept = self.kept.take();
        tracing::debug!(
            sent_whole = whole,
            "the client went away during its upstream exchange; the exchange goes on"
        );
        rt.spawn(async move {
            // Bounded by the exchange's own response timeout, and by ABORT_HOLD whatever the
            // route says (`response_timeout_ms = 0`): no longer than a drain waits for it,
            // since a client that is gone no longer counts against `max_connections`.
            let _ = tokio::time::timeout(ABORT_HOLD, call).await;
            drop(kept);
        });
    }
}
