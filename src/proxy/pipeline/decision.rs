//! What the pipeline decided about a request ([`Note`]: noted on the way), and its access log
//! line.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::{Method, Request, StatusCode, Uri};

use super::Route;
use crate::fence::admission::Resource;
use crate::fence::metrics::Outcome;
use crate::proxy::access_log::{AccessLog, Line};

/// What became of a request: filled in where `handle` decides (the same places that count
/// `palisade_requests_total`).
#[derive(Default)]
pub(super) struct Note<'a> {
    pub(super) route: Option<&'a Route>,
    /// The request's resource: its route's fixed one (borrowed, no reference count on the
    /// hot path), or the entity a template named.
    pub(super) resource: Option<Cow<'a, Arc<Resource>>>,
    pub(super) outcome: Option<Outcome>,
    pub(super) token: Option<u64>,
    pub(super) upstream: Option<&'a str>,
}

impl<'a> Note<'a> {
    pub(super) fn set(&mut self, outcome: Outcome, token: Option<u64>) {
        self.outcome = Some(outcome);
        self.token = token;
    }

    /// The route that took the request, and its fixed resource (the fence replaces it with
    /// the entity a template names).
    pub(super) fn routed(&mut self, route: &'a Route) {
        self.route = Some(route);
        self.resource = route.resource.as_ref().map(Cow::Borrowed);
    }

    /// The request's resource, once routing and the fence chose it.
    pub(super) fn resource(&self) -> Option<&Resource> {
        self.resource.as_deref().map(|r| &**r)
    }
}

/// A request whose future is dropped before an outcome was noted: its client went away (hyper
/// drops the request's future then), counted as `client_closed` by its route.
impl Drop for Note<'_> {
    fn drop(&mut self) {
        if let (None, Some(route)) = (self.outcome, self.route) {
            route.metrics.count(Outcome::ClientClosed);
        }
    }
}

/// Status and outcome of a request whose client went away (or whose connection shutdown's
/// grace dropped) before its answer was ready, as nginx logs it.
const CLIENT_CLOSED: (u16, &str) = (499, "client_closed");

/// A request on its way, written to the access log when dropped: after its answer, or
/// when hyper drops the request's future because the client went away.
pub(super) struct Logged<'a> {
    log: &'a AccessLog,
    pub(super) note: Note<'a>,
    peer: SocketAddr,
    started: Instant,
    // The request itself goes upstream: the line keeps its method and URI, whose clone
    // shares the bytes hyper parsed (a reference count, no copy).
    method: Method,
    uri: Uri,
    status: Option<StatusCode>,
}

impl<'a> Logged<'a> {
    /// `method` and `uri` are the request's (on hyper's path, clones of its own).
    pub(super) fn new(
        log: &'a AccessLog,
        (method, uri): (Method, Uri),
        peer: SocketAddr,
        started: Instant,
    ) -> Self {
        Self {
            log,
            note: Note::default(),
            peer,
            started,
            method,
            uri,
            status: None,
        }
    }

    /// [`Logged::new`] for a request hyper parsed.
    pub(super) fn of<B>(
        log: &'a AccessLog,
        req: &Request<B>,
        peer: SocketAddr,
        started: Instant,
    ) -> Self {
        Self::new(
            log,
            (req.method().clone(), req.uri().clone()),
            peer,
            started,
        )
    }

    /// The answer's status; the line is written when `self` is dropped.
    pub(super) fn answered(mut self, status: StatusCode) {
        self.status = Some(status);
    }
}

impl Drop for Logged<'_> {
    fn drop(&mut self) {
        let n = &self.note;
        let resource = n.resource();
        let (status, outcome) = match self.status {
            Some(s) => (s.as_u16(), n.outcome.map_or("", Outcome::as_str)),
            None => CLIENT_CLOSED,
        };
        self.log.record(&Line {
            peer: self.peer,
            method: self.method.as_str(),
            path: self.uri.path(),
            route: n.route.map(|r| r.settings.name.as_str()),
            resource: resource.map(Resource::name),
            status,
            outcome,
            token: n.token,
            mark: resource.map(Resource::mark),
            upstream: n.upstream,
            latency: self.started.elapsed(),
        });
    }
}
