//! What the proxy reads from a client's request before routing it: its host, whether it is
//! gRPC, whether it carries a body, and header spellings that would smuggle a second token.

use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Version};
use http_body::Body;

use crate::host::{self, HostPort};

pub(super) use crate::reject::grpc_content_type;

/// The host the request is for, validated (see [`crate::host`]).
///
/// Every request must name exactly one host: HTTP/1.1 without Host is a 400 (RFC 9112 3.2),
/// and so is an HTTP/1.0 or HTTP/2 request with neither Host nor authority, since a host-scoped
/// route could not judge it. Two Host headers, or a Host that disagrees with the request's
/// authority (HTTP/2 `:authority`, HTTP/1.1 absolute-form), are refused too.
pub(super) fn request_host<B>(req: &Request<B>) -> Result<HostPort<'_>, &'static str> {
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let header = hosts.next();
    if hosts.next().is_some() {
        return Err("more than one Host header");
    }
    let header = header
        .map(|h| {
            h.to_str()
                .map_err(|_| "the Host header is not visible ASCII")
        })
        .transpose()?;
    let authority = req.uri().authority().map(|a| a.as_str());
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

/// Methods that carry no body by convention (RFC 9110 9.3): an upstream may never read one.
pub(super) fn is_bodiless_method(m: &Method) -> bool {
    // Whatever the case: routing matches methods case-insensitively (a legacy upstream may
    // take `get` for GET), so `get` with a body is the same smuggling vector as GET.
    [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::TRACE,
        Method::CONNECT,
    ]
    .iter()
    .any(|b| b.as_str().eq_ignore_ascii_case(m.as_str()))
}

/// Whether the request carries body bytes: a Content-Length other than 0, chunked framing,
/// or HTTP/2 DATA still to come.
pub(super) fn has_body<B: Body>(req: &Request<B>) -> bool {
    !req.body().is_end_stream()
        || req
            .headers()
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
        || req.headers().contains_key(header::TRANSFER_ENCODING)
}

/// Whether `name` reads as `token` to a CGI/WSGI server, which maps `-` and `_` alike to `_`
/// (`x_fencing_token`, `x-fencing_token`, ...). Header names are already lower case.
pub(super) fn same_under_cgi(name: &HeaderName, token: &HeaderName) -> bool {
    let (a, b) = (name.as_str().as_bytes(), token.as_str().as_bytes());
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x == y || (matches!(x, b'-' | b'_') && matches!(y, b'-' | b'_')))
}

/// A header other than `token` itself that a CGI-style upstream would merge with it.
pub(super) fn token_alias<'a>(
    headers: &'a HeaderMap,
    token: &HeaderName,
) -> Option<&'a HeaderName> {
    let len = token.as_str().len();
    headers
        .keys()
        .find(|n| n.as_str().len() == len && *n != token && same_under_cgi(n, token))
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
            assert_eq!(token_alias(&h, &t).map(HeaderName::as_str), Some(alias));
        }
    }
}
