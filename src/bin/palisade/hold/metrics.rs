//! `--metrics-addr ADDR`: this process's owner metrics (the client library's feature
//! `metrics`: `palisade_owner_*`, `palisade_session_*`) as Prometheus text on `GET /metrics`,
//! from before the first acquisition until palisade exits.
//!
//! The recorder is `metrics-exporter-prometheus`'s, installed as the process's global one;
//! the text is rendered through its handle at each scrape and served by hyper, the HTTP
//! server the binary already has (the exporter's own listener would add crates).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Upper bounds of `palisade_owner_acquire_seconds`' buckets: a free lock takes
/// milliseconds, a queue behind a long job can take an hour.
const ACQUIRE_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
    3600.0,
];

/// Bound on a scraper's request head (a connection that sends nothing is closed).
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Listens on `addr`, installs the recorder and serves it in the background; returns the
/// address bound.
pub(super) async fn serve(addr: SocketAddr) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--metrics-addr {addr}: cannot listen: {e}"))?;
    let local = listener.local_addr().unwrap_or(addr);
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("palisade_owner_acquire_seconds".to_owned()),
            ACQUIRE_BUCKETS,
        )
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| format!("--metrics-addr {addr}: cannot install the recorder: {e}"))?;
    tokio::spawn(accept(listener, handle));
    tracing::info!(addr = %local, "serving owner metrics on GET /metrics");
    Ok(local)
}

async fn accept(listener: tokio::net::TcpListener, handle: PrometheusHandle) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: not a reason to stop serving, nor to spin.
                tracing::debug!(error = %e, "metrics listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let answer = answer(&handle, &req);
                async move { Ok::<_, Infallible>(answer) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "metrics connection ended");
            }
        });
    }
}

fn answer<B>(handle: &PrometheusHandle, req: &Request<B>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, content_type: &'static str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        r
    };
    if req.uri().path() != "/metrics" {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "only /metrics\n".to_owned(),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "only GET\n".to_owned(),
        );
    }
    reply(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        handle.render(),
    )
}
