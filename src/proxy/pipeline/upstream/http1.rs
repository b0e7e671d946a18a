//! Connection-affine HTTP/1.1 upstreams: each client connection keeps its own upstream
//! connection and drives it inside its own task.
//!
//! Why: with a shared pool every request checks a connection out under a lock, hands the
//! request over a channel to the task that owns the upstream socket, and wakes that task and
//! then the client's task again. nginx instead keeps upstream keep-alive connections per
//! worker and moves bytes between two sockets in one event loop. Here the client
//! connection's task polls the upstream connection itself: while it waits for the response
//! head ([`AwaitHead`]) and while it streams the response body ([`Held`]). A request goes
//! client -> guard -> upstream -> client with no lock held across it and no hop between tasks.
//!
//! Where a connection lives between requests:
//! - in its client connection's [`Affinity`] slot, taken by that connection's next request
//!   (HTTP/1.1 clients send one request at a time, so the slot is almost always a hit);
//! - in the upstream's shared [`IdlePool`](super::pool::IdlePool) when the slot was taken (HTTP/2 clients with
//!   concurrent streams) or its client connection closed, so short client connections do
//!   not pay a new upstream connect each time.
//!
//! A connection is reused only after it finished its exchange cleanly (response body read to
//! its end); one dropped mid-body, failed, or aborted by a drain is closed. A reused
//! connection is polled once before use: if the upstream closed it while it sat idle, it is
//! dropped and another is taken.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::dial::{DialError, Dialer};
use super::pool::IdlePool;
use super::socket::Check;
use super::tls::UpIo;
use crate::proxy::pipeline::request_body::RequestBody;

type Http1Conn<B> = http1::Connection<TokioIo<UpIo>, B>;

/// One upstream HTTP/1.1 connection: the handle that sends requests and the future that does
/// the I/O, which whoever holds it must poll. (Generic over the request body for its tests.)
pub(crate) struct UpConn<B: hyper::body::Body + 'static = RequestBody> {
    sender: http1::SendRequest<B>,
    conn: Pin<Box<Http1Conn<B>>>,
    /// The connection future returned (the upstream closed it, or it failed).
    done: bool,
    /// Asks the socket itself, not tokio's readiness, whether anything came while idle.
    check: Check,
}

impl<B> UpConn<B>
where
    B: hyper::body::Body + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// Drives the connection's I/O; `true` once it ended.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.done {
            if let Poll::Ready(r) = self.conn.as_mut().poll(cx) {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
                self.done = true;
            }
        }
        self.done
    }

    /// Whether the connection can take a request now, polled once with `cx`: bytes or a
    /// close that reached the socket while it was idle end hyper's connection here (the
    /// kernel is asked: `socket`), so a response nobody asked for is never read as the next
    /// request's.
    fn usable(&mut self, cx: &mut Context<'_>) -> bool {
        let check = self.check.clone();
        check.now(|| !self.drive(cx)) && matches!(self.sender.poll_ready(cx), Poll::Ready(Ok(())))
    }
}

/// A client connection's own upstream connection, between two of its requests.
#[derive(Default)]
pub(crate) struct Affinity {
    slot: Mutex<Option<Parked>>,
}

/// An idle connection in a client connection's slot: which pool it belongs to, since when.
struct Parked {
    pool: Arc<IdlePool<UpConn>>,
    since: Instant,
    conn: UpConn,
}

impl std::fmt::Debug for Affinity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Affinity").finish_non_exhaustive()
    }
}

impl Affinity {
    fn take(&self, pool: &Arc<IdlePool<UpConn>>) -> Option<UpConn> {
        let mut slot = self
            .slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let parked = slot.take()?;
        drop(slot);
        if Arc::ptr_eq(&parked.pool, pool) {
            if parked.since.elapsed() < pool.timeout {
                return Some(parked.conn);
            }
            return None; // idle too long: closed
        }
        // A connection to another upstream: it goes to its own upstream's pool.
        parked.pool.put(parked.since, parked.conn);
        None
    }

    fn put(&self, pool: &Arc<IdlePool<UpConn>>, conn: UpConn) {
        let since = Instant::now();
        let mut slot = self
            .slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(Parked {
                pool: Arc::clone(pool),
                since,
                conn,
            });
        } else {
            drop(slot);
            pool.put(since, conn);
        }
    }
}

impl Drop for Affinity {
    fn drop(&mut self) {
        let slot = self
            .slot
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = slot.take() {
            p.pool.put(p.since, p.conn);
        }
    }
}

/// Where an upstream connection goes back to once its exchange is over.
#[derive(Clone)]
pub(crate) struct Home {
    pub(crate) affinity: Arc<Affinity>,
    pub(crate) pool: Arc<IdlePool<UpConn>>,
}

/// Why a request could not be sent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    #[error(transparent)]
    Dial(#[from] DialError),
    #[error("http/1.1 handshake failed: {0}")]
    Handshake(#[source] hyper::Error),
    #[error("{0}")]
    Request(#[source] hyper::Error),
}

/// A new connection to one of the upstream's addresses.
async fn dial(dialer: &Dialer, timeout: Duration) -> Result<UpConn, SendError> {
    let io = dialer.connect(timeout).await?;
    let check = io.check();
    let (sender, conn) = http1::Builder::new()
        .handshake(TokioIo::new(io))
        .await
        .map_err(SendError::Handshake)?;
    Ok(UpConn {
        sender,
        conn: Box::pin(conn),
        done: false,
        check,
    })
}

/// A usable connection: the client connection's own, else an idle one, else a new one.
async fn checkout(home: &Home, dialer: &Dialer, timeout: Duration) -> Result<UpConn, SendError> {
    let mut candidate = home.affinity.take(&home.pool);
    loop {
        let Some(mut c) = candidate.take().or_else(|| home.pool.take()) else {
            // Boxed: connecting is rare (a new upstream connection), and its state would
            // otherwise grow every request's future.
            return Box::pin(dial(dialer, timeout)).await;
        };
        if std::future::poll_fn(|cx| Poll::Ready(c.usable(cx))).await {
            return Ok(c);
        }
        // Closed by the upstream while idle (or not ready): dropped, try the next.
    }
}

/// Sends `req` on a connection of `home`'s upstream and waits for the response head, polling
/// the connection's I/O in the caller's task.
///
/// The request is sent at most once: a reused connection that turns out closed before any of
/// the request was written (hyper gives the request back) is replaced by a new connection; a
/// request hyper has started writing is never sent again.
pub(crate) async fn send(
    home: &Home,
    dialer: &Dialer,
    connect_timeout: Duration,
    req: Request<RequestBody>,
) -> Result<(Response<Incoming>, Held), SendError> {
    let mut c = checkout(home, dialer, connect_timeout).await?;
    let resp = match exchange(&mut c, req).await {
        Ok(r) => r,
        // Boxed: rare, and its state (the failed request, a dial) would otherwise grow every
        // request's future.
        Err(e) => {
            let (r, fresh) = Box::pin(retry(dialer, connect_timeout, e)).await?;
            c = fresh;
            r
        }
    };
    Ok((
        resp,
        Held {
            conn: Some(c),
            home: home.clone(),
        },
    ))
}

type Sent = Result<Response<Incoming>, hyper::client::conn::TrySendError<Request<RequestBody>>>;

/// Sends `req` on `c` and waits for the response head, driving `c`'s I/O meanwhile.
async fn exchange(c: &mut UpConn, req: Request<RequestBody>) -> Sent {
    let mut sent = Box::pin(c.sender.try_send_request(req));
    AwaitHead {
        conn: c,
        response: sent.as_mut(),
    }
    .await
}

/// After a failed exchange: the request again on a new connection if hyper gave it back (the
/// reused connection closed before any of it was written), else the error.
async fn retry(
    dialer: &Dialer,
    connect_timeout: Duration,
    mut failed: hyper::client::conn::TrySendError<Request<RequestBody>>,
) -> Result<(Response<Incoming>, UpConn), SendError> {
    let Some(req) = failed.take_message() else {
        return Err(SendError::Request(failed.into_error()));
    };
    tracing::debug!(error = %failed.error(), "reused upstream connection closed before the request was written; dialing a new one");
    let mut c = dial(dialer, connect_timeout).await?;
    let r = exchange(&mut c, req)
        .await
        .map_err(|e| SendError::Request(e.into_error()))?;
    Ok((r, c))
}

/// Polls the connection and the response future together until the response head arrives.
struct AwaitHead<'a, F> {
    conn: &'a mut UpConn,
    response: Pin<&'a mut F>,
}

impl<F: Future> Future for AwaitHead<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        // The response future hands the request to the connection; the connection writes it
        // and reads the answer; then the response future completes. Polling the response
        // first lets a request queued just now go out in this same wake-up.
        if let Poll::Ready(r) = this.response.as_mut().poll(cx) {
            return Poll::Ready(r);
        }
        this.conn.drive(cx);
        this.response.as_mut().poll(cx)
    }
}

/// An upstream connection whose response body is still streaming: the response body polls it
/// and, when the body ended cleanly, gives it back to its [`Home`].
pub(crate) struct Held {
    conn: Option<UpConn>,
    home: Home,
}

impl Held {
    /// Drives the connection's I/O (the response body's bytes arrive through it).
    pub(crate) fn drive(&mut self, cx: &mut Context<'_>) {
        if let Some(c) = &mut self.conn {
            c.drive(cx);
        }
    }

    /// The response body ended cleanly: the connection may serve another request, if it is
    /// idle. It is not when the upstream answered before the request body was sent in full
    /// (an early 413, say) and hyper is still sending it: that connection is closed, so no
    /// request body is left half-sent on a connection nobody drives.
    pub(crate) fn release(&mut self) {
        let Some(mut c) = self.conn.take() else {
            return;
        };
        // One more turn of the connection's I/O lets hyper finish the exchange and go idle.
        // No task waits on this poll: nothing to wake.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if !c.drive(&mut cx) && c.sender.is_ready() {
            self.home.affinity.put(&self.home.pool, c);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::task::Context;

    use bytes::Bytes;
    use http::Request;
    use http_body_util::Empty;
    use hyper::body::Body;
    use hyper::client::conn::http1;
    use hyper_util::rt::TokioIo;
    use std::future::Future;
    use tokio::net::TcpStream;

    use super::super::socket::UpTcp;
    use super::super::tls::UpIo;
    use super::UpConn;

    /// hyper's idle connection, asked whether it can take a request right after the upstream
    /// sent a response nobody asked for (before the runtime's reactor learnt of it), says no:
    /// the next request would otherwise get that response.
    #[tokio::test(flavor = "current_thread")]
    async fn an_unasked_response_makes_an_idle_connection_unusable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut upstream, _) = listener.accept().unwrap();
        let io = UpIo::Plain(UpTcp::new(tcp));
        let check = io.check();
        let (sender, conn) = http1::Builder::new()
            .handshake::<_, Empty<Bytes>>(TokioIo::new(io))
            .await
            .unwrap();
        let mut c = UpConn {
            sender,
            conn: Box::pin(conn),
            done: false,
            check,
        };
        let served = std::thread::spawn(move || {
            let mut head = [0u8; 1024];
            let _ = upstream.read(&mut head).unwrap();
            upstream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .unwrap();
            upstream
        });
        let req = Request::get("/a")
            .header("host", "x")
            .body(Empty::<Bytes>::new())
            .unwrap();
        let mut sent = std::pin::pin!(c.sender.try_send_request(req));
        let resp = std::future::poll_fn(|cx| {
            c.drive(cx);
            sent.as_mut().poll(cx)
        })
        .await
        .unwrap();
        let mut body = resp.into_body();
        let mut got = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| {
            c.drive(cx);
            std::pin::Pin::new(&mut body).poll_frame(cx)
        })
        .await
        {
            got.extend_from_slice(&frame.unwrap().into_data().unwrap());
        }
        assert_eq!(got, b"ok");
        let mut upstream = served.join().unwrap();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(c.usable(&mut cx), "idle with nothing pending");
        upstream
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\nEXTRA")
            .unwrap();
        assert!(!c.usable(&mut cx), "the unasked response is pending");
    }
}
