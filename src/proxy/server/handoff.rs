//! A first handler tried before hyper on plain-TCP connections (palisade's HTTP/1.1 fast
//! path), and the hand-over to hyper of whatever it does not serve.
//!
//! The first handler owns the socket while it serves. When it meets something it does not
//! handle (the HTTP/2 preface, a chunked request body, an upgrade, ...) it gives the socket back
//! with the bytes it read but did not consume, and hyper serves the rest of the connection as
//! if it had read those bytes itself ([`Prefixed`] replays them first). The watchdog drives
//! both in turn ([`Phased`]): its limits and a graceful shutdown apply to either.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::conn::{Active, GracefulShutdown, State};
use super::Peer;

/// A plain-TCP client connection, handed to the first handler.
#[derive(Debug)]
pub struct FirstConn<C> {
    /// The client's socket.
    pub stream: TcpStream,
    /// Who the client is.
    pub peer: Peer,
    /// The connection's own state (as hyper's requests on it would see it).
    pub local: Arc<C>,
    /// What the watchdog must know of the connection, and its graceful shutdown.
    pub activity: Activity,
    /// `max_header_bytes`: the largest request head to read (431 above it).
    pub max_header_bytes: usize,
}

/// What a first handler gives back for hyper to serve: the socket and the bytes it read
/// from it but did not consume, which hyper reads first.
#[derive(Debug)]
pub struct Handoff {
    /// The client's socket.
    pub stream: TcpStream,
    /// Bytes read from `stream` that belong to the requests hyper will serve.
    pub read: Vec<u8>,
}

/// The future a first handler returns: `None` when it served the connection to its end,
/// `Some` to hand it to hyper.
pub type FirstFuture = Pin<Box<dyn Future<Output = Option<Handoff>> + Send>>;

/// A handler tried first on each plain-TCP connection of a listener (not on TLS ones).
pub type FirstHandler<C> = Arc<dyn Fn(FirstConn<C>) -> FirstFuture + Send + Sync>;

/// A graceful shutdown asked of a connection: close after the current response.
#[derive(Debug, Default)]
pub(super) struct Stop {
    requested: AtomicBool,
    notify: Notify,
}

impl Stop {
    fn request(&self) {
        // SeqCst pairs with the load in `stopped` after the waiter is enabled: either the
        // waiter sees the flag or it is registered before `notify_waiters` runs.
        self.requested.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

/// The watchdog's view of a connection served by a first handler: requests in progress mark
/// it busy (as hyper's service does), and a graceful shutdown is asked through it.
#[derive(Debug, Clone)]
pub struct Activity {
    pub(super) state: Arc<State>,
    pub(super) stop: Arc<Stop>,
}

/// One request in progress on a first handler's connection; dropping it ends the request
/// for the watchdog (the connection becomes idle).
#[derive(Debug)]
pub struct InProgress(#[allow(dead_code)] Active);

impl Activity {
    /// A request head is complete: the connection is busy until the returned guard drops.
    /// The first one also ends the connection's `header_read_timeout`.
    pub fn request_started(&self) -> InProgress {
        InProgress(self.state.request_started())
    }

    /// Whether the connection was asked to finish (server shutdown, idle timeout).
    pub fn stopping(&self) -> bool {
        self.stop.requested.load(Ordering::SeqCst)
    }

    /// Resolves once the connection is asked to finish.
    pub async fn stopped(&self) {
        self.stop.stopped().await;
    }

    /// [`Activity::stopped`] as a future of its own, for a connection to keep across its idle
    /// waits: its wake-up is registered once, not at every wait (a lock and a list insertion
    /// and removal per request otherwise).
    pub fn stop_signal(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let stop = Arc::clone(&self.stop);
        async move { stop.stopped().await }
    }
}

impl Stop {
    async fn stopped(&self) {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.requested.load(Ordering::SeqCst) {
                return;
            }
            n.await;
        }
    }
}

type Ended = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A connection served first by a first handler, then (if it hands over) by hyper.
pub(super) struct Phased<H, M> {
    first: Option<FirstFuture>,
    make: Option<Box<M>>,
    hyper: Option<Pin<Box<H>>>,
    stop: Arc<Stop>,
}

impl<H, M> Phased<H, M> {
    pub(super) fn new(first: FirstFuture, make: M, stop: Arc<Stop>) -> Self {
        Self {
            first: Some(first),
            make: Some(Box::new(make)),
            hyper: None,
            stop,
        }
    }
}

impl<H, M> Future for Phased<H, M>
where
    H: Future<Output = Ended> + GracefulShutdown,
    M: FnOnce(Handoff) -> H,
{
    type Output = Ended;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Ended> {
        let this = self.get_mut();
        if let Some(first) = &mut this.first {
            let Poll::Ready(handoff) = first.as_mut().poll(cx) else {
                return Poll::Pending;
            };
            this.first = None;
            let (Some(h), Some(make)) = (handoff, this.make.take()) else {
                return Poll::Ready(Ok(()));
            };
            let mut conn = Box::pin(make(h));
            if this.stop.requested.load(Ordering::SeqCst) {
                conn.as_mut().shutdown_gracefully();
            }
            this.hyper = Some(conn);
        }
        match &mut this.hyper {
            Some(conn) => conn.as_mut().poll(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

impl<H: GracefulShutdown, M> GracefulShutdown for Phased<H, M> {
    fn shutdown_gracefully(self: Pin<&mut Self>) {
        // `Phased` is `Unpin`: its futures are boxed.
        let this = self.get_mut();
        this.stop.request();
        if let Some(conn) = &mut this.hyper {
            conn.as_mut().shutdown_gracefully();
        }
    }
}

/// The client's socket with bytes already read from it replayed first.
pub(super) struct Prefixed<I> {
    read: Vec<u8>,
    at: usize,
    io: I,
}

impl<I> Prefixed<I> {
    pub(super) fn new(read: Vec<u8>, io: I) -> Self {
        Self { read, at: 0, io }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.read.len() {
            let n = buf.remaining().min(this.read.len() - this.at);
            buf.put_slice(&this.read[this.at..this.at + n]);
            this.at += n;
            if this.at == this.read.len() {
                this.read = Vec::new(); // replayed: the buffer is freed
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

crate::server::write_through!(Prefixed);
