//! Sending a request upstream on the fast path and reading the answer's head, at most once.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::task::Poll;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::exchange::{Failed, Relay, BODY_CHUNK};
use super::response::{self, Read, ResponseHead};
use super::shared::{error_chain, socket, upstream, Logged, Upstream, ABORT_HOLD};
use super::ClientConn;
use crate::fence::reject::Rejection;

impl ClientConn {
    /// Sends the head in `out` and `body` bytes of body, and reads the response head. At most
    /// once: only a kept or cached socket that fails the first write (nothing of the request
    /// was accepted) is replaced by a new one.
    ///
    /// `delivered` is set once the request went out whole; `gone` if the client hangs up after
    /// that, while the upstream has not answered: its access log line (`logged`) is then
    /// written at once, as a 499. A guarded request's answer is still waited for (a newer
    /// owner's drain must wait for it; at most ABORT_HOLD, whatever the response timeout);
    /// an unguarded one's upstream socket is closed at once.
    pub(super) async fn send(
        &mut self,
        upstream: &Upstream,
        connect: Duration,
        body: u64,
        head_request: bool,
        (delivered, gone, guarded): (&AtomicBool, &AtomicBool, bool),
        logged: &mut Option<Logged<'_>>,
    ) -> Result<Relay, Failed> {
        let Some(pool) = &upstream.raw_idle else {
            return Err(Failed::Upstream(Rejection::UpstreamFailed(
                "not a plain HTTP/1.1 upstream".to_owned(),
            )));
        };
        let mut sock = upstream::checkout(self.up.0.take(), pool, &upstream.dialer, connect)
            .await
            .map_err(|e| fail(&e))?;
        // The head and the body bytes already read go out in one write.
        let here = (self.buf.len() - self.start) as u64;
        let first = usize::try_from(body.min(here)).unwrap_or(usize::MAX);
        self.out
            .extend_from_slice(&self.buf[self.start..self.start + first]);
        self.start += first;
        let mut left = body - first as u64;
        let written = match sock.tcp.write(&self.out).await {
            Ok(n) => n,
            Err(e) if sock.reused => {
                tracing::debug!(error = %e, "reused upstream socket failed before the request was written; dialing a new one");
                sock = upstream::dial(pool, &upstream.dialer, connect)
                    .await
                    .map_err(|e| fail(&e))?;
                0
            }
            Err(e) => return Err(fail(&e)),
        };
        self.ubuf.clear();
        let ClientConn {
            client,
            buf,
            start,
            out,
            scratch,
            ubuf,
            fields,
            ..
        } = self;
        let (client, start) = (&*client, *start);
        let (head, sent_whole) = {
            let (mut up_read, mut up_write) = sock.tcp.split();
            let upload = async {
                up_write
                    .write_all(&out[written..])
                    .await
                    .map_err(|e| Some(fail(&e)))?;
                if left > 0 {
                    // Only connections that stream bodies pay for this buffer.
                    scratch.resize(BODY_CHUNK, 0);
                }
                while left > 0 {
                    let want = usize::try_from(left).unwrap_or(usize::MAX).min(BODY_CHUNK);
                    // Through `&TcpStream`: the wait for a hang-up below shares the socket.
                    let n = loop {
                        if client.readable().await.is_err() {
                            return Err(None);
                        }
                        match client.try_read(&mut scratch[..want]) {
                            Ok(0) => return Err(None),
                            Ok(n) => break n,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                            Err(_) => return Err(None),
                        }
                    };
                    up_write
                        .write_all(&scratch[..n])
                        .await
                        .map_err(|e| Some(fail(&e)))?;
                    left -= n as u64;
                }
                Ok::<(), Option<Failed>>(())
            };
            let download = read_head(&mut up_read, ubuf, head_request, fields);
            // Once the request went out whole: whether the client hangs up (see `hung_up`).
            let client_gone = std::future::poll_fn(|cx| hung_up(client, cx));
            tokio::pin!(upload, download, client_gone);
            let mut watching = false;
            // Once the client is gone: how long a guarded request's answer is still waited for.
            let mut give_up: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
            // The upstream may answer before it read the whole body (an early 413): the answer is
            // relayed, and neither connection is reused.
            let mut uploading = true;
            let mut sent_whole = false;
            let mut upload_failed = None;
            let head = loop {
                tokio::select! {
                    // The upload first: a response that was already waiting must not hide a
                    // request that went out whole in this same poll (it would be taken for an
                    // early answer, and both connections closed).
                    biased;
                    r = &mut upload, if uploading => {
                        uploading = false;
                        match r {
                            Ok(()) => {
                                sent_whole = true;
                                delivered.store(true, Relaxed);
                                // Bytes of the client's already here (a pipelined request)
                                // are not watched past: hyper's server does the same.
                                watching = start == buf.len();
                            }
                            Err(None) => return Err(Failed::ClientGone),
                            // A write failed: the upstream may still have answered.
                            Err(Some(f)) => upload_failed = Some(f),
                        }
                    }
                    r = &mut download => break r,
                    closed = &mut client_gone, if watching => {
                        watching = false;
                        if closed {
                            gone.store(true, Relaxed);
                            drop(logged.take()); // 499, now
                            if !guarded {
                                // Nothing waits for it: the upstream socket closes, as on
                                // hyper's path.
                                return Err(Failed::ClientGone);
                            }
                            give_up = Some(Box::pin(tokio::time::sleep(ABORT_HOLD)));
                        }
                    }
                    () = std::future::poll_fn(|cx| match give_up.as_mut() {
                        Some(s) => s.as_mut().poll(cx),
                        None => Poll::Pending,
                    }) => return Err(Failed::ClientGone),
                }
            };
            match (head, upload_failed) {
                (Ok(h), _) => (h, sent_whole),
                (Err(_), Some(f)) | (Err(f), None) => return Err(f),
            }
        };
        Ok(Relay {
            head,
            sock,
            sent_whole,
        })
    }
}

/// Reads the upstream's response head into `ubuf`, skipping interim (1xx) responses.
async fn read_head(
    up: &mut tokio::net::tcp::ReadHalf<'_>,
    ubuf: &mut Vec<u8>,
    head_request: bool,
    fields: &mut super::fields::FieldStore,
) -> Result<ResponseHead, Failed> {
    loop {
        match response::parse(ubuf, head_request, fields) {
            Ok(Read::Final(h)) => return Ok(h),
            Ok(Read::Informational(n)) => {
                ubuf.drain(..n);
            }
            Ok(Read::Partial) => {
                ubuf.reserve(BODY_CHUNK);
                let read = if ubuf.is_empty() {
                    up.read_buf(ubuf).await
                } else {
                    // A head cut in two: its first part is acknowledged at once.
                    socket::read_more(up.as_ref(), ubuf).await
                };
                match read {
                    Ok(0) => {
                        return Err(Failed::Upstream(Rejection::UpstreamFailed(
                            "the upstream closed the connection before a response".to_owned(),
                        )))
                    }
                    Ok(_) => {}
                    Err(e) => return Err(fail(&e)),
                }
            }
            Err(e) => return Err(fail(&e)),
        }
    }
}

/// Whether the client hung up, once its socket reports something: `true` when it closed its
/// side (or failed), `false` when bytes arrived (a pipelined request: left in the socket for
/// the next read). A peek, not a read; and only when the socket reports readiness: a request
/// read with a short read left it clear, so on the common path this costs no system call.
fn hung_up(client: &tokio::net::TcpStream, cx: &mut std::task::Context<'_>) -> Poll<bool> {
    let mut one = [0u8; 1];
    let mut peeked = tokio::io::ReadBuf::new(&mut one);
    match std::task::ready!(client.poll_peek(cx, &mut peeked)) {
        Ok(0) | Err(_) => Poll::Ready(true),
        Ok(_) => Poll::Ready(false),
    }
}

/// An upstream I/O failure: 502, with the error's chain in the log.
fn fail(e: &(dyn std::error::Error + 'static)) -> Failed {
    Failed::Upstream(Rejection::UpstreamFailed(error_chain(e)))
}
