//! One client connection: its activity, the watchdog that closes it when it idles, and the
//! I/O and body wrappers that feed the watchdog.
//!
//! The rules (times on tokio's clock, so tests can pause it):
//!
//! - **Fresh**: from accept until the first request's head is complete (HTTP/1.1) or the
//!   HTTP/2 connection preface has arrived, at most `header_read_timeout`. A silent socket, a
//!   slow head or a half-sent preface is closed then (`reason="header_read_timeout"`).
//! - **Idle**: no request in progress. After `idle_timeout` the connection is shut down
//!   gracefully (HTTP/1.1: closed; HTTP/2: GOAWAY, then closed at most a second later), counted
//!   as `reason="idle_timeout"`. This also bounds an HTTP/2 client that sends HEADERS without
//!   ever ending the header block, and a slow later head on a keep-alive connection (which
//!   hyper's own head timer bounds as well).
//! - **Busy**: at least one request whose response has not ended. No limit here: bodies may
//!   stream for as long as they need.
//!
//! A request is "in progress" from the moment hyper hands it to the service until its response
//! body has ended or was dropped ([`ActiveBody`](super::ActiveBody)).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;

use super::framing::Follow;
use super::linger::Closing;
use super::state::{Reason, State};
use super::wake::Gate;
use super::Limits;
use crate::fence::metrics::ConnMetrics;

const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// How long an idle HTTP/2 connection gets to finish after its GOAWAY.
const GOAWAY_GRACE: Duration = Duration::from_secs(1);

/// The client's socket, watched for the HTTP/2 preface (which ends the fresh phase: an h2
/// client may open its connection well before its first request).
pub(super) struct Watched<I> {
    io: I,
    state: Arc<State>,
    /// How many bytes of the preface matched so far; `u8::MAX` once decided.
    preface: u8,
    /// hyper shuts the socket down when it is done with the connection: a client still
    /// sending is read to its end first ([`super::linger`]).
    closing: Closing,
    /// The HTTP/1.x messages hyper reads, followed for ambiguous framing
    /// ([`super::framing`]).
    follow: Follow,
    /// Heads completed so far.
    heads: u64,
}

impl<I> Watched<I> {
    pub(super) fn new(io: I, state: Arc<State>) -> Self {
        Self {
            io,
            state,
            preface: 0,
            closing: Closing::default(),
            follow: Follow::default(),
            heads: 0,
        }
    }

    fn observe(&mut self, read: &[u8]) {
        let at = usize::from(self.preface);
        let want = &H2_PREFACE[at..];
        let n = read.len().min(want.len());
        if read[..n] != want[..n] {
            self.preface = u8::MAX;
            return;
        }
        let done = at + n;
        if done == H2_PREFACE.len() {
            self.preface = u8::MAX;
            self.state.preface_arrived();
        } else {
            self.preface = u8::try_from(done).unwrap_or(u8::MAX);
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) {
            let filled = &buf.filled()[before..];
            if this.preface != u8::MAX && !filled.is_empty() {
                this.observe(filled);
            }
            // An HTTP/2 preface is no HTTP/1.x head: following stops at once there.
            if !matches!(this.follow, Follow::Off) {
                let found = this.follow.feed(filled);
                if let Some(i) = found.ambiguous {
                    this.state.ambiguous_head(this.heads + i);
                }
                this.heads += found.heads;
            }
        }
        r
    }
}

crate::proxy::server::write_through!(Watched, shutdown = shut);

impl<I: AsyncRead + AsyncWrite + Unpin> Watched<I> {
    /// Shuts the connection down when hyper is done with it: a lingering close
    /// ([`super::linger`]), except for a socket that may be a tunnel's, which shuts down one
    /// direction and goes on reading the other.
    fn shut(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.state.may_tunnel() {
            return Pin::new(&mut self.io).poll_shutdown(cx);
        }
        self.closing.poll_close(&mut self.io, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A closing connection drains its client; one that may be a tunnel's only shuts down,
    /// and what its client sends after is still there to be read.
    #[tokio::test(start_paused = true)]
    async fn a_tunnels_shutdown_leaves_the_clients_bytes_to_be_read() {
        for tunnel in [false, true] {
            let (server, mut client) = tokio::io::duplex(64);
            let state = State::new();
            if tunnel {
                state.set_may_tunnel();
            }
            let mut io = Watched::new(server, state);
            client.write_all(b"more").await.unwrap();
            drop(client.shutdown().await);
            io.shutdown().await.unwrap();
            let mut rest = Vec::new();
            io.read_to_end(&mut rest).await.unwrap();
            let want: &[u8] = if tunnel { b"more" } else { b"" };
            assert_eq!(rest, want, "tunnel {tunnel}");
        }
    }
}

/// The watchdog of one connection.
#[derive(Clone)]
pub(super) struct Watch {
    pub(super) state: Arc<State>,
    pub(super) limits: Arc<Limits>,
    pub(super) metrics: Option<ConnMetrics>,
    pub(super) stopping: watch::Receiver<bool>,
    pub(super) peer: SocketAddr,
}

impl Watch {
    /// Drives `conn` to its end, shutting it down when a limit passes or the server stops.
    ///
    /// One timer per connection, re-armed only when it fires: requests starting and ending
    /// never wake the watchdog. When it fires it reads the state again; a connection that was
    /// busy is checked again one `idle_timeout` later, which is never after its real deadline
    /// (that is at least `idle_timeout` after the busy spell ends).
    pub(super) async fn drive<C>(mut self, conn: C)
    where
        C: Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + GracefulShutdown,
    {
        tokio::pin!(conn);
        let first = self
            .state
            .deadline(&self.limits)
            .map_or_else(|| Instant::now() + self.limits.idle_timeout, |(at, _)| at);
        let timer = tokio::time::sleep_until(first);
        tokio::pin!(timer);
        // Set once a graceful shutdown began: the connection is dropped at this instant.
        let mut hard_stop: Option<Instant> = None;
        // The timer and the stop signal are polled with this flag's waker, and only when it
        // was raised: the connection's own wake-ups do not poll them (see `wake`).
        let gate = Gate::new();
        // The connection is polled before the watchdog only at its very first poll: hyper's
        // `auto` connection asked to shut down before it was polled drops a request already
        // read (see `handoff::spawn`). From then on a stop is heard before the connection
        // reads or answers anything more, so every answer written after the server began to
        // stop says `Connection: close`, and no pipelined request is begun (CI once saw both
        // when the task was woken by its upstream and the stop at once).
        let mut fresh = true;
        loop {
            gate.open(); // new or reset futures below: poll them once
            let event = {
                let changed = self.stopping.changed();
                tokio::pin!(changed);
                std::future::poll_fn(|cx| {
                    // Both behind one gate: when either woke the task, both are polled.
                    let watchdog = std::future::poll_fn(|wcx| {
                        if hard_stop.is_none() {
                            if let Poll::Ready(changed) = changed.as_mut().poll(wcx) {
                                return Poll::Ready(Event::Stopping(changed.is_err()));
                            }
                        }
                        timer.as_mut().poll(wcx).map(|()| Event::Timer)
                    });
                    tokio::pin!(watchdog);
                    if !fresh {
                        if let Poll::Ready(event) = gate.poll(watchdog.as_mut(), cx) {
                            return Poll::Ready(event);
                        }
                    }
                    if let Poll::Ready(res) = conn.as_mut().poll(cx) {
                        return Poll::Ready(Event::Ended(res));
                    }
                    if fresh {
                        fresh = false;
                        return gate.poll(watchdog, cx);
                    }
                    Poll::Pending
                })
                .await
            };
            match event {
                Event::Ended(res) => {
                    if let Err(e) = res {
                        tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                Event::Stopping(closed) => {
                    if closed || *self.stopping.borrow() {
                        conn.as_mut().shutdown_gracefully();
                        // The server's own grace period bounds this connection from here.
                        let at = Instant::now() + self.limits.grace;
                        hard_stop = Some(at);
                        timer.as_mut().reset(at);
                    }
                }
                Event::Timer => {
                    let now = Instant::now();
                    if hard_stop.is_some_and(|at| now >= at) {
                        return; // the graceful shutdown took too long
                    }
                    if let Some(at) = hard_stop {
                        // Fired early: armed again, or the finished timer would be ready at
                        // every poll (and the watchdog is polled first).
                        timer.as_mut().reset(at);
                        continue;
                    }
                    match self.state.deadline(&self.limits) {
                        None => timer.as_mut().reset(now + self.limits.idle_timeout),
                        Some((at, _)) if at > now => timer.as_mut().reset(at),
                        Some((_, Reason::HeaderRead)) => {
                            if let Some(m) = &self.metrics {
                                m.header_timeout.inc();
                            }
                            tracing::debug!(peer = %self.peer, "no complete request head in time; closing");
                            return;
                        }
                        Some((_, Reason::Idle)) => {
                            if let Some(m) = &self.metrics {
                                m.idle_timeout.inc();
                            }
                            tracing::debug!(peer = %self.peer, "connection idle; closing");
                            conn.as_mut().shutdown_gracefully();
                            let at = now + GOAWAY_GRACE;
                            hard_stop = Some(at);
                            timer.as_mut().reset(at);
                        }
                    }
                }
            }
        }
    }
}

/// What ended one wait of [`Watch::drive`].
enum Event {
    /// The connection ended.
    Ended(Result<(), Box<dyn std::error::Error + Send + Sync>>),
    /// The server's stop signal changed (`true`: its sender is gone).
    Stopping(bool),
    /// The timer fired.
    Timer,
}

/// A connection that can be asked to finish (hyper-util's `auto::Connection`).
pub(super) trait GracefulShutdown {
    /// HTTP/1.1: close after the current response; HTTP/2: GOAWAY.
    fn shutdown_gracefully(self: Pin<&mut Self>);
}

impl<C: GracefulShutdown + ?Sized> GracefulShutdown for Pin<Box<C>> {
    fn shutdown_gracefully(self: Pin<&mut Self>) {
        self.get_mut().as_mut().shutdown_gracefully();
    }
}
