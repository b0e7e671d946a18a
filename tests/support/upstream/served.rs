//! The fake upstream on palisade's own server: HTTP/1.1 and h2c on one port, or TLS.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Body as _, Frame, Incoming};
use palisade::proxy::server::{Limits, Peer};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use super::{Answer, Content, Log, Read, ReplyFn, Seen};

type UpBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

tokio::task_local! {
    /// The accepted connections of the fake whose server runs in this task.
    static ACCEPTED: Arc<AtomicUsize>;
}

/// A connection's state on palisade's server, which creates it in its accept loop (the task
/// [`spawn`] starts) for every connection it accepts: counts the connection.
struct Accepted;

impl Default for Accepted {
    fn default() -> Self {
        ACCEPTED.with(|n| n.fetch_add(1, Ordering::SeqCst));
        Accepted
    }
}

pub(super) fn spawn(
    listener: TcpListener,
    reply: ReplyFn,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    log: Log,
    accepted: Arc<AtomicUsize>,
    stopped: oneshot::Receiver<()>,
) {
    let limits = Limits {
        tls: tls.map(|t| Arc::new(arc_swap::ArcSwap::new(t))),
        grace: Duration::from_secs(1),
        ..Limits::default()
    };
    let serve = palisade::proxy::server::serve_with(
        listener,
        move |req: Request<Incoming>, peer: Peer, _: &Arc<Accepted>| {
            let (log, reply) = (log.clone(), Arc::clone(&reply));
            async move { handle(req, peer, log, reply).await }
        },
        async move {
            let _ = stopped.await;
        },
        limits,
        None,
    );
    tokio::spawn(ACCEPTED.scope(accepted, serve));
}

async fn handle(req: Request<Incoming>, peer: Peer, log: Log, reply: ReplyFn) -> Response<UpBody> {
    let seen = Seen {
        method: req.method().clone(),
        path: req.uri().path().to_owned(),
        query: req.uri().query().map(str::to_owned),
        authority: req.uri().authority().map(|a| a.to_string()),
        version: req.version(),
        token: req
            .headers()
            .get("x-fencing-token")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        headers: req.headers().clone(),
        peer: Some(peer.addr),
        tls: peer.tls,
        ..Seen::default()
    };
    let reply = reply(&seen);
    let i = log.push(seen);
    let mut body = req.into_body();
    let mut unread = None;
    match reply.read {
        Read::Whole => read(&mut body, &log, i).await,
        Read::Early => {
            if !body.is_end_stream() {
                if let Some(Ok(frame)) = body.frame().await {
                    record(frame, &log, i);
                }
            }
            let log = log.clone();
            tokio::spawn(async move { read(&mut body, &log, i).await });
        }
        Read::Unread => unread = Some(body),
    }
    if let Some(d) = reply.after {
        tokio::time::sleep(d).await;
    }
    let resp = match reply.answer {
        Answer::Response {
            status,
            headers,
            body,
        } => {
            let mut r = Response::new(content(body, &log, i));
            *r.status_mut() = status;
            r.headers_mut().extend(headers);
            r
        }
        Answer::Never => {
            drop(unread);
            return std::future::pending().await;
        }
        Answer::Bytes(_) | Answer::Close => {
            panic!("raw answers need the raw engine (Builder::raw)")
        }
    };
    // A body left unread goes only once the answer is ready, as a handler holding its
    // request would drop it.
    drop(unread);
    resp
}

/// Reads the rest of the body into request `i`'s record.
async fn read(body: &mut Incoming, log: &Log, i: usize) {
    loop {
        match body.frame().await {
            Some(Ok(frame)) => record(frame, log, i),
            Some(Err(_)) => return,
            None => return log.update(i, |s| s.complete = true),
        }
    }
}

fn record(frame: Frame<Bytes>, log: &Log, i: usize) {
    match frame.into_data() {
        Ok(d) => log.update(i, |s| s.add_body(&d)),
        Err(frame) => {
            if let Ok(t) = frame.into_trailers() {
                log.update(i, |s| s.trailers = Some(t));
            }
        }
    }
}

fn content(body: Content, log: &Log, i: usize) -> UpBody {
    match body {
        Content::Bytes(b) => Full::new(b).boxed(),
        Content::BodyLen => {
            let s = log.get(i);
            let text = if s.complete {
                s.body_len.to_string()
            } else {
                "incomplete".to_owned()
            };
            Full::new(Bytes::from(text)).boxed()
        }
        Content::Download(total) => {
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let mut left = total;
            let frames = std::iter::from_fn(move || {
                if left == 0 {
                    return None;
                }
                let n = left.min(chunk.len());
                left -= n;
                Some(Ok(Frame::data(chunk.slice(..n))))
            });
            StreamBody::new(tokio_stream::iter(frames)).boxed()
        }
        Content::Trailers(b, trailers) => {
            let frames = vec![Ok(Frame::data(b)), Ok(Frame::trailers(trailers))];
            StreamBody::new(tokio_stream::iter(frames)).boxed()
        }
    }
}
