//! The HTTP/1.1-to-HTTP/1.1 fast path: plain-TCP client connections served without hyper.
//!
//! Why: on small keep-alive requests most of palisade's own CPU time went to hyper's server
//! dispatcher and client, not to the guard. Here one task reads the client's request head with
//! httparse into a buffer reused for the connection's life, judges it with exactly the code
//! hyper's path uses ([`Proxy::admit`]: path, host, route, method rules, GET bodies,
//! `max_body_bytes`, the fence), writes the head rewritten by the same rules as hyper's path
//! (`rewrite_head`'s, see [`upstream_head`]) to the connection's own upstream socket, relays
//! the `Content-Length` body, then the response by its framing. Heads are read and written as
//! byte ranges of the buffers ([`fields`]): no `http` map, name, value or URI per request.
//!
//! Which connections and requests it takes (`[proxy] http1_fast_path`):
//! - plain-TCP connections of the proxy listener only (TLS ones and the admin listener stay
//!   on hyper);
//! - request by request, the heads [`head`] accepts, to a route whose upstream is plain
//!   `http://` HTTP/1.1 and that is not a WebSocket route. The first request the fast path does
//!   not take hands the connection to hyper for the rest of its life, with the bytes read
//!   and not consumed (that request's and any pipelined after it) replayed to hyper first.
//!   Nothing of that request was judged, counted or forwarded: hyper sees it as if it had
//!   read it itself.
//! - Pipelined requests are taken one at a time: a request is not judged before the previous
//!   one's response has been relayed whole.

mod answer;
mod exchange;
mod fields;
mod head;
mod relay;
mod response;
mod send;
mod shared;
mod target;
mod upstream_head;
mod write;

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use self::fields::FieldStore;
use self::head::{Parsed, View};
use self::shared::{Proxy, Routed, UpSock};
use crate::fence::drain::AbortWatch;
use crate::proxy::config::Protocol;
use crate::proxy::server::{Activity, FirstConn, FirstFuture, Handoff, Peer};

/// Each read asks for at least this much room; the buffer grows (up to `max_header_bytes` for
/// a head) only for heads that need it. Small, because an idle connection keeps its buffer:
/// 2000 idle connections must stay well under the RSS budget (`tests/proxy/limits.rs`).
const READ_SIZE: usize = 4 * 1024;

/// Serves `conn` on the fast path, with the configuration current at each request; hands it
/// to hyper when a request is not for the fast path.
pub(crate) fn serve(current: Arc<ArcSwap<Proxy>>, conn: FirstConn) -> FirstFuture {
    // `run`'s own future, boxed as is: no async block around it, whose state each poll would
    // also go through.
    Box::pin(
        ClientConn {
            client: conn.stream,
            peer: conn.peer,
            activity: conn.activity,
            max_head: conn
                .max_header_bytes
                .max(crate::proxy::config::MIN_HEADER_BYTES),
            buf: Vec::new(),
            start: 0,
            up: Kept(None),
            ubuf: Vec::new(),
            out: Vec::new(),
            scratch: Vec::new(),
            fields: FieldStore::default(),
            abort_watch: AbortWatch::default(),
        }
        .run(current),
    )
}

/// The connection's own upstream socket between two of its requests; it goes back to its
/// upstream's idle cache when the client connection ends or moves to hyper. Only a socket
/// whose last exchange ended cleanly is kept.
struct Kept(Option<UpSock>);

impl Drop for Kept {
    fn drop(&mut self) {
        if let Some(up) = self.0.take() {
            up.release();
        }
    }
}

/// One client connection on the fast path and the buffers it reuses for each request.
struct ClientConn {
    client: TcpStream,
    peer: Peer,
    activity: Activity,
    max_head: usize,
    /// Bytes read from the client; those before `start` are consumed.
    buf: Vec<u8>,
    start: usize,
    up: Kept,
    /// Bytes read from the upstream.
    ubuf: Vec<u8>,
    /// A head being written (to the upstream or the client).
    out: Vec<u8>,
    /// Request body bytes on their way from the client to the upstream.
    scratch: Vec<u8>,
    /// The fields of the head being served (the request's, then the response's).
    fields: FieldStore,
    /// The connection's registration for the abort of the mark its requests are admitted
    /// under, kept from one request to the next.
    abort_watch: AbortWatch,
}

/// Whether the client connection stays open after an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    KeepAlive,
    Close,
    /// Closed with a reset (set by the exchange): the client must not take a cut response
    /// for a whole one.
    Reset,
}

impl ClientConn {
    /// Serves requests until the connection ends (`None`) or one is for hyper.
    ///
    /// Between two requests nothing but the client's socket is waited for: a connection that
    /// idles too long, or is waiting when the server stops, is closed by its watchdog task (see
    /// [`Activity`]), which never cuts a request once [`Activity::begin`] took it.
    async fn run(mut self, current: Arc<ArcSwap<Proxy>>) -> Option<Handoff> {
        loop {
            let head = loop {
                match head::parse(&self.buf[self.start..], self.max_head, &mut self.fields) {
                    Parsed::Head(h) => break h,
                    Parsed::HandOver => return self.handoff(),
                    Parsed::Refuse(status) => {
                        self.refuse_head(status).await;
                        crate::proxy::server::linger::close(&mut self.client).await;
                        return None;
                    }
                    // The reads are awaited here, not in a function of their own: one level
                    // of future fewer for each wake-up to go through.
                    Parsed::Partial => {
                        if !self.may_read() {
                            return None;
                        }
                        // A connection that has sent nothing yet holds no buffer: thousands
                        // of silent ones would otherwise cost READ_SIZE each
                        // (`tests/proxy/limits.rs`).
                        if self.buf.capacity() == 0 && self.client.readable().await.is_err() {
                            return None;
                        }
                        self.buf.reserve(READ_SIZE);
                        if !matches!(self.client.read_buf(&mut self.buf).await, Ok(n) if n > 0) {
                            return None;
                        }
                    }
                }
            };
            // The one load per request, as on hyper's path: the request keeps this
            // configuration to its end.
            let proxy = current.load_full();
            if !proxy.all_fast
                && !proxy.fast_takes(&View::new(&head, &self.buf[self.start..], &mut self.fields))
            {
                return self.handoff();
            }
            if !self.activity.begin() {
                return None; // being closed: nothing of this request was judged
            }
            let after = self.exchange(&proxy, head).await;
            let stop = self.activity.end();
            if after == After::Close && !stop {
                // A client may still be sending (a refused request's body): see `linger`.
                crate::proxy::server::linger::close(&mut self.client).await;
            }
            if after != After::KeepAlive || stop {
                return None;
            }
            self.compact();
        }
    }

    /// Makes room to read more of the client's bytes: `false` when the connection is being
    /// closed (a head partly read, see [`Activity::partial`]).
    fn may_read(&mut self) -> bool {
        self.compact();
        self.buf.is_empty() || self.activity.partial()
    }

    /// Answers a head refused before it was judged (400, 431), as hyper's server would.
    async fn refuse_head(&mut self, status: http::StatusCode) {
        self.out.clear();
        write::automatic(&mut self.out, status);
        let _ = self.client.write_all(&self.out).await;
    }

    /// Drops consumed bytes from the front of the buffer.
    fn compact(&mut self) {
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
    }

    /// The connection for hyper, with what it must read first; `None` when it is being
    /// closed instead.
    fn handoff(self) -> Option<Handoff> {
        if !self.activity.hand_over() {
            return None;
        }
        let ClientConn {
            client,
            mut buf,
            start,
            ..
        } = self;
        buf.drain(..start);
        Some(Handoff {
            stream: client,
            read: buf,
        })
    }
}

impl Proxy {
    /// Whether the fast path serves `req` (whose head [`head`] accepted): it does unless it
    /// would be routed to a WebSocket route or an upstream that is not plain HTTP/1.1. A
    /// request that will be refused is served too: the refusal is the same code.
    fn fast_takes(&self, req: &View<'_>) -> bool {
        use self::shared::RequestView;
        let Ok(normal) = crate::fence::path::normalize(req.path()) else {
            return true;
        };
        let Ok(host) = super::request::request_host(req) else {
            return true;
        };
        match self.route(
            req.method(),
            host.host,
            &crate::fence::path::match_key(&normal),
        ) {
            Routed::To(r) => Self::fast_route(r, &self.upstreams),
            Routed::MethodNotAllowed(_) | Routed::Nowhere => true,
        }
    }

    /// Whether requests routed to `r` can take the fast path.
    pub(super) fn fast_route(r: &super::Route, upstreams: &[Arc<shared::Upstream>]) -> bool {
        let u = &upstreams[r.settings.upstream];
        !r.settings.websocket && u.settings.protocol == Protocol::Http1 && u.raw_idle.is_some()
    }
}
