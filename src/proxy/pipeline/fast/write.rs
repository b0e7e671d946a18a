//! Heads written as bytes: the request for the upstream, and palisade's own responses (as
//! hyper's server writes them: the headers in map order, then `content-length`, then `date`).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Response, StatusCode};
use http_body::Body;
use http_body_util::Full;

/// Each header as `name: value` (names are lower case, as hyper writes them).
pub(super) fn headers(out: &mut Vec<u8>, h: &HeaderMap) {
    for (name, value) in h {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// `date: <now>`: what hyper's server adds to a response without one.
pub(super) fn date(out: &mut Vec<u8>) {
    out.extend_from_slice(b"date: ");
    out.extend_from_slice(httpdate::fmt_http_date(std::time::SystemTime::now()).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// A status line with the status's own reason phrase.
fn status_line(out: &mut Vec<u8>, status: StatusCode) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// One of palisade's refusals (from [`crate::fence::reject::Rejection::respond`]), whole; the body is
/// left out for a HEAD request, as hyper leaves it out. `closing`: the connection closes after
/// it, which hyper's server announces with `connection: close`.
pub(super) fn refusal(
    out: &mut Vec<u8>,
    resp: Response<Full<Bytes>>,
    head_request: bool,
    closing: bool,
) {
    let (mut parts, body) = resp.into_parts();
    let body = full_bytes(body);
    status_line(out, parts.status);
    if closing && !parts.headers.contains_key(header::CONNECTION) {
        parts.headers.insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
    }
    headers(out, &parts.headers);
    // hyper's server says no length for an empty body to HEAD (the body it does not send
    // might have had one), and the body's length otherwise.
    // Nor for a 204 (RFC 9110 8.6: never a Content-Length there).
    let says_none =
        (head_request && body.is_empty()) || parts.status == http::StatusCode::NO_CONTENT;
    if !says_none && !parts.headers.contains_key(header::CONTENT_LENGTH) {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(body.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !parts.headers.contains_key(header::DATE) {
        date(out);
    }
    out.extend_from_slice(b"\r\n");
    if !head_request {
        out.extend_from_slice(&body);
    }
}

/// The answer hyper's server gives a head it cannot parse (400) or that is too large (431).
pub(super) fn automatic(out: &mut Vec<u8>, status: StatusCode) {
    status_line(out, status);
    // The connection is closed after it, and hyper says so.
    out.extend_from_slice(b"connection: close\r\ncontent-length: 0\r\n");
    date(out);
    out.extend_from_slice(b"\r\n");
}

/// The bytes of a `Full` body, which are there at once.
fn full_bytes(mut body: Full<Bytes>) -> Bytes {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match Pin::new(&mut body).poll_frame(&mut cx) {
        Poll::Ready(Some(Ok(frame))) => frame.into_data().unwrap_or_default(),
        _ => Bytes::new(),
    }
}
