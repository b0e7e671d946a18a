//! A first handler tried before hyper on plain-TCP connections (palisade's HTTP/1.1 fast
//! path), and the hand-over to hyper of whatever it does not serve.
//!
//! The first handler owns the socket while it serves. When it meets something it does not
//! handle (the HTTP/2 preface, a chunked request body, an upgrade, ...) it gives the socket back
//! with the bytes it read but did not consume, and hyper serves the rest of the connection as
//! if it had read those bytes itself ([`Prefixed`] replays them first). The watchdog's limits
//! and a graceful shutdown apply to either: to the first handler through its watchdog_task
//! ([`spawn`]), to hyper through [`Watch::drive`].

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::conn::{GracefulShutdown, Watch};
use super::state::State;
use super::Peer;

/// A plain-TCP client connection, handed to the first handler.
#[derive(Debug)]
pub(crate) struct FirstConn {
    /// The client's socket.
    pub(crate) stream: TcpStream,
    /// Who the client is.
    pub(crate) peer: Peer,
    /// What the watchdog must know of the connection, and its graceful shutdown.
    pub(crate) activity: Activity,
    /// `max_header_bytes`: the largest request head to read (431 above it).
    pub(crate) max_header_bytes: usize,
}

/// What a first handler gives back for hyper to serve: the socket and the bytes it read
/// from it but did not consume, which hyper reads first.
#[derive(Debug)]
pub(crate) struct Handoff {
    /// The client's socket.
    pub(crate) stream: TcpStream,
    /// Bytes read from `stream` that belong to the requests hyper will serve.
    pub(crate) read: Vec<u8>,
}

/// The future a first handler returns: `None` when it served the connection to its end,
/// `Some` to hand it to hyper.
pub(crate) type FirstFuture = Pin<Box<dyn Future<Output = Option<Handoff>> + Send>>;

/// A handler tried first on each plain-TCP connection of a listener (not on TLS ones).
pub(crate) type FirstHandler = Arc<dyn Fn(FirstConn) -> FirstFuture + Send + Sync>;

/// The watchdog's view of a connection served by a first handler, shared with its watchdog_task (a
/// task of its own that closes the connection on a timeout or a stop): the handler reports
/// each request's start and end, and learns there whether it must finish.
#[derive(Debug, Clone)]
pub(crate) struct Activity {
    pub(super) state: Arc<State>,
    /// Set by the server when it stops, before any watchdog_task hears of it: a request answered
    /// after that carries `Connection: close` even if its connection's watchdog_task has not run yet.
    pub(super) server_stopping: Arc<AtomicBool>,
}

impl Activity {
    /// A request head is complete (the first one also ends the connection's
    /// `header_read_timeout`). `false`: the connection is being closed (an idle or header
    /// timeout, the server stopping) and must end without serving the request.
    #[must_use]
    pub(crate) fn begin(&self) -> bool {
        self.state.begin()
    }

    /// The request begun last is over: `true` when the connection must finish now (the
    /// server is stopping). Between two requests the handler needs no other check: a
    /// connection waiting for a request is closed by its watchdog_task.
    #[must_use]
    pub(crate) fn end(&self) -> bool {
        self.state.end() || self.server_stopping.load(Ordering::SeqCst)
    }

    /// Part of the next request head is read, and the handler waits for the rest: `false`
    /// when the connection is being closed. A stop then lets the head complete (within the
    /// server's grace) and its request be served, as hyper does.
    #[must_use]
    pub(crate) fn partial(&self) -> bool {
        self.state.partial()
    }

    /// Whether the connection was asked to finish after the current request, or the server
    /// began to stop (its watchdog_task may not have run yet).
    pub(crate) fn stopping(&self) -> bool {
        self.server_stopping.load(Ordering::SeqCst) || self.state.stop_asked()
    }

    /// The handler is about to hand the connection to hyper: `false` when the connection is
    /// being closed instead.
    #[must_use]
    pub(crate) fn hand_over(&self) -> bool {
        self.state.hand_over()
    }
}

type Ended = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Runs a first handler's connection: `served` in a task of its own, watched by a watchdog_task
/// task, then, if it hands over, hyper's connection made by `make` under [`Watch::drive`].
/// `hold` (the connection's count) is dropped when the connection's task ends.
pub(super) fn spawn<M, H, K>(served: FirstFuture, make: M, watch: Watch, hold: K)
where
    M: FnOnce(Handoff) -> H + Send + 'static,
    H: Future<Output = Ended> + GracefulShutdown + Send + 'static,
    K: Send + 'static,
{
    // Dropped with the connection's task (or at its hand-over): ends the watchdog_task.
    let (ended, ended_rx) = oneshot::channel::<()>();
    let watchdog_task = watch.clone();
    let task = tokio::spawn(async move {
        let handoff = served.await;
        drop(ended);
        if let Some(h) = handoff {
            // Boxed: hyper's connection is large, and most connections never get here.
            // A stop asked before the hand-over is not passed on here: hyper's `auto`
            // connection, asked to shut down before its first poll, cancels its version
            // detection and drops the request the stop let finish. `Watch::drive` polls the
            // connection first, then sees the stop (its receiver has not seen it) and shuts
            // it down gracefully: the request is served with `Connection: close`.
            let conn = Box::pin(make(h));
            watch.drive(conn).await;
        }
        drop(hold);
    });
    tokio::spawn(watchdog_task.watchdog_task(task.abort_handle(), ended_rx));
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

crate::proxy::server::write_through!(Prefixed);
