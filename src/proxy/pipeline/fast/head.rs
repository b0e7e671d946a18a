//! Reading a request head for the fast path: strict HTTP/1.1 framing, and the decision
//! whether the fast path takes the request at all.
//!
//! The rule: the fast path takes an HTTP/1.1 request in origin form, of a method other than
//! CONNECT, with no `Upgrade`, no `Expect` and no `Transfer-Encoding`, and at most one
//! `Content-Length` made of digits. Anything else it does not judge itself:
//! - what hyper parses into a request the fast path does not serve (HTTP/1.0, chunked bodies,
//!   upgrades, `Expect: 100-continue`, CONNECT, asterisk or authority form, the HTTP/2 preface)
//!   and every head httparse refuses is handed to hyper with the connection, untouched: hyper
//!   answers exactly as it does without the fast path;
//! - what hyper would accept but is a smuggling vector refused outright with 400 and the
//!   connection closed: bare LF line endings, `Content-Length` together with
//!   `Transfer-Encoding`, more than one `Content-Length`, a `Content-Length` that is not a
//!   plain decimal number within `u64`;
//! - a head larger than `max_header_bytes`, or with more than [`MAX_HEADERS`] headers, gets
//!   431 and the connection closed, as from hyper.
//!
//! obs-fold and whitespace between a header name and its colon are httparse errors in a
//! request: those heads go to hyper, which answers 400 and closes.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Method, Request, Uri, Version};
use http_body::{Body, Frame, SizeHint};

/// hyper's own limit on request headers (its `DEFAULT_MAX_HEADERS`).
pub(super) const MAX_HEADERS: usize = 100;

/// hyper answers 414 above this URI length: such requests go to hyper.
const MAX_URI_LEN: usize = (u16::MAX - 1) as usize;

/// What the bytes at the start of the buffer are.
// Returned once per read and matched at once: boxing the head would cost an allocation per
// request to save a move.
#[allow(clippy::large_enum_variant)]
pub(super) enum Parsed {
    /// Not a whole head yet.
    Partial,
    /// A request for hyper (see the module docs): hand the connection over.
    HandOver,
    /// Refused with this status (400 or 431); the connection is closed after it.
    Refuse(http::StatusCode),
    /// A request the fast path serves.
    Head(Head),
}

/// A request head the fast path serves.
pub(super) struct Head {
    /// Bytes of the head, request line to the empty line.
    pub(super) len: usize,
    /// The request as hyper's path would see it (same method, URI, version and headers),
    /// with a body that only knows its length.
    pub(super) request: Request<Sized>,
    /// `Content-Length`, 0 without one.
    pub(super) body: u64,
    /// The client asked to close the connection after this request.
    pub(super) close: bool,
}

/// A request body that is only a length: what [`super::super::Proxy::admit`] reads of a body
/// (its size hint, whether it is empty). The bytes themselves are relayed by the fast path.
pub(super) struct Sized(pub(super) u64);

impl Body for Sized {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.0 == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0)
    }
}

/// Reads the head at the start of `buf` (`max`: `max_header_bytes`).
pub(super) fn parse(buf: &[u8], max: usize) -> Parsed {
    // The HTTP/2 preface (`PRI * HTTP/2.0`): hyper serves h2c.
    if buf.len() < 4 && b"PRI ".starts_with(buf) {
        return Parsed::Partial;
    }
    if buf.starts_with(b"PRI ") {
        return Parsed::HandOver;
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Partial) if buf.len() >= max => {
            return Parsed::Refuse(http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        }
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Ok(httparse::Status::Complete(len)) if len > max => {
            return Parsed::Refuse(http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        }
        Ok(httparse::Status::Complete(len)) => len,
        Err(httparse::Error::TooManyHeaders) => {
            return Parsed::Refuse(http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        }
        // hyper parses with the same httparse and the same (default) settings: it refuses
        // these heads too, and says so in its own words.
        Err(_) => return Parsed::HandOver,
    };
    // httparse accepts a bare LF as a line end; an upstream or another hop may not.
    if bare_lf(&buf[..len]) {
        return Parsed::Refuse(http::StatusCode::BAD_REQUEST);
    }
    match judge(&req, len) {
        Ok(Some(head)) => Parsed::Head(head),
        Ok(None) => Parsed::HandOver,
        Err(()) => Parsed::Refuse(http::StatusCode::BAD_REQUEST),
    }
}

/// Whether any line of `head` ends in LF without CR.
fn bare_lf(head: &[u8]) -> bool {
    head.iter()
        .enumerate()
        .any(|(i, b)| *b == b'\n' && (i == 0 || head[i - 1] != b'\r'))
}

/// `Ok(None)`: for hyper; `Err`: refused with 400.
fn judge(req: &httparse::Request<'_, '_>, len: usize) -> Result<Option<Head>, ()> {
    if req.version != Some(1) {
        return Ok(None);
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Ok(None);
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Ok(None);
    };
    if method == Method::CONNECT || !path.starts_with('/') || path.len() > MAX_URI_LEN {
        return Ok(None);
    }
    let Ok(uri) = Uri::try_from(path) else {
        return Ok(None);
    };
    let mut map = http::HeaderMap::with_capacity(req.headers.len());
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut close = false;
    for h in req.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| ())?;
        let value = HeaderValue::from_bytes(h.value).map_err(|_| ())?;
        match name {
            http::header::CONTENT_LENGTH => {
                if length.is_some() {
                    return Err(()); // duplicate, even when equal: refused, never guessed
                }
                length = Some(content_length(h.value).ok_or(())?);
            }
            http::header::TRANSFER_ENCODING => chunked = true,
            http::header::UPGRADE | http::header::EXPECT => return Ok(None),
            http::header::CONNECTION => close |= says_close(h.value),
            _ => {}
        }
        map.append(name, value);
    }
    match (chunked, length) {
        (true, Some(_)) => return Err(()),
        (true, None) => return Ok(None),
        _ => {}
    }
    let body = length.unwrap_or(0);
    let mut request = Request::new(Sized(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = map;
    Ok(Some(Head {
        len,
        request,
        body,
        close,
    }))
}

/// Whether a `Connection` value lists `close` (in a request or a response head).
pub(super) fn says_close(value: &[u8]) -> bool {
    value
        .split(|b| *b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"))
}

/// A `Content-Length` value: 1 to 19 ASCII digits (anything longer may overflow `u64`; no
/// sign, no spaces, no list).
pub(super) fn content_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(raw: &str) -> Option<u16> {
        match parse(raw.as_bytes(), 64 * 1024) {
            Parsed::Refuse(s) => Some(s.as_u16()),
            Parsed::Head(_) => Some(0),
            Parsed::HandOver => Some(1),
            Parsed::Partial => None,
        }
    }

    #[test]
    fn framing_rules() {
        let ok = "POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc";
        assert_eq!(status(ok), Some(0));
        assert_eq!(status("GET /a HTTP/1.1\r\nhost: x\r\n"), None);
        assert_eq!(status("PR"), None);
        let bad = [
            "POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\n",
            "POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: +3\r\n\r\n",
            "POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999999999999\r\n\r\n",
            "POST /a HTTP/1.1\nhost: x\r\n\r\n",
            "POST /a HTTP/1.1\r\nhost: x\n\r\n",
        ];
        for b in bad {
            assert_eq!(status(b), Some(400), "{b:?}");
        }
        let hyper = [
            "POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n",
            "GET /a HTTP/1.0\r\n\r\n",
            "GET /a HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n\r\n",
            "POST /a HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n\r\n",
            "CONNECT a:1 HTTP/1.1\r\nhost: a:1\r\n\r\n",
            "OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n",
            "GET /a HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n  folded\r\n\r\n",
            "GET /a HTTP/1.1\r\nhost : x\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ];
        for h in hyper {
            assert_eq!(status(h), Some(1), "{h:?}");
        }
        let big = format!("GET /a HTTP/1.1\r\nx: {}\r\n", "a".repeat(70_000));
        assert_eq!(status(&big), Some(431));
    }
}
