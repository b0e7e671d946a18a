//! An HTTP/2 request on a bodiless method whose HEADERS frame did not end the stream: many
//! clients end it with an empty DATA frame right after. Its first frames are read before the
//! GET-body rule judges it, so that an empty body is no body (nginx answers such a GET 200;
//! it used to be refused 400 here). The first bytes of a real body are kept and sent first
//! ([`Peeked`]): a route that forwards GET bodies loses nothing.

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

/// Reads `req`'s first frames when it is an HTTP/2 request on a bodiless method with its
/// stream still open and no `Content-Length` but 0: up to its end (then its body is ended, as if
/// HEADERS had said so), its first data, trailers or error (kept in a [`Peeked`] extension:
/// the request then has a body), or [`FIRST_FRAME_WAIT`] (the same without a frame).
pub(super) async fn settle(req: &mut Request<Incoming>) {
    if req.version() != Version::HTTP_2
        || !is_bodiless_method(req.method().as_str())
        || req.body().is_end_stream()
        || req
            .headers()
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
    {
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
    if let Ok(Some(first)) = tokio::time::timeout(FIRST_FRAME_WAIT, read).await {
        req.extensions_mut().insert(first);
    }
}
