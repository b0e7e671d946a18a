//! The request head the upstream gets from the fast path, written from the client's bytes.
//!
//! Why here and not through `rewrite_head`: that one rewrites an `http::request::Parts`, which
//! the fast path would have to build (a map, names, values, a URI) for every request. The rules
//! are still the same code: the target from [`upstream_target`], Host from
//! [`client_authority`], every header rule from [`rewrite_fields`], applied to the client's
//! fields in place ([`super::fields`]). The tests check that the bytes are those hyper's path
//! would send.

use super::head::View;
use super::shared::rewrite::{self, client_authority, rewrite_fields, upstream_target};

/// Writes the upstream's head for the request in `view` (an admitted one, to an HTTP/1.1
/// upstream): `rewritten`, the normal form of its path when it differs; `rules`, the rest of
/// what `rewrite_head` would be told.
pub(super) fn write(
    out: &mut Vec<u8>,
    view: &mut View<'_>,
    rewritten: Option<String>,
    rules: &rewrite::UpstreamHead<'_>,
) {
    let authority = client_authority(
        rules.upstream.settings.protocol,
        rules.normalized_host.as_deref(),
        &view.fields,
        None,
    );
    out.extend_from_slice(view.method.as_bytes());
    out.push(b' ');
    match rewritten {
        None => out.extend_from_slice(view.target.as_bytes()),
        Some(normal) => {
            let target = upstream_target(normal, view.query());
            out.extend_from_slice(target.as_ref().map_or("/", |t| t.as_str()).as_bytes());
        }
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    rewrite_fields(&mut view.fields, rules, authority.as_ref());
    view.fields.write(out);
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use http::header::{HeaderMap, HeaderName, HeaderValue};

    use super::super::fields::FieldStore;
    use super::super::head::{parse, Parsed};
    use super::super::shared::rewrite::rewrite_head;
    use super::super::shared::{has_body, is_bodiless_method, request_host, Proxy};
    use super::*;
    use crate::fence::admission::Admission;
    use crate::fence::marks::MemoryStore;
    use crate::fence::metrics::Metrics;
    use crate::proxy::config::Config;

    const CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[marks]
store = "memory"
[[upstream]]
name = "raw"
url = "http://127.0.0.1:9"
protocol = "http1"
[[route]]
name = "strip"
upstream = "raw"
path_prefix = "/strip"
guard = false
strip_token = true
[[route]]
name = "rest"
upstream = "raw"
path_prefix = "/"
guard = false
"#;

    /// The head as the fast path wrote it before it stopped building `http` types: the
    /// request as hyper's path sees it, `rewrite_head`, then each header of the map.
    fn by_hyper_path(
        raw: &[u8],
        rewritten: Option<String>,
        rules: rewrite::UpstreamHead<'_>,
    ) -> Vec<u8> {
        let mut headers = [httparse::EMPTY_HEADER; 100];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(raw).unwrap();
        let mut map = HeaderMap::new();
        for h in req.headers.iter() {
            map.append(
                HeaderName::from_bytes(h.name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(h.value).unwrap(),
            );
        }
        let mut request = http::Request::new(());
        *request.method_mut() = http::Method::from_bytes(req.method.unwrap().as_bytes()).unwrap();
        *request.uri_mut() = http::Uri::try_from(req.path.unwrap()).unwrap();
        *request.headers_mut() = map;
        let (mut parts, ()) = request.into_parts();
        rewrite_head(
            &mut parts,
            rewrite::UpstreamHead {
                rewritten_path: rewritten,
                ..rules
            },
        );
        let mut out = Vec::new();
        out.extend_from_slice(parts.method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(
            parts
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .as_bytes(),
        );
        out.extend_from_slice(b" HTTP/1.1\r\n");
        for (name, value) in &parts.headers {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    const HEADS: &[&str] = &[
        "GET /orders/7 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nx-fencing-token: 5\r\n\r\n",
        "GET /a HTTP/1.1\r\nhost: x\r\nConnection: keep-alive, X-Secret\r\nx-secret: 1\r\nX-A: 1\r\nx-b: 2\r\nx-a: 3\r\n\r\n",
        "GET /a?q=1#frag HTTP/1.1\r\nHOST: Example.COM.\r\nTE: trailers, deflate\r\nKeep-Alive: 5\r\nProxy-Connection: x\r\n\r\n",
        "POST /strip/x HTTP/1.1\r\nhost: x:81\r\nX-Fencing-Token: 9\r\ncontent-length: 0\r\nx-forwarded-for: 1.1.1.1\r\nx-z: 1\r\nX-Forwarded-For: 2.2.2.2, \u{e9}\r\n\r\n",
        "GET /a/%c3%a9/c?x=%41 HTTP/1.1\r\nhost: x.\r\ncontent-length: 3\r\nte: gzip\r\nconnection: close\r\nx-forwarded-proto: https\r\n\r\nabc",
        "GET /%e2%82%acb#x HTTP/1.1\r\nhost: y\r\nconnection: te, host, content-length, x-fencing-token, x-q\r\nx-q: 1\r\nte: trailers\r\nproxy-authorization: a\r\nupgrade-insecure-requests: 1\r\n\r\n",
        "DELETE /strip HTTP/1.1\r\nx-a: 1\r\nhost: z\r\nx-fencing-token: 3\r\nx-b: 2\r\nx-c: 3\r\nx-forwarded-for: \r\n\r\n",
        "OPTIONS /x HTTP/1.1\r\nhost: [::1]:8080\r\ncontent-length: 1\r\n\r\nz",
    ];

    #[tokio::test]
    async fn the_upstream_gets_the_head_hyper_path_would_send() {
        let config = Config::parse(CONFIG, Path::new("p.toml")).unwrap();
        let metrics = Metrics::new(prometheus::Registry::new()).unwrap();
        let store: Arc<dyn crate::fence::marks::MarkStore> = Arc::new(MemoryStore::default());
        let admission = Admission::open(store, Vec::<String>::new(), &metrics)
            .await
            .unwrap();
        let proxy = Proxy::new(&config, Arc::new(admission), &metrics);
        let peers = ["10.0.0.1:5000", "[2001:db8::1]:5000"];
        let mut store = FieldStore::default();
        for raw in HEADS {
            for peer in peers {
                let raw = raw.as_bytes();
                let Parsed::Head(head) = parse(raw, 64 * 1024, &mut store) else {
                    panic!("{:?}", String::from_utf8_lossy(raw));
                };
                let mut view = View::new(&head, raw, &mut store);
                let normal = crate::fence::path::normalize(view.path).unwrap();
                let route = match normal.starts_with("/strip") {
                    true => &proxy.routes[0],
                    false => &proxy.routes[1],
                };
                let rewritten = match normal {
                    std::borrow::Cow::Owned(p) => Some(p),
                    std::borrow::Cow::Borrowed(_) => None,
                };
                let host = request_host(&view).unwrap();
                let normalized_host = host.trailing_dot.then(|| match host.port {
                    Some(p) => format!("{}:{p}", host.host),
                    None => host.host.to_owned(),
                });
                let close = is_bodiless_method(view.method) && has_body(&view);
                let rules = || rewrite::UpstreamHead {
                    route: &route.settings,
                    token_header: &proxy.header,
                    upstream: &proxy.upstreams[0],
                    rewritten_path: None,
                    normalized_host: normalized_host.clone(),
                    peer: peer.parse().unwrap(),
                    close,
                    https: false,
                };
                let want = by_hyper_path(raw, rewritten.clone(), rules());
                let mut got = Vec::new();
                write(&mut got, &mut view, rewritten, &rules());
                assert_eq!(
                    String::from_utf8_lossy(&got),
                    String::from_utf8_lossy(&want),
                    "{:?}",
                    String::from_utf8_lossy(raw)
                );
            }
        }
    }
}
