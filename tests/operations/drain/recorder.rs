//! The drain tests' upstream: it records, in one global sequence, when each request's head
//! arrived (its body starts) and when its whole body had been read (the write is "applied"),
//! or that the request went away before its end. That order is what the drain's guarantee is
//! about, and what a fake upstream's log of requests (`tests/support/upstream.rs`) does not
//! keep.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// The request's head reached the upstream: its body starts.
    Start,
    /// The whole body was read.
    Complete,
    /// The request failed or was dropped before its body's end.
    Gone,
}

#[derive(Debug, Clone)]
pub(super) struct Ev {
    pub(super) seq: u64,
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) token: u64,
    pub(super) bytes: u64,
    pub(super) at: Instant,
}

#[derive(Default)]
struct RecState {
    seq: u64,
    events: Vec<Ev>,
    received: HashMap<String, u64>,
}

#[derive(Clone, Default)]
pub(super) struct Rec(Arc<Mutex<RecState>>);

impl Rec {
    fn push(&self, kind: Kind, id: &str, token: u64, bytes: u64) {
        let mut s = self.0.lock().unwrap();
        s.seq += 1;
        let seq = s.seq;
        s.events.push(Ev {
            seq,
            kind,
            id: id.to_owned(),
            token,
            bytes,
            at: Instant::now(),
        });
    }
    fn progress(&self, id: &str, n: u64) {
        self.0.lock().unwrap().received.insert(id.to_owned(), n);
    }
    pub(super) fn events(&self) -> Vec<Ev> {
        self.0.lock().unwrap().events.clone()
    }
    pub(super) fn find(&self, id: &str, kind: Kind) -> Option<Ev> {
        let s = self.0.lock().unwrap();
        s.events
            .iter()
            .find(|e| e.id == id && e.kind == kind)
            .cloned()
    }
    pub(super) fn received(&self, id: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .received
            .get(id)
            .copied()
            .unwrap_or(0)
    }
}

/// Logs `Gone` for a request whose handler ends (or is dropped) before the body's end.
struct GoneGuard {
    rec: Rec,
    id: String,
    token: u64,
    bytes: u64,
    done: bool,
}

impl Drop for GoneGuard {
    fn drop(&mut self) {
        if !self.done {
            self.rec.push(Kind::Gone, &self.id, self.token, self.bytes);
        }
    }
}

pub(super) struct Recorder {
    pub(super) addr: SocketAddr,
    pub(super) rec: Rec,
    _stop: oneshot::Sender<()>,
}

/// An HTTP/1.1 + h2c upstream that reads every request body whole, then answers 200.
pub(super) async fn recorder() -> Recorder {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rec = Rec::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let r = rec.clone();
    tokio::spawn(palisade::proxy::server::serve(
        listener,
        move |req, _peer| record(req, r.clone()),
        async move {
            let _ = stopped.await;
        },
        Duration::from_secs(1),
    ));
    Recorder {
        addr,
        rec,
        _stop: stop,
    }
}

async fn record(req: Request<Incoming>, rec: Rec) -> Response<Full<Bytes>> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let id = header("x-id").unwrap_or_default();
    let apply_after: Option<u64> = header("x-apply-after-ms").and_then(|v| v.parse().ok());
    let token: u64 = header("x-fencing-token")
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    rec.push(Kind::Start, &id, token, 0);
    let mut guard = GoneGuard {
        rec: rec.clone(),
        id: id.clone(),
        token,
        bytes: 0,
        done: false,
    };
    let mut body = req.into_body();
    loop {
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    guard.bytes += d.len() as u64;
                    rec.progress(&id, guard.bytes);
                }
            }
            Some(Err(_)) => {
                let mut r = Response::new(Full::new(Bytes::from_static(b"broken body")));
                *r.status_mut() = http::StatusCode::BAD_REQUEST;
                return r; // the guard logs Gone
            }
            None => break,
        }
    }
    guard.done = true;
    // An upstream that works a while on a request it read whole before its write is applied,
    // and does not stop when the client's connection goes away (a task of its own).
    if let Some(ms) = apply_after {
        let (rec, bytes) = (rec.clone(), guard.bytes);
        let applied = id.clone();
        let _ = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            rec.push(Kind::Complete, &applied, token, bytes);
        })
        .await;
        return Response::new(Full::new(Bytes::from(format!("applied {id} {bytes}"))));
    }
    rec.push(Kind::Complete, &id, token, guard.bytes);
    Response::new(Full::new(Bytes::from(format!(
        "applied {id} {}",
        guard.bytes
    ))))
}
