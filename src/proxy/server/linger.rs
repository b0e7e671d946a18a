//! The lingering close: a connection being closed is first shut down for writing (the client
//! sees its answer end), then read, what arrives dropped, until the client closes its side or
//! stops sending, for at most [`LINGER`]; only then is the socket closed.
//!
//! Why: closing a socket with bytes unread makes the kernel reset the connection. A client
//! that writes its whole request before it reads its answer (many HTTP client libraries do)
//! then fails on its next write and never reads the answer: typically the refusal of a request
//! whose body the proxy did not want (a stale token's 409, a 413, a 428). nginx does the same
//! (`lingering_close`, `lingering_timeout`). A client that closes its side when it has read
//! its answer, as clients do, ends the wait at once.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// How long a closing connection may go on reading what its client sends.
pub(crate) const LINGER: Duration = Duration::from_secs(5);

/// How long a closing connection waits for its client's next bytes. The wait is timed, not a
/// single look: bytes may be on their way, or have arrived without the socket's readiness
/// having been read again yet.
const QUIET: Duration = Duration::from_millis(500);

/// What is read and dropped at a time.
const SINK: usize = 16 * 1024;

/// The lingering close of one connection, driven by [`Closing::poll_close`] from the
/// connection's `poll_shutdown`.
#[derive(Default)]
pub(crate) enum Closing {
    /// Not asked to close yet.
    #[default]
    Open,
    /// Shut down for writing; reading on until the client closes, stays quiet for [`QUIET`],
    /// or [`LINGER`] passes.
    Lingering {
        end: Instant,
        wait: Pin<Box<Sleep>>,
        sink: Box<[u8]>,
    },
    /// Done: the socket may be dropped.
    Closed,
}

impl Closing {
    /// Shuts `io` down for writing, then reads and drops what its client sends until it
    /// closes, fails, stays quiet for [`QUIET`] or [`LINGER`] passes.
    pub(crate) fn poll_close<I: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut I,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            match self {
                Closing::Open => {
                    let shut = ready!(Pin::new(&mut *io).poll_shutdown(cx));
                    if shut.is_err() {
                        *self = Closing::Closed;
                        return Poll::Ready(shut);
                    }
                    let now = Instant::now();
                    *self = Closing::Lingering {
                        end: now + LINGER,
                        wait: Box::pin(tokio::time::sleep_until(now + QUIET)),
                        sink: vec![0u8; SINK].into_boxed_slice(),
                    };
                }
                Closing::Lingering { end, wait, sink } => match poll_drop_some(io, sink, cx) {
                    Poll::Ready(true) => {
                        let next = (Instant::now() + QUIET).min(*end);
                        wait.as_mut().reset(next);
                    }
                    Poll::Ready(false) => *self = Closing::Closed,
                    Poll::Pending => {
                        ready!(wait.as_mut().poll(cx));
                        *self = Closing::Closed;
                    }
                },
                Closing::Closed => return Poll::Ready(Ok(())),
            }
        }
    }
}

/// Reads once into `sink`: `Ready(true)` when bytes came, `Ready(false)` at the end of the
/// stream or on an error.
fn poll_drop_some<I: AsyncRead + Unpin>(
    io: &mut I,
    sink: &mut [u8],
    cx: &mut Context<'_>,
) -> Poll<bool> {
    let mut buf = ReadBuf::new(sink);
    match ready!(Pin::new(io).poll_read(cx, &mut buf)) {
        Ok(()) => Poll::Ready(!buf.filled().is_empty()),
        Err(_) => Poll::Ready(false),
    }
}

/// The lingering close as a future, for a connection served outside hyper.
pub(crate) async fn close<I: AsyncRead + AsyncWrite + Unpin>(io: &mut I) {
    let mut closing = Closing::default();
    let _ = std::future::poll_fn(|cx| closing.poll_close(io, cx)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The client sees the end of the stream at once, and a client that closes its side ends
    /// the wait at once.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_closes_ends_it_at_once() {
        let (mut server, mut client) = tokio::io::duplex(64);
        let started = Instant::now();
        let closing = tokio::spawn(async move { close(&mut server).await });
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        drop(client);
        closing.await.unwrap();
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    /// A quiet client is waited for [`QUIET`]; one that goes on sending is read until it stops
    /// or [`LINGER`] passes.
    #[tokio::test(start_paused = true)]
    async fn it_waits_for_a_quiet_client_briefly_and_a_sending_one_at_most_linger() {
        let (mut server, _quiet) = tokio::io::duplex(64);
        let started = Instant::now();
        close(&mut server).await;
        assert_eq!(started.elapsed(), QUIET);

        let (mut server, mut client) = tokio::io::duplex(64);
        let started = Instant::now();
        let sender = tokio::spawn(async move {
            // Never quiet for QUIET: 100 bytes every QUIET / 2, forever (until it fails).
            while client.write_all(&[b'x'; 100]).await.is_ok() {
                tokio::time::sleep(QUIET / 2).await;
            }
        });
        close(&mut server).await;
        assert_eq!(started.elapsed(), LINGER);
        drop(server);
        sender.await.unwrap();
    }
}
