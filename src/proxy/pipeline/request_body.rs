//! The client's request body on its way upstream: drain aborts, `max_body_bytes` counted as
//! it streams, the token stripped from trailers, and what tells whether it went up whole.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use bytes::Bytes;
use http::HeaderName;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use super::request::Peeked;
use crate::fence::drain::Ticket;
use crate::fence::flight::{poll_fenced, BodyError, Flight};
use crate::proxy::error_chain::error_chain;

/// Whether a guarded request's body has been handed to the upstream connection whole: set
/// when hyper sees its end (for a request without a body, when hyper starts to write its
/// head). From then on an abort cannot keep the upstream from applying the request, so a
/// drain waits for its answer instead (see `forward::abortable`).
#[derive(Debug, Clone, Default)]
pub(super) struct Delivered(Arc<AtomicBool>);

impl Delivered {
    pub(super) fn is_whole(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Whether hyper has started to write a bodiless request's head yet, and the means to stop
/// it from ever doing so whole: a request stuck before that point (hyper can leave one in the
/// queue of an HTTP/2 connection that a GOAWAY is closing, and never answer it) is withdrawn:
/// a read is then sent again, a write answered 502 (see `forward`).
#[derive(Debug, Clone, Default)]
pub(super) struct HeadGate(Arc<AtomicU8>);

/// [`HeadGate`]'s states.
const HEAD_WAITING: u8 = 0;
const HEAD_SENT: u8 = 1;
const HEAD_WITHDRAWN: u8 = 2;

impl HeadGate {
    /// Withdraws the request if hyper has not started its head: true when withdrawn (its
    /// head is then never sent whole: the body fails first).
    pub(super) fn withdraw(&self) -> bool {
        self.leave_waiting(HEAD_WITHDRAWN).is_ok()
    }

    /// hyper starts the head: false if the request was withdrawn first.
    fn pass(&self) -> bool {
        match self.leave_waiting(HEAD_SENT) {
            Ok(_) => true,
            Err(state) => state == HEAD_SENT,
        }
    }

    /// Moves from waiting to `to`, once: the state found instead when another move won.
    fn leave_waiting(&self, to: u8) -> Result<u8, u8> {
        self.0
            .compare_exchange(HEAD_WAITING, to, Ordering::AcqRel, Ordering::Acquire)
    }
}

/// The error of a body whose request was withdrawn before its head went out.
#[derive(Debug)]
struct Withdrawn;

impl std::fmt::Display for Withdrawn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("request withdrawn before hyper started its head")
    }
}

impl std::error::Error for Withdrawn {}

/// Whether the client's request body failed (the client went away mid-body, reset its stream
/// or cancelled its call, or sent a body its framing cannot parse): an upstream failure that
/// follows is the client's doing, not the upstream's.
#[derive(Debug, Clone, Default)]
pub(super) struct ClientFailed(Arc<AtomicU8>);

/// [`ClientFailed`]'s states.
const BODY_OK: u8 = 0;
const BODY_GONE: u8 = 1;
const BODY_MALFORMED: u8 = 2;

impl ClientFailed {
    pub(super) fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire) != BODY_OK
    }

    /// The body's framing was broken (a bad chunk size line, say) by a client that is still
    /// there to be told: 400, as for a malformed head.
    pub(super) fn is_malformed(&self) -> bool {
        self.0.load(Ordering::Acquire) == BODY_MALFORMED
    }

    fn set(&self, e: &(dyn std::error::Error + 'static)) {
        let state = if malformed(e) {
            BODY_MALFORMED
        } else {
            BODY_GONE
        };
        self.0.store(state, Ordering::Release);
    }
}

/// Whether a body's error says its bytes could not be parsed (hyper's chunked decoder reports
/// `InvalidInput`/`InvalidData`), rather than that they stopped coming (`UnexpectedEof`, a
/// reset, a cancelled stream). TLS reports every failure of the session (a fatal alert from a
/// client going away included) as `InvalidData` around a rustls error: that is not framing.
fn malformed(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            let tls = io
                .get_ref()
                .is_some_and(|inner| inner.is::<tokio_rustls::rustls::Error>());
            return !tls
                && matches!(
                    io.kind(),
                    std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData
                );
        }
        cur = c.source();
    }
    false
}

/// The client's request body on its way upstream. With `strip_token`, the token is removed
/// from request trailers too (HTTP/2 and chunked HTTP/1.1 can carry it there), in both of its
/// spellings (`x-fencing-token` and the `x_fencing_token` that CGI-style servers merge with it).
///
/// On a guarded route it also carries the request's drain ticket: when a newer owner's drain
/// aborts the request, the body fails at once, so the upstream never receives its end (HTTP/1.1:
/// the connection is closed before the body is complete; HTTP/2: the stream is reset).
pub(crate) struct RequestBody {
    /// Read before admission (`peek`): sent before `inner`'s frames.
    first: Option<Peeked>,
    /// `None`: no body (a request sent again, see [`RequestBody::none`]).
    inner: Option<Incoming>,
    strip: Option<HeaderName>,
    flight: Option<Flight>,
    limit: Option<BodyLimit>,
    delivered: Option<Delivered>,
    client_failed: Option<ClientFailed>,
    /// For a bodiless request that may be sent again (`forward`).
    gate: Option<HeadGate>,
}

impl RequestBody {
    pub(super) fn new(
        (first, inner): (Option<Peeked>, Incoming),
        strip: Option<HeaderName>,
        ticket: Option<Ticket>,
        limit: Option<BodyLimit>,
        (delivered, client_failed): (Option<Delivered>, Option<ClientFailed>),
    ) -> Self {
        Self {
            first,
            inner: Some(inner),
            strip,
            flight: Flight::of(ticket),
            limit,
            delivered,
            client_failed,
            gate: None,
        }
    }

    /// Whether there are no body bytes to send, asked without the side effect of
    /// `is_end_stream` (which hyper calls as it writes the head).
    pub(super) fn is_bodiless(&self) -> bool {
        self.first.is_none() && self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    /// What tells whether this body went upstream whole.
    pub(super) fn delivered(&self) -> Option<Delivered> {
        self.delivered.clone()
    }

    /// No body, for a bodiless request sent again (`forward`); `delivered` is told when its
    /// head is written, as for the first send.
    pub(super) fn none(delivered: Option<Delivered>) -> Self {
        Self {
            first: None,
            inner: None,
            strip: None,
            flight: None,
            limit: None,
            delivered,
            client_failed: None,
            gate: None,
        }
    }

    /// Lets `gate` withdraw this (bodiless) request until hyper starts its head.
    pub(super) fn gated(mut self, gate: HeadGate) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Whether hyper may send the head now (false: withdrawn, see [`HeadGate`]).
    fn passes_gate(&self) -> bool {
        self.gate.as_ref().is_none_or(HeadGate::pass)
    }
}

/// `max_body_bytes` for a body of unknown length (chunked, HTTP/2 without content-length):
/// counted as it streams. Past the limit the body fails, so the upstream never receives its
/// end (as with a drain's abort), and `hit` tells the pipeline to answer 413 rather than 502.
pub(super) struct BodyLimit {
    pub(super) max: u64,
    pub(super) seen: u64,
    pub(super) hit: Arc<AtomicBool>,
}

/// Why the client's body failed, as text only. hyper resets an HTTP/2 upstream stream whose
/// body failed with the first HTTP/2 reason it finds among the error's causes: a client that
/// cancels its call mid-stream (`RST_STREAM(CANCEL)`) would have its `CANCEL` passed on, which
/// a tonic upstream reads as the stream's clean end and would apply the partial stream. With
/// no cause to find, hyper resets with `INTERNAL_ERROR`, as for a drain's abort.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(super) struct BodyFailed(String);

/// The error a body fails with past `max_body_bytes`.
#[derive(Debug, thiserror::Error)]
#[error("the request body is larger than the route's max_body_bytes ({0})")]
pub(super) struct TooLarge(u64);

impl std::fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody").finish_non_exhaustive()
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if !this.passes_gate() {
            return Poll::Ready(Some(Err(Box::new(Withdrawn))));
        }
        let Some(inner) = &mut this.inner else {
            if let Some(d) = &this.delivered {
                d.set();
            }
            return Poll::Ready(None);
        };
        // What was read before admission goes first, unless a drain aborted the request.
        let polled = match this.first.take() {
            Some(first) if !this.flight.as_ref().is_some_and(Flight::is_aborted) => {
                Poll::Ready(Some(match first {
                    Peeked::Data(d) => Ok(Frame::data(d)),
                    Peeked::Trailers(t) => Ok(Frame::trailers(t)),
                    Peeked::Failed(e) => Err(BodyError::from(e)),
                }))
            }
            _ => poll_fenced(Pin::new(inner), &mut this.flight, cx),
        };
        if let Poll::Ready(Some(Err(e))) = polled {
            // The client's body failed (not a drain's abort, which fails it with its ticket).
            if let (Some(f), false) = (
                &this.client_failed,
                this.flight.as_ref().is_some_and(Flight::is_aborted),
            ) {
                f.set(&*e);
            }
            return Poll::Ready(Some(Err(Box::new(BodyFailed(error_chain(&*e))))));
        }
        if let (Some(d), Poll::Ready(None)) = (&this.delivered, &polled) {
            d.set();
        }
        if let (Some(limit), Poll::Ready(Some(Ok(frame)))) = (&mut this.limit, &polled) {
            if let Some(d) = frame.data_ref() {
                limit.seen = limit.seen.saturating_add(d.len() as u64);
                if limit.seen > limit.max {
                    limit.hit.store(true, Ordering::Release);
                    return Poll::Ready(Some(Err(Box::new(TooLarge(limit.max)))));
                }
            }
        }
        let Some(strip) = &this.strip else {
            return polled;
        };
        polled.map(|frame| {
            frame.map(|r| {
                r.map(|f| match f.into_trailers() {
                    Ok(mut trailers) => {
                        let doomed: Vec<HeaderName> = trailers
                            .keys()
                            .filter(|n| {
                                super::request::same_under_cgi(n.as_str().as_bytes(), strip)
                            })
                            .cloned()
                            .collect();
                        for n in doomed {
                            trailers.remove(n);
                        }
                        Frame::trailers(trailers)
                    }
                    Err(f) => f,
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        // hyper asks when it writes the head (a request without a body is then sent whole) and
        // after each data frame (a Content-Length body's last bytes): it writes what it has and
        // stops polling, so this is where the end is handed over.
        // A drain aborted the request: not the end, so that hyper polls the body and gets the
        // abort's error rather than sending a bodiless request whole later.
        if self.flight.as_ref().is_some_and(Flight::is_aborted) {
            return false;
        }
        // Withdrawn (see `HeadGate`): not the end either, for the same reason.
        if !self.passes_gate() {
            return false;
        }
        let end = self.first.is_none() && self.inner.as_ref().is_none_or(Body::is_end_stream);
        if let (true, Some(d)) = (end, &self.delivered) {
            d.set();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        if self.first.is_some() {
            return SizeHint::default();
        }
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::malformed;
    use std::io::{Error, ErrorKind};

    /// hyper's chunked decoder's errors are framing; a TLS session's failure, an early end or
    /// a reset are a client gone.
    #[test]
    fn framing_errors_are_malformed_tls_failures_and_hang_ups_are_not() {
        let bad_chunk = Error::new(ErrorKind::InvalidInput, "invalid chunk size line");
        assert!(malformed(&bad_chunk));
        let alert = Error::new(
            ErrorKind::InvalidData,
            tokio_rustls::rustls::Error::AlertReceived(
                tokio_rustls::rustls::AlertDescription::DecodeError,
            ),
        );
        assert!(!malformed(&alert));
        for gone in [ErrorKind::UnexpectedEof, ErrorKind::ConnectionReset] {
            assert!(!malformed(&Error::new(gone, "x")));
        }
    }
}
