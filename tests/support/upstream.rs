//! Fake upstreams: one builder for the HTTP services the tests put behind palisade.
//!
//! A fake records every request that reaches it ([`Seen`], in its [`Log`]) and answers what
//! its reply function decides when the request's head arrives ([`Reply`]): a status and a
//! body, after a delay, early (once the body began, before the rest of it is read), never, or
//! by closing the connection unanswered, and counts the connections it accepts. It serves on
//! one of two engines:
//!
//! - palisade's own server (the default, `served.rs`): HTTP/1.1 and h2c on one port, or TLS
//!   with `h2` and `http/1.1` offered by ALPN ([`Builder::tls`]);
//! - raw HTTP/1.1 on TCP ([`Builder::raw`], `raw.rs`): each head as it came, bodies by
//!   Content-Length or chunked framing, and idle connections closed when asked
//!   ([`Builder::idle_close`]).
//!
//! [`upstream`] is the small "legacy" service most tests put behind the proxy. Upstreams that
//! misbehave on purpose below HTTP (a second answer nobody asked for, broken framing, a parser
//! that reads requests its own way) are named scenarios in the files that use them.

mod raw;
mod served;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

/// How many body bytes a [`Seen`] keeps (it counts them all).
pub const KEPT: usize = 64 * 1024;

/// What the upstream saw of one request, updated while its body arrives.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub query: Option<String>,
    pub authority: Option<String>,
    pub version: http::Version,
    pub token: Option<String>,
    pub headers: HeaderMap,
    /// The raw engine's copy of the head as it came, up to and including its empty line.
    pub head: String,
    /// The body's first [`KEPT`] bytes (the raw engine keeps a chunked body's framing).
    pub body: Vec<u8>,
    /// Every body byte read so far.
    pub body_len: u64,
    /// The body was read to its end.
    pub complete: bool,
    /// The request's trailers, once read.
    pub trailers: Option<HeaderMap>,
    /// When the head arrived.
    pub at: Instant,
    /// The address the request came from: one per connection.
    pub peer: Option<SocketAddr>,
    /// The connection is TLS.
    pub tls: bool,
    /// Raw engine: the connection ended after this request (either side closed or reset it).
    pub closed: bool,
}

impl Default for Seen {
    fn default() -> Self {
        Self {
            method: Method::GET,
            path: String::new(),
            query: None,
            authority: None,
            version: http::Version::HTTP_11,
            token: None,
            headers: HeaderMap::new(),
            head: String::new(),
            body: Vec::new(),
            body_len: 0,
            complete: false,
            trailers: None,
            at: Instant::now(),
            peer: None,
            tls: false,
            closed: false,
        }
    }
}

impl Seen {
    /// The value of header `name`, when it is text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn add_body(&mut self, data: &[u8]) {
        let room = KEPT.saturating_sub(self.body.len());
        self.body.extend_from_slice(&data[..data.len().min(room)]);
        self.body_len += data.len() as u64;
    }
}

/// The upstream's own log of every request that reached it, in arrival order.
#[derive(Debug, Clone)]
pub struct Log(Arc<LogState>);

#[derive(Debug)]
struct LogState {
    seen: Mutex<Vec<Seen>>,
    /// How many requests arrived, for [`Log::wait`].
    arrived: watch::Sender<usize>,
}

impl Default for Log {
    fn default() -> Self {
        Self(Arc::new(LogState {
            seen: Mutex::new(Vec::new()),
            arrived: watch::Sender::new(0),
        }))
    }
}

impl Log {
    /// Records a request; returns its index, for [`Log::update`].
    pub fn push(&self, s: Seen) -> usize {
        let i = {
            let mut seen = self.0.seen.lock().unwrap();
            seen.push(s);
            seen.len() - 1
        };
        self.0.arrived.send_replace(i + 1);
        i
    }

    /// Changes request `i` (its body arrived, its connection ended).
    pub fn update(&self, i: usize, f: impl FnOnce(&mut Seen)) {
        f(&mut self.0.seen.lock().unwrap()[i]);
    }

    /// Request `i` as it stands.
    pub fn get(&self, i: usize) -> Seen {
        self.0.seen.lock().unwrap()[i].clone()
    }

    pub fn all(&self) -> Vec<Seen> {
        self.0.seen.lock().unwrap().clone()
    }

    pub fn tokens(&self) -> Vec<Option<String>> {
        self.all().into_iter().map(|s| s.token).collect()
    }

    pub fn paths(&self) -> Vec<String> {
        self.all().into_iter().map(|s| s.path).collect()
    }

    pub fn len(&self) -> usize {
        self.0.seen.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many requests `f` accepts.
    pub fn count(&self, f: impl Fn(&Seen) -> bool) -> usize {
        self.0.seen.lock().unwrap().iter().filter(|s| f(s)).count()
    }

    /// The first request `f` accepts.
    pub fn find(&self, f: impl Fn(&Seen) -> bool) -> Option<Seen> {
        self.0.seen.lock().unwrap().iter().find(|s| f(s)).cloned()
    }

    /// Waits until `n` requests have arrived; fails the test after 10 s.
    pub async fn wait(&self, n: usize) {
        let mut arrived = self.0.arrived.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(10), arrived.wait_for(|a| *a >= n));
        if waited.await.is_err() {
            panic!(
                "{} of {n} requests reached the upstream in 10 s",
                self.len()
            );
        }
    }
}

/// How an upstream answers one request, decided when its head arrives.
pub struct Reply {
    read: Read,
    after: Option<Duration>,
    answer: Answer,
}

/// When the request's body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// Whole, before the answer.
    Whole,
    /// The answer goes once the body began (at once without a body); the rest is read after.
    Early,
    /// Never (palisade's server only): held unread until the answer, then dropped (at once
    /// when there is no answer).
    Unread,
}

enum Answer {
    Response {
        status: StatusCode,
        headers: HeaderMap,
        body: Content,
    },
    /// Raw engine: exactly these bytes.
    Bytes(Bytes),
    /// No answer, ever.
    Never,
    /// Raw engine: the connection closed without an answer.
    Close,
}

enum Content {
    Bytes(Bytes),
    /// The number of body bytes read, or `incomplete` when the body broke off.
    BodyLen,
    /// That many bytes of `x`, streamed in 64 KiB frames.
    Download(usize),
    /// A body followed by trailers (declared in a `trailer` field for HTTP/1.1).
    Trailers(Bytes, HeaderMap),
}

impl Reply {
    /// `200` with `body`, once the request's body was read whole.
    pub fn text(body: impl Into<Bytes>) -> Reply {
        Reply {
            read: Read::Whole,
            after: None,
            answer: Answer::Response {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: Content::Bytes(body.into()),
            },
        }
    }

    /// `200` with the number of body bytes read (`incomplete` when the body broke off).
    pub fn body_len() -> Reply {
        Reply::text("").content(Content::BodyLen)
    }

    /// `200` with `n` bytes of `x`, streamed (palisade's server only).
    pub fn download(n: usize) -> Reply {
        Reply::text("").content(Content::Download(n))
    }

    /// The raw engine writes exactly `bytes` as the answer.
    pub fn bytes(bytes: &'static [u8]) -> Reply {
        Reply {
            answer: Answer::Bytes(Bytes::from_static(bytes)),
            ..Reply::text("")
        }
    }

    /// No answer, ever; the body is dropped unread.
    pub fn never() -> Reply {
        Reply {
            read: Read::Unread,
            after: None,
            answer: Answer::Never,
        }
    }

    /// The raw engine reads the request whole, then closes the connection without answering.
    pub fn close() -> Reply {
        Reply {
            answer: Answer::Close,
            ..Reply::text("")
        }
    }

    /// This status instead of `200`.
    pub fn status(mut self, code: u16) -> Reply {
        if let Answer::Response { status, .. } = &mut self.answer {
            *status = StatusCode::from_u16(code).unwrap();
        }
        self
    }

    /// A response header.
    pub fn header(mut self, name: &'static str, value: &str) -> Reply {
        if let Answer::Response { headers, .. } = &mut self.answer {
            headers.append(name, HeaderValue::from_str(value).unwrap());
        }
        self
    }

    /// The body, then a trailer field `name: value` (palisade's server only).
    pub fn trailer(mut self, name: &'static str, value: &str) -> Reply {
        let mut trailers = HeaderMap::new();
        trailers.insert(HeaderName::from_static(name), value.parse().unwrap());
        if let Answer::Response { body, .. } = &mut self.answer {
            if let Content::Bytes(b) = body {
                *body = Content::Trailers(b.clone(), trailers);
            }
        }
        self.header("trailer", name)
    }

    /// Answers `d` later (after the body was read, or after it began with [`Reply::early`]).
    pub fn after(mut self, d: Duration) -> Reply {
        self.after = Some(d);
        self
    }

    /// Answers once the body began (at once for a request without one), before the rest of
    /// it is read; the rest is still read and recorded.
    pub fn early(mut self) -> Reply {
        self.read = Read::Early;
        self
    }

    /// Answers without reading the body (palisade's server only), as a service does that
    /// ignores it: hyper drains it or closes the connection once the answer went out.
    pub fn unread(mut self) -> Reply {
        self.read = Read::Unread;
        self
    }

    fn content(mut self, content: Content) -> Reply {
        if let Answer::Response { body, .. } = &mut self.answer {
            *body = content;
        }
        self
    }
}

type ReplyFn = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

/// A fake upstream to [`Builder::start`]. Without [`Builder::reply`] it answers `200 ok`.
pub struct Builder {
    reply: ReplyFn,
    raw: bool,
    idle_close: Option<Duration>,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
}

pub fn builder() -> Builder {
    Builder {
        reply: Arc::new(|_| Reply::text("ok")),
        raw: false,
        idle_close: None,
        tls: None,
    }
}

impl Builder {
    /// What to answer each request, decided from its head.
    pub fn reply(mut self, f: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Self {
        self.reply = Arc::new(f);
        self
    }

    /// Every answer `d` later ([`Reply::after`]).
    pub fn delay(self, d: Duration) -> Self {
        self.each(move |r| r.after(d))
    }

    /// Every answer early ([`Reply::early`]).
    pub fn early(self) -> Self {
        self.each(Reply::early)
    }

    /// Every answer without reading the body ([`Reply::unread`]).
    pub fn unread(self) -> Self {
        self.each(Reply::unread)
    }

    /// No answer to any request ([`Reply::never`]).
    pub fn hang(self) -> Self {
        self.each(|_| Reply::never())
    }

    /// Every request read whole, then its connection closed unanswered ([`Reply::close`]).
    pub fn close(self) -> Self {
        self.each(|_| Reply::close())
    }

    /// Raw HTTP/1.1 on TCP instead of palisade's server.
    pub fn raw(mut self) -> Self {
        self.raw = true;
        self
    }

    /// The raw engine closes a connection that waited `d` for its next head, telling nobody
    /// (a keep-alive timeout, as most servers have).
    pub fn idle_close(mut self, d: Duration) -> Self {
        self.idle_close = Some(d);
        self.raw()
    }

    /// TLS with `config` on palisade's server (`h2` or `http/1.1` as its ALPN list says).
    pub fn tls(mut self, config: Arc<tokio_rustls::rustls::ServerConfig>) -> Self {
        self.tls = Some(config);
        self
    }

    /// Listens on a fresh loopback port; serves until the [`Upstream`] is dropped.
    pub async fn start(self) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log = Log::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (stop, stopped) = oneshot::channel();
        if self.raw {
            assert!(self.tls.is_none(), "TLS is palisade's server's");
            raw::spawn(
                listener,
                self.reply,
                self.idle_close,
                log.clone(),
                Arc::clone(&accepted),
                stopped,
            );
        } else {
            served::spawn(
                listener,
                self.reply,
                self.tls,
                log.clone(),
                Arc::clone(&accepted),
                stopped,
            );
        }
        Upstream {
            addr,
            log,
            accepted,
            _stop: stop,
        }
    }

    fn each(self, f: impl Fn(Reply) -> Reply + Send + Sync + 'static) -> Self {
        let reply = self.reply;
        Builder {
            reply: Arc::new(move |s| f(reply(s))),
            ..self
        }
    }
}

/// A running fake upstream; it stops when dropped.
pub struct Upstream {
    pub addr: SocketAddr,
    pub log: Log,
    accepted: Arc<AtomicUsize>,
    _stop: oneshot::Sender<()>,
}

impl Upstream {
    /// The connections it accepted.
    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// A small "legacy" HTTP service (HTTP/1.1 and h2c on one port) that logs every request.
///
/// - `/upload`: reads the whole body, answers with the byte count;
/// - `/download?N`: streams N bytes;
/// - `.../trailers`: answers with a body and a trailer `x-checksum: 42`;
/// - `.../slow?MS`: waits MS milliseconds, then answers;
/// - anything else: `200 ok <method> <path>`.
///
/// Only `/upload` reads the body: the others answer without it, as a service does that
/// expects none.
pub async fn upstream() -> Upstream {
    builder().reply(legacy).start().await
}

fn legacy(s: &Seen) -> Reply {
    let query = s.query.as_deref().unwrap_or("");
    match s.path.as_str() {
        "/upload" => Reply::body_len(),
        "/download" => Reply::download(query.parse().unwrap()).unread(),
        p if p.ends_with("/trailers") => Reply::text("body").trailer("x-checksum", "42").unread(),
        p if p.ends_with("/slow") => Reply::text("slow done")
            .after(Duration::from_millis(query.parse().unwrap_or(500)))
            .unread(),
        p => Reply::text(format!("ok {} {p}", s.method)).unread(),
    }
}
