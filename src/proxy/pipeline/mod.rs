//! The request pipeline: route -> token -> guard -> store (on advance) -> forward -> metrics.
//!
//! [`Proxy::handle`] reads top to bottom in that order. Everything that can refuse a request
//! becomes a [`Rejection`]; the upstream is called at most once and only for requests that
//! passed the guard (the pooled clients never retry).

mod admit;
mod build;
mod client_gone;
mod decision;
pub(crate) mod fast;
mod fields;
mod forward;
mod peek;
mod refuse;
mod request;
mod request_body;
mod response_body;
mod rewrite;
mod stale_log;
mod unread;
mod upgrade;
mod upstream;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

pub use build::CarriedOver;
pub(crate) use response_body::ResponseBody;
pub(crate) use upstream::http1::Affinity;

use self::admit::Passed;
use self::decision::{Logged, Note};
use self::forward::{forward, Abort, Forwarded};
use self::rewrite::{prepare, strip_hop_by_hop, Forward, UpstreamHead};
use self::upstream::Upstream;
use crate::fence::admission::{Admission, Resource};
use crate::fence::drain::Ticket;
use crate::fence::metrics::{Outcome, Outcomes, RouteMetrics};
use crate::fence::reject::Rejection;
use crate::proxy::access_log::AccessLog;
use crate::proxy::config::RouteSettings;
use crate::proxy::server::ConnCount;

/// The body palisade answers with: the upstream's, streamed, or its own rejection.
pub(crate) type ProxyBody = Either<ResponseBody, Full<Bytes>>;

/// The reverse proxy's state for one configuration: routes, upstream clients, admission and
/// the access log. A reload builds a new one ([`Proxy::build`]); a request keeps the one it
/// started with until it is over.
pub(crate) struct Proxy {
    routes: Vec<Route>,
    upstreams: Vec<Arc<Upstream>>,
    header: HeaderName,
    require_nfkc_paths: bool,
    admission: Arc<Admission>,
    // Requests that never matched a route count under route="".
    unrouted: Outcomes,
    /// Every route can take the HTTP/1.1 fast path: it need not route a request to know.
    all_fast: bool,
    access_log: Option<Arc<AccessLog>>,
    /// Which stale refusals are logged whole (kept across reloads).
    stale_log: Arc<stale_log::StaleLog>,
}

struct Route {
    settings: RouteSettings,
    resource: Option<Arc<Resource>>,
    metrics: RouteMetrics,
    /// The `Allow` header of a 405 (`other_methods = "reject"`).
    allow: Option<HeaderValue>,
}

/// Which route, if any, takes a request.
enum Routed<'a> {
    To(&'a Route),
    /// The path matched a route that refuses methods it does not list.
    MethodNotAllowed(&'a Route),
    Nowhere,
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

/// A refusal of an HTTP/2 HEAD request without its body: hyper's HTTP/2 server sends the
/// body it is given, and a client may reject a stream that answers HEAD with DATA (python-h2
/// does). HTTP/1.1 answers to HEAD never carry one (hyper leaves it out).
fn bodiless_if(head_h2: bool, mut resp: Response<ProxyBody>) -> Response<ProxyBody> {
    if head_h2 && matches!(resp.body(), Either::Right(_)) {
        resp.headers_mut().remove(http::header::CONTENT_LENGTH);
        *resp.body_mut() = Either::Right(Full::new(Bytes::new()));
    }
    resp
}

impl Proxy {
    /// Handles one request from `peer`. Never fails: refusals are responses.
    /// `affinity` is the client connection's own: its upstream connection between requests.
    pub(crate) async fn handle(
        &self,
        req: Request<Incoming>,
        client: crate::proxy::server::Peer,
        affinity: &Arc<Affinity>,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let head_h2 = req.method() == http::Method::HEAD && req.version() == http::Version::HTTP_2;
        let Some(log) = &self.access_log else {
            let resp = self
                .serve(req, client, affinity, started, &mut Note::default())
                .await;
            return bodiless_if(head_h2, resp);
        };
        let mut logged = Logged::of(log, &req, client.addr, started);
        let resp = self
            .serve(req, client, affinity, started, &mut logged.note)
            .await;
        logged.answered(resp.status());
        bodiless_if(head_h2, resp)
    }

    /// [`Proxy::handle`], noting what it decided in `note`.
    async fn serve<'a>(
        &'a self,
        mut req: Request<Incoming>,
        client: crate::proxy::server::Peer,
        affinity: &Arc<Affinity>,
        started: Instant,
        note: &mut Note<'a>,
    ) -> Response<ProxyBody> {
        let peer = client.addr;
        if peek::unsettled(&req) {
            // Worth waiting for only where a body would be refused.
            let wait = if self.refuses_get_body(&req) {
                peek::FIRST_FRAME_WAIT
            } else {
                Duration::ZERO
            };
            peek::settle(&mut req, wait).await;
        }
        let Passed {
            route,
            upstream,
            outcome,
            token,
            ticket,
            rewritten,
            normalized_host,
            close_upstream,
            limit,
            mut inflight,
            grpc,
        } = match self.admit(&req, peer, started, note).await {
            Ok(a) => a,
            Err(refused) => {
                // The refusal must reach a client still sending its body.
                unread::discard(req);
                return refused.map(Either::Right);
            }
        };
        let too_large = limit.as_ref().map(|l| Arc::clone(&l.hit));
        let m = &route.metrics;

        // The request body and the response each hold a half of the drain ticket: the exchange
        // counts as in flight until both are over.
        let (mut ticket, body_ticket) = match ticket.map(Ticket::split) {
            Some((response, body)) => (Some(response), Some(body)),
            None => (None, None),
        };
        let aborted = ticket.as_ref().map(|t| Arc::clone(t.generation()));
        let multiplexed = matches!(upstream.via, upstream::Via::Pooled(_));
        // Whether the body went out whole: for the drain (guarded requests), and for what
        // becomes of an HTTP/2 exchange whose client goes away (`client_gone`).
        let delivered = (ticket.is_some() || multiplexed).then(request_body::Delivered::default);
        // A WebSocket upgrade on a route that allows it: the client's connection is taken over
        // once palisade answers 101.
        let client_upgrade = (route.settings.websocket && upgrade::is_websocket(&req))
            .then(|| hyper::upgrade::on(&mut req))
            .map(|on| (on, req.extensions_mut().remove::<ConnCount>()));
        // Only a body can fail on the client's side while the upstream exchange runs.
        let client_failed = (!http_body::Body::is_end_stream(req.body())
            || req.extensions().get::<request::Peeked>().is_some())
        .then(request_body::ClientFailed::default);
        let mut req = prepare(
            req,
            Forward {
                head: UpstreamHead {
                    route: &route.settings,
                    token_header: &self.header,
                    upstream,
                    rewritten_path: rewritten,
                    normalized_host,
                    peer,
                    close: close_upstream,
                    https: client.tls,
                },
                ticket: body_ticket,
                limit,
                delivered: delivered.clone(),
                client_failed: client_failed.clone(),
            },
        );
        // A newer owner's drain that runs out of time aborts this request and the client gets
        // 409.
        let forwarded = if client_upgrade.is_some() {
            upgrade::upgrade_headers(req.headers_mut());
            // Boxed: rare, and its state would otherwise grow every request's future.
            Box::pin(upgrade::forward(
                upstream,
                &route.settings,
                req,
                aborted.as_ref(),
            ))
            .await
        } else {
            // Boxed: the exchange's state is the largest part of a request's future, which is
            // moved whole at every level on its way into hyper (a memcpy per level and
            // request); a box is one small allocation.
            let call = Box::pin(forward(
                Arc::clone(upstream),
                route.settings.connect_timeout,
                route.settings.response_timeout,
                Arc::clone(affinity),
                req,
                aborted.as_ref().map(|generation| Abort {
                    generation: Arc::clone(generation),
                    delivered: delivered.clone(),
                }),
            ));
            // Kept alive if the client hangs up after the request went out whole.
            let mut exchange =
                client_gone::Outliving::new(call, delivered.clone(), multiplexed, ticket, inflight);
            let forwarded = (&mut exchange).await;
            (ticket, inflight) = exchange.into_kept();
            forwarded
        };
        let result = match forwarded {
            Forwarded::Answered(r) => r,
            Forwarded::Aborted => {
                return self
                    .aborted(route, token, grpc, peer, started, note)
                    .map(Either::Right)
            }
        };
        // The body went over `max_body_bytes` while streaming: the upstream got no complete
        // request, and the client gets 413, not 502.
        if result.is_err() && too_large.is_some_and(|hit| hit.load(Ordering::Acquire)) {
            let limit = route.settings.max_body_bytes.unwrap_or_default();
            let why = Rejection::BodyTooLarge { limit };
            let refused = (Outcome::TooLarge, token);
            return self
                .refuse(route, why, refused, grpc, peer, started, note)
                .map(Either::Right);
        }
        // The client's body could not be parsed: the client is still there to be told (timed
        // by the refusal).
        if result.is_err()
            && client_failed
                .as_ref()
                .is_some_and(request_body::ClientFailed::is_malformed)
        {
            let why = "the request body's framing is malformed";
            return self
                .refuse_malformed(route, why, token, grpc, peer, started, note)
                .map(Either::Right);
        }
        m.duration.observe(started.elapsed().as_secs_f64());
        match result {
            Ok((mut resp, held)) => {
                m.count(outcome);
                note.set(outcome, token);
                if let Some(client) =
                    client_upgrade.filter(|_| resp.status() == StatusCode::SWITCHING_PROTOCOLS)
                {
                    let (client, hold) = client;
                    upgrade::tunnel(client, &mut resp, ticket, inflight, hold);
                    let (mut parts, _) = resp.into_parts();
                    strip_hop_by_hop(&mut parts.headers, &self.header);
                    upgrade::upgrade_headers(&mut parts.headers);
                    return Response::from_parts(parts, Either::Right(Full::new(Bytes::new())));
                }
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers, &self.header);
                // A proxy answers in its own HTTP version (RFC 9110 6.2); hyper's server writes
                // the response's, so an HTTP/1.0 upstream's would reach an HTTP/1.1 client.
                if parts.version == http::Version::HTTP_10 {
                    parts.version = http::Version::HTTP_11;
                }
                // A 204 never says a length (RFC 9110 8.6); hyper's server keeps an upstream's
                // Content-Length on a 204 to HEAD. As the fast path does.
                if parts.status == StatusCode::NO_CONTENT {
                    parts.headers.remove(http::header::CONTENT_LENGTH);
                }
                Response::from_parts(
                    parts,
                    Either::Left(ResponseBody {
                        inner: body,
                        _inflight: inflight,
                        flight: crate::fence::flight::Flight::of(ticket),
                        held,
                        delivered,
                    }),
                )
            }
            // The client went away mid-body (or cancelled its call): the upstream failed
            // because of it.
            Err(_)
                if client_failed
                    .as_ref()
                    .is_some_and(request_body::ClientFailed::is_set) =>
            {
                self.client_closed(route, token, note).map(Either::Right)
            }
            Err(rejection) => self
                .upstream_failed(route, upstream, rejection, token, grpc, peer, note)
                .map(Either::Right),
        }
    }
}
