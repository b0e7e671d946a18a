//! The refusals and the token check of a matched route: everything in `handle` that can
//! turn a request away, and the route table lookup.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::HeaderValue;
use http::Response;
use http_body_util::Full;

use super::fields::Fields;
use super::request::{token_alias, RequestView};
use super::upstream::Upstream;
use super::{Note, Proxy, Route, Routed};
use crate::fence::admission::{Refused, Resource};
use crate::fence::drain::Ticket;
use crate::fence::metrics::Outcome;
use crate::fence::reject::{Context, Rejection, StoreStep};
use crate::fence::template::{Captures, RequestParts};
use crate::proxy::config::{MissingToken, PathMatch, Pick};
use crate::token::FencingToken;

impl Proxy {
    /// Answers a request that a newer owner's drain aborted before its response started.
    pub(super) fn aborted(
        &self,
        route: &Route,
        token: Option<u64>,
        grpc: Option<HeaderValue>,
        peer: SocketAddr,
        started: Instant,
        note: &mut Note<'_>,
    ) -> Response<Full<Bytes>> {
        note.set(Outcome::Stale, token);
        let m = &route.metrics;
        let resource = note.resource();
        if let Some(c) = &m.stale {
            c.inc();
        }
        m.count(Outcome::Stale);
        m.duration.observe(started.elapsed().as_secs_f64());
        let stale = Rejection::Stale {
            token: token.unwrap_or_default(),
            mark: resource.map_or(0, Resource::mark),
        };
        tracing::info!(
            route = %route.settings.name,
            resource = resource.map(Resource::name),
            token,
            peer = %peer,
            "in-flight request aborted by a newer owner's drain"
        );
        let ctx = Context {
            route: Some(&route.settings.name),
            resource: resource.map(Resource::name),
            token,
        };
        stale.respond(ctx, grpc.as_ref())
    }

    /// Answers an admitted request whose upstream exchange failed (502) or timed out (504):
    /// logged, counted, answered from the table.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn upstream_failed(
        &self,
        route: &Route,
        upstream: &Upstream,
        rejection: Rejection,
        token: Option<u64>,
        grpc: Option<HeaderValue>,
        peer: SocketAddr,
        note: &mut Note<'_>,
    ) -> Response<Full<Bytes>> {
        route.metrics.count(Outcome::UpstreamError);
        note.set(Outcome::UpstreamError, token);
        tracing::warn!(
            route = %route.settings.name,
            upstream = %upstream.settings.name,
            peer = %peer,
            error = %rejection,
            "upstream request failed"
        );
        let ctx = Context {
            route: Some(&route.settings.name),
            resource: note.resource().map(Resource::name),
            token,
        };
        rejection.respond(ctx, grpc.as_ref())
    }

    /// An admitted request whose client went away mid-body or cancelled its call, which made
    /// its upstream exchange fail: counted and logged as `client_closed` (not an upstream
    /// error); the empty 499 goes nowhere, the client is gone.
    pub(super) fn client_closed(
        &self,
        route: &Route,
        token: Option<u64>,
        note: &mut Note<'_>,
    ) -> Response<Full<Bytes>> {
        route.metrics.count(Outcome::ClientClosed);
        note.set(Outcome::ClientClosed, token);
        tracing::debug!(route = %route.settings.name, "the client went away before its answer");
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = http::StatusCode::from_u16(499).unwrap_or(http::StatusCode::BAD_REQUEST);
        r
    }

    /// Answers an admitted fence request (`x-fencing-fence: 1`): 204 / gRPC OK with the mark,
    /// logged and counted as `fence`; the upstream never sees it.
    pub(super) fn fence_answered(
        &self,
        route: &Route,
        token: u64,
        grpc: Option<HeaderValue>,
        peer: SocketAddr,
        started: Instant,
        note: &mut Note<'_>,
    ) -> Response<Full<Bytes>> {
        note.set(Outcome::Fence, Some(token));
        let resource = note.resource();
        let mark = resource.map_or(token, Resource::mark);
        tracing::info!(
            route = %route.settings.name,
            resource = resource.map(Resource::name),
            token,
            mark,
            peer = %peer,
            "fence request admitted"
        );
        route.metrics.count(Outcome::Fence);
        route
            .metrics
            .duration
            .observe(started.elapsed().as_secs_f64());
        crate::fence::reject::fence_admitted(mark, grpc.as_ref())
    }

    /// A 400 (`malformed`) after which nothing more is read from the client's connection:
    /// where the request's body ends is in doubt, or its unread bytes must not be parsed as
    /// the connection's next request.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn refuse_malformed(
        &self,
        route: &Route,
        why: &'static str,
        token: Option<u64>,
        grpc: Option<HeaderValue>,
        peer: SocketAddr,
        started: Instant,
        note: &mut Note<'_>,
    ) -> Response<Full<Bytes>> {
        let refused = (Outcome::Malformed, token);
        let mut resp = self.refuse(
            route,
            Rejection::BadRequest(why),
            refused,
            grpc,
            peer,
            started,
            note,
        );
        resp.headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        resp
    }

    /// Refuses a request that matched `route` (or cuts one already on its way upstream):
    /// logged, counted, answered from the table.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn refuse(
        &self,
        route: &Route,
        rejection: Rejection,
        (outcome, token): (Outcome, Option<u64>),
        grpc: Option<HeaderValue>,
        peer: SocketAddr,
        started: Instant,
        note: &mut Note<'_>,
    ) -> Response<Full<Bytes>> {
        note.set(outcome, token);
        let resource = note.resource();
        let judged = resource.map(|r| (r.name(), r.mark()));
        route.metrics.refused(&rejection, judged, token, peer);
        let whole = match (&rejection, resource) {
            (Rejection::Stale { token, mark }, Some(r)) => {
                self.stale_log
                    .first(&route.settings.name, r.name(), *token, *mark)
            }
            _ => true,
        };
        if whole {
            // An upstream was chosen only for a request that passed: a refusal after that (its
            // body went over `max_body_bytes` or turned malformed while it streamed) cut an
            // exchange that had begun.
            let what = if note.upstream.is_some() {
                "request cut after it went upstream"
            } else {
                "request refused"
            };
            tracing::info!(
                route = %route.settings.name,
                resource = resource.map(Resource::name),
                token,
                mark = resource.map(Resource::mark),
                peer = %peer,
                reason = %rejection,
                "{what}"
            );
        }
        route.metrics.count(outcome);
        route
            .metrics
            .duration
            .observe(started.elapsed().as_secs_f64());
        let ctx = Context {
            route: Some(&route.settings.name),
            resource: resource.map(Resource::name),
            token,
        };
        rejection.respond(ctx, grpc.as_ref())
    }

    /// The token check of a matched route: `Ok((outcome, token))` to forward, or the refusal.
    /// The request's resource (the route's, or the entity its template names) goes into
    /// `note`, for the refusal and the access log.
    pub(super) async fn fence<'a>(
        &'a self,
        route: &'a Route,
        headers: &impl Fields,
        target: &Target<'_>,
        note: &mut Note<'a>,
    ) -> Result<(Outcome, Option<u64>, Option<Ticket>), (Rejection, Outcome, Option<u64>)> {
        if !route.settings.guard {
            return Ok((Outcome::Passthrough, None, None));
        }
        if token_alias(headers, &self.header).is_some() {
            return Err((Rejection::TokenAlias, Outcome::Malformed, None));
        }
        let t: FencingToken = match headers.token(&self.header) {
            Ok(Some(t)) if route.settings.max_token.is_some_and(|max| t.get() > max) => {
                let max = route.settings.max_token.unwrap_or(u64::MAX);
                return Err((
                    Rejection::AboveMaxToken {
                        token: t.get(),
                        max,
                    },
                    Outcome::Malformed,
                    Some(t.get()),
                ));
            }
            Ok(Some(t)) => t,
            Ok(None) if route.settings.missing_token == MissingToken::Allow => {
                return Ok((Outcome::Missing, None, None))
            }
            Ok(None) => return Err((Rejection::MissingToken, Outcome::Missing, None)),
            Err(e) => return Err((Rejection::MalformedToken(e), Outcome::Malformed, None)),
        };
        // Only a request with a well-formed token names an entity: no store read for
        // anything less.
        note.resource = Some(match &route.resource {
            Some(r) => Cow::Borrowed(r),
            None => {
                let name = self.entity_name(route, headers, target, t)?;
                match self
                    .admission
                    .entity_cached(&name, route.settings.max_marks)
                {
                    Some(entity) => Cow::Owned(entity),
                    // Boxed: its state must not grow every request's future (hyper moves it
                    // whole).
                    None => Cow::Owned(Box::pin(self.entity(route, name, t)).await?),
                }
            }
        });
        let resource: &Arc<Resource> = note.resource.as_deref().expect("set above");
        // The fast path decides at once; the slow one (an advance: persist, then drain) is
        // boxed, so that its state does not grow the future of every request, which hyper
        // moves whole.
        let decided = match &route.settings.epoch {
            // Fed by a lock: confirmed with the lock's epoch (linearizable), or judged on the
            // local mark that a watch of the epoch keeps (cached).
            Some(feed) => match self.admission.admit_fed_now(resource, t) {
                Some(now) => now,
                // The epoch key is made only when it is read.
                None => {
                    let key = match &feed.fixed_key {
                        Some(k) => Arc::clone(k),
                        None => {
                            let name = self.fill(route, &feed.name, headers, target, t)?;
                            let key = match feed.kind {
                                crate::client::session::EpochOf::Semaphore => {
                                    let Some(slot) = slot_of(route, target) else {
                                        let why = crate::fence::template::FillError::BadLock(
                                            "the {slot} capture is not a slot number".to_owned(),
                                        );
                                        let bad = Rejection::BadResource(why);
                                        return Err((bad, Outcome::Malformed, Some(t.get())));
                                    };
                                    feed.slot_key(&name, slot)
                                }
                                _ => feed.key(&name),
                            };
                            match key {
                                Ok(k) => Arc::from(k),
                                Err(e) => {
                                    let why =
                                        crate::fence::template::FillError::BadLock(e.to_string());
                                    let bad = Rejection::BadResource(why);
                                    return Err((bad, Outcome::Malformed, Some(t.get())));
                                }
                            }
                        }
                    };
                    Box::pin(self.admission.admit_fed(
                        resource,
                        t,
                        &key,
                        route.settings.drain_timeout,
                    ))
                    .await
                    .map(|(_, ticket)| ticket)
                }
            },
            None => match self.admission.admit_now(resource, t) {
                Some(now) => now,
                None => Box::pin(self.admission.admit_waiting(
                    resource,
                    t,
                    route.settings.drain_timeout,
                ))
                .await
                .map(|(_, ticket)| ticket),
            },
        };
        match decided {
            Ok(ticket) => Ok((Outcome::Admitted, Some(t.get()), Some(ticket))),
            Err(Refused::Full { limit, .. }) => Err((
                Rejection::MarksFull { limit },
                Outcome::MarksFull,
                Some(t.get()),
            )),
            Err(Refused::Unissued { epoch, .. }) => Err((
                Rejection::Unissued {
                    token: t.get(),
                    epoch,
                },
                Outcome::Unissued,
                Some(t.get()),
            )),
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
            Err(Refused::Unavailable { source, step, .. }) => {
                let mark = resource.mark();
                match step {
                    StoreStep::Epoch => tracing::error!(
                        route = %route.settings.name,
                        resource = %resource.name(),
                        token = t.get(),
                        mark,
                        error = %source,
                        "the feeding lock's epoch is missing or went back; refusing the request"
                    ),
                    StoreStep::Confirm => tracing::error!(
                        route = %route.settings.name,
                        resource = %resource.name(),
                        token = t.get(),
                        mark,
                        error = %source,
                        "mark store cannot confirm the mark; refusing the request"
                    ),
                    _ => tracing::error!(
                        route = %route.settings.name,
                        resource = %resource.name(),
                        token = t.get(),
                        mark,
                        error = %source,
                        "mark store cannot persist; refusing the advance"
                    ),
                }
                Err((
                    Rejection::StoreUnavailable {
                        step,
                        mark: Some(mark),
                    },
                    Outcome::Unavailable,
                    Some(t.get()),
                ))
            }
        }
    }

    /// The name of the entity a request to a templated route names.
    fn entity_name(
        &self,
        route: &Route,
        headers: &impl Fields,
        target: &Target<'_>,
        t: FencingToken,
    ) -> Result<String, (Rejection, Outcome, Option<u64>)> {
        let Some(template) = &route.settings.template else {
            unreachable!("a guarded route has a resource or a template");
        };
        self.fill(route, template, headers, target, t)
    }

    /// `template` (the route's resource, or the name of the lock that feeds it) filled from
    /// a request.
    fn fill(
        &self,
        route: &Route,
        template: &crate::fence::template::ResourceTemplate,
        headers: &impl Fields,
        target: &Target<'_>,
        t: FencingToken,
    ) -> Result<String, (Rejection, Outcome, Option<u64>)> {
        let captures = match &route.settings.path {
            PathMatch::Pattern(p) => p.captures(target.key).unwrap_or_default(),
            _ => Captures::default(),
        };
        // A header named in `Connection` is removed before forwarding: the upstream would
        // not see the entity the request was judged by.
        for h in template.headers() {
            let listed = headers.values(&http::header::CONNECTION).any(|v| {
                v.split(|b| *b == b',')
                    .any(|t| t.trim_ascii().eq_ignore_ascii_case(h.as_str().as_bytes()))
            });
            if listed {
                let why = crate::fence::template::FillError::HopByHop(h.to_string());
                return Err((
                    Rejection::BadResource(why),
                    Outcome::Malformed,
                    Some(t.get()),
                ));
            }
        }
        let parts = Parts { target, headers };
        template
            .fill(&captures, &parts)
            .map_err(|e| (Rejection::BadResource(e), Outcome::Malformed, Some(t.get())))
    }

    /// The entity `name` of a templated route, its mark loaded from the store on first use.
    async fn entity(
        &self,
        route: &Route,
        name: String,
        t: FencingToken,
    ) -> Result<Arc<Resource>, (Rejection, Outcome, Option<u64>)> {
        let Some(template) = &route.settings.template else {
            unreachable!("a guarded route has a resource or a template");
        };
        self.admission
            .entity_within(&name, template, route.settings.max_marks)
            .await
            .map_err(|e| {
                tracing::error!(
                    route = %route.settings.name,
                    resource = %name,
                    error = %e,
                    "mark store cannot load the mark; refusing the request"
                );
                let load = Rejection::StoreUnavailable {
                    step: StoreStep::Load,
                    mark: None,
                };
                (load, Outcome::Unavailable, Some(t.get()))
            })
    }

    pub(super) fn route(&self, method: &str, host: &str, key: &str) -> Routed<'_> {
        match crate::proxy::config::pick(&self.routes, |r| &r.settings, method, host, key) {
            Pick::To(r) => Routed::To(r),
            Pick::MethodNotAllowed(r) => Routed::MethodNotAllowed(r),
            Pick::Nowhere => Routed::Nowhere,
        }
    }

    pub(super) fn refuse_unrouted(
        &self,
        rejection: Rejection,
        outcome: Outcome,
        grpc: Option<HeaderValue>,
        peer: SocketAddr,
        req: &impl RequestView,
        note: &mut Note<'_>,
    ) -> Response<Full<Bytes>> {
        // A well-formed token is echoed back, as on routed refusals; a malformed one is not
        // judged here (no route asked for it).
        let token = req
            .fields()
            .token(&self.header)
            .ok()
            .flatten()
            .map(|t| t.get());
        note.set(outcome, token);
        tracing::info!(method = req.method(), path = req.path(), peer = %peer, token, reason = %rejection, "request refused");
        self.unrouted.count(outcome);
        let ctx = Context {
            token,
            ..Context::default()
        };
        rejection.respond(ctx, grpc.as_ref())
    }
}

/// The `{slot}` capture of a semaphore route's request, in canonical decimal only (`07` and
/// `7` must not name two resources of one slot).
fn slot_of(route: &Route, target: &Target<'_>) -> Option<u32> {
    let PathMatch::Pattern(p) = &route.settings.path else {
        return None;
    };
    let text = p.captures(target.key)?.get("slot")?;
    let slot: u32 = text.parse().ok()?;
    (slot.to_string() == text).then_some(slot)
}

/// What a resource template may read of a request besides its headers.
pub(super) struct Target<'r> {
    /// The path's match key (normal form, `;parameters` dropped).
    pub(super) key: &'r str,
    /// The host as routed (no port, no trailing dot).
    pub(super) host: &'r str,
    /// The request's path, for a gRPC call's service and method.
    pub(super) path: &'r str,
    /// Whether it is a gRPC call.
    pub(super) grpc: bool,
}

struct Parts<'r, F> {
    target: &'r Target<'r>,
    headers: &'r F,
}

impl<F: Fields> RequestParts for Parts<'_, F> {
    fn host(&self) -> Option<Cow<'_, str>> {
        let h = self.target.host;
        Some(if h.bytes().any(|b| b.is_ascii_uppercase()) {
            Cow::Owned(h.to_ascii_lowercase())
        } else {
            Cow::Borrowed(h)
        })
    }

    fn header_values(&self, name: &http::HeaderName) -> Vec<&[u8]> {
        self.headers.values(name).collect()
    }

    fn path(&self) -> &str {
        self.target.path
    }

    fn is_grpc(&self) -> bool {
        self.target.grpc
    }
}
