//! Turning the client's request into the upstream's: URI, version, hop-by-hop headers,
//! `x-forwarded-*`, and the Host the upstream sees.

use std::net::SocketAddr;

use http::header::{self, HeaderName};
use http::uri::PathAndQuery;
use http::{Request, Uri, Version};
use hyper::body::Incoming;

use super::fields::{is_text, same_name, Fields, FieldsMut, NewValue};
use super::request_body::RequestBody;
use super::upstream::Upstream;
use crate::proxy::config::{Protocol, RouteSettings};

/// What `prepare` needs to know beyond the request itself.
pub(super) struct Forward<'a> {
    pub(super) head: UpstreamHead<'a>,
    /// The request body's half of a guarded request's drain ticket.
    pub(super) ticket: Option<crate::fence::drain::Ticket>,
    /// `max_body_bytes`, counted as the body streams (its length was not known up front).
    pub(super) limit: Option<super::request_body::BodyLimit>,
    /// A guarded request's "handed over whole" flag.
    pub(super) delivered: Option<super::request_body::Delivered>,
    /// Set when the client's body fails.
    pub(super) client_failed: Option<super::request_body::ClientFailed>,
}

/// What [`rewrite_head`] needs to know beyond the request head itself.
pub(super) struct UpstreamHead<'a> {
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
    let first = parts.extensions.remove::<super::request::Peeked>();
    // hyper's client sends a GET (HEAD, CONNECT) body of unknown length as no body at all
    // unless the head says chunked: a route that forwards GET bodies says it.
    let chunked = f.head.close
        && f.head.upstream.settings.protocol == Protocol::Http1
        && !parts.headers.contains_key(header::CONTENT_LENGTH)
        && (first.is_some() || http_body::Body::size_hint(&body).exact().is_none());
    rewrite_head(&mut parts, f.head);
    if chunked {
        parts.headers.insert(
            header::TRANSFER_ENCODING,
            http::HeaderValue::from_static("chunked"),
        );
    }
    Request::from_parts(
        parts,
        RequestBody::new(
            (first, body),
            strip,
            f.ticket,
            f.limit,
            (f.delivered, f.client_failed),
        ),
    )
}

/// Turns the client's request head into the upstream's, in place: URI, version, hop-by-hop
/// headers, the token header, Host and `x-forwarded-*`. hyper's path calls it; the HTTP/1.1
/// fast path writes the same head from the client's bytes with the same parts
/// ([`upstream_target`], [`client_authority`], [`rewrite_fields`]), so the upstream sees the
/// same head whichever path served the client.
pub(super) fn rewrite_head(parts: &mut http::request::Parts, mut f: UpstreamHead<'_>) {
    let settings = &f.upstream.settings;
    let path_and_query = match f.rewritten_path.take() {
        None => parts.uri.path_and_query().cloned(),
        Some(p) => upstream_target(p, parts.uri.query()),
    };
    let client_authority = client_authority(
        settings.protocol,
        f.normalized_host.as_deref(),
        &parts.headers,
        parts.uri.authority(),
    );
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
    rewrite_fields(&mut parts.headers, &f, client_authority.as_ref());
}

/// The target the upstream sees when the path's normal form differs from the client's
/// spelling: the normal form and the client's query; `None` (sent as `/`) if that is not a
/// valid target.
pub(super) fn upstream_target(normal: String, query: Option<&str>) -> Option<PathAndQuery> {
    match query {
        None => PathAndQuery::try_from(normal).ok(),
        Some(q) => PathAndQuery::try_from(format!("{normal}?{q}")).ok(),
    }
}

/// The client's authority, where the upstream needs it: for h2c's `:authority`, or a Host to
/// fill in or normalize. `None` otherwise: HTTP/1.1 requests with a Host of their own, the
/// common case, skip parsing it.
pub(super) fn client_authority(
    protocol: Protocol,
    normalized_host: Option<&str>,
    fields: &impl Fields,
    uri_authority: Option<&http::uri::Authority>,
) -> Option<http::uri::Authority> {
    // The host the upstream sees is the one routing judged: a trailing dot is removed for
    // both (see `crate::proxy::host`), so `api.example.com.` cannot be routed as one host and served
    // as another.
    let needs_authority =
        protocol.is_http2() || normalized_host.is_some() || !fields.contains(&header::HOST);
    if !needs_authority {
        return None;
    }
    match normalized_host {
        Some(h) => http::uri::Authority::try_from(h).ok(),
        None => fields
            .first(&header::HOST)
            .and_then(|h| http::uri::Authority::try_from(h).ok())
            .or_else(|| uri_authority.cloned()),
    }
}

/// The header rules of [`rewrite_head`], on either path's fields: hop-by-hop headers, the
/// token header, Host (`authority`: from [`client_authority`]) and `x-forwarded-*`.
pub(super) fn rewrite_fields<F: FieldsMut>(
    h: &mut F,
    f: &UpstreamHead<'_>,
    authority: Option<&http::uri::Authority>,
) {
    strip_hop_by_hop(h, f.token_header);
    if f.route.strip_token {
        h.remove(f.token_header);
    }
    match f.upstream.settings.protocol {
        Protocol::H2c | Protocol::H2 => h.remove(&header::HOST),
        Protocol::Http1 => {
            let missing = !h.contains(&header::HOST);
            if missing || f.normalized_host.is_some() {
                if let Some(a) = authority {
                    h.insert(&header::HOST, NewValue::Bytes(a.as_str().as_bytes()));
                }
            }
            if f.close {
                h.insert(&header::CONNECTION, NewValue::Static("close"));
            }
        }
    }
    // The peer's address, after any the client sent (those that read as text).
    let ip = ip_text(f.peer.ip());
    if h.contains(&X_FORWARDED_FOR) {
        let mut list = Vec::with_capacity(64);
        for (i, prior) in h
            .values(&X_FORWARDED_FOR)
            .filter(|v| is_text(v))
            .enumerate()
        {
            if i > 0 {
                list.extend_from_slice(b", ");
            }
            list.extend_from_slice(prior);
        }
        list.extend_from_slice(b", ");
        list.extend_from_slice(ip.as_bytes());
        h.insert(&X_FORWARDED_FOR, NewValue::Bytes(&list));
    } else {
        h.insert(&X_FORWARDED_FOR, NewValue::Bytes(ip.as_bytes()));
    }
    h.insert(
        &X_FORWARDED_PROTO,
        NewValue::Static(if f.https { "https" } else { "http" }),
    );
}

/// An IP address as text, formatted on the stack: no allocation per request.
struct IpText {
    buf: [u8; 48],
    len: usize,
}

impl IpText {
    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

fn ip_text(ip: std::net::IpAddr) -> IpText {
    use std::io::Write;
    let mut buf = [0u8; 48];
    let mut cur = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(cur, "{ip}");
    let len = cur.position() as usize;
    IpText { buf, len }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Removes the headers that describe one connection rather than the message (RFC 9110 7.6.1),
/// keeping `te: trailers`, which gRPC needs end to end. Headers that a `Connection` header
/// names are removed too, except the fencing token, Host and Content-Length: a client must
/// not be able to strip what the upstream relies on. Requests and responses, both paths.
pub(super) fn strip_hop_by_hop<F: FieldsMut>(h: &mut F, protect: &HeaderName) {
    const HOP: [HeaderName; 8] = [
        header::CONNECTION,
        header::TE,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
        KEEP_ALIVE,
        PROXY_CONNECTION,
    ];
    // Most messages carry none of these: one pass over the names is cheaper than eight
    // removals on the hot path.
    if !h.names().any(|n| HOP.iter().any(|hop| same_name(n, hop))) {
        return;
    }
    // `Connection: keep-alive` (or `close`), what nearly every HTTP/1.1 message carries, names
    // no other header: no list to build.
    let names_others = h.values(&header::CONNECTION).any(|v| {
        v.split(|b| *b == b',').any(|t| {
            let t = t.trim_ascii();
            !t.is_empty()
                && !t.eq_ignore_ascii_case(b"keep-alive")
                && !t.eq_ignore_ascii_case(b"close")
        })
    });
    let named: Vec<HeaderName> = if !names_others {
        Vec::new()
    } else {
        h.values(&header::CONNECTION)
            .filter(|v| is_text(v))
            .filter_map(|v| std::str::from_utf8(v).ok())
            .flat_map(|s| s.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect()
    };
    for n in named {
        if n != header::TE && n != header::HOST && n != header::CONTENT_LENGTH && n != *protect {
            h.remove(&n);
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
        h.remove(&n);
    }
    if let Some(te) = h.first(&header::TE) {
        let trailers = is_text(te)
            && std::str::from_utf8(te).is_ok_and(|s| {
                s.split(',').any(|p| {
                    p.split(';')
                        .next()
                        .is_some_and(|p| p.trim().eq_ignore_ascii_case("trailers"))
                })
            });
        if trailers {
            h.insert(&header::TE, NewValue::Static("trailers"));
        } else {
            h.remove(&header::TE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{HeaderMap, HeaderValue};

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
