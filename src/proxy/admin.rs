//! The admin listener: `GET /metrics`, `/livez`, `/readyz`, `/marks`, `/marks/<resource>`,
//! and `POST /reload`.
//!
//! Kept off the data path's listener so it can bind to loopback while the proxy faces clients
//! (it binds `127.0.0.1` by default): whoever reaches it can reload the configuration.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;

use crate::admission::Admission;
use crate::metrics::Metrics;
use crate::reload::{ReloadError, Reloader};

/// What the admin endpoints read.
#[derive(Debug, Clone)]
pub struct Admin {
    admission: Arc<Admission>,
    metrics: Metrics,
    reloader: Option<Reloader>,
}

impl Admin {
    /// An admin view of `admission` and `metrics`.
    pub fn new(admission: Arc<Admission>, metrics: Metrics) -> Self {
        Self {
            admission,
            metrics,
            reloader: None,
        }
    }

    /// Serves `POST /reload` with `reloader`.
    #[must_use]
    pub fn with_reloader(mut self, reloader: Reloader) -> Self {
        self.reloader = Some(reloader);
        self
    }

    /// Answers one admin request.
    pub async fn handle<B>(&self, req: Request<B>) -> Response<Full<Bytes>> {
        if req.uri().path() == "/reload" {
            return self.reload(req.method()).await;
        }
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        }
        match req.uri().path() {
            "/metrics" => {
                let mut r = text(StatusCode::OK, self.metrics.render());
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            "/livez" => text(StatusCode::OK, "ok\n"),
            "/readyz" => match self.admission.store().ready().await {
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
                "not found: try /metrics, /livez, /readyz, /marks, /marks/<resource> or POST \
                 /reload\n",
            ),
        }
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
