//! The refusals and the token check of a matched route: everything in `handle` that can
//! turn a request away, and the route table lookup.

use std::net::SocketAddr;
use std::time::Instant;

use bytes::Bytes;
use http::header::HeaderValue;
use http::Response;
use http_body_util::Full;

use super::fields::Fields;
use super::request::{token_alias, RequestView};
use super::upstream::Upstream;
use super::{Note, Proxy, Route, Routed};
use crate::admission::{Refused, Resource};
use crate::config::{MissingToken, Pick};
use crate::drain::Ticket;
use crate::metrics::Outcome;
use crate::reject::{Context, Rejection, StoreStep};
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
        let resource = route.resource.as_deref();
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
            resource: route.resource.as_deref().map(Resource::name),
            token,
        };
        rejection.respond(ctx, grpc.as_ref())
    }

    /// Refuses a request that matched `route`: logged, counted, answered from the table.
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
        let resource = route.resource.as_deref();
        let whole = match (&rejection, resource) {
            (Rejection::Stale { token, mark }, Some(r)) => {
                self.stale_log
                    .first(&route.settings.name, r.name(), *token, *mark)
            }
            _ => true,
        };
        if whole {
            tracing::info!(
                route = %route.settings.name,
                resource = resource.map(Resource::name),
                token,
                mark = resource.map(Resource::mark),
                peer = %peer,
                reason = %rejection,
                "request refused"
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
    pub(super) async fn fence(
        &self,
        route: &Route,
        headers: &impl Fields,
    ) -> Result<(Outcome, Option<u64>, Option<Ticket>), (Rejection, Outcome, Option<u64>)> {
        let Some(resource) = &route.resource else {
            return Ok((Outcome::Passthrough, None, None));
        };
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
        // The fast path decides at once; the slow one (an advance: persist, then drain) is
        // boxed, so that its state does not grow the future of every request, which hyper
        // moves whole.
        let decided = match self.admission.admit_now(resource, t) {
            Some(now) => now,
            None => Box::pin(
                self.admission
                    .admit(resource, t, route.settings.drain_timeout),
            )
            .await
            .map(|(_, ticket)| ticket),
        };
        match decided {
            Ok(ticket) => Ok((Outcome::Admitted, Some(t.get()), Some(ticket))),
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

    pub(super) fn route(&self, method: &str, host: &str, key: &str) -> Routed<'_> {
        match crate::config::pick(&self.routes, |r| &r.settings, method, host, key) {
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
