//! Turning the client's request into the upstream's: URI, version, hop-by-hop headers,
//! `x-forwarded-*`, and the Host the upstream sees.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Uri, Version};
use hyper::body::Incoming;

use super::body::RequestBody;
use super::upstream::Upstream;
use crate::config::{Protocol, RouteSettings};

/// What `prepare` needs to know beyond the request itself.
pub(super) struct Forward<'a> {
    pub(super) head: Head<'a>,
    /// The request body's half of a guarded request's drain ticket.
    pub(super) ticket: Option<crate::drain::Ticket>,
    /// `max_body_bytes`, counted as the body streams (its length was not known up front).
    pub(super) limit: Option<super::body::BodyLimit>,
    /// A guarded request's "handed over whole" flag.
    pub(super) delivered: Option<super::body::Delivered>,
}

/// What [`rewrite_head`] needs to know beyond the request head itself.
pub(super) struct Head<'a> {
    pub(super) route: &'a RouteSettings,
    pub(super) token_header: &'a HeaderName,
    pub(super) upstream: &'a Upstream,
    pub(super) rewritten_path: Option<String>,
    /// The client's `host[:port]` without its trailing dot, when it had one.
    pub(super) normalized_host: Option<String>,
    pub(super) peer: SocketAddr,
    /// Close the upstream connection after this request (a body on a bodiless method).
    pub(super) close: bool,
    /// The client's connection is TLS: `x-forwarded-proto: https`.
    pub(super) https: bool,
}

/// Turns the client's request into the upstream request, in place.
pub(super) fn prepare(req: Request<Incoming>, f: Forward<'_>) -> Request<RequestBody> {
    let (mut parts, body) = req.into_parts();
    let strip = f
        .head
        .route
        .strip_token
        .then(|| f.head.token_header.clone());
    rewrite_head(&mut parts, f.head);
    Request::from_parts(
        parts,
        RequestBody::new(body, strip, f.ticket, f.limit, f.delivered),
    )
}

/// Turns the client's request head into the upstream's, in place: URI, version, hop-by-hop
/// headers, the token header, Host and `x-forwarded-*`. hyper's path and the HTTP/1.1 fast
/// path both call it, so the upstream sees the same head whichever path served the client.
pub(super) fn rewrite_head(parts: &mut http::request::Parts, f: Head<'_>) {
    let settings = &f.upstream.settings;
    let path_and_query = match (f.rewritten_path, parts.uri.query()) {
        (None, _) => parts.uri.path_and_query().cloned(),
        (Some(p), None) => PathAndQuery::try_from(p).ok(),
        (Some(p), Some(q)) => PathAndQuery::try_from(format!("{p}?{q}")).ok(),
    };
    // The host the upstream sees is the one routing judged: a trailing dot is removed for
    // both (see `crate::host`), so `api.example.com.` cannot be routed as one host and served
    // as another.
    let normalized_host = f.normalized_host;
    // Parsed only where it is used (h2c's :authority, or a Host to fill in): HTTP/1.1 requests
    // with a Host of their own skip it.
    let needs_authority = settings.protocol.is_http2()
        || normalized_host.is_some()
        || !parts.headers.contains_key(header::HOST);
    let client_authority = if !needs_authority {
        None
    } else {
        match &normalized_host {
            Some(h) => http::uri::Authority::try_from(h.as_str()).ok(),
            None => parts
                .headers
                .get(header::HOST)
                .and_then(|h| http::uri::Authority::try_from(h.as_bytes()).ok())
                .or_else(|| parts.uri.authority().cloned()),
        }
    };
    let path_and_query = path_and_query.unwrap_or_else(|| PathAndQuery::from_static("/"));
    let mut uri = http::uri::Parts::default();
    match settings.protocol {
        // The connector always dials the upstream, so the URI can carry the client's
        // authority: HTTP/2 sends it as :authority (which must agree with any Host).
        Protocol::H2c | Protocol::H2 => {
            uri.scheme = Some(settings.scheme.clone());
            uri.authority = Some(
                client_authority
                    .clone()
                    .unwrap_or_else(|| settings.authority.clone()),
            );
            uri.path_and_query = Some(path_and_query);
        }
        // hyper's HTTP/1.1 connection writes the URI as given: origin-form (`/path?query`),
        // CONNECT's authority-form; the Host header is set below.
        Protocol::Http1 if parts.method == http::Method::CONNECT => {
            uri.authority = Some(settings.authority.clone());
        }
        Protocol::Http1 => uri.path_and_query = Some(path_and_query),
    }
    parts.uri = Uri::from_parts(uri).expect("the URI's parts agree with its form");
    parts.version = match settings.protocol {
        Protocol::Http1 => Version::HTTP_11,
        Protocol::H2c | Protocol::H2 => Version::HTTP_2,
    };

    let h = &mut parts.headers;
    strip_hop_by_hop(h, f.token_header);
    if f.route.strip_token {
        h.remove(f.token_header);
    }
    match settings.protocol {
        Protocol::H2c | Protocol::H2 => {
            h.remove(header::HOST);
        }
        Protocol::Http1 => {
            let missing = !h.contains_key(header::HOST);
            if missing || normalized_host.is_some() {
                if let Some(a) =
                    client_authority.and_then(|a| HeaderValue::from_str(a.as_str()).ok())
                {
                    h.insert(header::HOST, a);
                }
            }
            if f.close {
                h.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
        }
    }
    let xff = if h.contains_key(&X_FORWARDED_FOR) {
        let prior: Vec<&str> = h
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        HeaderValue::from_str(&format!("{}, {}", prior.join(", "), f.peer.ip())).ok()
    } else {
        Some(ip_header(f.peer.ip()))
    };
    if let Some(v) = xff {
        h.insert(X_FORWARDED_FOR, v);
    }
    h.insert(
        X_FORWARDED_PROTO,
        HeaderValue::from_static(if f.https { "https" } else { "http" }),
    );
}

fn ip_header(ip: std::net::IpAddr) -> HeaderValue {
    use std::io::Write;
    // Formats into a stack buffer: no String allocation per request.
    let mut buf = [0u8; 48];
    let mut cur = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(cur, "{ip}");
    let n = cur.position() as usize;
    HeaderValue::from_bytes(&buf[..n]).expect("an IP address is a valid header value")
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Removes the headers that describe one connection rather than the message (RFC 9110 7.6.1),
/// keeping `te: trailers`, which gRPC needs end to end. Headers that a `Connection` header
/// names are removed too, except the fencing token, Host and Content-Length: a client must
/// not be able to strip what the upstream relies on.
pub(super) fn strip_hop_by_hop(h: &mut HeaderMap, protect: &HeaderName) {
    // Most messages carry none of these: one pass over the names is cheaper than eight
    // hashed removals on the hot path.
    let hop = |n: &HeaderName| {
        n == header::CONNECTION
            || n == header::TE
            || n == header::TRANSFER_ENCODING
            || n == header::UPGRADE
            || n == header::PROXY_AUTHORIZATION
            || n == header::PROXY_AUTHENTICATE
            || n == KEEP_ALIVE
            || n == PROXY_CONNECTION
    };
    if !h.keys().any(hop) {
        return;
    }
    // `Connection: keep-alive` (or `close`), what nearly every HTTP/1.1 message carries, names
    // no other header: no list to build.
    let names_others = h.get_all(header::CONNECTION).iter().any(|v| {
        v.as_bytes().split(|b| *b == b',').any(|t| {
            let t = t.trim_ascii();
            !t.is_empty()
                && !t.eq_ignore_ascii_case(b"keep-alive")
                && !t.eq_ignore_ascii_case(b"close")
        })
    });
    let named: Vec<HeaderName> = if !names_others {
        Vec::new()
    } else {
        h.get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|s| s.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect()
    };
    for n in named {
        if n != header::TE && n != header::HOST && n != header::CONTENT_LENGTH && n != *protect {
            h.remove(n);
        }
    }
    for n in [
        header::CONNECTION,
        KEEP_ALIVE,
        PROXY_CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ] {
        h.remove(n);
    }
    if let Some(te) = h.get(header::TE) {
        let trailers = te.to_str().is_ok_and(|s| {
            s.split(',').any(|p| {
                p.split(';')
                    .next()
                    .is_some_and(|p| p.trim().eq_ignore_ascii_case("trailers"))
            })
        });
        if trailers {
            h.insert(header::TE, HeaderValue::from_static("trailers"));
        } else {
            h.remove(header::TE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_and_te_trailers_stays() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::TE, HeaderValue::from_static("trailers, deflate"));
        h.insert("x-fencing-token", HeaderValue::from_static("7"));
        h.append(
            header::CONNECTION,
            HeaderValue::from_static("x-fencing-token, host, x-second"),
        );
        h.insert("x-second", HeaderValue::from_static("2"));
        strip_hop_by_hop(&mut h, &HeaderName::from_static("x-fencing-token"));
        assert_eq!(h.len(), 2, "{h:?}");
        assert_eq!(h[header::TE], "trailers");
        assert_eq!(h["x-fencing-token"], "7");
    }
}
