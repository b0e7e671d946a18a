//! lock-grpc: a tonic gRPC server with palisade's `FenceLayer` on it, and a zombie lock
//! holder.
//!
//! The same story as `lock-http`, over gRPC: owner A takes the lock `orders` and calls
//! `orders.Orders/Write` with its token in the `x-fencing-token` metadata; A freezes, its lease
//! expires, B takes the lock with a higher token and writes; A wakes up and writes again: the
//! layer answers `ABORTED` (trailers-only) and the service never runs.
//!
//! The layer goes on the server, `Server::builder().layer(FenceLayer::new(..))`, rather than in
//! a tonic `Interceptor`: an interceptor is synchronous and cannot wait for an advanced mark to
//! be persisted before the call runs; the layer can. The admitted token is in the request's
//! extensions for the service to store next to its data.
//!
//! The service is written against tonic's runtime API (no `.proto` build step), as generated
//! code would be. Run it with `cargo run --features layer,grpc --example lock-grpc`. It exits
//! 0 only if A's late call was refused. `PALISADE_EXAMPLE_UNFENCED=1` serves without the layer:
//! A's write then lands over B's and the example exits 1.

#[path = "common/ledger.rs"]
mod ledger;
#[path = "common/process.rs"]
mod process;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http::uri::PathAndQuery;
use ledger::Ledger;
use palisade::{
    Admission, FenceLayer, FencingToken, LockService, MemoryProvider, MemoryStore, Metrics,
    Provider, SessionOptions,
};
use tokio::net::TcpListener;
use tonic::server::{Grpc, UnaryService};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

const WRITE: &str = "/orders.Orders/Write";
const B_VALUE: &str = "cancelled by B";

#[derive(Clone, PartialEq, prost::Message)]
struct WriteRequest {
    #[prost(string, tag = "1")]
    value: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WriteReply {
    #[prost(string, tag = "1")]
    applied: String,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// `orders.Orders`: one unary method, `Write`, applied to the ledger unconditionally (what
/// tonic's generated server does, written by hand).
#[derive(Clone)]
struct OrdersService(Ledger);

// Generic over the request body: behind the layer it is `FenceRequestBody<Body>`, without it
// tonic's `Body`. (A generated service behind `Server::builder().layer(..).add_service(..)`,
// with tonic's default `router` feature, gets the same body through tonic's router.)
impl<B> tower::Service<http::Request<B>> for OrdersService
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let ledger = self.0.clone();
        let req = req.map(tonic::body::Body::new);
        Box::pin(async move {
            Ok(match req.uri().path() {
                WRITE => {
                    Grpc::new(ProstCodec::default())
                        .unary(Write(ledger), req)
                        .await
                }
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Write(Ledger);

impl UnaryService<WriteRequest> for Write {
    type Response = WriteReply;
    type Future = BoxFuture<Result<tonic::Response<WriteReply>, Status>>;

    fn call(&mut self, req: tonic::Request<WriteRequest>) -> Self::Future {
        // The token the layer admitted; without the layer, the metadata as sent.
        let token = req
            .extensions()
            .get::<FencingToken>()
            .copied()
            .or_else(|| {
                palisade::client::transport::grpc::read_metadata(req.metadata())
                    .ok()
                    .flatten()
            })
            .map(FencingToken::get);
        let owner = req
            .metadata()
            .get("x-owner")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("?")
            .to_owned();
        let value = req.into_inner().value;
        self.0.write(owner, token, value.clone());
        Box::pin(async move {
            Ok(tonic::Response::new(WriteReply {
                applied: format!("applied {value:?}"),
            }))
        })
    }
}

/// Serves `orders.Orders` on a free loopback port, behind the fence when `fenced`.
async fn serve(
    ledger: Ledger,
    fenced: bool,
) -> Result<(SocketAddr, tokio::sync::oneshot::Sender<()>), Box<dyn std::error::Error>> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let incoming = TcpIncoming::from(listener);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stopped = async move {
        let _ = stopped.await;
    };
    let service = OrdersService(ledger);
    if fenced {
        let metrics = Metrics::new(prometheus::Registry::new())?;
        let store = Arc::new(MemoryStore::new());
        let admission = Arc::new(Admission::open(store, ["orders"], &metrics).await?);
        let server = Server::builder()
            .layer(FenceLayer::new(admission, "orders"))
            .serve_with_incoming_shutdown(service, incoming, stopped);
        tokio::spawn(server);
    } else {
        let server = Server::builder().serve_with_incoming_shutdown(service, incoming, stopped);
        tokio::spawn(server);
    }
    Ok((addr, stop))
}

/// Calls `Write` as `owner` with `token`: the reply, or the status the server answered.
/// Errors (other than the call's status) are strings so that an owner's thread can hand
/// them back.
async fn write(
    addr: SocketAddr,
    owner: &str,
    token: FencingToken,
    value: &str,
) -> Result<Result<String, Status>, String> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.map_err(|e| e.to_string())?;
    let mut req = tonic::Request::new(WriteRequest {
        value: value.to_owned(),
    });
    palisade::client::transport::grpc::stamp_request(&mut req, token);
    let owner = owner.parse().map_err(|_| "owner is not ASCII".to_owned())?;
    req.metadata_mut().insert("x-owner", owner);
    let reply = client
        .unary(req, PathAndQuery::from_static(WRITE), ProstCodec::default())
        .await;
    Ok(reply.map(|r: tonic::Response<WriteReply>| r.into_inner().applied))
}

fn show(answer: &Result<String, Status>) -> String {
    match answer {
        Ok(applied) => format!("OK, {applied}"),
        Err(status) => format!("{:?}: {}", status.code(), status.message()),
    }
}

fn options() -> SessionOptions {
    SessionOptions::new()
        .with_ttl(process::TTL)
        .with_namespace("/lock-grpc")
}

async fn owner_a(
    provider: MemoryProvider,
    addr: SocketAddr,
    mut freezer: process::Freezer,
) -> Result<Result<String, Status>, String> {
    let session = provider
        .session(options())
        .await
        .map_err(|e| e.to_string())?;
    let grant = session.lock("orders").await.map_err(|e| e.to_string())?;
    let token = grant.token();
    let first = write(addr, "A", token, "shipped by A").await?;
    println!(
        "  A: locks \"orders\" with token {token}; Write -> {}",
        show(&first)
    );
    let lost = grant.loss_signal().is_lost();
    println!("  A: checks its grant (lost: {lost}), then freezes before its next call");
    freezer.freeze();
    println!("  A: wakes up, still believing it holds the lock; Write with token {token}");
    write(addr, "A", token, "shipped by A (late)").await
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let fenced = !process::unfenced();
    let ledger = Ledger::default();
    let (addr, _stop) = serve(ledger.clone(), fenced).await?;
    println!("lock-grpc: tonic server on {addr}, service orders.Orders");
    if fenced {
        println!("  Server::builder().layer(FenceLayer) (resource \"orders\", marks in memory)\n");
    } else {
        println!("  PALISADE_EXAMPLE_UNFENCED=1: the server runs without FenceLayer\n");
    }
    let provider = MemoryProvider::new();
    // B's session first: the store's lease reaper runs on the runtime of its first lease
    // (see common/process.rs), and this one is never frozen.
    let b = provider.session(options()).await?;
    let mut a = process::spawn("owner-a", {
        let provider = provider.connect();
        move |freezer| owner_a(provider, addr, freezer)
    });
    if !a.frozen().await {
        return Err(format!("A ended before freezing: {:?}", a.join().await.err()).into());
    }
    let waited = Instant::now();
    let grant = b.lock("orders").await?;
    let token = grant.token();
    println!(
        "  B: locks \"orders\" after {:.1} s (A's lease expired) with token {token}",
        waited.elapsed().as_secs_f64()
    );
    let answer = write(addr, "B", token, B_VALUE).await?;
    println!("  B: Write -> {}", show(&answer));
    let late = a.join().await?;
    println!("  A: -> {}", show(&late));
    grant.unlock().await?;
    let code = ledger.verdict(B_VALUE);
    if fenced && !matches!(&late, Err(s) if s.code() == Code::Aborted) {
        println!("FAIL: A's late call should have been ABORTED");
        return Ok(ExitCode::FAILURE);
    }
    Ok(code)
}
