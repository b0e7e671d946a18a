//! The checks every request passes before its upstream exchange, in one place for hyper's
//! path and the HTTP/1.1 fast path: path normal form, host, routing, method rules, the GET-body
//! rule, `max_body_bytes`, the fence, and the answer to a fence request.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::HeaderValue;
use http::Response;
use http_body_util::Full;

use super::decision::Note;
use super::fields::Fields;
use super::request::{
    framing_refusal, grpc_content_type, has_body, is_bodiless_method, request_host, RequestView,
};
use super::request_body::BodyLimit;
use super::response_body::InflightCount;
use super::upstream::Upstream;
use super::{Proxy, Route, Routed};
use crate::fence::drain::Ticket;
use crate::fence::metrics::Outcome;
use crate::fence::path::{self, PathError};
use crate::fence::reject::Rejection;
use crate::proxy::config::GetBodies;

/// `x-fencing-fence`, read from the request's fields.
const FENCE_HEADER: http::HeaderName = http::HeaderName::from_static(crate::token::FENCE_HEADER);

/// A request that passed [`Proxy::admit`]: what the upstream exchange needs to know.
pub(super) struct Passed<'a> {
    pub(super) route: &'a Route,
    pub(super) upstream: &'a Arc<Upstream>,
    pub(super) outcome: Outcome,
    pub(super) token: Option<u64>,
    /// A guarded request's drain ticket: held until its upstream exchange is over.
    pub(super) ticket: Option<Ticket>,
    /// The normal form of the path, when it differs from the request's.
    pub(super) rewritten: Option<String>,
    /// The client's `host[:port]` without its trailing dot, when it had one.
    pub(super) normalized_host: Option<String>,
    /// A body on a bodiless method: close the upstream connection after this request.
    pub(super) close_upstream: bool,
    /// `max_body_bytes` for a body whose length is not known up front.
    pub(super) limit: Option<BodyLimit>,
    pub(super) inflight: InflightCount,
    pub(super) grpc: Option<HeaderValue>,
}

impl Proxy {
    /// Whether the route `req` goes to refuses a body on a bodiless method (`get_bodies =
    /// "reject"`, the default): only there is an HTTP/2 GET's first frame worth waiting for
    /// (`peek::settle`). `false` for a request [`Proxy::admit`] refuses before that rule.
    pub(super) fn refuses_get_body(&self, req: &impl RequestView) -> bool {
        let (Ok(normalized), Ok(host)) = (path::normalize(req.path()), request_host(req)) else {
            return false;
        };
        match self.route(req.method(), host.host, &path::match_key(&normalized)) {
            Routed::To(r) => r.settings.get_bodies == GetBodies::Reject,
            Routed::MethodNotAllowed(_) | Routed::Nowhere => false,
        }
    }

    /// Everything before the upstream exchange, shared by hyper's path ([`Proxy::serve`]) and
    /// the HTTP/1.1 fast path (`fast`): path normal form, host, routing, method rules, the
    /// GET-body rule, `max_body_bytes` and the fence. Only the request's head is read (and what
    /// its framing says of the body), through [`RequestView`]: both paths judge a request by
    /// exactly the same code.
    ///
    /// `Err` is the refusal to send, already counted, logged and noted.
    pub(super) async fn admit<'a, R: RequestView>(
        &'a self,
        req: &R,
        peer: std::net::SocketAddr,
        started: Instant,
        note: &mut Note<'a>,
    ) -> Result<Passed<'a>, Response<Full<Bytes>>> {
        let grpc = grpc_content_type(req.fields());
        if let Some(why) = framing_refusal(req) {
            let mut resp = self.refuse_unrouted(why, Outcome::Malformed, grpc, peer, req, note);
            // Where this request's body ends is in doubt: nothing more is read from the
            // connection.
            resp.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
            return Err(resp);
        }

        let normalized = match path::normalize(req.path()) {
            Ok(p) if self.require_nfkc_paths && !path::is_nfkc(&p) => Err(PathError::NotNfkc),
            r => r,
        };
        let normalized = match normalized {
            Ok(p) => p,
            Err(e) => {
                return Err(self.refuse_unrouted(
                    Rejection::BadPath(Box::new(e)),
                    Outcome::Malformed,
                    grpc,
                    peer,
                    req,
                    note,
                ))
            }
        };
        let host = match request_host(req) {
            Ok(h) => h,
            Err(why) => {
                return Err(self.refuse_unrouted(
                    Rejection::BadRequest(why),
                    Outcome::Malformed,
                    grpc,
                    peer,
                    req,
                    note,
                ))
            }
        };
        let key = path::match_key(&normalized);
        let route = match self.route(req.method(), host.host, &key) {
            Routed::To(r) => r,
            Routed::MethodNotAllowed(r) => {
                let allow = r.allow.clone();
                note.routed(r);
                let mut resp = self.refuse(
                    r,
                    Rejection::MethodNotAllowed,
                    (Outcome::MethodNotAllowed, None),
                    grpc,
                    peer,
                    started,
                    note,
                );
                if let Some(a) = allow {
                    resp.headers_mut().insert(http::header::ALLOW, a);
                }
                return Err(resp);
            }
            Routed::Nowhere => {
                return Err(self.refuse_unrouted(
                    Rejection::NoRoute,
                    Outcome::NoRoute,
                    grpc,
                    peer,
                    req,
                    note,
                ))
            }
        };
        note.routed(route);
        // Reset by its client while its first frame was awaited: `client_closed`, not a GET
        // with a body refused 400 to nobody.
        if req.client_gone() {
            return Err(self.client_closed(route, None, note));
        }
        // A body on GET (or HEAD, OPTIONS, TRACE, CONNECT) could be read by the upstream as
        // the next request on its connection, a request palisade never checked.
        let close_upstream = is_bodiless_method(req.method()) && has_body(req);
        if close_upstream && route.settings.get_bodies == GetBodies::Reject {
            // The unread body must not be parsed as this connection's next request either.
            let why = "a request body on GET, HEAD, OPTIONS, TRACE or CONNECT is refused";
            return Err(self.refuse_malformed(route, why, None, grpc, peer, started, note));
        }
        // Routing judged the host without a trailing dot; the upstream must see the same.
        let normalized_host = host.trailing_dot.then(|| match host.port {
            Some(p) => format!("{}:{p}", host.host),
            None => host.host.to_owned(),
        });
        // An oversized body is refused before the guard: it must not advance a mark.
        let limit = match route.settings.max_body_bytes {
            None => None,
            Some(max) => match req.body_length() {
                Some(n) if n > max => {
                    let why = Rejection::BodyTooLarge { limit: max };
                    let refused = (Outcome::TooLarge, None);
                    return Err(self.refuse(route, why, refused, grpc, peer, started, note));
                }
                Some(_) => None,
                None => Some(BodyLimit {
                    max,
                    seen: 0,
                    hit: Arc::default(),
                }),
            },
        };
        // A fence request is judged like any request, then answered here (below).
        let fence_request =
            match crate::token::fence_from_values(req.fields().values(&FENCE_HEADER)) {
                Ok(f) => f,
                Err(e) => {
                    let why = Rejection::MalformedFence(e);
                    let refused = (Outcome::Malformed, None);
                    return Err(self.refuse(route, why, refused, grpc, peer, started, note));
                }
            };
        if fence_request && !route.settings.guard {
            let refused = (Outcome::Malformed, None);
            let why = Rejection::NothingToFence;
            return Err(self.refuse(route, why, refused, grpc, peer, started, note));
        }
        let inflight = InflightCount::new(&route.metrics.inflight);

        let target = super::refuse::Target {
            key: &key,
            host: host.host,
            path: req.path(),
            grpc: grpc.is_some(),
        };
        let (outcome, token, ticket) = match self.fence(route, req.fields(), &target, note).await {
            Ok(admitted) => admitted,
            Err((rejection, outcome, token)) => {
                return Err(self.refuse(
                    route,
                    rejection,
                    (outcome, token),
                    grpc,
                    peer,
                    started,
                    note,
                ))
            }
        };
        drop(key);
        if fence_request {
            drop(ticket); // admitted: older requests were drained; nothing goes upstream
            return Err(match token {
                Some(t) => self.fence_answered(route, t, grpc, peer, started, note),
                // A route that lets requests without a token through: a fence needs one.
                None => {
                    let refused = (Outcome::Missing, None);
                    let why = Rejection::MissingToken;
                    self.refuse(route, why, refused, grpc, peer, started, note)
                }
            });
        }
        let rewritten = match normalized {
            Cow::Owned(p) => Some(p),
            Cow::Borrowed(_) => None,
        };
        let upstream = &self.upstreams[route.settings.upstream];
        note.upstream = Some(&upstream.settings.name);
        note.token = token;
        Ok(Passed {
            route,
            upstream,
            outcome,
            token,
            ticket,
            rewritten,
            normalized_host,
            close_upstream,
            limit,
            inflight,
            grpc,
        })
    }
}
