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
//!   connection closed: ambiguous framing by the rule both paths share
//!   ([`framing::ambiguity`]: bare LF line endings, `Content-Length` together with
//!   `Transfer-Encoding`, more than one `Content-Length`), a `Content-Length` that is not a
//!   plain decimal number within `u64`;
//! - a head larger than `max_header_bytes`, or with more than [`MAX_HEADERS`] headers, gets
//!   431 and the connection closed, as from hyper.
//!
//! obs-fold and whitespace between a header name and its colon are httparse errors in a
//! request: those heads go to hyper, which answers 400 and closes.

use std::ops::Range;

use http::Version;

use super::fields::{FieldList, FieldStore};
use super::shared::RequestView;
use super::target::{self, MAX_URI_LEN};
use crate::proxy::server::framing;

/// hyper's own limit on request headers (its `DEFAULT_MAX_HEADERS`).
pub(super) const MAX_HEADERS: usize = 100;

/// What the bytes at the start of the buffer are.
pub(super) enum Parsed {
    /// Not a whole head yet.
    Partial,
    /// A request for hyper (see the module docs): hand the connection over.
    HandOver,
    /// Refused with this status (400 or 431); the connection is closed after it.
    Refuse(http::StatusCode),
    /// A request the fast path serves; its fields are in the store `parse` was given.
    Head(Head),
}

/// A request head the fast path serves: where its parts are in its bytes (the first `len`
/// bytes of the buffer it was parsed from).
#[derive(Debug, Clone)]
pub(super) struct Head {
    /// Bytes of the head, request line to the empty line.
    pub(super) len: usize,
    pub(super) method: Range<usize>,
    /// The target's path and query, without any fragment (as `http::Uri` keeps it).
    pub(super) target: Range<usize>,
    /// Where the target's path ends (at its `?`, or its end).
    pub(super) path_end: usize,
    /// `Content-Length`, 0 without one.
    pub(super) body: u64,
    /// The client asked to close the connection after this request.
    pub(super) close: bool,
}

/// A parsed head as the checks read it ([`RequestView`]), over its bytes and fields.
pub(super) struct View<'a> {
    pub(super) head: &'a Head,
    pub(super) method: &'a str,
    pub(super) path: &'a str,
    /// The path and query the client sent.
    pub(super) target: &'a str,
    pub(super) fields: FieldList<'a>,
}

impl<'a> View<'a> {
    /// The view of `head`, parsed from `src` with its fields in `store`.
    pub(super) fn new(head: &'a Head, src: &'a [u8], store: &'a mut FieldStore) -> Self {
        let text = |r: Range<usize>| std::str::from_utf8(&src[r]).unwrap_or_default();
        Self {
            head,
            // httparse checked both: a method is a token, a target visible ASCII or UTF-8.
            method: text(head.method.clone()),
            path: text(head.target.start..head.path_end),
            target: text(head.target.clone()),
            fields: store.list(&src[..head.len]),
        }
    }

    /// The query, without its `?`.
    pub(super) fn query(&self) -> Option<&'a str> {
        let path = self.head.path_end - self.head.target.start;
        self.target.get(path..).and_then(|q| q.strip_prefix('?'))
    }
}

impl<'a> RequestView for View<'a> {
    type Fields = FieldList<'a>;

    fn method(&self) -> &str {
        self.method
    }

    fn path(&self) -> &str {
        self.path
    }

    fn authority(&self) -> Option<&str> {
        None // origin form only
    }

    fn version(&self) -> Version {
        Version::HTTP_11
    }

    fn fields(&self) -> &FieldList<'a> {
        &self.fields
    }

    fn body_ended(&self) -> bool {
        self.head.body == 0
    }

    fn body_length(&self) -> Option<u64> {
        Some(self.head.body)
    }
}

/// Reads the head at the start of `buf` (`max`: `max_header_bytes`); a head the fast path
/// serves has its fields put in `store`.
pub(super) fn parse(buf: &[u8], max: usize, store: &mut FieldStore) -> Parsed {
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
    // Framing two hops could read differently: the rule both paths share (an HTTP/1.0
    // request goes to hyper, where the same rule answers it in HTTP/1.0).
    if req.version == Some(1) && framing::ambiguity(&buf[..len], req.headers).is_some() {
        return Parsed::Refuse(http::StatusCode::BAD_REQUEST);
    }
    match judge(&req, &buf[..len]) {
        Ok(Some(head)) => {
            store.fill(&buf[..len], req.headers);
            Parsed::Head(head)
        }
        Ok(None) => Parsed::HandOver,
        Err(()) => Parsed::Refuse(http::StatusCode::BAD_REQUEST),
    }
}

/// `Ok(None)`: for hyper; `Err`: refused with 400. `src`: the head's bytes, which `req` was
/// parsed from.
fn judge(req: &httparse::Request<'_, '_>, src: &[u8]) -> Result<Option<Head>, ()> {
    if req.version != Some(1) {
        return Ok(None);
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Ok(None);
    };
    // httparse takes only token bytes in a method, which `http::Method` takes too.
    if method == "CONNECT" || !path.starts_with('/') || path.len() > MAX_URI_LEN {
        return Ok(None);
    }
    let Some(t) = target::parse(path) else {
        return Ok(None);
    };
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut close = false;
    for h in req.headers.iter() {
        // httparse takes only token bytes in a name and no control bytes in a value, as
        // `HeaderName` and `HeaderValue` do; a name longer than `HeaderName`'s limit would
        // be refused by hyper.
        if h.name.len() > MAX_NAME_LEN {
            return Err(());
        }
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            // One at most, alone (`framing::ambiguity` refused the others).
            length = Some(content_length(h.value).ok_or(())?);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            chunked = true;
        } else if name.eq_ignore_ascii_case(b"upgrade") || name.eq_ignore_ascii_case(b"expect") {
            return Ok(None);
        } else if name.eq_ignore_ascii_case(b"connection") {
            close |= says_close(h.value);
        }
    }
    if chunked {
        return Ok(None); // hyper decodes chunked bodies
    }
    let at = |s: &str| (s.as_ptr() as usize).wrapping_sub(src.as_ptr() as usize);
    let method_at = at(method);
    let target_at = at(path);
    Ok(Some(Head {
        len: src.len(),
        method: method_at..method_at + method.len(),
        target: target_at..target_at + t.end,
        path_end: target_at + t.path_end,
        body: length.unwrap_or(0),
        close,
    }))
}

/// `HeaderName`'s limit on a name's length.
const MAX_NAME_LEN: usize = (1 << 16) - 1;

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
        match parse(raw.as_bytes(), 64 * 1024, &mut FieldStore::default()) {
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
