//! The resource of the HTTP examples: an axum service holding order 42, fenced by palisade's
//! `FenceLayer` (left out when the fence is disabled), and a client that stamps the owner's
//! token on every request. The service checks nothing itself: it applies every write that
//! reaches it and logs it in a [`Ledger`].

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use palisade::{Admission, FenceLayer, FencingToken, MemoryStore, Metrics};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::ledger::Ledger;

pub(crate) const PATH: &str = "/orders/42";

/// The running service; stops when dropped.
pub(crate) struct Orders {
    pub(crate) addr: SocketAddr,
    pub(crate) ledger: Ledger,
    _stop: oneshot::Sender<()>,
}

/// Serves order 42 on a free loopback port; with `fenced`, every request passes the mark of
/// `resource` (marks in memory: this process is the only guard).
pub(crate) async fn serve(
    resource: &str,
    fenced: bool,
) -> Result<Orders, Box<dyn std::error::Error>> {
    let ledger = Ledger::default();
    let app = Router::new()
        .route(PATH, get(read).put(write))
        .with_state(ledger.clone());
    let app = if fenced {
        let metrics = Metrics::new(prometheus::Registry::new())?;
        let store = Arc::new(MemoryStore::new());
        let admission = Arc::new(Admission::open(store, [resource], &metrics).await?);
        app.layer(FenceLayer::new(admission, resource))
    } else {
        app
    };
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await;
    });
    Ok(Orders {
        addr,
        ledger,
        _stop: stop,
    })
}

/// The token the request carried: the one the layer admitted (in the extensions), else the
/// header as sent (only without the layer).
fn token_of(req: &Request) -> Option<u64> {
    req.extensions()
        .get::<FencingToken>()
        .copied()
        .or_else(|| {
            palisade::client::transport::read_headers(req.headers())
                .ok()
                .flatten()
        })
        .map(FencingToken::get)
}

fn owner_of(req: &Request) -> String {
    req.headers()
        .get("x-owner")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?")
        .to_owned()
}

async fn read(State(ledger): State<Ledger>, req: Request) -> String {
    ledger.read(owner_of(&req), token_of(&req))
}

async fn write(State(ledger): State<Ledger>, req: Request) -> Result<&'static str, StatusCode> {
    let (owner, token) = (owner_of(&req), token_of(&req));
    let body = req
        .into_body()
        .collect()
        .await
        .map_err(|_| StatusCode::BAD_REQUEST)?
        .to_bytes();
    ledger.write(owner, token, String::from_utf8_lossy(&body).into_owned());
    Ok("applied")
}

/// What the service answered.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) body: String,
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.body.trim())
    }
}

/// Sends one request as `owner`, stamped with `token`: a PUT of `value`, or a GET when it is
/// `None`. Errors are strings so that an owner's thread can hand them back.
pub(crate) async fn send(
    addr: SocketAddr,
    owner: &str,
    token: FencingToken,
    value: Option<&str>,
) -> Result<Answer, String> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let (method, body) = match value {
        Some(v) => (http::Method::PUT, Bytes::from(v.to_owned())),
        None => (http::Method::GET, Bytes::new()),
    };
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{PATH}"))
        .header("x-owner", owner)
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    palisade::client::transport::stamp_request(&mut req, token);
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(Answer {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}
