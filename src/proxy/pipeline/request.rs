//! What the proxy reads from a client's request before routing it: its host, whether it is
//! gRPC, whether it carries a body, and header spellings that would smuggle a second token.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Version};
use http_body::Body;

use super::fields::{same_name, Fields};
use crate::fence::reject::Rejection;
use crate::proxy::host::{self, HostPort};

/// A request's head as the checks read it: hyper's parsed [`Request`] on hyper's path, the
/// client's own bytes on the fast path. Every rule of [`super::Proxy::admit`] reads a request
/// only through this, so that both paths judge it by the same code.
pub(super) trait RequestView {
    /// The head's fields.
    type Fields: Fields;

    /// The method as the client spelled it.
    fn method(&self) -> &str;
    /// The target's path (no query).
    fn path(&self) -> &str;
    /// The authority of an absolute-form target or HTTP/2's `:authority`.
    fn authority(&self) -> Option<&str>;
    fn version(&self) -> Version;
    fn fields(&self) -> &Self::Fields;
    /// No body bytes follow the head (as `Body::is_end_stream`).
    fn body_ended(&self) -> bool;
    /// The body's length, when the framing says it up front.
    fn body_length(&self) -> Option<u64>;
    /// The client already reset the stream (seen while `peek::settle` waited for its first
    /// frame): there is nobody left to answer.
    fn client_gone(&self) -> bool {
        false
    }
}

impl<B: Body> RequestView for Request<B> {
    type Fields = HeaderMap;

    fn method(&self) -> &str {
        Request::method(self).as_str()
    }

    fn path(&self) -> &str {
        self.uri().path()
    }

    fn authority(&self) -> Option<&str> {
        self.uri().authority().map(|a| a.as_str())
    }

    fn version(&self) -> Version {
        Request::version(self)
    }

    fn fields(&self) -> &HeaderMap {
        self.headers()
    }

    fn body_ended(&self) -> bool {
        self.body().is_end_stream() && self.extensions().get::<Peeked>().is_none()
    }

    fn body_length(&self) -> Option<u64> {
        if self.extensions().get::<Peeked>().is_some() {
            return None;
        }
        self.body().size_hint().exact()
    }

    fn client_gone(&self) -> bool {
        matches!(self.extensions().get::<Peeked>(), Some(Peeked::Failed(_)))
    }
}

/// The request's content type if it is gRPC (see [`crate::fence::grpc::grpc_content_type`]).
pub(super) fn grpc_content_type(fields: &impl Fields) -> Option<HeaderValue> {
    fields
        .first(&header::CONTENT_TYPE)
        .filter(|v| crate::fence::grpc::is_grpc_content_type(v))
        .and_then(|v| HeaderValue::from_bytes(v).ok())
}

/// The host the request is for, validated (see [`crate::proxy::host`]).
///
/// Every request must name exactly one host: HTTP/1.1 without Host is a 400 (RFC 9112 3.2),
/// and so is an HTTP/1.0 or HTTP/2 request with neither Host nor authority, since a host-scoped
/// route could not judge it. Two Host headers, or a Host that disagrees with the request's
/// authority (HTTP/2 `:authority`, HTTP/1.1 absolute-form), are refused too.
pub(super) fn request_host(req: &impl RequestView) -> Result<HostPort<'_>, &'static str> {
    let mut hosts = req.fields().values(&header::HOST);
    let header = hosts.next();
    if hosts.next().is_some() {
        return Err("more than one Host header");
    }
    let header = header
        .map(|h| {
            // As `HeaderValue::to_str`: visible ASCII (then also UTF-8).
            super::fields::is_text(h)
                .then(|| std::str::from_utf8(h).ok())
                .flatten()
                .ok_or("the Host header is not visible ASCII")
        })
        .transpose()?;
    let authority = req.authority();
    let raw = match (header, authority) {
        (Some(h), Some(a)) if !h.eq_ignore_ascii_case(a) => {
            return Err("the Host header disagrees with the request's authority")
        }
        (Some(h), _) => h,
        (None, Some(a)) => a,
        (None, None) if req.version() == Version::HTTP_11 => {
            return Err("an HTTP/1.1 request must have a Host header")
        }
        (None, None) => return Err("the request names no host (no Host header or authority)"),
    };
    host::parse(raw)
}

/// The body's first frame that was not an empty DATA frame, read by `peek::settle`: the upstream
/// body yields it first.
#[derive(Debug, Clone)]
pub(super) enum Peeked {
    Data(bytes::Bytes),
    Trailers(http::HeaderMap),
    /// The client's stream failed (a reset): the body fails with this.
    Failed(String),
}

/// Methods that carry no body by convention (RFC 9110 9.3): an upstream may never read one.
pub(super) fn is_bodiless_method(m: &str) -> bool {
    // Whatever the case: routing matches methods case-insensitively (a legacy upstream may
    // take `get` for GET), so `get` with a body is the same smuggling vector as GET.
    ["GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"]
        .iter()
        .any(|b| b.eq_ignore_ascii_case(m))
}

/// A request whose `Transfer-Encoding` both data paths refuse (RFC 9112 6), as hyper hands
/// it over: more than one `Transfer-Encoding` field or `chunked` applied twice (400), a coding
/// palisade does not decode, such as `gzip, chunked` or `identity, chunked` (501, as RFC 9112
/// 6.1 asks). hyper refuses itself a coding list that does not end in `chunked` and a
/// `Content-Length` list; what hyper hides (a second `Content-Length`, one beside
/// `Transfer-Encoding`, bare-LF line ends) is judged on the raw head by
/// `server::framing::ambiguity`, on both paths. The fast path hands every `Transfer-Encoding`
/// request to hyper, so this rule judges them all.
pub(super) fn framing_refusal(req: &impl RequestView) -> Option<Rejection> {
    let mut fields = req.fields().values(&header::TRANSFER_ENCODING);
    let codings = fields.next()?;
    if fields.next().is_some() {
        return Some(Rejection::BadRequest(
            "more than one Transfer-Encoding field",
        ));
    }
    let mut chunked = 0;
    for coding in codings.split(|b| *b == b',').map(<[u8]>::trim_ascii) {
        if coding.eq_ignore_ascii_case(b"chunked") {
            chunked += 1;
        } else if !coding.is_empty() {
            return Some(Rejection::UnsupportedTransferCoding);
        }
    }
    (chunked != 1).then_some(Rejection::BadRequest(
        "Transfer-Encoding must be chunked, once",
    ))
}

/// Whether the request carries body bytes: a Content-Length other than 0, chunked framing,
/// or HTTP/2 DATA still to come.
pub(super) fn has_body(req: &impl RequestView) -> bool {
    let f = req.fields();
    !req.body_ended()
        || f.first(&header::CONTENT_LENGTH).is_some_and(|v| v != b"0")
        || f.contains(&header::TRANSFER_ENCODING)
}

/// Whether the field name `name` (any case) reads as `token` to a CGI/WSGI server, which maps
/// `-` and `_` alike to `_` and ignores case (`x_fencing_token`, `X-Fencing_Token`, ...).
pub(super) fn same_under_cgi(name: &[u8], token: &HeaderName) -> bool {
    let (a, b) = (name, token.as_str().as_bytes());
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.eq_ignore_ascii_case(y) || (matches!(x, b'-' | b'_') && matches!(y, b'-' | b'_'))
        })
}

/// A field name other than `token` itself that a CGI-style upstream would merge with it.
pub(super) fn token_alias<'a>(fields: &'a impl Fields, token: &HeaderName) -> Option<&'a [u8]> {
    let len = token.as_str().len();
    fields
        .names()
        .find(|n| n.len() == len && !same_name(n, token) && same_under_cgi(n, token))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn grpc_content_types() {
        let is = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            grpc_content_type(&h).is_some()
        };
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=utf-8",
            "Application/GRPC+json",
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text+proto",
        ] {
            assert!(is(yes), "{yes}");
        }
        for no in [
            "application/grpcfoo",
            "application/grpc-other",
            "application/grpc-webx",
            "application/json",
            "application/grp",
        ] {
            assert!(!is(no), "{no}");
        }
    }

    #[test]
    fn cgi_aliases_of_the_token_header() {
        let t = HeaderName::from_static("x-fencing-token");
        let mut h = HeaderMap::new();
        h.insert("x-fencing-token", HeaderValue::from_static("5"));
        assert_eq!(token_alias(&h, &t), None);
        for alias in ["x_fencing_token", "x-fencing_token", "x_fencing-token"] {
            let mut h = h.clone();
            h.insert(
                HeaderName::from_bytes(alias.as_bytes()).unwrap(),
                HeaderValue::from_static("1"),
            );
            assert_eq!(token_alias(&h, &t), Some(alias.as_bytes()));
        }
    }
}
