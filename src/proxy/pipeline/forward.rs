//! Sending an admitted request upstream, once, and waiting for the response head, or for a
//! newer owner's drain to abort the request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;

use super::request_body::{Delivered, HeadGate, RequestBody};
use super::upstream::http1::{self, Held, Home};
use super::upstream::{Upstream, Via};
use super::Affinity;
use crate::fence::drain::Generation;
use crate::fence::reject::Rejection;
use crate::proxy::error_chain::error_chain;

/// How long an aborted request's pooled (h2c) exchange is kept alive so that it ends with an
/// error reset rather than a cancel (see [`forward`]).
pub(super) const ABORT_HOLD: Duration = Duration::from_secs(30);

/// What became of a forwarded request.
// Returned once per request and matched at once: boxing the answer would cost an allocation
// per request to save a move.
#[allow(clippy::large_enum_variant)]
pub(super) enum Forwarded {
    /// The upstream answered (with the connection the body streams on, for HTTP/1.1), or
    /// failed.
    Answered(Reply),
    /// A newer owner's drain ran out of time and aborted the request.
    Aborted,
}

/// What a guarded request's exchange watches for a newer owner's drain. Owned, like all of
/// the exchange's inputs: an exchange whose client hangs up after its request went out whole
/// lives on in a task of its own (see [`super::client_gone`]).
pub(super) struct Abort {
    /// The generation of the request's drain ticket.
    pub(super) generation: Arc<Generation>,
    /// Whether its body went to the upstream connection whole (`None`: never counts as sent).
    pub(super) delivered: Option<Delivered>,
}

/// Sends `req` to `upstream` at most once. When a newer owner's drain aborts the request
/// (`abort`) before its body was handed over whole, it is abandoned, so that the upstream never
/// receives its end (see the notes in the body). One whose body was handed over whole is
/// waited for instead: the upstream may apply it whatever palisade does now, so its answer is
/// what tells the drain it is over (the drain waits for it at most its abort grace).
///
/// `limit` is the route's response timeout, `connect` its connect timeout.
pub(super) async fn forward(
    upstream: Arc<Upstream>,
    connect: Duration,
    limit: Option<Duration>,
    affinity: Arc<Affinity>,
    req: Request<RequestBody>,
    abort: Option<Abort>,
) -> Forwarded {
    match &upstream.via {
        Via::Affine(pool) => {
            let home = Home {
                affinity,
                pool: Arc::clone(pool),
            };
            // Combinators, not an async block: the request lives in one place (the send) and
            // the state every request moves stays small (see [`Abortable`]).
            let sent = http1::send(&home, &upstream.dialer, connect, req);
            // HTTP/1.1: dropping the exchange closes the upstream connection, before the body
            // is complete if it was still being sent, so the upstream never sees its end.
            let Some(r) = abortable(Within::new(limit, sent), abort).await else {
                return Forwarded::Aborted;
            };
            Forwarded::Answered(match r {
                Err(elapsed) => Err(Rejection::UpstreamTimeout(elapsed)),
                Ok(r) => r
                    .map(|(resp, held)| (resp, Some(held)))
                    .map_err(|e| Rejection::UpstreamFailed(error_chain(&e))),
            })
        }
        Via::Pooled(client) => {
            // A bodiless request can be sent again when the upstream did not process it; never
            // a guarded one (a drain may abort it, and its ticket rides on the first send).
            let again = abort.is_none().then(|| Again::of(&req)).flatten();
            // A request that can be sent again can also be withdrawn while hyper has not
            // started its head (see `HEAD_STALL`).
            let mut gate = again.as_ref().map(|_| HeadGate::default());
            let req = match &gate {
                Some(g) => req.map(|b| b.gated(g.clone())),
                None => req,
            };
            // The pooled client's future is `Unpin` and owns everything: an aborted request
            // can hand it to a task of its own (see below).
            let mut pending = client.request(req);
            let call = async {
                let deadline = limit.map(|l| (tokio::time::Instant::now() + l, l));
                let (mut sent, mut withdrawn) = (0, 0);
                loop {
                    let stall = gate
                        .as_ref()
                        .filter(|_| withdrawn < MAX_WITHDRAWALS)
                        .map(|_| tokio::time::Instant::now() + connect + HEAD_STALL);
                    let r = tokio::select! {
                        biased;
                        r = &mut pending => r,
                        () = until(deadline.map(|(at, _)| at)) => {
                            let limit = deadline.map_or(Duration::ZERO, |(_, l)| l);
                            return Err(Rejection::UpstreamTimeout(limit));
                        }
                        () = until(stall) => {
                            match (&again, gate.as_ref().is_some_and(HeadGate::withdraw)) {
                                (Some(again), true) if again.method.is_safe() => {
                                    tracing::debug!("hyper did not start the request's head in time (a connection closing under it); sending it again");
                                    withdrawn += 1;
                                    let (next, g) = again.gated_request();
                                    pending = client.request(next);
                                    gate = Some(g);
                                }
                                // A write is not sent again: see `HEAD_STALL`.
                                (Some(_), true) => {
                                    return Err(Rejection::UpstreamFailed(NOT_STARTED.to_owned()));
                                }
                                // The head went out: the answer is waited for as any other.
                                _ => gate = None,
                            }
                            continue;
                        }
                    };
                    match r {
                        Ok(resp) => return Ok((resp, None)),
                        Err(e) => match again.as_ref().filter(|_| sent < MAX_RESENDS) {
                            Some(again) if never_processed(&again.method, &e) => {
                                tracing::debug!(error = %error_chain(&e), "the HTTP/2 upstream did not process the request (GOAWAY or REFUSED_STREAM); sending it again");
                                sent += 1;
                                // The first at once (a rotated connection: the next is a new
                                // one); later ones after a pause that doubles (an upstream
                                // refusing streams is busy), within the response deadline.
                                if sent > 1 {
                                    let pause = RESEND_PAUSE * 2u32.pow(sent - 2);
                                    let late = deadline.is_some_and(|(at, _)| {
                                        tokio::time::Instant::now() + pause >= at
                                    });
                                    if late {
                                        return Err(Rejection::UpstreamFailed(error_chain(&e)));
                                    }
                                    tokio::time::sleep(pause).await;
                                }
                                let (next, g) = again.gated_request();
                                pending = client.request(next);
                                gate = Some(g);
                            }
                            _ => return Err(Rejection::UpstreamFailed(error_chain(&e))),
                        },
                    }
                }
            };
            match abortable(call, abort).await {
                Some(r) => Forwarded::Answered(r),
                None => {
                    // The request body fails at its next poll, which resets the upstream HTTP/2
                    // stream with INTERNAL_ERROR. Dropping the response future before that
                    // would make hyper reset the stream with CANCEL instead, which a tonic
                    // server takes for the clean end of a client stream: the upstream would
                    // apply a partial write. So the future lives on in its own task until the
                    // body has failed (the call then ends). An HTTP/2 upstream that grants no
                    // send window never lets hyper poll the body again; the future is kept for
                    // ABORT_HOLD in that case, then dropped.
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(ABORT_HOLD, pending).await;
                    });
                    Forwarded::Aborted
                }
            }
        }
    }
}

/// How many times a request an HTTP/2 upstream never processed is sent again.
const MAX_RESENDS: u32 = 3;

/// The pause before the second resend of a request (the first goes at once); it doubles for
/// each further one.
const RESEND_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// How long hyper may take to start a bodiless request's head, beyond the connect timeout,
/// before the request is withdrawn. hyper (1.x, HTTP/2) can check a pooled connection out
/// just as a GOAWAY closes it and leave the request in that connection's queue, never sent
/// and never answered. A withdrawn request's head is never sent whole (see `HeadGate`), and
/// hyper skips a queued request whose caller is gone; but in the instant between hyper's check
/// and the withdrawal it may still send the head without the end of the stream, then reset
/// the stream: a server that acts on a head alone could act. So only a read is sent again; a
/// write is answered 502 (at most once, as every write). A request legitimately waiting that
/// long (a connection being made takes at most the connect timeout) loses only its place.
const HEAD_STALL: Duration = Duration::from_secs(1);

/// The 502's reason for a write withdrawn before hyper started it.
const NOT_STARTED: &str = "the HTTP/2 upstream connection never started the request (closed under it); a write is not sent again";

/// How many times one request is withdrawn (then it waits for as long as its deadline).
const MAX_WITHDRAWALS: u32 = 3;

/// Resolves at `at`, never for `None`.
async fn until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What it takes to send a bodiless request again: its head.
struct Again {
    method: http::Method,
    uri: http::Uri,
    version: http::Version,
    headers: http::HeaderMap,
    delivered: Option<Delivered>,
}

impl Again {
    /// `None` for a request with a body: its bytes are gone once sent, so it is sent once.
    fn of(req: &Request<RequestBody>) -> Option<Self> {
        // Not `is_end_stream`, which tells the body's `Delivered` that the head went out.
        req.body().is_bodiless().then(|| Self {
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            headers: req.headers().clone(),
            delivered: req.body().delivered(),
        })
    }

    /// The request again, with a gate of its own to withdraw it by.
    fn gated_request(&self) -> (Request<RequestBody>, HeadGate) {
        let gate = HeadGate::default();
        (self.request().map(|b| b.gated(gate.clone())), gate)
    }

    fn request(&self) -> Request<RequestBody> {
        let mut r = Request::new(RequestBody::none(self.delivered.clone()));
        *r.method_mut() = self.method.clone();
        *r.uri_mut() = self.uri.clone();
        *r.version_mut() = self.version;
        *r.headers_mut() = self.headers.clone();
        r
    }
}

/// Whether an HTTP/2 upstream said it did not process the request, so that sending it again
/// cannot apply it twice (RFC 9113 8.7):
/// - the upstream reset its stream with `REFUSED_STREAM`: any method;
/// - the stream was above the last stream id of a GOAWAY the upstream sent (an upstream
///   rotating its connection, as nginx does every 1000 requests), or it was never sent on a
///   connection the upstream had already closed with GOAWAY: only for safe methods (GET, HEAD,
///   OPTIONS, TRACE). h2 gives the same error to a stream that the upstream did process when
///   the connection ends before its answer arrived (an upstream that closes without sending
///   what it owes), so a write is never sent again on its word.
///
/// - hyper never started to write it (`canceled`: its connection closed or was not ready
///   first): any method. hyper sends these again by itself when the connection was a reused
///   one (`retry_canceled_requests`), not when it was new.
fn never_processed(method: &http::Method, e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if c.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        if let Some(h2) = c.downcast_ref::<h2::Error>() {
            let refused =
                h2.is_reset() && h2.is_remote() && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            return refused || (h2.is_go_away() && h2.is_remote() && method.is_safe());
        }
        cur = c.source();
    }
    false
}

/// Runs `call`, or gives `None` as soon as a newer owner's drain aborts the request
/// (`abort`) while its body is not yet handed over whole; `call` is then dropped, which closes
/// its connection. After the body was handed over whole, an abort is ignored and `call` runs
/// to its end.
pub(super) fn abortable<F: Future>(
    call: F,
    abort: Option<Abort>,
) -> Abortable<F, impl Future<Output = ()>> {
    let (generation, delivered) = abort.map(|a| (a.generation, a.delivered)).unzip();
    Abortable {
        abort: generation.map(|g| async move { g.aborted().await }),
        delivered: delivered.flatten(),
        call,
    }
}

pin_project_lite::pin_project! {
    /// [`abortable`]'s future. Written out rather than as an async fn with a `select!`: that
    /// kept `call` twice (the argument and the select's copy), and every request's future
    /// (moved whole at each level on its way into hyper's connection) grew by its size.
    pub(super) struct Abortable<F, A> {
        #[pin]
        abort: Option<A>,
        delivered: Option<Delivered>,
        #[pin]
        call: F,
    }
}

impl<F: Future, A: Future<Output = ()>> Future for Abortable<F, A> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // The abort first: it also fails the request body, which can end `call` with an
        // upstream error in the same wake-up, and that must not turn the 409 into a 502.
        if let Some(abort) = this.abort.as_mut().as_pin_mut() {
            if abort.poll(cx).is_ready() {
                if !this.delivered.as_ref().is_some_and(Delivered::is_whole) {
                    return Poll::Ready(None);
                }
                // Handed over whole: only the upstream's answer ends it now.
                this.abort.set(None);
            }
        }
        this.call.poll(cx).map(Some)
    }
}

pin_project_lite::pin_project! {
    /// `fut`, within `limit` if there is one: `Err(limit)` when it ran out.
    #[project = WithinProj]
    pub(super) enum Within<F> {
        Bare { #[pin] fut: F },
        Timed { #[pin] fut: tokio::time::Timeout<F>, limit: Duration },
    }
}

impl<F: Future> Within<F> {
    pub(super) fn new(limit: Option<Duration>, fut: F) -> Self {
        match limit {
            None => Within::Bare { fut },
            Some(limit) => Within::Timed {
                fut: tokio::time::timeout(limit, fut),
                limit,
            },
        }
    }
}

impl<F: Future> Future for Within<F> {
    type Output = Result<F::Output, Duration>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            WithinProj::Bare { fut } => fut.poll(cx).map(Ok),
            WithinProj::Timed { fut, limit } => fut.poll(cx).map(|r| r.map_err(|_| *limit)),
        }
    }
}

/// What an upstream exchange gives: the response head (with the connection its body streams
/// on, for HTTP/1.1), or the refusal to send.
pub(super) type Reply = Result<(Response<Incoming>, Option<Held>), Rejection>;

#[cfg(test)]
mod tests {
    use super::{Again, RequestBody};
    use crate::proxy::pipeline::request_body::Delivered;

    /// Keeping what it takes to send a request again must not tell its drain that the request
    /// went out: a guarded request that is not sent yet must stay abortable.
    #[test]
    fn keeping_a_request_for_another_send_does_not_count_it_as_delivered() {
        let delivered = Delivered::default();
        let req = http::Request::new(RequestBody::none(Some(delivered.clone())));
        assert!(
            Again::of(&req).is_some(),
            "a bodiless request can be sent again"
        );
        assert!(!delivered.is_whole());
    }

    /// A request withdrawn before hyper started its head is never sent whole: its body is not
    /// at its end and fails when polled (the upstream then gets a reset stream, never a
    /// complete request). Once the head started, it cannot be withdrawn.
    #[tokio::test]
    async fn a_withdrawn_request_is_never_sent_whole_and_a_sent_one_cannot_be_withdrawn() {
        use http_body::Body;
        use http_body_util::BodyExt;

        let again = Again::of(&http::Request::new(RequestBody::none(None))).unwrap();
        let (req, gate) = again.gated_request();
        assert!(gate.withdraw(), "nothing was sent yet");
        let mut body = req.into_body();
        assert!(
            !body.is_end_stream(),
            "a withdrawn request's head must not end its stream"
        );
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.to_string().contains("withdrawn"), "{err}");

        let (req, gate) = again.gated_request();
        let mut body = req.into_body();
        assert!(
            body.is_end_stream(),
            "hyper starts the head of a bodiless request"
        );
        assert!(!gate.withdraw(), "the head went out: too late to withdraw");
        assert!(body.frame().await.is_none(), "and the request ends as sent");
    }
}
