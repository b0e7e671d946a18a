//! The admin listener: `/metrics`, `/livez`, `/readyz`, `/marks`.
//!
//! Kept off the data path's listener so it can bind to loopback while the proxy faces clients.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;

use crate::admission::Admission;
use crate::metrics::Metrics;

/// What the admin endpoints read.
#[derive(Debug, Clone)]
pub struct Admin {
    admission: Arc<Admission>,
    metrics: Metrics,
}

impl Admin {
    /// An admin view of `admission` and `metrics`.
    pub fn new(admission: Arc<Admission>, metrics: Metrics) -> Self {
        Self { admission, metrics }
    }

    /// Answers one admin request.
    pub async fn handle<B>(&self, req: Request<B>) -> Response<Full<Bytes>> {
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
                let body = serde_json::to_string(&self.admission.marks())
                    .expect("a map of integers serializes");
                let mut r = text(StatusCode::OK, body);
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                r
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /livez, /readyz or /marks\n",
            ),
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
