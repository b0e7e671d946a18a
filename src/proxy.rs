//! The request pipeline: route -> token -> guard -> store (on advance) -> forward -> metrics.
//!
//! [`Proxy::handle`] reads top to bottom in that order. Everything that can refuse a request
//! becomes a [`Rejection`]; the upstream is called at most once and only for requests that
//! passed the guard (the pooled clients never retry).

use std::borrow::Cow;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use prometheus::IntGauge;

use crate::admission::{Admission, Refused, Resource};
use crate::config::{Config, MissingToken, Protocol, RouteSettings, UpstreamSettings};
use crate::metrics::{Metrics, Outcome, Outcomes, RouteMetrics};
use crate::path;
use crate::reject::{Context, Rejection};
use crate::token::{self, FencingToken};

/// The body palisade answers with: the upstream's, streamed, or its own rejection.
pub type ProxyBody = Either<Tracked, Full<Bytes>>;

/// The reverse proxy's shared state: routes, upstream clients and admission.
pub struct Proxy {
    routes: Vec<Route>,
    upstreams: Vec<Upstream>,
    header: HeaderName,
    admission: Arc<Admission>,
    // Requests that never matched a route count under route="".
    unrouted: Outcomes,
}

struct Route {
    settings: RouteSettings,
    resource: Option<Arc<Resource>>,
    metrics: RouteMetrics,
}

struct Upstream {
    settings: UpstreamSettings,
    client: Client<Dial, Incoming>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field(
                "routes",
                &self
                    .routes
                    .iter()
                    .map(|r| &r.settings.name)
                    .collect::<Vec<_>>(),
            )
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// Builds the proxy for `config`. Every guarded route's resource must be in `admission`.
    ///
    /// # Panics
    /// If a guarded route's resource is missing from `admission` (a wiring bug, not bad input).
    pub fn new(config: &Config, admission: Arc<Admission>, metrics: &Metrics) -> Self {
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| Upstream {
                settings: u.clone(),
                client: client_for(u),
            })
            .collect();
        let routes = config
            .routes
            .iter()
            .map(|r| Route {
                settings: r.clone(),
                resource: r.guard.then(|| {
                    admission
                        .resource(&r.resource)
                        .cloned()
                        .expect("every guarded resource is loaded")
                }),
                metrics: metrics.route(&r.name, r.guard.then_some(r.resource.as_str())),
            })
            .collect();
        Self {
            routes,
            upstreams,
            header: config.fencing.header.clone(),
            admission,
            unrouted: metrics.outcomes(""),
        }
    }

    /// Handles one request from `peer`. Never fails: refusals are responses.
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
        let started = Instant::now();
        let grpc = grpc_content_type(req.headers());

        let normalized = match path::normalize(req.uri().path()) {
            Ok(p) => p,
            Err(e) => {
                return self.refuse_unrouted(
                    Rejection::BadPath(e),
                    Outcome::Malformed,
                    grpc,
                    peer,
                    &req,
                )
            }
        };
        let host = match request_host(&req) {
            Ok(h) => h,
            Err(why) => {
                return self.refuse_unrouted(
                    Rejection::BadRequest(why),
                    Outcome::Malformed,
                    grpc,
                    peer,
                    &req,
                )
            }
        };
        let Some(route) = self.route(&req, host, &path::match_key(&normalized)) else {
            return self.refuse_unrouted(Rejection::NoRoute, Outcome::NoRoute, grpc, peer, &req);
        };
        let rewritten = match normalized {
            Cow::Owned(p) => Some(p),
            Cow::Borrowed(_) => None,
        };
        let m = &route.metrics;
        let inflight = InflightGuard::new(&m.inflight);

        let (outcome, token) = match self.fence(route, req.headers()).await {
            Ok(admitted) => admitted,
            Err((rejection, outcome, token)) => {
                let resource = route.resource.as_deref();
                tracing::info!(
                    route = %route.settings.name,
                    resource = resource.map(Resource::name),
                    token,
                    mark = resource.map(Resource::mark),
                    peer = %peer,
                    reason = %rejection,
                    "request refused"
                );
                m.count(outcome);
                m.duration.observe(started.elapsed().as_secs_f64());
                let ctx = Context {
                    route: Some(&route.settings.name),
                    resource: resource.map(Resource::name),
                    token,
                };
                return rejection.respond(ctx, grpc.as_ref()).map(Either::Right);
            }
        };

        let upstream = &self.upstreams[route.settings.upstream];
        let req = prepare(
            req,
            &route.settings,
            &self.header,
            upstream,
            rewritten,
            peer,
        );
        let call = upstream.client.request(req);
        let result = match upstream.settings.response_timeout {
            Some(limit) => match tokio::time::timeout(limit, call).await {
                Ok(r) => r.map_err(|e| Rejection::UpstreamFailed(error_chain(&e))),
                Err(_) => Err(Rejection::UpstreamTimeout(limit)),
            },
            None => call
                .await
                .map_err(|e| Rejection::UpstreamFailed(error_chain(&e))),
        };
        m.duration.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(resp) => {
                m.count(outcome);
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers, &self.header);
                Response::from_parts(
                    parts,
                    Either::Left(Tracked {
                        inner: body,
                        _inflight: inflight,
                    }),
                )
            }
            Err(rejection) => {
                m.count(Outcome::UpstreamError);
                tracing::warn!(
                    route = %route.settings.name,
                    upstream = %upstream.settings.name,
                    peer = %peer,
                    error = %rejection,
                    "upstream request failed"
                );
                let ctx = Context {
                    route: Some(&route.settings.name),
                    resource: route.resource.as_deref().map(Resource::name),
                    token,
                };
                rejection.respond(ctx, grpc.as_ref()).map(Either::Right)
            }
        }
    }

    /// The token check of a matched route: `Ok((outcome, token))` to forward, or the refusal.
    async fn fence(
        &self,
        route: &Route,
        headers: &HeaderMap,
    ) -> Result<(Outcome, Option<u64>), (Rejection, Outcome, Option<u64>)> {
        let Some(resource) = &route.resource else {
            return Ok((Outcome::Passthrough, None));
        };
        let t: FencingToken = match token::from_headers(headers, &self.header) {
            Ok(Some(t)) => t,
            Ok(None) if route.settings.missing_token == MissingToken::Allow => {
                return Ok((Outcome::Missing, None))
            }
            Ok(None) => return Err((Rejection::MissingToken, Outcome::Missing, None)),
            Err(e) => return Err((Rejection::MalformedToken(e), Outcome::Malformed, None)),
        };
        match self.admission.admit(resource, t).await {
            Ok(_) => Ok((Outcome::Admitted, Some(t.get()))),
            Err(Refused::Stale { mark, .. }) => {
                if let Some(c) = &route.metrics.stale {
                    c.inc();
                }
                Err((
                    Rejection::Stale {
                        token: t.get(),
                        mark,
                    },
                    Outcome::Stale,
                    Some(t.get()),
                ))
            }
            Err(Refused::Unavailable { source, .. }) => {
                tracing::error!(
                    route = %route.settings.name,
                    resource = %resource.name(),
                    token = t.get(),
                    error = %source,
                    "mark store cannot persist; refusing the advance"
                );
                Err((
                    Rejection::StoreUnavailable,
                    Outcome::Unavailable,
                    Some(t.get()),
                ))
            }
        }
    }

    fn route(&self, req: &Request<Incoming>, host: Option<&str>, key: &str) -> Option<&Route> {
        let method = req.method().as_str();
        self.routes.iter().find(|r| {
            let s = &r.settings;
            // Methods match whatever their case: a legacy upstream may treat `post` as POST,
            // so a lower-case spelling must not slip past a guarded route.
            s.methods
                .as_ref()
                .is_none_or(|ms| ms.iter().any(|m| m.as_str().eq_ignore_ascii_case(method)))
                && s.host
                    .as_deref()
                    .is_none_or(|h| host.is_some_and(|rh| rh.eq_ignore_ascii_case(h)))
                && s.path.matches(key)
        })
    }

    fn refuse_unrouted(
        &self,
        rejection: Rejection,
        outcome: Outcome,
        grpc: Option<HeaderValue>,
        peer: SocketAddr,
        req: &Request<Incoming>,
    ) -> Response<ProxyBody> {
        tracing::info!(method = %req.method(), path = req.uri().path(), peer = %peer, reason = %rejection, "request refused");
        self.unrouted.count(outcome);
        rejection
            .respond(Context::default(), grpc.as_ref())
            .map(Either::Right)
    }
}

/// Dials the upstream's address whatever authority the request URI carries (which, for h2c,
/// is the client's, sent on as :authority).
#[derive(Clone)]
struct Dial {
    inner: HttpConnector,
    target: Uri,
}

impl tower_service::Service<Uri> for Dial {
    type Response = <HttpConnector as tower_service::Service<Uri>>::Response;
    type Error = <HttpConnector as tower_service::Service<Uri>>::Error;
    type Future = <HttpConnector as tower_service::Service<Uri>>::Future;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        self.inner.call(self.target.clone())
    }
}

fn client_for(u: &UpstreamSettings) -> Client<Dial, Incoming> {
    let mut inner = HttpConnector::new();
    inner.set_nodelay(true);
    inner.set_connect_timeout(Some(u.connect_timeout));
    let target = Uri::builder()
        .scheme(u.scheme.clone())
        .authority(u.authority.clone())
        .path_and_query("/")
        .build()
        .expect("scheme and authority were validated");
    let connector = Dial { inner, target };
    let mut b = Client::builder(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        // An admitted request is sent at most once, even when hyper could tell it was not
        // written before the pooled connection closed.
        .retry_canceled_requests(false)
        .pool_max_idle_per_host(usize::MAX)
        .http2_only(u.protocol == Protocol::H2c);
    b.build(connector)
}

/// The request's content type if it is gRPC (`application/grpc*`, gRPC-web included).
fn grpc_content_type(headers: &HeaderMap) -> Option<HeaderValue> {
    headers
        .get(header::CONTENT_TYPE)
        .filter(|v| v.as_bytes().starts_with(b"application/grpc"))
        .cloned()
}

/// The host the request is for, without port or trailing dot, for routing.
///
/// Refuses what different servers would read differently: two Host headers, a Host that is
/// not text, or (HTTP/2, absolute-form) a Host that disagrees with the request's authority.
fn request_host(req: &Request<Incoming>) -> Result<Option<&str>, &'static str> {
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
        (None, None) => return Ok(None),
    };
    // Strip a port, keeping bracketed IPv6 literals whole, then one trailing dot.
    let host = match raw.rfind(':') {
        Some(i) if !raw[i..].contains(']') => &raw[..i],
        _ => raw,
    };
    Ok(Some(host.strip_suffix('.').unwrap_or(host)))
}

/// Turns the client's request into the upstream request, in place.
fn prepare(
    req: Request<Incoming>,
    route: &RouteSettings,
    token_header: &HeaderName,
    upstream: &Upstream,
    rewritten_path: Option<String>,
    peer: SocketAddr,
) -> Request<Incoming> {
    let (mut parts, body) = req.into_parts();
    let original_authority = parts.uri.authority().cloned();
    let path_and_query = match (rewritten_path, parts.uri.query()) {
        (None, _) => parts.uri.path_and_query().cloned(),
        (Some(p), None) => PathAndQuery::try_from(p).ok(),
        (Some(p), Some(q)) => PathAndQuery::try_from(format!("{p}?{q}")).ok(),
    };
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(upstream.settings.scheme.clone());
    // The connector always dials the upstream, so the URI can carry the client's authority:
    // HTTP/2 sends it as :authority (which must agree with any Host), HTTP/1.1 gets a Host
    // header below.
    uri.authority = Some(match upstream.settings.protocol {
        Protocol::H2c => parts
            .headers
            .get(header::HOST)
            .and_then(|h| http::uri::Authority::try_from(h.as_bytes()).ok())
            .or_else(|| original_authority.clone())
            .unwrap_or_else(|| upstream.settings.authority.clone()),
        Protocol::Http1 => upstream.settings.authority.clone(),
    });
    uri.path_and_query = Some(path_and_query.unwrap_or_else(|| PathAndQuery::from_static("/")));
    parts.uri = Uri::from_parts(uri).expect("scheme, authority and path are set");
    parts.version = match upstream.settings.protocol {
        Protocol::Http1 => Version::HTTP_11,
        Protocol::H2c => Version::HTTP_2,
    };

    let h = &mut parts.headers;
    strip_hop_by_hop(h, token_header);
    if route.strip_token {
        h.remove(token_header);
    }
    match upstream.settings.protocol {
        Protocol::H2c => {
            h.remove(header::HOST);
        }
        Protocol::Http1 => {
            if !h.contains_key(header::HOST) {
                if let Some(a) =
                    original_authority.and_then(|a| HeaderValue::from_str(a.as_str()).ok())
                {
                    h.insert(header::HOST, a);
                }
            }
        }
    }
    let xff = if h.contains_key(&X_FORWARDED_FOR) {
        let prior: Vec<&str> = h
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        HeaderValue::from_str(&format!("{}, {}", prior.join(", "), peer.ip())).ok()
    } else {
        Some(ip_header(peer.ip()))
    };
    if let Some(v) = xff {
        h.insert(X_FORWARDED_FOR, v);
    }
    h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    Request::from_parts(parts, body)
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
fn strip_hop_by_hop(h: &mut HeaderMap, protect: &HeaderName) {
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
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
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

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Counts a request in `palisade_inflight_requests` until dropped.
struct InflightGuard(IntGauge);

impl InflightGuard {
    fn new(g: &IntGauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The upstream's response body, streamed frame by frame (trailers included), which keeps the
/// request counted as in flight until it ends or the client goes away.
pub struct Tracked {
    inner: Incoming,
    _inflight: InflightGuard,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracked").finish_non_exhaustive()
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
