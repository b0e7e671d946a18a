//! The guard in-process: a tower layer for services that can be changed (hyper, axum, tonic).
//!
//! [`FenceLayer`] wraps any `Service<http::Request<B>>` with exactly the proxy's admission:
//! the same token parsing ([`crate::token`]), the same [`Admission`] (guard, mark store,
//! persist before the inner service runs, drain of older requests), and the same rejection
//! table ([`Rejection`]: 409/400/428/503 and their trailers-only gRPC forms). A request the
//! layer admits reaches the inner service with its [`FencingToken`] in the request's
//! extensions, so the handler can store it next to its data.
//!
//! For gRPC, put the layer on the tonic server (`Server::builder().layer(..)`): tonic's
//! `Interceptor` is synchronous and cannot wait for a mark to be persisted, the layer can.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use palisade::FenceLayer;
//! use palisade::{Admission, FileStore, Metrics};
//!
//! let metrics = Metrics::new(prometheus::Registry::new())?;
//! let store = Arc::new(FileStore::open("data/marks.db")?);
//! let admission = Arc::new(Admission::open(store, ["orders"], &metrics).await?);
//! let layer = FenceLayer::new(admission, "orders");
//! // axum: Router::new().route(..).layer(layer); tonic: Server::builder().layer(layer)
//! # Ok(()) }
//! ```

mod body;
mod future;

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response};
use http_body::Body;

pub use crate::fence::flight::{Aborted, BodyError as BoxError};
pub use body::{FenceRequestBody, FenceResponseBody};
pub use future::ResponseFuture;

use crate::fence::admission::{Admission, Refused, Resource};
use crate::fence::guard::MissingToken;
use crate::fence::reject::{Context as RejectContext, Rejection};
use crate::fence::template::{PathPattern, ResourceTemplate};
use crate::token::{self, FencingToken};

/// Picks a request's resource from its head.
type ResourceFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;

/// Which resource a request is for.
#[derive(Clone)]
enum Which {
    /// One resource for every request, resolved on first use and kept.
    Fixed(Arc<str>, Arc<std::sync::OnceLock<Arc<Resource>>>),
    /// Chosen per request (e.g. from the path); `None` lets the request through unguarded.
    Derived(Arc<ResourceFn>),
    /// Filled in from the request by a template; a path the pattern does not match goes
    /// through unguarded.
    Template(Arc<(PathPattern, ResourceTemplate)>),
}

/// The resource a request of a per-request [`Which`] names: `Ok(None)` when it is not
/// guarded, `Err` when it cannot name one.
fn derive(which: &Which, parts: &http::request::Parts) -> Result<Option<String>, Rejection> {
    match which {
        Which::Fixed(..) => Ok(None),
        Which::Derived(f) => Ok(f(parts)),
        Which::Template(t) => {
            let (pattern, template) = &**t;
            // The path as the service will read it: one spelling per entity.
            let normal = crate::fence::path::normalize(parts.uri.path())
                .map_err(|e| Rejection::BadPath(Box::new(e)))?;
            let key = crate::fence::path::match_key(&normal);
            let Some(captures) = pattern.captures(&key) else {
                return Ok(None);
            };
            template
                .fill(&captures, parts)
                .map(Some)
                .map_err(Rejection::BadResource)
        }
    }
}

#[derive(Clone)]
struct Settings {
    admission: Arc<Admission>,
    header: HeaderName,
    which: Which,
    missing: MissingToken,
    drain_timeout: Duration,
    max_marks: Option<u64>,
}

/// Fences the wrapped service (see the module docs).
#[derive(Clone)]
pub struct FenceLayer {
    settings: Arc<Settings>,
}

impl std::fmt::Debug for FenceLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceLayer")
            .field("header", &self.settings.header)
            .finish_non_exhaustive()
    }
}

impl FenceLayer {
    /// Guards every request with the mark of `resource`; tokens in `x-fencing-token`, a
    /// missing token refused (428), older requests drained for at most 2 s on an advance.
    pub fn new(admission: Arc<Admission>, resource: impl Into<Arc<str>>) -> Self {
        Self {
            settings: Arc::new(Settings {
                admission,
                header: HeaderName::from_static(token::DEFAULT_HEADER),
                which: Which::Fixed(resource.into(), Arc::default()),
                missing: MissingToken::Reject,
                drain_timeout: Duration::from_secs(2),
                max_marks: None,
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Settings)) -> Self {
        f(Arc::make_mut(&mut self.settings));
        self
    }

    /// Chooses the resource per request (`None`: the request is not guarded). A resource
    /// seen for the first time has its mark loaded from the store.
    pub fn with_resource_fn(
        self,
        f: impl Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.with(|s| s.which = Which::Derived(Arc::new(f)))
    }

    /// Takes the resource from the request: requests whose normal-form path `pattern`
    /// matches are guarded by the mark of the entity `template` names (one mark per entity,
    /// its metrics per template); other requests go through unguarded. The same types as the
    /// proxy's `path_pattern` and `resource` (see [`crate::fence::template`]).
    pub fn with_template(self, pattern: PathPattern, template: ResourceTemplate) -> Self {
        self.with(|s| s.which = Which::Template(Arc::new((pattern, template))))
    }

    /// With [`FenceLayer::with_template`]: at most `max` stored marks for the template; a
    /// new entity beyond it is refused (503, gRPC RESOURCE_EXHAUSTED). Without it the
    /// template's marks are not bounded.
    pub fn with_max_marks(self, max: u64) -> Self {
        self.with(|s| s.max_marks = Some(max))
    }

    /// The header (and gRPC metadata key) carrying the token.
    pub fn with_header(self, header: HeaderName) -> Self {
        self.with(|s| s.header = header)
    }

    /// What to do with a request without a token (default: refuse with 428).
    pub fn with_missing_token(self, missing: MissingToken) -> Self {
        self.with(|s| s.missing = missing)
    }

    /// How long an advance waits for requests under older marks before aborting them.
    pub fn with_drain_timeout(self, timeout: Duration) -> Self {
        self.with(|s| s.drain_timeout = timeout)
    }
}

impl<S> tower_layer::Layer<S> for FenceLayer {
    type Service = Fence<S>;

    fn layer(&self, inner: S) -> Fence<S> {
        Fence {
            inner,
            settings: Arc::clone(&self.settings),
        }
    }
}

/// A service behind the fence (made by [`FenceLayer`]).
#[derive(Clone)]
pub struct Fence<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> std::fmt::Debug for Fence<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence").finish_non_exhaustive()
    }
}

impl<S, B, RB> tower_service::Service<Request<B>> for Fence<S>
where
    S: tower_service::Service<Request<FenceRequestBody<B>>, Response = Response<RB>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<FenceResponseBody<RB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let fence = match token::fence_from_headers(req.headers()) {
            Ok(fence) => fence,
            Err(e) => {
                let refusal = (Rejection::MalformedFence(e), None, None);
                return ResponseFuture::refused(refuse(refusal, req.headers()));
            }
        };
        if fence {
            // Answered here once admitted: the service never sees a fence.
            let settings = Arc::clone(&self.settings);
            let (parts, _body) = req.into_parts();
            return ResponseFuture::waiting(Box::pin(async move {
                Ok(fence_answer(&settings, &parts).await)
            }));
        }
        // Decided at once. Admitted (an equal token) or unguarded: the service that was polled
        // ready runs the request now, and the future is a small named one, no allocation. A
        // fixed resource is judged on the request as it is (no split into parts and back).
        let now = match &self.settings.which {
            Which::Fixed(_, cached) => match cached.get() {
                Some(resource) => decide_now(&self.settings, resource, req.headers()),
                None => None,
            },
            Which::Derived(_) | Which::Template(_) => None,
        };
        let req = match now {
            Some(Ok(admitted)) => return self.run_now(req, admitted),
            Some(Err(refusal)) => return ResponseFuture::refused(refuse(refusal, req.headers())),
            None => req,
        };
        let (mut parts, body) = req.into_parts();
        if !matches!(self.settings.which, Which::Fixed(..)) {
            let now = match derive(&self.settings.which, &parts) {
                Ok(Some(n)) => self
                    .settings
                    .admission
                    .resource(&n)
                    .and_then(|r| decide_now(&self.settings, &r, &parts.headers)),
                Ok(None) => Some(Ok(None)),
                // Judged with the token, as the proxy does (428 before 400 bad_resource).
                Err(_) => None,
            };
            match now {
                Some(Ok(admitted)) => {
                    return self.run_now(Request::from_parts(parts, body), admitted)
                }
                Some(Err(refusal)) => {
                    return ResponseFuture::refused(refuse(refusal, &parts.headers))
                }
                None => {}
            }
        }
        // Admission has to wait. The service that was polled ready goes with the request; a
        // fresh clone takes its place (tower's usual pattern).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let settings = Arc::clone(&self.settings);
        ResponseFuture::waiting(Box::pin(async move {
            match admit(&settings, &parts).await {
                Ok(None) => {
                    let req = Request::from_parts(parts, FenceRequestBody::new(body, None));
                    let resp = inner.call(req).await?;
                    Ok(resp.map(|b| FenceResponseBody::inner(b, None)))
                }
                Ok(Some((token, ticket, _))) => {
                    parts.extensions.insert(token);
                    let (for_body, for_response) = ticket.split();
                    let req =
                        Request::from_parts(parts, FenceRequestBody::new(body, Some(for_body)));
                    let resp = inner.call(req).await?;
                    Ok(resp.map(|b| FenceResponseBody::inner(b, Some(for_response))))
                }
                Err(refusal) => Ok(refuse(refusal, &parts.headers)),
            }
        }))
    }
}

impl<S> Fence<S> {
    /// Runs an admitted (or unguarded) request on the service that was polled ready: the
    /// token in its extensions, half of its ticket in each body.
    fn run_now<B, RB>(
        &mut self,
        mut req: Request<B>,
        admitted: Admitted,
    ) -> ResponseFuture<S::Future, RB, S::Error>
    where
        S: tower_service::Service<Request<FenceRequestBody<B>>, Response = Response<RB>>,
    {
        let (for_body, for_response) = match admitted {
            Some((token, ticket)) => {
                req.extensions_mut().insert(token);
                let (for_body, for_response) = ticket.split();
                (Some(for_body), Some(for_response))
            }
            None => (None, None),
        };
        let req = req.map(|body| FenceRequestBody::new(body, for_body));
        ResponseFuture::called(self.inner.call(req), for_response)
    }
}

fn refuse<RB>(
    (rejection, resource, token): Refusal,
    headers: &http::HeaderMap,
) -> Response<FenceResponseBody<RB>> {
    let ctx = RejectContext {
        route: None,
        resource: resource.as_deref().map(Resource::name),
        token,
    };
    let grpc = crate::fence::grpc::grpc_content_type(headers);
    rejection
        .respond(ctx, grpc.as_ref())
        .map(FenceResponseBody::rejected)
}

/// The answer to a fence request: admitted like any request (an advance persisted, older
/// requests drained), then 204 / gRPC OK with the mark; refused as any request would be.
async fn fence_answer<RB>(
    s: &Settings,
    parts: &http::request::Parts,
) -> Response<FenceResponseBody<RB>> {
    let refusal = match admit(s, parts).await {
        Ok(Some((_, ticket, resource))) => {
            drop(ticket);
            let grpc = crate::fence::grpc::grpc_content_type(&parts.headers);
            return crate::fence::reject::fence_admitted(resource.mark(), grpc.as_ref())
                .map(FenceResponseBody::rejected);
        }
        // Allowed without a token: a fence needs one.
        Ok(None)
            if token::from_headers(&parts.headers, &s.header).is_ok_and(|t| t.is_none())
                && guarded(s, parts) =>
        {
            (Rejection::MissingToken, None, None)
        }
        Ok(None) => (Rejection::NothingToFence, None, None),
        Err(refusal) => refusal,
    };
    refuse(refusal, &parts.headers)
}

/// Whether a request is for a resource (`false`: the layer lets it through unguarded).
fn guarded(s: &Settings, parts: &http::request::Parts) -> bool {
    match &s.which {
        Which::Fixed(..) => true,
        which => !matches!(derive(which, parts), Ok(None)),
    }
}

/// The synchronous part of [`admit`] for a known resource (borrowed: an admitted request
/// takes no reference to it): `None` when only the async path can decide.
#[inline]
fn decide_now(
    s: &Settings,
    resource: &Arc<Resource>,
    headers: &http::HeaderMap,
) -> Option<Result<Admitted, Refusal>> {
    let token = match token::from_headers(headers, &s.header) {
        Ok(Some(t)) => t,
        Ok(None) if s.missing == MissingToken::Allow => return Some(Ok(None)),
        Ok(None) => return Some(Err((Rejection::MissingToken, None, None))),
        Err(e) => return Some(Err((Rejection::MalformedToken(e), None, None))),
    };
    Some(match s.admission.admit_now(resource, token)? {
        Ok(ticket) => Ok(Some((token, ticket))),
        Err(Refused::Full { limit, .. }) => Err((
            Rejection::MarksFull { limit },
            Some(Arc::clone(resource)),
            Some(token.get()),
        )),
        Err(Refused::Stale { mark, .. }) => Err((
            Rejection::Stale {
                token: token.get(),
                mark,
            },
            Some(Arc::clone(resource)),
            Some(token.get()),
        )),
        Err(Refused::Unissued { epoch, .. }) => Err((
            Rejection::Unissued {
                token: token.get(),
                epoch,
            },
            Some(Arc::clone(resource)),
            Some(token.get()),
        )),
        Err(Refused::Unavailable { step, .. }) => Err((
            Rejection::StoreUnavailable {
                step,
                mark: Some(resource.mark()),
            },
            Some(Arc::clone(resource)),
            Some(token.get()),
        )),
    })
}

/// An admitted request's token and drain ticket (`None`: unguarded, or allowed without one).
type Admitted = Option<(FencingToken, crate::fence::drain::Ticket)>;

type Refusal = (Rejection, Option<Arc<Resource>>, Option<u64>);

/// The proxy's admission, in-process: `Ok(None)` for an unguarded or token-less allowed
/// request, the token, its drain ticket and its resource when admitted.
async fn admit(
    s: &Settings,
    parts: &http::request::Parts,
) -> Result<Option<(FencingToken, crate::fence::drain::Ticket, Arc<Resource>)>, Refusal> {
    let derived = match &s.which {
        Which::Fixed(..) => None,
        which => match derive(which, parts) {
            Ok(None) => return Ok(None),
            other => Some(other),
        },
    };
    let token = match token::from_headers(&parts.headers, &s.header) {
        Ok(Some(t)) => t,
        Ok(None) if s.missing == MissingToken::Allow => return Ok(None),
        Ok(None) => return Err((Rejection::MissingToken, None, None)),
        Err(e) => return Err((Rejection::MalformedToken(e), None, None)),
    };
    let derived = match derived {
        None => None,
        Some(Ok(name)) => name,
        Some(Err(why)) => return Err((why, None, Some(token.get()))),
    };
    let unavailable = |_| {
        let load = Rejection::StoreUnavailable {
            step: crate::fence::reject::StoreStep::Load,
            mark: None,
        };
        (load, None, Some(token.get()))
    };
    let resource = match (&s.which, derived) {
        (Which::Fixed(name, cached), _) => match cached.get() {
            Some(r) => Arc::clone(r),
            None => {
                let r = s
                    .admission
                    .resource_or_open(name)
                    .await
                    .map_err(unavailable)?;
                Arc::clone(cached.get_or_init(|| r))
            }
        },
        (Which::Template(t), Some(name)) => s
            .admission
            .entity_within(&name, &t.1, s.max_marks)
            .await
            .map_err(unavailable)?,
        (_, Some(name)) => s
            .admission
            .resource_or_open(&name)
            .await
            .map_err(unavailable)?,
        (_, None) => return Ok(None),
    };
    match s.admission.admit(&resource, token, s.drain_timeout).await {
        Ok((_, ticket)) => Ok(Some((token, ticket, resource))),
        Err(Refused::Full { limit, .. }) => Err((
            Rejection::MarksFull { limit },
            Some(resource),
            Some(token.get()),
        )),
        Err(Refused::Stale { mark, .. }) => Err((
            Rejection::Stale {
                token: token.get(),
                mark,
            },
            Some(resource),
            Some(token.get()),
        )),
        Err(Refused::Unissued { epoch, .. }) => Err((
            Rejection::Unissued {
                token: token.get(),
                epoch,
            },
            Some(resource),
            Some(token.get()),
        )),
        Err(Refused::Unavailable { step, .. }) => Err((
            Rejection::StoreUnavailable {
                step,
                mark: Some(resource.mark()),
            },
            Some(resource),
            Some(token.get()),
        )),
    }
}
