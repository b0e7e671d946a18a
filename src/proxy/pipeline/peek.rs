//! An HTTP/2 request on a bodiless method whose HEADERS frame did not end the stream: many
//! clients end it with an empty DATA frame right after. Its first frames are read before the
//! GET-body rule judges it, so that an empty body is no body (nginx answers such a GET 200;
//! it used to be refused 400 here). The first bytes of a real body are kept and sent first
//! ([`Peeked`]): a route that forwards GET bodies loses nothing, and waits for nothing (it
//! reads only the frames already received).

use std::time::Duration;

use http::{header, Request, Version};
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::request::{is_bodiless_method, Peeked};
use crate::proxy::error_chain::error_chain;

/// How long the first frame of such a body may take; after that the request counts as having
/// a body (a client that sends HEADERS without END_STREAM and then nothing).
pub(super) const FIRST_FRAME_WAIT: Duration = Duration::from_secs(1);

/// Whether `req` is an HTTP/2 request on a bodiless method with its stream still open and no
/// `Content-Length` but 0: one whose body [`settle`] may find empty.
pub(super) fn unsettled(req: &Request<Incoming>) -> bool {
    req.version() == Version::HTTP_2
        && is_bodiless_method(req.method().as_str())
        && !req.body().is_end_stream()
        && req
            .headers()
            .get(header::CONTENT_LENGTH)
            .is_none_or(|v| v.as_bytes() == b"0")
}

/// Reads an [`unsettled`] request's first frames: up to its end (then its body is ended, as if
/// HEADERS had said so), its first data, trailers or error (kept in a [`Peeked`] extension:
/// the request then has a body), or `wait` (the same without a frame). With no wait, only
/// the frames already received are read (a route that forwards GET bodies has nothing to wait
/// for: it forwards what comes, and an empty body read at once still keeps its upstream
/// connection reusable).
pub(super) async fn settle(req: &mut Request<Incoming>, wait: Duration) {
    if !unsettled(req) {
        return;
    }
    let body = req.body_mut();
    let read = async {
        loop {
            if body.is_end_stream() {
                return None;
            }
            match body.frame().await {
                None => return None,
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) => return Some(Peeked::Data(data)),
                    Err(frame) => return frame.into_trailers().ok().map(Peeked::Trailers),
                },
                Some(Err(e)) => return Some(Peeked::Failed(error_chain(&e))),
            }
        }
    };
    // `timeout` polls `read` before its deadline: a zero wait still reads what arrived.
    if let Ok(Some(first)) = tokio::time::timeout(wait, read).await {
        req.extensions_mut().insert(first);
    }
}
