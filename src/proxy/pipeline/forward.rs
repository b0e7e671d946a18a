//! Sending an admitted request upstream, once, and waiting for the response head, or for a
//! newer owner's drain to abort the request.

use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use super::affine::{self, Held, Home};
use super::body::RequestBody;
use super::upstream::{Upstream, Via};
use super::Affinity;
use crate::config::RouteSettings;
use crate::drain::Generation;
use crate::reject::Rejection;

/// How long an aborted request's pooled (h2c) exchange is kept alive so that it ends with an
/// error reset rather than a cancel (see [`forward`]).
const ABORT_HOLD: std::time::Duration = std::time::Duration::from_secs(30);

/// What became of a forwarded request.
// Returned once per request and matched at once: boxing the answer would cost an allocation
// per request to save a move.
#[allow(clippy::large_enum_variant)]
pub(super) enum Forwarded {
    /// The upstream answered (with the connection the body streams on, for HTTP/1.1), or
    /// failed.
    Answered(Answer),
    /// A newer owner's drain ran out of time and aborted the request.
    Aborted,
}

/// Sends `req` to `upstream` at most once. `aborted` is the generation of a guarded request's
/// drain ticket: when a newer owner's drain aborts it, the request is abandoned so that the
/// upstream never receives its end (see the notes in the body).
pub(super) async fn forward(
    upstream: &Upstream,
    route: &RouteSettings,
    affinity: &Arc<Affinity>,
    req: Request<RequestBody>,
    aborted: Option<&Arc<Generation>>,
) -> Forwarded {
    let limit = route.response_timeout;
    match &upstream.via {
        Via::Affine(pool) => {
            let home = Home {
                affinity: Arc::clone(affinity),
                pool: Arc::clone(pool),
            };
            let call = async {
                let sent = affine::send(&home, &upstream.dialer, route.connect_timeout, req);
                let r = match limit {
                    Some(limit) => match tokio::time::timeout(limit, sent).await {
                        Ok(r) => r,
                        Err(_) => return Err(Rejection::UpstreamTimeout(limit)),
                    },
                    None => sent.await,
                };
                r.map(|(resp, held)| (resp, Some(held)))
                    .map_err(|e| Rejection::UpstreamFailed(error_chain(&e)))
            };
            // HTTP/1.1: dropping the exchange closes the upstream connection, before the body
            // is complete if it was still being sent, so the upstream never sees its end.
            abortable(call, aborted).await
        }
        Via::Pooled(client) => {
            // The pooled client's future is `Unpin` and owns everything: an aborted request
            // can hand it to a task of its own (see below).
            let mut pending = client.request(req);
            let call = async {
                let r = match limit {
                    Some(limit) => match tokio::time::timeout(limit, &mut pending).await {
                        Ok(r) => r,
                        Err(_) => return Err(Rejection::UpstreamTimeout(limit)),
                    },
                    None => (&mut pending).await,
                };
                r.map(|resp| (resp, None))
                    .map_err(|e| Rejection::UpstreamFailed(error_chain(&e)))
            };
            // The abort is polled first: it also fails the request body, which can end `call`
            // with an upstream error in the same wake-up, and that must not turn the 409 into a
            // 502.
            let Some(generation) = aborted else {
                return Forwarded::Answered(call.await);
            };
            let answered = tokio::select! {
                biased;
                () = generation.aborted() => None,
                r = call => Some(r),
            };
            match answered {
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

/// Runs `call`, or gives [`Forwarded::Aborted`] as soon as a newer owner's drain aborts the
/// request (`aborted`); `call` is then dropped, which closes its connection.
pub(super) async fn abortable(
    call: impl std::future::Future<Output = Answer>,
    aborted: Option<&Arc<Generation>>,
) -> Forwarded {
    match aborted {
        None => Forwarded::Answered(call.await),
        Some(generation) => tokio::select! {
            biased;
            () = generation.aborted() => Forwarded::Aborted,
            r = call => Forwarded::Answered(r),
        },
    }
}

/// What an upstream exchange gives: the response head (with the connection its body streams
/// on, for HTTP/1.1), or the refusal to send.
pub(super) type Answer = Result<(Response<Incoming>, Option<Held>), Rejection>;

pub(super) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
