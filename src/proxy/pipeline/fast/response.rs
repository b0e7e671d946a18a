//! The upstream's response on the fast path: its head, parsed strictly, and its framing,
//! which says where the response ends so that the upstream socket can serve the next request.
//!
//! Strict means: anything hyper's client would read differently, or that could make the
//! proxy and the client disagree on where a response ends, is an invalid response (502 before
//! any byte reached the client; afterwards the client connection is closed). That is: a bare
//! LF, obs-fold, whitespace before a colon, `Transfer-Encoding` other than exactly `chunked`,
//! `Transfer-Encoding` with `Content-Length`, more than one `Content-Length`, a malformed one,
//! a 101 (the fast path never asks for an upgrade), and chunk sizes that are not plain hex.

use std::ops::Range;

use http::StatusCode;

use super::fields::FieldStore;
use super::head::{content_length, says_close, MAX_HEADERS};

/// A response head is refused above this size (hyper's client reads up to ~400 KiB).
pub(super) const MAX_RESPONSE_HEAD: usize = 256 * 1024;

/// Where a response's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// No body (HEAD, 204, 304).
    Empty,
    /// `Content-Length`.
    Length(u64),
    /// `Transfer-Encoding: chunked`, relayed as is.
    Chunked,
    /// Until the upstream closes: the client connection is closed after it too.
    Close,
}

/// A parsed final response head; its fields are in the store `parse` was given.
pub(super) struct ResponseHead {
    /// Bytes of the head in the buffer.
    pub(super) len: usize,
    pub(super) status: StatusCode,
    /// Where the status line's reason phrase is in the head, kept as the upstream sent it (as
    /// hyper's path does).
    pub(super) reason: Range<usize>,
    pub(super) framing: Framing,
    /// The upstream asked to close its connection after this response.
    pub(super) close: bool,
}

/// What the start of the upstream's bytes are.
pub(super) enum Read {
    Partial,
    /// An informational (1xx, not 101) response of this many bytes: skipped, as hyper's
    /// client skips them.
    Informational(usize),
    Final(ResponseHead),
}

/// Why a response is refused.
#[derive(Debug, thiserror::Error)]
#[error("invalid response from the upstream: {0}")]
pub(super) struct Invalid(pub(super) &'static str);

/// Parses the response head at the start of `buf`; `head_request`: the request was HEAD. A
/// final head's fields are put in `store`.
pub(super) fn parse(
    buf: &[u8],
    head_request: bool,
    store: &mut FieldStore,
) -> Result<Read, Invalid> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Partial) if buf.len() >= MAX_RESPONSE_HEAD => {
            return Err(Invalid("response head too large"))
        }
        Ok(httparse::Status::Partial) => return Ok(Read::Partial),
        Ok(httparse::Status::Complete(len)) => len,
        Err(_) => return Err(Invalid("malformed response head")),
    };
    let head = &buf[..len];
    if head
        .iter()
        .enumerate()
        .any(|(i, b)| *b == b'\n' && (i == 0 || head[i - 1] != b'\r'))
    {
        return Err(Invalid("bare LF in the response head"));
    }
    // An HTTP/1.0 response is read as hyper's client reads it; its connection is not reused.
    let http10 = resp.version == Some(0);
    let code = resp.code.ok_or(Invalid("no status"))?;
    let status = StatusCode::from_u16(code).map_err(|_| Invalid("bad status"))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(Invalid("101 to a request that asked for no upgrade"));
    }
    if status.is_informational() {
        return Ok(Read::Informational(len));
    }
    let (mut length, mut chunked, mut close) = (None, false, http10);
    for h in resp.headers.iter() {
        // httparse takes only token bytes in a name and no control bytes in a value, as
        // `HeaderName` and `HeaderValue` (hyper's client) do, up to a name's length limit.
        if h.name.len() >= 1 << 16 {
            return Err(Invalid("header"));
        }
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            if length.is_some() {
                return Err(Invalid("more than one Content-Length"));
            }
            length = Some(content_length(h.value).ok_or(Invalid("bad Content-Length"))?);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            if chunked || !h.value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(Invalid("Transfer-Encoding other than chunked"));
            }
            chunked = true;
        } else if name.eq_ignore_ascii_case(b"connection") {
            close |= says_close(h.value);
        }
    }
    if chunked && length.is_some() {
        return Err(Invalid("both Content-Length and Transfer-Encoding"));
    }
    let framing =
        if head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            Framing::Empty
        } else if chunked {
            Framing::Chunked
        } else {
            match length {
                Some(0) => Framing::Empty,
                Some(n) => Framing::Length(n),
                None => Framing::Close,
            }
        };
    // httparse gives an empty reason (a missing one, or one that is not UTF-8) as a string of
    // its own, not a slice of `buf`: only a slice that lies inside the head is a range of it.
    let reason = resp
        .reason
        .and_then(|r| {
            let at = (r.as_ptr() as usize).checked_sub(buf.as_ptr() as usize)?;
            (!r.is_empty() && at + r.len() <= len).then_some(at..at + r.len())
        })
        .unwrap_or(0..0);
    store.fill(&buf[..len], resp.headers);
    Ok(Read::Final(ResponseHead {
        len,
        status,
        reason,
        framing,
        close,
    }))
}

/// Follows a chunked body as its bytes pass, to know where it ends; checks every chunk size
/// line and every CRLF on the way.
#[derive(Debug, Default)]
pub(super) struct Chunks {
    state: State,
    size: u64,
    /// Hex digits in the current size (leading zeros too): at most 16, as Go's and hyper's
    /// parsers allow, so that no hop reads a different size.
    digits: u8,
    /// The current trailer line had its colon.
    colon: bool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// At the start of a size line.
    #[default]
    Size,
    /// In the size's hex digits.
    Digits,
    /// After the size: optional whitespace, then `;ext` or CR.
    AfterSize,
    /// In a chunk extension, up to CR.
    Ext,
    /// CR seen at the end of the size line.
    SizeLf,
    /// In chunk data (`size` bytes left).
    Data,
    /// After the data: CR, then LF.
    DataCr,
    DataLf,
    /// After the last chunk: at the start of a trailer line (or the final CRLF).
    TrailerStart,
    /// In a trailer line.
    Trailer,
    TrailerLf,
    /// CR of the final empty line seen.
    EndLf,
    Done,
}

impl Chunks {
    /// Whether the body is complete.
    pub(super) fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Follows `bytes`: how many belong to the body (all of them until it ends), and whether
    /// the byte after those broke the framing (the count is then of the valid ones).
    pub(super) fn feed(&mut self, bytes: &[u8]) -> (usize, Result<(), Invalid>) {
        let mut i = 0;
        let r = self.follow(bytes, &mut i);
        (i, r)
    }

    fn follow(&mut self, bytes: &[u8], at: &mut usize) -> Result<(), Invalid> {
        let i = at;
        while *i < bytes.len() && self.state != State::Done {
            let b = bytes[*i];
            if self.state == State::Data {
                let n = usize::try_from(self.size).unwrap_or(usize::MAX);
                let take = n.min(bytes.len() - *i);
                *i += take;
                self.size -= take as u64;
                if self.size == 0 {
                    self.state = State::DataCr;
                }
                continue;
            }
            self.state = match (self.state, b) {
                (State::Size, _) | (State::Digits, _) if b.is_ascii_hexdigit() => {
                    if self.state == State::Size {
                        self.digits = 0;
                    }
                    self.digits += 1;
                    if self.digits > 16 {
                        return Err(Invalid("chunk size longer than 16 hex digits"));
                    }
                    let d = u64::from((b as char).to_digit(16).unwrap_or(0));
                    self.size = self
                        .size
                        .checked_mul(16)
                        .and_then(|s| s.checked_add(d))
                        .ok_or(Invalid("chunk size overflows"))?;
                    State::Digits
                }
                (State::Size, _) => return Err(Invalid("chunk size is not hex")),
                (State::Digits | State::AfterSize, b' ' | b'\t') => State::AfterSize,
                (State::Digits | State::AfterSize, b';') => State::Ext,
                (State::Digits, b'\r') => State::SizeLf,
                // Whitespace after a size is only allowed before an extension (RFC 9112 7.1.1).
                (State::AfterSize, b'\r') => return Err(Invalid("whitespace after a chunk size")),
                (State::Digits | State::AfterSize, _) => return Err(Invalid("bad chunk size")),
                (State::Ext, b'\r') => State::SizeLf,
                (State::Ext, b'\n') => return Err(Invalid("bare LF in a chunk extension")),
                (State::Ext, b) if b != b'\t' && (b < 0x20 || b == 0x7f) => {
                    return Err(Invalid("control byte in a chunk extension"))
                }
                (State::Ext, _) => State::Ext,
                (State::SizeLf, b'\n') if self.size == 0 => State::TrailerStart,
                (State::SizeLf, b'\n') => State::Data,
                (State::DataCr, b'\r') => State::DataLf,
                (State::DataLf, b'\n') => State::Size,
                (State::TrailerStart, b'\r') => State::EndLf,
                (State::TrailerStart, b' ' | b'\t') => return Err(Invalid("obs-fold trailer")),
                (State::Trailer, b'\r') if self.colon => State::TrailerLf,
                (State::Trailer, b'\r') => return Err(Invalid("trailer line without a colon")),
                (State::TrailerStart | State::Trailer, b'\n') => {
                    return Err(Invalid("bare LF in a trailer"))
                }
                (State::TrailerStart | State::Trailer, b)
                    if b != b'\t' && (b < 0x20 || b == 0x7f) =>
                {
                    return Err(Invalid("control byte in a trailer"))
                }
                // A trailer line is `name: value`: a token, then its colon.
                (State::TrailerStart, b) if is_tchar(b) => {
                    self.colon = false;
                    State::Trailer
                }
                (State::TrailerStart, _) => return Err(Invalid("bad trailer name")),
                (State::Trailer, b':') if !self.colon => {
                    self.colon = true;
                    State::Trailer
                }
                (State::Trailer, b) if !self.colon && !is_tchar(b) => {
                    return Err(Invalid("bad trailer name"))
                }
                (State::Trailer, _) => State::Trailer,
                (State::TrailerLf, b'\n') => State::TrailerStart,
                (State::EndLf, b'\n') => State::Done,
                _ => return Err(Invalid("bad chunked framing")),
            };
            *i += 1;
        }
        Ok(())
    }
}

/// An HTTP token character (RFC 9110 5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(body: &[u8]) -> Result<(bool, usize), Invalid> {
        let mut c = Chunks::default();
        let (n, r) = c.feed(body);
        r.map(|()| (c.done(), n))
    }

    #[test]
    fn chunked_bodies_end_where_they_say() {
        let b = b"3\r\nabc\r\n0\r\n\r\nGET";
        assert_eq!(run(b).unwrap(), (true, b.len() - 3));
        let t = b"a;x=1\r\n0123456789\r\n0\r\nx-t: 1\r\n\r\n";
        assert_eq!(run(t).unwrap(), (true, t.len()));
        // Byte by byte gives the same.
        let mut c = Chunks::default();
        for b in t {
            assert_eq!(c.feed(&[*b]).0, 1);
        }
        assert!(c.done());
        assert_eq!(run(b"3\r\nab").unwrap(), (false, 5));
    }

    #[test]
    fn bad_chunk_framing_is_refused() {
        for bad in [
            &b"x\r\n"[..],
            b"-1\r\n",
            b"0x3\r\nabc\r\n",
            b"3\nabc\r\n",
            b"3\r\nabcX\r\n",
            b"11111111111111111\r\n",
            b"3 4\r\n",
            b"0\r\nx: 1\n\r\n",
            b"0\r\n folded\r\n\r\n",
            b"0\r\n\n",
            // Found by an outside attack: relayed as is, read differently by some hops.
            b"5 \t \r\nhello\r\n",
            b"000000000000000000000005\r\nhello\r\n",
            b"0\r\ngarbage line\r\n\r\n",
            b"0\r\nx y: 1\r\n\r\n",
            b"0\r\n: 1\r\n\r\n",
        ] {
            assert!(run(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn response_framing() {
        let f =
            |raw: &str, head: bool| match parse(raw.as_bytes(), head, &mut FieldStore::default()) {
                Ok(Read::Final(h)) => Ok(h.framing),
                Ok(Read::Informational(n)) => Ok(Framing::Length(n as u64 + 1_000_000)),
                Ok(Read::Partial) => Err("partial"),
                Err(e) => Err(e.0),
            };
        assert_eq!(
            f("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", false),
            Ok(Framing::Length(2))
        );
        assert_eq!(
            f("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", true),
            Ok(Framing::Empty)
        );
        assert_eq!(
            f("HTTP/1.1 204 No Content\r\n\r\n", false),
            Ok(Framing::Empty)
        );
        assert_eq!(
            f(
                "HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
                false
            ),
            Ok(Framing::Empty)
        );
        assert_eq!(
            f(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                false
            ),
            Ok(Framing::Chunked)
        );
        assert_eq!(f("HTTP/1.1 200 OK\r\n\r\n", false), Ok(Framing::Close));
        assert!(matches!(
            f("HTTP/1.1 100 Continue\r\n\r\n", false),
            Ok(Framing::Length(_))
        ));
        for bad in [
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            "HTTP/1.1 200 OK\ncontent-length: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\nx: 1\r\n folded\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        ] {
            assert!(f(bad, false).is_err(), "{bad:?}");
        }
    }
}
