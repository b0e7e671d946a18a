//! Accept loop shared by the proxy and admin listeners.
//!
//! Servers take an already-bound listener and a shutdown future, so tests bind port 0 and
//! callers decide what "shutdown" means (a signal, a test's oneshot). On shutdown the listener
//! is closed at once, open connections are asked to finish (HTTP/1.1 after the current
//! response, HTTP/2 with GOAWAY), and whatever is still running after `grace` is dropped.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

/// Serves HTTP/1.1 and h2c on `listener` until `shutdown` resolves, calling `handle` for each
/// request with the peer's address.
///
/// Returns once every connection has finished or `grace` has passed.
pub async fn serve<H, F, B>(
    listener: TcpListener,
    handle: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        let svc = service_fn(move |req| {
            let fut = handle(req, peer);
            async move { Ok::<_, Infallible>(fut.await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(peer = %peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => tracing::debug!("all connections closed"),
        () = tokio::time::sleep(grace) => tracing::warn!(?grace, "shutdown grace period over; dropping open connections"),
    }
}
