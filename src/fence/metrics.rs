//! Prometheus metrics (names fixed in `docs/design.md#metrics`).
//!
//! Label values are resolved once, when routes and resources are known, so the request path
//! only bumps pre-resolved atomics: no hashing, no locks. A refusal also goes into the ring of
//! recent refusals ([`crate::fence::recent`]) that the admin's status page shows; module `read` reads
//! the families back for it.

mod read;

use std::net::SocketAddr;
use std::sync::Arc;

pub use self::read::{DrainStats, OpLatency};
use crate::fence::recent::RecentRefusals;
use crate::fence::reject::Rejection;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Every request ends in exactly one of these (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Guarded, token fresh (equal or advancing), forwarded.
    Admitted,
    /// Unguarded route, forwarded.
    Passthrough,
    /// Token below the mark: 409 / ABORTED.
    Stale,
    /// Guarded route, no token. Rejected with 428, or forwarded under `missing_token = "allow"`.
    Missing,
    /// Malformed token or request path: 400.
    Malformed,
    /// The mark store could not persist an advance: 503.
    Unavailable,
    /// No route matched: 404.
    NoRoute,
    /// The upstream failed or timed out after the request was admitted: 502 / 504.
    UpstreamError,
    /// The path matched a guarded route with `other_methods = "reject"` but the method is not
    /// one it lists: 405.
    MethodNotAllowed,
    /// The request body was larger than the route's `max_body_bytes`: 413.
    TooLarge,
    /// A new entity of a templated route, refused because the route's `max_marks` stored
    /// marks exist: 503 / RESOURCE_EXHAUSTED.
    MarksFull,
    /// A fence request (`x-fencing-fence: 1`) admitted and answered 204 / OK, not forwarded.
    Fence,
    /// A token above the epoch of the lock that feeds the route (never issued): 403 /
    /// PERMISSION_DENIED.
    Unissued,
    /// The client went away (closed its connection, reset its stream, cancelled its call)
    /// before its answer: 499 in the access log, as nginx logs it. Not an upstream error.
    ClientClosed,
}

impl Outcome {
    const ALL: [Outcome; 14] = [
        Outcome::Admitted,
        Outcome::Passthrough,
        Outcome::Stale,
        Outcome::Missing,
        Outcome::Malformed,
        Outcome::Unavailable,
        Outcome::NoRoute,
        Outcome::UpstreamError,
        Outcome::MethodNotAllowed,
        Outcome::TooLarge,
        Outcome::MarksFull,
        Outcome::Fence,
        Outcome::Unissued,
        Outcome::ClientClosed,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Passthrough => "passthrough",
            Outcome::Stale => "stale",
            Outcome::Missing => "missing",
            Outcome::Malformed => "malformed",
            Outcome::Unavailable => "unavailable",
            Outcome::NoRoute => "no_route",
            Outcome::UpstreamError => "upstream_error",
            Outcome::MethodNotAllowed => "method_not_allowed",
            Outcome::TooLarge => "too_large",
            Outcome::MarksFull => "marks_full",
            Outcome::Fence => "fence",
            Outcome::Unissued => "unissued",
            Outcome::ClientClosed => "client_closed",
        }
    }
}

/// All of palisade's metric families, registered in one caller-owned [`Registry`].
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    stale: IntCounterVec,
    mark: IntGaugeVec,
    advances: IntCounterVec,
    duration: HistogramVec,
    inflight: IntGaugeVec,
    store_duration: HistogramVec,
    store_errors: IntCounterVec,
    connections: IntGaugeVec,
    conn_closed: IntCounterVec,
    drain_duration: HistogramVec,
    drain_timeouts: IntCounterVec,
    drain_aborted: IntCounterVec,
    entities: EntityMetrics,
    /// The last refusals, shared by every configuration (reloads keep them).
    refusals: Arc<RecentRefusals>,
}

/// The entities of resource templates in memory (`[marks] max_cached`).
#[derive(Debug, Clone)]
pub struct EntityMetrics {
    /// `palisade_entities_cached`: entities in memory now.
    pub cached: IntGauge,
    /// `palisade_entities_loaded_total`: marks of entities read from the store on first use
    /// (or after an eviction).
    pub loaded: IntCounter,
    /// `palisade_entities_evicted_total`: idle entities dropped from memory.
    pub evicted: IntCounter,
}

/// Pre-resolved `palisade_requests_total{route,outcome}` counters of one route.
#[derive(Debug, Clone)]
pub struct Outcomes([IntCounter; 14]);

impl Outcomes {
    /// Counts one request under `outcome`.
    pub fn count(&self, outcome: Outcome) {
        self.0[outcome as usize].inc();
    }
}

/// Pre-resolved handles for one route.
#[derive(Debug, Clone)]
pub struct RouteMetrics {
    outcomes: Outcomes,
    /// `palisade_stale_rejections_total{route,resource}`; `None` on unguarded routes.
    pub stale: Option<IntCounter>,
    /// `palisade_request_duration_seconds{route}`.
    pub duration: Histogram,
    /// `palisade_inflight_requests{route}`.
    pub inflight: IntGauge,
    /// The route's name, for its refusals' records.
    route: Arc<str>,
    refusals: Arc<RecentRefusals>,
}

impl RouteMetrics {
    /// Counts one request under `outcome`.
    pub fn count(&self, outcome: Outcome) {
        self.outcomes.count(outcome);
    }

    /// Records a refusal of a request to this route in the recent refusals (see
    /// [`RecentRefusals::record`]); refusals only, never on an admitted request's path.
    pub fn refused(
        &self,
        rejection: &Rejection,
        resource: Option<(&str, u64)>,
        token: Option<u64>,
        peer: SocketAddr,
    ) {
        self.refusals
            .record(&self.route, rejection, resource, token, peer);
    }
}

/// Pre-resolved handles for one resource's mark.
#[derive(Debug, Clone)]
pub struct MarkMetrics {
    /// `palisade_mark{resource}`; `None` for the entities of a resource template, which
    /// report per template only (one gauge per entity would grow without bound).
    pub mark: Option<IntGauge>,
    /// `palisade_mark_advances_total{resource}`.
    pub advances: IntCounter,
    /// `palisade_drain_duration_seconds{resource}`: how long an advance waited for older
    /// owners' in-flight requests.
    pub drain_duration: Histogram,
    /// `palisade_drain_timeouts_total{resource}`: drains that ran out of time.
    pub drain_timeouts: IntCounter,
    /// `palisade_drain_aborted_requests_total{resource}`: requests aborted by those.
    pub drain_aborted: IntCounter,
}

/// Pre-resolved connection handles of one listener (`listener` label: `proxy` or `admin`).
#[derive(Debug, Clone)]
pub struct ConnMetrics {
    /// `palisade_connections_open{listener}`.
    pub open: IntGauge,
    /// `palisade_connections_closed_total{listener,reason="max_connections"}`: accepted and
    /// closed at once because `max_connections` were open.
    pub refused: IntCounter,
    /// `...{reason="header_read_timeout"}`: no complete first request head in time.
    pub header_timeout: IntCounter,
    /// `...{reason="idle_timeout"}`: no request in progress for `idle_timeout_ms`.
    pub idle_timeout: IntCounter,
    /// `...{reason="accept_error"}`: `accept` failed (out of file descriptors and the like).
    pub accept_errors: IntCounter,
    /// `...{reason="tls_handshake"}`: the TLS handshake failed or took longer than
    /// `header_read_timeout_ms` (a client without a valid certificate, when one is required).
    pub tls_failed: IntCounter,
}

/// Pre-resolved handles for one store operation.
#[derive(Debug, Clone)]
pub struct StoreMetrics {
    /// `palisade_store_operation_duration_seconds{store,op}`.
    pub duration: Histogram,
    /// `palisade_store_errors_total{store,op}`.
    pub errors: IntCounter,
}

impl Metrics {
    /// Registers every family in `registry`.
    ///
    /// # Errors
    /// Fails only if a family with one of palisade's names is already registered there.
    pub fn new(registry: Registry) -> prometheus::Result<Self> {
        let requests = IntCounterVec::new(
            Opts::new("palisade_requests_total", "Requests by route and outcome."),
            &["route", "outcome"],
        )?;
        let stale = IntCounterVec::new(
            Opts::new(
                "palisade_stale_rejections_total",
                "Requests rejected because their fencing token was below the resource's mark.",
            ),
            &["route", "resource"],
        )?;
        let mark = IntGaugeVec::new(
            Opts::new(
                "palisade_mark",
                "Highest fencing token accepted for the resource.",
            ),
            &["resource"],
        )?;
        let advances = IntCounterVec::new(
            Opts::new(
                "palisade_mark_advances_total",
                "Times the resource's mark advanced.",
            ),
            &["resource"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "palisade_request_duration_seconds",
                "Time from request arrival to response headers.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0,
            ]),
            &["route"],
        )?;
        let inflight = IntGaugeVec::new(
            Opts::new(
                "palisade_inflight_requests",
                "Requests in progress, until their response body ends.",
            ),
            &["route"],
        )?;
        let store_duration = HistogramVec::new(
            HistogramOpts::new(
                "palisade_store_operation_duration_seconds",
                "Mark store operation latency.",
            )
            .buckets(vec![
                0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0,
            ]),
            &["store", "op"],
        )?;
        let store_errors = IntCounterVec::new(
            Opts::new(
                "palisade_store_errors_total",
                "Mark store operations that failed.",
            ),
            &["store", "op"],
        )?;
        let connections = IntGaugeVec::new(
            Opts::new("palisade_connections_open", "Client connections open now."),
            &["listener"],
        )?;
        let conn_closed = IntCounterVec::new(
            Opts::new(
                "palisade_connections_closed_total",
                "Client connections palisade closed on its own, by reason.",
            ),
            &["listener", "reason"],
        )?;
        let drain_duration = HistogramVec::new(
            HistogramOpts::new(
                "palisade_drain_duration_seconds",
                "How long an advance waited for requests of older owners still in flight.",
            )
            .buckets(vec![
                0.0, 0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0,
            ]),
            &["resource"],
        )?;
        let drain_timeouts = IntCounterVec::new(
            Opts::new(
                "palisade_drain_timeouts_total",
                "Advances whose drain ran out of time and aborted older requests.",
            ),
            &["resource"],
        )?;
        let drain_aborted = IntCounterVec::new(
            Opts::new(
                "palisade_drain_aborted_requests_total",
                "Requests of older owners aborted because they outlasted the drain time.",
            ),
            &["resource"],
        )?;
        let entities = EntityMetrics {
            cached: IntGauge::new(
                "palisade_entities_cached",
                "Entities of resource templates whose marks are in memory now.",
            )?,
            loaded: IntCounter::new(
                "palisade_entities_loaded_total",
                "Entity marks read from the store on first use or after an eviction.",
            )?,
            evicted: IntCounter::new(
                "palisade_entities_evicted_total",
                "Idle entities dropped from memory under [marks] max_cached.",
            )?,
        };
        registry.register(Box::new(entities.cached.clone()))?;
        registry.register(Box::new(entities.loaded.clone()))?;
        registry.register(Box::new(entities.evicted.clone()))?;
        registry.register(Box::new(drain_duration.clone()))?;
        registry.register(Box::new(drain_timeouts.clone()))?;
        registry.register(Box::new(drain_aborted.clone()))?;
        registry.register(Box::new(connections.clone()))?;
        registry.register(Box::new(conn_closed.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(stale.clone()))?;
        registry.register(Box::new(mark.clone()))?;
        registry.register(Box::new(advances.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(inflight.clone()))?;
        registry.register(Box::new(store_duration.clone()))?;
        registry.register(Box::new(store_errors.clone()))?;
        Ok(Self {
            registry,
            requests,
            stale,
            mark,
            advances,
            duration,
            inflight,
            store_duration,
            store_errors,
            connections,
            conn_closed,
            drain_duration,
            drain_timeouts,
            drain_aborted,
            entities,
            refusals: Arc::default(),
        })
    }

    /// The last refusals of requests that matched a route.
    pub fn refusals(&self) -> &RecentRefusals {
        &self.refusals
    }

    /// The entity cache's handles.
    pub fn entities(&self) -> EntityMetrics {
        self.entities.clone()
    }

    /// Connection handles for the listener named `listener`.
    pub fn connections(&self, listener: &str) -> ConnMetrics {
        let closed = |reason: &str| self.conn_closed.with_label_values(&[listener, reason]);
        ConnMetrics {
            open: self.connections.with_label_values(&[listener]),
            refused: closed("max_connections"),
            header_timeout: closed("header_read_timeout"),
            idle_timeout: closed("idle_timeout"),
            accept_errors: closed("accept_error"),
            tls_failed: closed("tls_handshake"),
        }
    }

    /// Request counters labelled `route` (`""` for requests that matched no route).
    pub fn outcomes(&self, route: &str) -> Outcomes {
        Outcomes(Outcome::ALL.map(|o| self.requests.with_label_values(&[route, o.as_str()])))
    }

    /// Handles for a route; `resource` is the one it guards, `None` when unguarded.
    pub fn route(&self, route: &str, resource: Option<&str>) -> RouteMetrics {
        RouteMetrics {
            outcomes: self.outcomes(route),
            stale: resource.map(|r| self.stale.with_label_values(&[route, r])),
            duration: self.duration.with_label_values(&[route]),
            inflight: self.inflight.with_label_values(&[route]),
            route: Arc::from(route),
            refusals: Arc::clone(&self.refusals),
        }
    }

    /// Handles for a resource's mark.
    pub fn mark(&self, resource: &str) -> MarkMetrics {
        MarkMetrics {
            mark: Some(self.mark.with_label_values(&[resource])),
            advances: self.advances.with_label_values(&[resource]),
            drain_duration: self.drain_duration.with_label_values(&[resource]),
            drain_timeouts: self.drain_timeouts.with_label_values(&[resource]),
            drain_aborted: self.drain_aborted.with_label_values(&[resource]),
        }
    }

    /// Handles shared by every entity of a resource template: the counters and histograms
    /// labelled with the template's text, no mark gauge.
    pub fn keyed_mark(&self, template: &str) -> MarkMetrics {
        MarkMetrics {
            mark: None,
            ..self.mark(template)
        }
    }

    /// Handles for one store operation.
    pub fn store(&self, store: &str, op: &str) -> StoreMetrics {
        StoreMetrics {
            duration: self.store_duration.with_label_values(&[store, op]),
            errors: self.store_errors.with_label_values(&[store, op]),
        }
    }

    /// The registry every family is registered in, for the proxy's own families (config
    /// reloads, the access log) that the resource's shared side knows nothing about.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The Prometheus text exposition of every registered family.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus::TextEncoder::new()
            .encode_utf8(&self.registry.gather(), &mut out)
            .expect("writing to a String cannot fail");
        out
    }
}
