//! The raw framing of HTTP/1.x request heads, judged the same on both data paths.
//!
//! A body is framed by one `Content-Length` or by `Transfer-Encoding` (ending in `chunked`),
//! never both, and every line of a head ends in CRLF. Anything else is a way for two hops to
//! disagree on where a request ends (request smuggling), so palisade refuses it with 400 and
//! closes the connection, as nginx does: bare-LF line ends, more than one `Content-Length`
//! (even equal ones), `Content-Length` with `Transfer-Encoding` ([`ambiguity`]).
//!
//! The fast path judges each head it reads with [`ambiguity`]. hyper accepts such heads and
//! hides the evidence (it drops a second `Content-Length` and one that comes with
//! `Transfer-Encoding`, and keeps no line ends), so on hyper's HTTP/1.x connections
//! [`Follow`] reads the bytes as hyper reads them, message by message (heads, then bodies by
//! their length or chunks), and marks the first ambiguous head; the service answers that
//! request with [`refused`] instead of serving it. Where the bytes stop being HTTP/1.x
//! messages hyper would take (a head or chunk hyper refuses itself, closing the connection)
//! following stops. An upgrade or CONNECT is followed like any request: after a 101 or a
//! tunnel hyper hands the service nothing more, and otherwise the connection goes on.

use http::{Response, StatusCode};

use super::body::ActiveBody;

/// Why a request head's framing is ambiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ambiguity {
    /// A line ends in LF without CR.
    BareLf,
    /// More than one `Content-Length` field.
    TwoLengths,
    /// `Content-Length` together with `Transfer-Encoding`.
    LengthAndCoding,
}

/// Whether the head `raw` (parsed by httparse into `fields`) frames its body ambiguously.
pub(crate) fn ambiguity(raw: &[u8], fields: &[httparse::Header<'_>]) -> Option<Ambiguity> {
    if raw
        .iter()
        .enumerate()
        .any(|(i, b)| *b == b'\n' && (i == 0 || raw[i - 1] != b'\r'))
    {
        return Some(Ambiguity::BareLf);
    }
    let named = |n: &str| {
        fields
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(n))
            .count()
    };
    match (named("content-length"), named("transfer-encoding")) {
        (2.., _) => Some(Ambiguity::TwoLengths),
        (1, 1..) => Some(Ambiguity::LengthAndCoding),
        _ => None,
    }
}

/// The answer to an ambiguous head on hyper's path, as the fast path gives it: 400, empty,
/// and the connection closed after it (where the request ends is not known, so nothing after
/// it can be read as a request).
pub(super) fn refused<B>() -> Response<ActiveBody<B>> {
    let mut resp = Response::new(ActiveBody::empty());
    *resp.status_mut() = StatusCode::BAD_REQUEST;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    // Said even to HEAD, as the fast path says it (hyper would leave it out there).
    h.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from_static("0"),
    );
    resp
}

/// Heads longer than this are not followed (hyper refuses them with 431 anyway).
const MAX_FOLLOWED_HEAD: usize = 1 << 20;
/// httparse's field limit for a followed head (hyper's is 100; a head with more is refused).
const MAX_FIELDS: usize = 128;

/// Where the bytes of an HTTP/1.x connection are, as hyper reads them.
#[derive(Debug)]
pub(super) enum Follow {
    /// A head, from its first byte (the bytes so far).
    Head(Vec<u8>),
    /// This many body bytes still to come.
    Length(u64),
    /// A chunked body.
    Chunked(Chunk),
    /// Not followed any more (see the module docs).
    Off,
}

/// Where a chunked body is.
#[derive(Debug, Clone, Copy)]
pub(super) enum Chunk {
    /// A chunk-size line: its value so far, whether any digit came, whether an extension began.
    Size { n: u64, digits: bool, ext: bool },
    /// This many bytes of chunk data still to come.
    Data(u64),
    /// The line end after a chunk's data.
    DataEnd { cr: bool },
    /// The trailer section: bytes on the current line.
    Trailers { line: usize },
}

/// What following a read found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Found {
    /// Heads completed in these bytes.
    pub(super) heads: u64,
    /// The first ambiguous one among them: its index in `heads` (0-based).
    pub(super) ambiguous: Option<u64>,
}

impl Default for Follow {
    fn default() -> Self {
        Follow::Head(Vec::new())
    }
}

impl Follow {
    /// Follows `bytes`, the next ones hyper reads.
    pub(super) fn feed(&mut self, mut bytes: &[u8]) -> Found {
        let mut found = Found::default();
        while !bytes.is_empty() {
            match self {
                Follow::Off => break,
                Follow::Head(head) => {
                    // A head that arrives whole is parsed where it is; only a partial one is
                    // kept.
                    let start = head.len();
                    if start > 0 {
                        head.extend_from_slice(bytes);
                    }
                    let parsed = {
                        let src: &[u8] = if start == 0 { bytes } else { head };
                        let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
                        let mut req = httparse::Request::new(&mut fields);
                        match req.parse(src) {
                            Ok(httparse::Status::Complete(len)) => Some(Some((
                                len,
                                ambiguity(&src[..len], req.headers),
                                body_of(&req),
                            ))),
                            Ok(httparse::Status::Partial) => Some(None),
                            Err(_) => None,
                        }
                    };
                    let (len, ambiguous, next) = match parsed {
                        Some(Some(done)) => done,
                        Some(None) => {
                            if start == 0 {
                                head.extend_from_slice(bytes);
                            }
                            if head.len() > MAX_FOLLOWED_HEAD {
                                *self = Follow::Off;
                            }
                            break;
                        }
                        None => {
                            *self = Follow::Off;
                            break;
                        }
                    };
                    // A head that was incomplete without these bytes ends inside them.
                    let Some(used) = len.checked_sub(start) else {
                        *self = Follow::Off;
                        break;
                    };
                    bytes = &bytes[used..];
                    let index = found.heads;
                    found.heads += 1;
                    if let Some(a) = ambiguous {
                        tracing::debug!(ambiguity = ?a, "ambiguous request framing");
                        found.ambiguous = Some(index);
                        *self = Follow::Off;
                        break;
                    }
                    *self = next;
                }
                Follow::Length(n) => {
                    let take = usize::try_from(*n).unwrap_or(usize::MAX).min(bytes.len());
                    bytes = &bytes[take..];
                    *n -= take as u64;
                    if *n == 0 {
                        *self = Follow::default();
                    }
                }
                Follow::Chunked(chunk) => match chunk.feed(bytes) {
                    Some((used, done)) => {
                        bytes = &bytes[used..];
                        if done {
                            *self = Follow::default();
                        }
                    }
                    None => *self = Follow::Off,
                },
            }
        }
        found
    }
}

/// What follows a head that is not ambiguous.
fn body_of(req: &httparse::Request<'_, '_>) -> Follow {
    let field = |n: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(n))
            .map(|h| h.value)
    };
    // An upgrade or CONNECT is followed by its framing too: a route that does not take it
    // over answers it as a plain request, and the connection goes on with HTTP/1.x (after a
    // 101 or a tunnel, hyper hands the service nothing more, whatever is marked here).
    if let Some(codings) = field("transfer-encoding") {
        let last = codings.rsplit(|b| *b == b',').next().unwrap_or_default();
        return if last.trim_ascii().eq_ignore_ascii_case(b"chunked") {
            Follow::Chunked(Chunk::Size {
                n: 0,
                digits: false,
                ext: false,
            })
        } else {
            Follow::Off // hyper refuses it
        };
    }
    match field("content-length").map(std::str::from_utf8) {
        None => Follow::default(),
        Some(Ok(v)) => match v.trim().parse::<u64>() {
            Ok(0) => Follow::default(),
            Ok(n) => Follow::Length(n),
            Err(_) => Follow::Off, // hyper refuses it
        },
        Some(Err(_)) => Follow::Off,
    }
}

impl Chunk {
    /// Follows `bytes` of a chunked body: how many belong to it, and whether it ended. `None`
    /// for bytes that are not a chunked body (hyper refuses them).
    fn feed(&mut self, bytes: &[u8]) -> Option<(usize, bool)> {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match self {
                Chunk::Size { n, digits, ext } => {
                    i += 1;
                    match b {
                        b'\n' if !*digits => return None,
                        b'\n' if *n == 0 => *self = Chunk::Trailers { line: 0 },
                        b'\n' => *self = Chunk::Data(*n),
                        b'\r' => {}
                        _ if *ext => {}
                        b';' | b' ' | b'\t' => *ext = true,
                        _ => {
                            let d = char::from(b).to_digit(16)?;
                            *n = n.checked_mul(16)?.checked_add(u64::from(d))?;
                            *digits = true;
                        }
                    }
                }
                Chunk::Data(n) => {
                    let take = usize::try_from(*n)
                        .unwrap_or(usize::MAX)
                        .min(bytes.len() - i);
                    i += take;
                    *n -= take as u64;
                    if *n == 0 {
                        *self = Chunk::DataEnd { cr: false };
                    }
                }
                Chunk::DataEnd { cr } => {
                    i += 1;
                    match b {
                        b'\r' if !*cr => *cr = true,
                        b'\n' => {
                            *self = Chunk::Size {
                                n: 0,
                                digits: false,
                                ext: false,
                            }
                        }
                        _ => return None,
                    }
                }
                Chunk::Trailers { line } => {
                    i += 1;
                    match b {
                        b'\n' if *line == 0 => return Some((i, true)),
                        b'\n' => *line = 0,
                        b'\r' => {}
                        _ => *line += 1,
                    }
                }
            }
        }
        Some((i, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fed(parts: &[&str]) -> (Vec<Found>, Follow) {
        let mut f = Follow::default();
        let found = parts.iter().map(|p| f.feed(p.as_bytes())).collect();
        (found, f)
    }

    fn found(heads: u64, ambiguous: Option<u64>) -> Found {
        Found { heads, ambiguous }
    }

    #[test]
    fn heads_and_bodies_are_followed_in_any_cuts() {
        let stream = "GET /a HTTP/1.1\r\nhost: x\r\n\r\n\
                      POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello\
                      POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
                      5;ext=1\r\nhello\r\n0\r\nx-t: 1\r\n\r\n\
                      \r\nGET /d HTTP/1.1\r\nhost: x\r\n\r\n";
        // Whole, and cut at every byte: the same four heads, none ambiguous.
        let (all, _) = fed(&[stream]);
        assert_eq!(all, vec![found(4, None)]);
        for cut in 1..stream.len() {
            let (parts, f) = fed(&[&stream[..cut], &stream[cut..]]);
            assert_eq!(
                parts.iter().map(|p| p.heads).sum::<u64>(),
                4,
                "cut at {cut}"
            );
            assert!(parts.iter().all(|p| p.ambiguous.is_none()), "cut at {cut}");
            assert!(
                matches!(f, Follow::Head(ref h) if h.is_empty()),
                "cut at {cut}: {f:?}"
            );
        }
    }

    #[test]
    fn the_first_ambiguous_head_is_marked_and_following_stops() {
        let ok = "GET /a HTTP/1.1\r\nhost: x\r\n\r\n";
        for bad in [
            "POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 1\r\n\r\nz",
            "POST /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ncontent-length: 1\r\n\r\n",
            "POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST /b HTTP/1.1\nhost: x\r\n\r\n",
            "POST /b HTTP/1.1\r\nhost: x\n\r\n",
        ] {
            let (f, state) = fed(&[&format!("{ok}{bad}{ok}")]);
            assert_eq!(f, vec![found(2, Some(1))], "{bad:?}");
            assert!(matches!(state, Follow::Off));
        }
    }

    /// An upgrade that a route does not take over is answered as a plain request and the
    /// connection goes on: what follows it is followed just the same.
    #[test]
    fn an_upgrade_request_does_not_stop_the_following() {
        let bad = "POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n";
        for first in [
            "GET /ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
            "CONNECT a:1 HTTP/1.1\r\nhost: a:1\r\n\r\n",
        ] {
            let (f, _) = fed(&[first, bad]);
            assert_eq!(f, vec![found(1, None), found(1, Some(0))], "{first:?}");
        }
    }

    #[test]
    fn what_is_not_plain_http_stops_being_followed() {
        for head in [
            "POST /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n",
            "GET / HTTP/1.1\r\nho st: x\r\n\r\n",
        ] {
            let (_, state) = fed(&[head, "POST /b HTTP/1.1\nhost: x\r\n\r\n"]);
            assert!(matches!(state, Follow::Off), "{head:?}");
        }
        let (f, state) =
            fed(&["POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"]);
        assert_eq!(f, vec![found(1, None)]);
        assert!(matches!(state, Follow::Off), "not a chunk size");
    }
}
