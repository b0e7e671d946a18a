//! What the kernel knows of an upstream socket that tokio's cached readiness does not say:
//! whether an idle connection has anything pending, and a quick ACK while a response is
//! incomplete.
//!
//! Why ask the kernel: tokio clears a socket's readiness after a short read and sets it again
//! only at the reactor's next poll. Bytes that arrived in between (an upstream's response
//! nobody asked for, or its close) are invisible to a check through tokio, and the connection
//! would be reused: the next, unrelated request would get that response. A non-blocking
//! `recv(MSG_PEEK)` asks the socket itself.
//!
//! Why a quick ACK: an upstream that writes a response's head and body in two sends with
//! Nagle on holds the second until the first is acknowledged, and Linux delays that ACK up to
//! 40 ms on a kept-alive connection. Acknowledging at once when a read must wait for more of
//! a response removes the stall; a response that arrives whole costs nothing.

use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use rustix::io::Errno;
use rustix::net::RecvFlags;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Whether an idle socket may take a request: open, with nothing to read. `false` when the
/// upstream closed it (FIN or RST) or sent bytes nobody asked for.
pub(crate) fn idle_and_open(socket: impl AsFd) -> bool {
    let mut one = [0u8; 1];
    loop {
        match rustix::net::recv(&socket, &mut one[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => return true,
            // Bytes pending, the upstream's FIN (0 bytes), or an error such as a reset.
            _ => return false,
        }
    }
}

/// Acknowledges what was received now instead of at the delayed-ACK timer. Best effort: a
/// socket that refuses only keeps the kernel's default.
pub(crate) fn quick_ack(socket: impl AsFd) {
    let _ = rustix::net::sockopt::set_tcp_quickack(socket, true);
}

/// Reads more of a response whose first bytes came already (the fast path's own reads): when
/// nothing is there yet, the bytes so far are acknowledged at once before waiting (see the
/// module docs). A response that arrives whole never gets here.
pub(crate) async fn read_more(tcp: &TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    loop {
        match tcp.try_read_buf(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                quick_ack(tcp);
                tcp.readable().await?;
            }
            r => return r,
        }
    }
}

/// An upstream TCP connection as hyper's client connections (HTTP/1.1 and HTTP/2, plain or
/// under TLS) own it: tokio's stream, with a quick ACK when a read must wait after bytes came
/// (see the module docs), and a read that asks the kernel when the pool checks the
/// connection ([`Check`]).
pub(crate) struct UpTcp {
    stream: TcpStream,
    /// Bytes were read since the last read that had to wait.
    read_since_wait: bool,
    check: Check,
}

/// The pool's handle on an [`UpTcp`] that hyper's connection owns: while [`Check::now`] runs,
/// a read that tokio would park reads from the kernel instead, so hyper's idle connection
/// sees bytes or a close that tokio has not reported yet (and ends itself, as hyper does for
/// any unexpected bytes on an idle client connection).
#[derive(Clone, Default)]
pub(crate) struct Check(Arc<AtomicBool>);

impl Check {
    /// Runs `f` (which polls the connection) with the kernel asked directly.
    pub(crate) fn now<T>(&self, f: impl FnOnce() -> T) -> T {
        self.0.store(true, Ordering::Relaxed);
        let out = f();
        self.0.store(false, Ordering::Relaxed);
        out
    }
}

impl UpTcp {
    pub(crate) fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            read_since_wait: false,
            check: Check::default(),
        }
    }

    /// The handle that checks this connection while hyper owns it.
    pub(crate) fn check(&self) -> Check {
        self.check.clone()
    }

    /// tokio's stream itself (for the fast path, which reads and writes it directly).
    pub(crate) fn into_stream(self) -> TcpStream {
        self.stream
    }
}

impl AsyncRead for UpTcp {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.read_since_wait |= buf.filled().len() > before;
                Poll::Ready(r)
            }
            Poll::Pending => {
                if this.read_since_wait {
                    this.read_since_wait = false;
                    quick_ack(&this.stream);
                }
                if this.check.0.load(Ordering::Relaxed) {
                    // tokio's readiness may be stale: read what the kernel has, if anything.
                    match rustix::net::recv(
                        &this.stream,
                        buf.initialize_unfilled(),
                        RecvFlags::DONTWAIT,
                    ) {
                        Ok((n, _)) => {
                            buf.advance(n);
                            return Poll::Ready(Ok(()));
                        }
                        Err(Errno::AGAIN | Errno::INTR) => {}
                        Err(e) => return Poll::Ready(Err(e.into())),
                    }
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for UpTcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::task::{Context, Poll};

    use tokio::io::{AsyncReadExt, ReadBuf};
    use tokio::net::TcpStream;

    use super::idle_and_open;

    /// A connected pair: tokio's end (the proxy's upstream socket) and a blocking std end (the
    /// upstream), so that the upstream's writes happen without the test's runtime polling its
    /// reactor.
    async fn pair() -> (TcpStream, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (theirs, _) = listener.accept().unwrap();
        (ours, theirs)
    }

    /// What palisade once asked tokio (`poll_peek`) says "nothing pending" for bytes that came
    /// after a short read cleared tokio's readiness, until the reactor polls again; the kernel,
    /// asked directly, says what is there.
    #[tokio::test(flavor = "current_thread")]
    async fn bytes_tokio_has_not_seen_yet_make_an_idle_socket_unusable() {
        let (mut ours, mut theirs) = pair().await;
        assert!(idle_and_open(&ours), "nothing sent yet");
        theirs
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = ours.read(&mut buf).await.unwrap();
        assert!(n > 0 && n < buf.len(), "a short read");
        assert!(idle_and_open(&ours), "the response was read whole");
        // A response nobody asked for, while the runtime does not poll its reactor.
        theirs
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        let mut one = [0u8; 1];
        let mut peek = ReadBuf::new(&mut one);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(
            matches!(ours.poll_peek(&mut cx, &mut peek), Poll::Pending),
            "tokio's readiness is stale here (the premise of this test)"
        );
        assert!(!idle_and_open(&ours), "the kernel has the unasked response");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_closed_idle_socket_is_unusable() {
        let (ours, theirs) = pair().await;
        drop(theirs);
        assert!(!idle_and_open(&ours));
    }
}
