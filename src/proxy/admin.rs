//! The admin listener: `GET /` (the status page, module `status`), `/metrics`, `/livez`,
//! `/readyz`, `/marks`, `/marks/<resource>`, and `POST /reload`.
//!
//! Kept off the data path's listener so it can bind to loopback while the proxy faces clients
//! (it binds `127.0.0.1` by default). With `[admin] token_env`, every request but `GET` and
//! `HEAD` (so `POST /reload`, and any endpoint that changes something) must carry
//! `Authorization: Bearer <token>`; the reads stay open. A refused request changes nothing:
//! 401 with `WWW-Authenticate: Bearer`, counted in `palisade_admin_unauthorized_total`.

mod html;
mod status;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use prometheus::{IntCounter, IntGauge, Registry};

use crate::fence::admission::Admission;
use crate::fence::metrics::Metrics;
use crate::proxy::config::AdminToken;
use crate::proxy::reload::{ReloadError, Reloader};

/// The admin listener's own metric families.
#[derive(Debug, Clone)]
pub(crate) struct AdminMetrics {
    /// `palisade_ready`: 1 when the mark store answered ready the last time `/readyz` or
    /// `/metrics` asked (every scrape asks), 0 otherwise.
    ready: IntGauge,
    /// `palisade_admin_unauthorized_total`: requests refused for want of the bearer token.
    unauthorized: IntCounter,
}

impl AdminMetrics {
    /// Registers the families in `registry`.
    ///
    /// # Errors
    /// When one of them is registered there already.
    pub(crate) fn register(registry: &Registry) -> prometheus::Result<Self> {
        let ready = IntGauge::new(
            "palisade_ready",
            "1 when the mark store answers ready (as /readyz does), 0 otherwise; asked at each \
             scrape.",
        )?;
        let unauthorized = IntCounter::new(
            "palisade_admin_unauthorized_total",
            "Admin requests refused with 401: no valid bearer token ([admin] token_env).",
        )?;
        registry.register(Box::new(ready.clone()))?;
        registry.register(Box::new(unauthorized.clone()))?;
        Ok(Self {
            ready,
            unauthorized,
        })
    }
}

/// What the admin endpoints read.
#[derive(Debug, Clone)]
pub(crate) struct Admin {
    admission: Arc<Admission>,
    metrics: Metrics,
    own: AdminMetrics,
    reloader: Option<Reloader>,
    token: Option<AdminToken>,
}

/// Why a request did not get past the token check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unauthorized {
    /// No `Authorization: Bearer` credential.
    Missing,
    /// One that is not the token (or several `Authorization` headers).
    Invalid,
}

impl Admin {
    /// An admin view of `admission` and `metrics`, its own families in `own`.
    pub(crate) fn new(admission: Arc<Admission>, metrics: Metrics, own: AdminMetrics) -> Self {
        Self {
            admission,
            metrics,
            own,
            reloader: None,
            token: None,
        }
    }

    /// Serves `POST /reload` with `reloader`.
    #[must_use]
    pub(crate) fn with_reloader(mut self, reloader: Reloader) -> Self {
        self.reloader = Some(reloader);
        self
    }

    /// Asks `token` of every request that is not a `GET` or `HEAD`.
    #[must_use]
    pub(crate) fn with_token(mut self, token: Option<AdminToken>) -> Self {
        self.token = token;
        self
    }

    /// Answers one admin request from `peer`.
    pub(crate) async fn handle<B>(
        &self,
        req: Request<B>,
        peer: SocketAddr,
    ) -> Response<Full<Bytes>> {
        let reads = req.method() == Method::GET || req.method() == Method::HEAD;
        if let (false, Some(token)) = (reads, &self.token) {
            if let Err(why) = check(token, req.headers()) {
                self.own.unauthorized.inc();
                tracing::warn!(
                    %peer,
                    method = %req.method(),
                    path = req.uri().path(),
                    reason = ?why,
                    "admin request refused: no valid bearer token ([admin] token_env)"
                );
                return unauthorized(why);
            }
        }
        if req.uri().path() == "/reload" {
            return self.reload(req.method()).await;
        }
        if !reads {
            return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        }
        match req.uri().path() {
            "/" => self.status(req.uri().query()).await,
            "/metrics" => {
                // Asked now, so that the scrape reads the store's readiness of this moment
                // (bounded like /readyz: the store's own probe and request timeouts).
                let _ = self.ready().await;
                let mut r = text(StatusCode::OK, self.metrics.render());
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            "/livez" => text(StatusCode::OK, "ok\n"),
            "/readyz" => match self.ready().await {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(e) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("mark store not ready: {e}\n"),
                ),
            },
            "/marks" => {
                let marks = match marks_query(req.uri().query()) {
                    // The resources in memory (fixed ones, and entities in the cache).
                    None => self.admission.marks(),
                    // The store's, paged: entities evicted from memory included.
                    Some(Ok((prefix, limit))) => {
                        match self.admission.store().list(&prefix, limit).await {
                            Ok(m) => m,
                            Err(e) => {
                                return text(
                                    StatusCode::SERVICE_UNAVAILABLE,
                                    format!("cannot list marks: {e}\n"),
                                )
                            }
                        }
                    }
                    Some(Err(why)) => return text(StatusCode::BAD_REQUEST, format!("{why}\n")),
                };
                let body = serde_json::to_string(&marks).expect("a map of integers serializes");
                let mut r = text(StatusCode::OK, body);
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                r
            }
            path if path.starts_with("/marks/") => self.one_mark(&path["/marks/".len()..]).await,
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try / (the status page), /metrics, /livez, /readyz, /marks, \
                 /marks/<resource> or POST /reload\n",
            ),
        }
    }

    /// The store's readiness, as `/readyz` answers it, also set in `palisade_ready`.
    async fn ready(&self) -> Result<(), crate::fence::marks::StoreError> {
        let r = self.admission.store().ready().await;
        self.own.ready.set(i64::from(r.is_ok()));
        r
    }

    /// `GET /marks/<resource>` (the name percent-decoded): `{"resource", "mark", "guarded"}`.
    /// A resource this proxy guards answers with the mark it judges by; any other with the
    /// store's (0: no token accepted). 503 when the store cannot be read.
    async fn one_mark(&self, encoded: &str) -> Response<Full<Bytes>> {
        let name = match percent_encoding::percent_decode_str(encoded).decode_utf8() {
            Ok(n) if !n.is_empty() => n.into_owned(),
            _ => return text(StatusCode::BAD_REQUEST, "expected /marks/<resource name>\n"),
        };
        // Guarded: a route in force checks it (the admission also keeps resources of routes
        // that a reload removed or retired, which no request reaches any more).
        let guarded = self
            .reloader
            .as_ref()
            .is_none_or(|r| r.proxy().guards(&name));
        let (mark, guarded) = match self.admission.resource(&name) {
            Some(r) => (r.mark(), guarded),
            // Not in memory: an entity evicted (or never used), or a resource no route has.
            None => match self.admission.stored_mark(&name).await {
                Ok(m) => (m, guarded && self.reloader.is_some()),
                Err(e) => {
                    return text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("cannot read the mark of {name:?}: {e}\n"),
                    )
                }
            },
        };
        let body = serde_json::json!({"resource": name, "mark": mark, "guarded": guarded});
        let mut r = text(StatusCode::OK, body.to_string());
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }

    /// `POST /reload`: what SIGHUP does, with the outcome in the answer: 200 and a summary,
    /// 400 for an invalid file (the error names file:line:column), 503 when the marks of new
    /// resources cannot be loaded, 500 otherwise. Nothing changes unless it answers 200.
    async fn reload(&self, method: &Method) -> Response<Full<Bytes>> {
        if method != Method::POST {
            let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "only POST\n");
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
            return r;
        }
        let Some(reloader) = &self.reloader else {
            return text(StatusCode::NOT_FOUND, "reload is not available here\n");
        };
        match reloader.reload().await {
            Ok(r) => {
                let mut body = format!(
                    "reloaded: {} routes, {} upstreams kept, {} new; new resources: {:?}\n",
                    r.routes, r.carried.upstreams_kept, r.carried.upstreams_new, r.new_resources
                );
                for k in &r.kept {
                    body.push_str(&format!("warning: {k}\n"));
                }
                for c in &r.carried_marks {
                    body.push_str(&format!(
                        "mark carried over: route {:?} now guards {:?} (was {:?}), mark {}\n",
                        c.route, c.to, c.from, c.mark
                    ));
                }
                for d in &r.retired {
                    body.push_str(&format!(
                        "warning: resource {:?} (mark {}) is no longer guarded ([marks] retired)\n",
                        d.resource, d.mark
                    ));
                }
                text(StatusCode::OK, body)
            }
            Err(e) => {
                let status = match e {
                    ReloadError::Config(_) => StatusCode::BAD_REQUEST,
                    ReloadError::Unprotected(_) => StatusCode::CONFLICT,
                    ReloadError::Store(_) | ReloadError::Carry { .. } => {
                        StatusCode::SERVICE_UNAVAILABLE
                    }
                    ReloadError::AccessLog(_) | ReloadError::TaskLost(_) => {
                        StatusCode::INTERNAL_SERVER_ERROR
                    }
                };
                text(
                    status,
                    format!("reload failed, the previous configuration stays: {e}\n"),
                )
            }
        }
    }
}

/// Whether `headers` carry the one credential `Authorization: Bearer <token>` (the scheme in
/// any case, RFC 9110 11.1).
fn check(token: &AdminToken, headers: &HeaderMap) -> Result<(), Unauthorized> {
    let mut all = headers.get_all(header::AUTHORIZATION).iter();
    let (value, None) = (all.next().ok_or(Unauthorized::Missing)?, all.next()) else {
        return Err(Unauthorized::Invalid);
    };
    let value = value.as_bytes();
    let (scheme, credential) = match value.iter().position(|&b| b == b' ') {
        Some(at) => (&value[..at], value[at..].trim_ascii()),
        None => (value, &b""[..]),
    };
    if !scheme.eq_ignore_ascii_case(b"bearer") || credential.is_empty() {
        return Err(Unauthorized::Missing);
    }
    if token.verify(credential) {
        Ok(())
    } else {
        Err(Unauthorized::Invalid)
    }
}

/// 401 with the challenge of RFC 6750 section 3 (`error="invalid_token"` when a token was
/// sent). The body names the header, never the token.
fn unauthorized(why: Unauthorized) -> Response<Full<Bytes>> {
    let (challenge, body) = match why {
        Unauthorized::Missing => (
            "Bearer realm=\"palisade admin\"",
            "unauthorized: this request needs Authorization: Bearer <token> ([admin] \
             token_env)\n",
        ),
        Unauthorized::Invalid => (
            "Bearer realm=\"palisade admin\", error=\"invalid_token\"",
            "unauthorized: the bearer token is not the admin token\n",
        ),
    };
    let mut r = text(StatusCode::UNAUTHORIZED, body);
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(challenge),
    );
    r
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Default and largest `limit` of `/marks?prefix=...`.
const MARKS_PAGE: usize = 1000;
const MARKS_PAGE_MAX: usize = 100_000;

/// `prefix=P&limit=N` of `/marks`: `None` without a query.
fn marks_query(query: Option<&str>) -> Option<Result<(String, usize), String>> {
    let query = query.filter(|q| !q.is_empty())?;
    let mut prefix = String::new();
    let mut limit = MARKS_PAGE;
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = match percent_encoding::percent_decode_str(v).decode_utf8() {
            Ok(v) => v.into_owned(),
            Err(_) => return Some(Err(format!("{k}: not UTF-8"))),
        };
        match k {
            "prefix" => prefix = v,
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=MARKS_PAGE_MAX).contains(&n) => limit = n,
                _ => return Some(Err(format!("limit must be 1..={MARKS_PAGE_MAX}"))),
            },
            other => return Some(Err(format!("unknown parameter {other:?} (prefix, limit)"))),
        }
    }
    Some(Ok((prefix, limit)))
}
