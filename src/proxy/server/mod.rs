//! Accept loop shared by the proxy and admin listeners.
//!
//! Servers take an already-bound listener and a shutdown future, so tests bind port 0 and
//! callers decide what "shutdown" means (a signal, a test's oneshot). On shutdown the listener
//! is closed at once, open connections are asked to finish (HTTP/1.1 after the current
//! response, HTTP/2 with GOAWAY), and whatever is still running after `grace` is dropped.
//!
//! A client cannot hold resources for free: every connection is watched by `conn`
//! (`header_read_timeout`, `idle_timeout`), at most `max_connections` are open at once (more
//! are accepted and closed at once, counted), and running out of file descriptors never makes
//! the accept loop spin (see [`serve_with`]).

/// `AsyncWrite` for a read-side wrapper `$t<I>` with an `io: I` field: writes go straight
/// through (the wrappers only watch or replay what is read). With `shutdown = $f`, the
/// wrapper's own `fn $f(&mut self, cx)` shuts it down (and `I` must be readable too).
macro_rules! write_through {
    ($t:ident) => {
        impl<I: AsyncWrite + Unpin> AsyncWrite for $t<I> {
            $crate::proxy::server::write_through!(@methods);

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
            }
        }
    };
    ($t:ident, shutdown = $f:ident) => {
        impl<I: AsyncRead + AsyncWrite + Unpin> AsyncWrite for $t<I> {
            $crate::proxy::server::write_through!(@methods);

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                self.get_mut().$f(cx)
            }
        }
    };
    (@methods) => {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
        }

        fn is_write_vectored(&self) -> bool {
            self.io.is_write_vectored()
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().io).poll_flush(cx)
        }
    };
}
pub(crate) use write_through;

mod body;
mod conn;
mod count;
pub(crate) mod framing;
mod handoff;
mod head;
pub(crate) mod linger;
mod state;
mod wake;
mod watchdog_task;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::fence::metrics::ConnMetrics;

pub(crate) use body::ActiveBody;
pub(crate) use count::ConnCount;
use count::Counting;
pub(crate) use handoff::{Activity, FirstConn, FirstFuture, FirstHandler, Handoff};

/// What one listener allows a client connection (`[proxy]` keys of
/// `docs/design.md#configuration-names`).
#[derive(Debug, Clone)]
pub struct Limits {
    /// `max_connections`: open client connections; more are accepted and closed at once.
    pub max_connections: usize,
    /// `header_read_timeout_ms`: from accept until the first request's head is complete
    /// (HTTP/1.1), or until the HTTP/2 preface arrived.
    pub header_read_timeout: Duration,
    /// `idle_timeout_ms`: how long a connection may stay open with no request in progress
    /// (HTTP/1.1 keep-alive; HTTP/2 with no open stream, also after its preface).
    pub idle_timeout: Duration,
    /// `http2_keepalive_interval_ms`: PING an HTTP/2 client this often and close the
    /// connection when a PING is not answered within the same time; `None`: no PINGs.
    pub http2_keepalive_interval: Option<Duration>,
    /// After shutdown begins, how long in-flight requests may still run.
    pub grace: Duration,
    /// `max_header_bytes`: the largest request head; HTTP/1.1 clients over it get 431.
    pub max_header_bytes: usize,
    /// `[proxy.tls]`: terminate TLS with this configuration (the handshake counts toward
    /// `header_read_timeout`). Each new connection uses the configuration current when it is
    /// accepted, so a reload can replace certificates without a restart.
    pub tls: Option<TlsConfig>,
}

/// The listener's TLS configuration, replaceable while serving (a reload re-reads the
/// certificate files).
pub type TlsConfig = Arc<arc_swap::ArcSwap<tokio_rustls::rustls::ServerConfig>>;

/// Who sent a request: the client's address, and whether its connection is TLS.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// The client's address.
    pub addr: SocketAddr,
    /// The connection is TLS (`[proxy.tls]`).
    pub tls: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            http2_keepalive_interval: Some(Duration::from_secs(20)),
            grace: Duration::from_secs(10),
            max_header_bytes: crate::proxy::config::DEFAULT_MAX_HEADER_BYTES,
            tls: None,
        }
    }
}

/// Serves HTTP/1.1 and h2c on `listener` until `shutdown` resolves, calling `handle` for each
/// request with the peer's address, with default [`Limits`] and the given shutdown `grace`.
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
    let limits = Limits {
        grace,
        ..Limits::default()
    };
    let handle = move |req, peer: Peer, _: &Arc<()>| handle(req, peer.addr);
    serve_with(listener, handle, shutdown, limits, None).await;
}

/// [`serve`] with explicit [`Limits`], optionally connection metrics, and state of type `C`
/// per client connection (created when the connection is accepted, dropped when it ends; the
/// proxy keeps the connection's own upstream connection there).
///
/// Out of file descriptors (`EMFILE`/`ENFILE`), the loop frees a descriptor it keeps in
/// reserve, accepts the waiting connection and closes it at once, then takes the reserve back:
/// the kernel's queue drains instead of the same error coming back in a busy loop. Without a
/// reserve it backs off for 50 ms.
pub async fn serve_with<H, F, B, C>(
    listener: TcpListener,
    handle: H,
    shutdown: impl Future<Output = ()>,
    limits: Limits,
    metrics: Option<ConnMetrics>,
) where
    H: Fn(Request<Incoming>, Peer, &Arc<C>) -> F + Clone + Send + Sync + 'static,
    C: Default + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_first(listener, handle, shutdown, limits, metrics, None).await;
}

/// [`serve_with`] where `first`, when given, serves each plain-TCP connection before hyper
/// does (TLS ones go to hyper at once): it may serve the connection to its end or hand it
/// over to hyper (see [`Handoff`]). The watchdog, `max_connections` and shutdown apply to
/// both alike.
pub(crate) async fn serve_first<H, F, B, C>(
    listener: TcpListener,
    handle: H,
    shutdown: impl Future<Output = ()>,
    limits: Limits,
    metrics: Option<ConnMetrics>,
    first: Option<FirstHandler>,
) where
    H: Fn(Request<Incoming>, Peer, &Arc<C>) -> F + Clone + Send + Sync + 'static,
    C: Default + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The watchdog in `conn` bounds slow heads (first and later ones). hyper's own head timer
    // would add a timer and an allocation to every request for nothing, so it is off.
    builder.http1().header_read_timeout(None).max_buf_size(
        limits
            .max_header_bytes
            .max(crate::proxy::config::MIN_HEADER_BYTES),
    );
    let mut h2 = builder.http2();
    h2.timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    if let Some(every) = limits.http2_keepalive_interval {
        h2.keep_alive_interval(every).keep_alive_timeout(every);
    }
    // Shared by connections that start on `first` and may move to hyper later.
    let shared_builder = Arc::new(builder.clone());
    let limits = Arc::new(limits);
    let open = Arc::new(AtomicUsize::new(0));
    // Each connection task holds a sender; `recv` returns `None` once all have finished.
    let (alive, mut all_done) = mpsc::channel::<Infallible>(1);
    let (stop, stopping) = watch::channel(false);
    // Read by the fast path's connections for each answer (see `Activity::stopping`).
    let server_stopping = Arc::new(AtomicBool::new(false));
    let mut reserve = reserve_fd();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    if let Some(m) = &metrics {
                        m.accept_errors.inc();
                    }
                    if out_of_descriptors(&e) && reserve.is_some() {
                        tracing::warn!(error = %e, "out of file descriptors: closing a new connection");
                        drop(reserve.take());
                        if let Ok(Ok((s, _))) =
                            tokio::time::timeout(Duration::ZERO, listener.accept()).await
                        {
                            drop(s);
                        }
                        reserve = reserve_fd();
                    } else {
                        tracing::warn!(error = %e, "accept failed; backing off");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    continue;
                }
            },
        };
        // A reserve lost to a race (another task took the freed descriptor) is taken back as
        // soon as descriptors are available again.
        if reserve.is_none() {
            reserve = reserve_fd();
        }
        // The count goes up here and down when the task ends: no lock, and a refused
        // connection never reaches hyper.
        if open.fetch_add(1, Ordering::AcqRel) >= limits.max_connections {
            open.fetch_sub(1, Ordering::AcqRel);
            if let Some(m) = &metrics {
                m.refused.inc();
            }
            tracing::debug!(peer = %peer, max = limits.max_connections, "max_connections reached; closing");
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        let state = state::State::new();
        let handle = handle.clone();
        let svc_state = Arc::clone(&state);
        let svc_local = Arc::new(C::default());
        let client = Peer {
            addr: peer,
            tls: limits.tls.is_some(),
        };
        let counted = Arc::new(Counting::new(
            &open,
            metrics.as_ref().map(|m| m.open.clone()),
            &alive,
        ));
        let svc_counted = Arc::clone(&counted);
        let max_head = limits
            .max_header_bytes
            .max(crate::proxy::config::MIN_HEADER_BYTES);
        let svc = service_fn(move |mut req: Request<Incoming>| {
            let active = svc_state.request_started();
            // A request that may take the connection over (a WebSocket) carries the
            // connection's count, so that a tunnel keeps counting toward `max_connections`
            // (and is waited for at shutdown) after hyper lets the connection go.
            if req.headers().contains_key(http::header::UPGRADE) {
                req.extensions_mut()
                    .insert(ConnCount(Arc::clone(&svc_counted)));
                svc_state.set_may_tunnel();
            }
            // Boxed: hyper moves the service's future into its connection state, and the
            // future of a proxied request is kilobytes.
            // hyper hides what makes a head's framing ambiguous: its bytes were followed as
            // hyper read them (`framing`).
            let ambiguous =
                req.version() <= http::Version::HTTP_11 && svc_state.next_head_is_ambiguous();
            let fut = (!ambiguous && !head::over_limit(&req, max_head))
                .then(|| Box::pin(handle(req, client, &svc_local)));
            async move {
                Ok::<_, Infallible>(match fut {
                    Some(fut) => fut.await.map(|b| ActiveBody::new(b, active)),
                    None if ambiguous => framing::refused(),
                    None => head::refused(),
                })
            }
        });
        let watch = conn::Watch {
            state: Arc::clone(&state),
            limits: Arc::clone(&limits),
            metrics: metrics.clone(),
            stopping: stopping.clone(),
            peer,
        };
        // With upgrades: a WebSocket route answers 101 and takes the connection over.
        match (&limits.tls, &first) {
            (None, Some(first)) => {
                let served = first(FirstConn {
                    stream,
                    peer: client,
                    activity: Activity {
                        state: Arc::clone(&state),
                        server_stopping: Arc::clone(&server_stopping),
                    },
                    max_header_bytes: limits.max_header_bytes,
                });
                let builder = Arc::clone(&shared_builder);
                let hyper = move |h: Handoff| {
                    let io = conn::Watched::new(handoff::Prefixed::new(h.read, h.stream), state);
                    builder
                        .serve_connection_with_upgrades(TokioIo::new(io), svc)
                        .into_owned()
                };
                handoff::spawn(served, hyper, watch, counted);
            }
            (None, None) => {
                let io = conn::Watched::new(stream, state);
                let conn = builder
                    .serve_connection_with_upgrades(TokioIo::new(io), svc)
                    .into_owned();
                tokio::spawn(async move {
                    watch.drive(conn).await;
                    drop(counted);
                });
            }
            (Some(tls), _) => {
                let acceptor = tokio_rustls::TlsAcceptor::from(tls.load_full());
                let builder = builder.clone();
                tokio::spawn(async move {
                    let by = state.accepted() + watch.limits.header_read_timeout;
                    match tokio::time::timeout_at(by, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let io = conn::Watched::new(tls, state);
                            let conn = builder
                                .serve_connection_with_upgrades(TokioIo::new(io), svc)
                                .into_owned();
                            watch.drive(conn).await;
                        }
                        failed => {
                            if let Some(m) = &watch.metrics {
                                m.tls_failed.inc();
                            }
                            let why = match failed {
                                Ok(Err(e)) => e.to_string(),
                                _ => "handshake took longer than header_read_timeout".to_owned(),
                            };
                            tracing::debug!(peer = %peer, error = %why, "TLS handshake failed");
                        }
                    }
                    drop(counted);
                });
            }
        }
    }
    drop(listener);
    drop(alive);
    server_stopping.store(true, Ordering::SeqCst);
    let _ = stop.send(true);
    tokio::select! {
        _ = all_done.recv() => tracing::debug!("all connections closed"),
        () = tokio::time::sleep(limits.grace) => tracing::warn!(grace = ?limits.grace, "shutdown grace period over; dropping open connections"),
    }
}

/// A descriptor held in reserve for the out-of-descriptors case.
fn reserve_fd() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

fn out_of_descriptors(e: &io::Error) -> bool {
    // EMFILE (24): this process's limit; ENFILE (23): the system's.
    matches!(e.raw_os_error(), Some(23 | 24))
}

impl<I, S, E, B> conn::GracefulShutdown for auto::UpgradeableConnection<'static, I, S, E>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    E: auto::HttpServerConnExec<S::Future, B>,
{
    fn shutdown_gracefully(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}
